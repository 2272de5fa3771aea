"""The Transformers fallback (model_impl="transformers"): architectures vllite does not implement natively
(GPT-NeoX, OPT) run through transformers' own classes with vllite's paged cache, chunked prefill, prefix
caching and sampler, token-identical to HF generate in float32 with raw logprobs within 1e-4; a native
family (Llama) through the fallback equals its native run; what the fallback cannot take is refused clearly."""
from __future__ import annotations

import json

import pytest
import torch
from tiny_models import TINY, save_tiny

from model_registry.model_impl import resolve_model_impl
from model_registry.models.transformers_fallback import FallbackUnavailableError, hf_causal_lm_class
from model_registry.registry import UnknownArchitectureError
from vllite_core import LLM, SamplingParams
from vllite_core.errors import ConfigError

VOCAB = 512
N_OUT = 12
CHUNK = 32  # max_num_batched_tokens: the 40- and 90-token prompts prefill in chunks
LENGTHS = (3, 17, 40, 90)


def _configs():
    from transformers import GPTNeoXConfig, OPTConfig

    return {
        # Partial rotary (a quarter of each head), parallel residual, biases.
        "gpt_neox": GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.25,
                                  architectures=["GPTNeoXForCausalLM"]),
        # Learned positions (offset 2), pre-LN, a tied head.
        "opt": OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                         word_embed_proj_dim=64, max_position_embeddings=256, architectures=["OPTForCausalLM"],
                         pad_token_id=1, bos_token_id=2, eos_token_id=2),
    }


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


@torch.inference_mode()
def _hf_generate(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF generate's greedy tokens (EOS never stops it: no eos id) and each one's raw logprob."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=N_OUT, min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, lps


def _run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True, logprobs=0))
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return toks, lps, outs


@pytest.fixture(scope="module", params=["gpt_neox", "opt"])
def fallback_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(path, _configs()[request.param], seed=7)
    prompts = _prompts(11)
    return request.param, path, prompts, [_hf_generate(hf, p) for p in prompts]


def test_fallback_matches_hf_generate_with_chunks_and_prefix_hits(fallback_model, caplog):
    name, path, prompts, ref = fallback_model
    with caplog.at_level("INFO", logger="vllite"):
        llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=CHUNK, num_kv_blocks=64)
    core = llm.llm_engine.core.engine_core
    assert core.model_impl.impl == "transformers"  # auto: nothing native is registered for it
    assert "Using the Transformers fallback" in caplog.text and "model_impl: transformers" in caplog.text
    toks, lps, _ = _run(llm, prompts)
    assert toks == [t for t, _ in ref]
    for got, (_, want) in zip(lps, ref):
        assert got == pytest.approx(want, abs=1e-4)
    # The same long prompt again: its full blocks come from the prefix cache, and the answer is unchanged.
    toks2, lps2, outs = _run(llm, [prompts[3]])
    assert outs[0].num_cached_tokens >= 80
    assert toks2 == [ref[3][0]] and lps2[0] == pytest.approx(ref[3][1], abs=1e-4)


def test_native_llama_through_the_fallback_equals_its_native_run(tmp_path):
    from transformers import LlamaConfig

    save_tiny(tmp_path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], tie_word_embeddings=False), seed=3)
    prompts = _prompts(5)
    runs = {}
    for impl in ("vllite", "transformers"):
        llm = LLM(model=str(tmp_path), dtype="float32", max_num_batched_tokens=CHUNK, num_kv_blocks=64,
                  model_impl=impl)
        assert llm.llm_engine.core.engine_core.model_impl.impl == impl
        runs[impl] = _run(llm, prompts)[:2]
        del llm
    assert runs["transformers"][0] == runs["vllite"][0]
    for a, b in zip(runs["transformers"][1], runs["vllite"][1]):
        assert a == pytest.approx(b, abs=1e-4)


