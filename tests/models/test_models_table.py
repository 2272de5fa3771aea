"""docs/models.md's supported-architectures table is the one the registry generates (scripts/models_table.py)."""
from __future__ import annotations

import pathlib

from model_registry.support_table import BEGIN, END, render, support_rows, updated_doc

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_doc_table_is_generated_from_the_registry():
    text = DOC.read_text()
    assert BEGIN in text and END in text
    assert updated_doc(text, render(support_rows())) == text, "run: python scripts/models_table.py"


def test_rows_say_what_the_classes_declare():
    rows = {r.architecture: r for r in support_rows()}
    assert rows["Gemma2ForCausalLM"].gguf == ("gemma2",) and rows["Gemma2ForCausalLM"].tensor_parallel
    assert rows["LlamaForCausalLM"].fused_cpu == "yes" and rows["Phi3ForCausalLM"].fused_cpu == "yes"
    assert rows["Qwen3ForCausalLM"].fused_cpu == "no: it normalises q and k (the fused layer computes Llama's)"
    assert rows["WhisperForConditionalGeneration"].fused_cpu == "-"
    # Pipeline stages: what tests/worker/test_pipeline_parallel.py runs on two stages, and classes that build every
    # layer on every rank.
    for arch in ("LlamaForCausalLM", "MixtralForCausalLM", "JambaForCausalLM", "LlavaForConditionalGeneration",
                 "Qwen3Model"):
        assert rows[arch].pipeline_parallel, arch
    for arch in ("BertModel", "Qwen2VLForConditionalGeneration", "MambaForCausalLM", "WhisperForConditionalGeneration"):
        assert not rows[arch].pipeline_parallel, arch


def test_fallback_column_and_rows():
    """The fallback column says what the fallback's own checks say (tested / accepted / refused with the reason /
    not a causal LM), and the architectures only the fallback runs get rows of its class."""
    rows = {r.architecture: r for r in support_rows()}
    assert rows["LlamaForCausalLM"].fallback == "tested" and rows["Qwen3ForCausalLM"].fallback == "accepted"
    assert rows["Gemma2ForCausalLM"].fallback == "no: soft-caps attention logits"
    assert rows["BertModel"].fallback == "-"
    neox, opt = rows["GPTNeoXForCausalLM"], rows["OPTForCausalLM"]
    assert neox.target.endswith("transformers_fallback:TransformersForCausalLM") and neox.fallback == "tested"
    assert neox.lora and opt.lora
    assert neox.tensor_parallel and not opt.tensor_parallel  # transformers gives OPT no tensor-parallel plan
    for family in ("Qwen3", "Gemma2", "Gemma3", "Phi3", "Granite", "Olmo2", "Glm4", "SmolLM3", "Exaone4"):
        row = rows[f"{family}ForCausalLM"]
        assert row.lora and row.tensor_parallel, family  # tests/models/test_lora_dense_families.py proves both
