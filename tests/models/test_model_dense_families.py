"""The dense families on the shared decoder (model_registry/models/dense.py) against transformers.

Per family, one tiny random checkpoint (its own seed; sliding windows of a few tokens so the prompts cross
them) and HF ``generate``'s greedy tokens and raw logits, computed once per module:
- the engine (chunked prefill with a 16-token budget under prompts of 26-37 tokens, prefix caching with a
  shared prefix) gives the same tokens and logprobs within 1e-4, float32;
- stepped over a paged cache (``paged_harness``: whole prefills, chunks, mixed batches, decodes), every
  position's logits match HF's with the CPU platform's fused path on (C++ attention; the C++ decoder layer
  where the family's record allows it) and off (torch attention, plain ops);
Two ranks (``tensor_parallel_size=2``) and LoRA against peft, for every family: test_lora_dense_families.py.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from dense_family_configs import ARCH, family_config
from paged_harness import PagedHarness, assert_matches_hf, run_standard_schedule
from tiny_models import save_tiny

from model_registry.builtin import BUILTIN_MODELS
from model_registry.loader import load_model
from model_registry.source import load_hf_config, resolve_model_source

torch.set_num_threads(2)

MAX_TOKENS = 8


FUSED = {"phi3": 2, "smollm3": 2}  # families with Llama-shaped layers: how many the C++ decoder layer takes


class Family:
    def __init__(self, name, path, hf, prompts, ref_tokens, ref_logits):
        self.name, self.path, self.hf, self.prompts = name, path, hf, prompts
        self.ref_tokens, self.ref_logits = ref_tokens, ref_logits


@pytest.fixture(scope="module", params=sorted(ARCH))
def family(request, tmp_path_factory):
    name = request.param
    config = family_config(name)
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
    if fused and family.name in FUSED:  # float32 Llama-shaped layers: the AVX2 GEMM's panels, else small_linear
        assert report.fused == FUSED[family.name]
    elif fused:
        from vllite_platform_cpu import decoder_layer

        assert report.fused == 0
        told = caplog.text + " ".join(decoder_layer._TOLD)
        assert f"{ARCH[family.name]}: " in told  # the family's reason, logged once


def test_a_field_the_family_needs_is_named_at_load():
    """A Gemma 2 config without query_pre_attn_scalar (a config transformers did not validate, as a GGUF's or a
    remote class's): a ConfigError naming it when the model is built, never a guessed scale."""
    from vllite_platform_cpu.attention import TorchPagedAttention

    from model_registry.models.gemma import Gemma2ForCausalLM
    from vllite_core.errors import ConfigError

    config = family_config("gemma2")
    config.__dict__["query_pre_attn_scalar"] = None  # past transformers' own validation
    with pytest.raises(ConfigError, match="query_pre_attn_scalar"):
        Gemma2ForCausalLM(config, TorchPagedAttention(), torch.float32)


def test_a_backend_without_soft_capping_is_refused():
    from model_registry.models.gemma import Gemma2ForCausalLM
    from vllite_core.attention.backend import AttentionBackend
    from vllite_core.errors import ConfigError

    class Plain(AttentionBackend):
        name = "plain"

        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    with pytest.raises(ConfigError, match="logits_soft_cap"):
        Gemma2ForCausalLM(family_config("gemma2"), Plain(), torch.float32)