def test_sliding_window_layers_through_the_fallback(tmp_path):
    """Mistral with a 16-token window under model_impl="transformers": a sliding-window cache group, and the
    tokens of HF generate (which differ from full attention's here)."""
    import copy

    from transformers import MistralConfig

    from vllite_core.core.kv_cache_spec import SlidingWindowSpec

    hf = save_tiny(tmp_path, MistralConfig(**TINY, sliding_window=16, architectures=["MistralForCausalLM"]), seed=4)
    prompts = _prompts(9)[2:]
    ref = [_hf_generate(hf, p) for p in prompts]
    full = copy.deepcopy(hf)
    full.config.sliding_window = None
    assert [_hf_generate(full, p)[0] for p in prompts] != [t for t, _ in ref]  # the window matters here
    llm = LLM(model=str(tmp_path), dtype="float32", max_num_batched_tokens=CHUNK, num_kv_blocks=64,
              model_impl="transformers")
    assert [type(g.spec) for g in llm.llm_engine.core.engine_core.kv_cache_manager.groups] == [SlidingWindowSpec]
    toks, lps, _ = _run(llm, prompts)
    assert toks == [t for t, _ in ref]
    for got, (_, want) in zip(lps, ref):
        assert got == pytest.approx(want, abs=1e-4)


# ---- what the fallback refuses ---------------------------------------------------------------------


def _config(model_type: str, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


def test_a_class_without_custom_attention_support_is_refused_naming_the_reason():
    from model_registry.registry import ModelRegistry

    config = _config("falcon", architectures=["FalconForCausalLM"])
    with pytest.raises(FallbackUnavailableError, match="_supports_attention_backend"):
        resolve_model_impl(ModelRegistry(), config, "transformers")
    with pytest.raises(FallbackUnavailableError, match="Transformers fallback .* cannot run it either"):
        resolve_model_impl(ModelRegistry(), config, "auto")  # also an UnknownArchitectureError
    with pytest.raises(ConfigError, match="model_impl: must be one of auto, vllite, transformers"):
        LLM(model="unused", model_impl="bogus")


@pytest.mark.parametrize("model_type,arch,why", [
    ("bart", "BartForConditionalGeneration", "encoder-decoder"),
    ("gpt_neox", "GPTNeoXForSequenceClassification", "not a causal language model"),
    ("gpt_neox", "NoSuchForCausalLM", "has no class NoSuchForCausalLM"),
    ("gemma2", "Gemma2ForCausalLM", "attn_logit_softcapping"),
])
def test_models_the_fallback_cannot_take(model_type, arch, why):
    with pytest.raises(FallbackUnavailableError, match=why):
        hf_causal_lm_class(_config(model_type, architectures=[arch]), trust_remote_code=False)


REMOTE_CODE = '''from transformers import GPTNeoXForCausalLM


class MyNeoXForCausalLM(GPTNeoXForCausalLM):
    """A model that exists only as the checkpoint's own code."""
'''


def test_remote_code_needs_trust_remote_code(tmp_path):
    config = _configs()["gpt_neox"]
    hf = save_tiny(tmp_path, config, seed=2)
    cfg_path = tmp_path / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["architectures"] = ["MyNeoXForCausalLM"]
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling_my_neox.MyNeoXForCausalLM"}
    cfg_path.write_text(json.dumps(raw))
    (tmp_path / "modeling_my_neox.py").write_text(REMOTE_CODE)
    # transformers saves GPT-NeoX's head under its legacy name and renames it on load only for its own class;
    # a checkpoint made for remote code holds the class's own names.
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = weights.pop("embed_out.weight")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="trust_remote_code"):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=CHUNK,
              trust_remote_code=True)
    assert llm.llm_engine.core.engine_core.model_impl.model_cls.hf_class.__name__ == "MyNeoXForCausalLM"
    prompt = _prompts(3)[2]
    assert _run(llm, [prompt])[0] == [_hf_generate(hf, prompt)[0]]


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    path = tmp_path_factory.mktemp("neox")
    save_tiny(path, _configs()["gpt_neox"], seed=1)
    return path


def test_options_the_fallback_does_not_support_are_refused(neox):
    from model_registry.models.transformers_fallback import fallback_model_class

    path = neox
    for kwargs, field in (({"tensor_parallel_size": 3}, "tensor_parallel_size"), ({"quantization": "int8"},
                                                                                  "quantization")):
        with pytest.raises(ConfigError, match=f"{field}: .*Transformers fallback"):
            LLM(model=str(path), dtype="float32", num_kv_blocks=16, **kwargs)
    with pytest.raises(UnknownArchitectureError, match="not supported"):
        LLM(model=str(path), dtype="float32", num_kv_blocks=16, model_impl="vllite")
    opt = _configs()["opt"]  # transformers gives OPT no tensor-parallel plan
    with pytest.raises(ConfigError, match="tensor_parallel_size: transformers' OPTForCausalLM has no tensor-"):
        fallback_model_class(opt, False).check_tensor_parallel(opt, 2)


