"""The dense families on the shared decoder (model_registry/models/dense.py) against transformers.

Per family, one tiny random checkpoint (its own seed; sliding windows of a few tokens so the prompts cross
them) and HF ``generate``'s greedy tokens and raw logits, computed once per module:
- the engine (chunked prefill with a 16-token budget under prompts of 26-37 tokens, prefix caching with a
  shared prefix) gives the same tokens and logprobs within 1e-4, float32;
- stepped over a paged cache (``paged_harness``: whole prefills, chunks, mixed batches, decodes), every
  position's logits match HF's with the CPU platform's fused path on (C++ attention; the C++ decoder layer
  where the family's record allows it) and off (torch attention, plain ops);
- two ranks (``tensor_parallel_size=2``) for a subset that covers the cross-rank parts (slow).
"""
from __future__ import annotations

import importlib

import pytest
import torch
from paged_harness import PagedHarness, assert_matches_hf, run_standard_schedule
from tiny_models import save_tiny

from model_registry.builtin import BUILTIN_MODELS
from model_registry.loader import load_model
from model_registry.source import load_hf_config, resolve_model_source

torch.set_num_threads(2)

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
MAX_TOKENS = 8


def _config(name: str):
    import transformers as t

    if name == "qwen3":  # layer 1 slides (layer_types from max_window_layers)
        return t.Qwen3Config(**BASE, head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    if name == "olmo2":  # one KV head: replicated on two ranks, its all-heads k norm counted once
        return t.Olmo2Config(**{**BASE, "num_key_value_heads": 1}, pad_token_id=0)
    if name == "granite":
        return t.GraniteConfig(**BASE, embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2,
                               logits_scaling=2.5)
    if name == "glm4":
        return t.Glm4Config(**BASE, head_dim=16, pad_token_id=0)
    if name == "phi3":  # LongRoPE within its original length (its short factors; the long ones: test_model_rope)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 64}
        return t.Phi3Config(**{**BASE, "num_key_value_heads": 4}, pad_token_id=0, sliding_window=7,
                            rope_parameters=rope, original_max_position_embeddings=64)
    if name == "phi4-partial":  # Phi-4-mini's partial rotary: 3/4 of each head
        return t.Phi3Config(**BASE, pad_token_id=0, partial_rotary_factor=0.75)
    if name == "gemma2":
        return t.Gemma2Config(**BASE, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=6.0)
    if name == "gemma3":  # local, global (linear-scaled rope), local
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
        return t.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 3}, head_dim=16, sliding_window=5,
                                  query_pre_attn_scalar=24, rope_parameters=rope,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise KeyError(name)


ARCH = {"qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
        "glm4": "Glm4ForCausalLM", "phi3": "Phi3ForCausalLM", "phi4-partial": "Phi3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
FUSED = {"phi3"}  # families whose layers are Llama-shaped: the C++ decoder layer takes them


class Family:
    def __init__(self, name, path, hf, prompts, ref_tokens, ref_logits):
        self.name, self.path, self.hf, self.prompts = name, path, hf, prompts
        self.ref_tokens, self.ref_logits = ref_tokens, ref_logits


@pytest.fixture(scope="module", params=sorted(ARCH))
def family(request, tmp_path_factory):
    name = request.param
    config = _config(name)
    config.architectures = [ARCH[name]]
    path = tmp_path_factory.mktemp(name)
    seed = sorted(ARCH).index(name) + 11
    hf = save_tiny(path, config, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(3, 500, (37,), generator=gen).tolist()
    prompts = [first, first[:20] + torch.randint(3, 500, (6,), generator=gen).tolist()]  # shared 20-token prefix
    tokens, logits = [], []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append(torch.cat(out.logits).float())
    return Family(name, str(path), hf, prompts, tokens, logits)


def _assert_engine_matches(fam, llm):
    from vllite_core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in fam.prompts], params)
    for out, ref_tokens, ref_logits in zip(outs, fam.ref_tokens, fam.ref_logits):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, fam.name
        ref = torch.log_softmax(ref_logits, dim=-1)
        for step, (lp, tok) in enumerate(zip(comp.logprobs, comp.token_ids)):
            assert abs(lp[tok].logprob - float(ref[step, tok])) < 1e-4, (fam.name, step)


def test_engine_matches_hf_generate(family):
    """Chunked prefill (16-token budget), prefix caching (block size 4, a shared 20-token prefix), float32."""
    from vllite_core import LLM

    llm = LLM(family.path, dtype="float32", max_num_batched_tokens=16, block_size=4, num_kv_blocks=96)
    try:
        _assert_engine_matches(family, llm)
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_paged_steps_match_hf(family, fused, monkeypatch, caplog):
    """Every computed position's logits against HF's forward, the CPU platform's fused path on and off."""
    from vllite_platform_cpu import kernels
    from vllite_platform_cpu.attention import TorchPagedAttention
    from vllite_platform_cpu.model_ops import CpuModelOps
    from vllite_platform_cpu.platform import has_fast_bf16, use_avx2_gemm, use_bf16_gemm

    from model_registry.layers.fast_path import report_fast_paths
    from vllite_core.model_ops import ModelOps, use_model_ops

    if fused and not kernels.available():
        pytest.skip(f"CPU kernels not built here: {kernels.error()}")
    if not fused:
        monkeypatch.setattr(kernels, "available", lambda: False)  # the backend's torch attention
    ops = CpuModelOps(fused=True, packed_linear=True, widen_16bit=not has_fast_bf16(), avx2_gemm=use_avx2_gemm(),
                      bf16_gemm=use_bf16_gemm()) if fused else ModelOps()
    source = resolve_model_source(family.path)
    hf_config = load_hf_config(source)
    module, name = BUILTIN_MODELS[ARCH[family.name]].split(":")
    cls = getattr(importlib.import_module(module), name)
    backend = TorchPagedAttention()
    with use_model_ops(ops), caplog.at_level("INFO", logger="vllite.platform.cpu"):
        model = load_model(source, hf_config, cls, backend, torch.float32, torch.device("cpu"))
        report = report_fast_paths(model)
        prompts = {rid: family.prompts[0][:n] for rid, n in (("a", 9), ("b", 14), ("c", 6))}
        harness = PagedHarness(model, backend, num_blocks=48, block_size=4)
        run_standard_schedule(harness, prompts, decode_steps=4)
    assert_matches_hf(harness, family.hf, atol=1e-4)
    if fused and family.name in FUSED and ops.avx2_gemm:
        assert report.fused == len(report.paths) > 0
    elif fused:
        from vllite_platform_cpu import decoder_layer

        assert report.fused == 0
        told = caplog.text + " ".join(decoder_layer._TOLD)
        assert f"{ARCH[family.name]}: " in told  # the family's reason, logged once


@pytest.mark.slow
def test_two_ranks_match_hf_generate(family):
    """tensor_parallel_size=2 for the families whose layers split differently over ranks: OLMo 2's all-heads
    q/k norm (a summed mean square; one replicated KV head), Gemma 2's soft-capping and windows, Phi-3's stacked
    q/k/v and gate/up checkpoint tensors."""
    if family.name not in ("olmo2", "gemma2", "phi3"):
        pytest.skip("two ranks run for a representative subset")
    from vllite_core import LLM

    llm = LLM(family.path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4,
              num_kv_blocks=96)
    try:
        _assert_engine_matches(family, llm)
    finally:
        llm.llm_engine.core.shutdown()