@pytest.mark.slow
def test_two_ranks_through_the_fallback_match_hf_and_peft(tmp_path):
    """GPT-NeoX on two ranks through transformers' own plan (the fused per-head query_key_value and the MLP input
    split by rows, the dense layers by columns and all-reduced): HF generate's tokens and logprobs for base
    requests of 3 to 90 tokens (chunked), and peft's for an adapter on query_key_value and dense_4h_to_h (each
    rank its rows / columns of it) in the same batch."""
    from lora_fixtures import make_adapter

    from vllite_core import LoRARequest

    hf = save_tiny(tmp_path / "base", _configs()["gpt_neox"], seed=7)
    peft_model = make_adapter(hf, tmp_path / "adapter", seed=1, scale=4.0, r=4, lora_alpha=8,
                              target_modules=["query_key_value", "dense_4h_to_h"])
    prompts = _prompts(11)
    ref = [_hf_generate(hf, p) for p in prompts] + [_hf_generate(peft_model, prompts[2])]
    assert ref[-1][0] != ref[2][0]  # the adapter changes the answer
    llm = LLM(model=str(tmp_path / "base"), dtype="float32", max_num_batched_tokens=CHUNK, num_kv_blocks=64,
              tensor_parallel_size=2, enable_lora=True, max_lora_rank=8)
    try:
        assert llm.llm_engine.core.engine_core.executor.backend == "mp"
        outs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, prompts[2]]],
                            SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True, logprobs=0),
                            lora_request=[None] * len(prompts) + [LoRARequest("a", 1, str(tmp_path / "adapter"))])
    finally:
        llm.llm_engine.core.shutdown()
    for out, (toks, lps) in zip(outs, ref):
        got = out.outputs[0]
        assert list(got.token_ids) == toks
        assert [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)] == pytest.approx(lps, abs=1e-4)


def test_lora_adapters_through_the_fallback(tmp_path):
    """A PEFT adapter on GPT-NeoX's fused query_key_value and MLP output, served beside a base request in one
    batch: the adapted request equals peft's model under HF generate, the other one the base model's."""
    from lora_fixtures import make_adapter

    from vllite_core import LoRARequest

    hf = save_tiny(tmp_path / "base", _configs()["gpt_neox"], seed=6)
    peft_model = make_adapter(hf, tmp_path / "adapter", seed=1, scale=4.0, r=4, lora_alpha=8,
                              target_modules=["query_key_value", "dense_4h_to_h"])
    prompts = _prompts(13)[1:3]
    ref_lora, ref_base = _hf_generate(peft_model, prompts[0]), _hf_generate(hf, prompts[1])
    assert ref_lora[0] != _hf_generate(hf, prompts[0])[0]  # the adapter changes the answer
    llm = LLM(model=str(tmp_path / "base"), dtype="float32", max_num_batched_tokens=CHUNK, num_kv_blocks=64,
              enable_lora=True, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True, logprobs=0),
                        lora_request=[LoRARequest("a", 1, str(tmp_path / "adapter")), None])
    for out, (toks, lps) in zip(outs, (ref_lora, ref_base)):
        got = out.outputs[0]
        assert list(got.token_ids) == toks
        assert [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)] == pytest.approx(lps, abs=1e-4)


def test_vllite_env_says_which_implementation_runs_the_model(neox, capsys):
    from vllite_core.entrypoints.cli import main

    assert main(["env", "--json", "--model", str(neox)]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["model_impl"] == "transformers" and "no native implementation" in model["reason"]
    assert model["class"].endswith("GPTNeoXForCausalLM")
    assert main(["env", "--model", str(neox), "--model-impl", "vllite"]) == 1
    assert "model_impl:    none: model architecture GPTNeoXForCausalLM is not supported" in capsys.readouterr().out


def test_model_impl_is_an_engine_flag():
    import argparse

    from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["--model-impl", "transformers"]))
    assert args.create_config().model_config.model_impl == "transformers"
    assert engine_args_from_namespace(parser.parse_args([])).model_impl == "auto"
