"""quantization="int8" (W8A8, dynamic activations): the quantizer and the CPU int8 linear against numpy
float64 computations of the same formula, and the engine end to end on a tiny random Llama against its
unquantized self."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model_registry.layers import ReplicatedLinear
from model_registry.layers.quantization import quantize_model
from vllite_core.config import ConfigError, ModelConfig
from vllite_core.model_ops import ModelOps, quantize_rows_int8

torch.set_num_threads(1)


def _np_quantize(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Independent numpy version: per-row symmetric scale max|a|/127 (1 for zero rows), round half to even."""
    a = a.astype(np.float32)
    amax = np.abs(a).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    return np.clip(np.round(a / scale[:, None]), -127, 127).astype(np.int8), scale


def test_quantize_rows_matches_numpy():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=g) * torch.rand(37, 1, generator=g) * 4
    w[5] = 0.0
    w[6, :] = torch.tensor([2.5, -2.5, 0.5] * 17 + [1.0, 1.0])  # exact halves: round half to even
    q, s = quantize_rows_int8(w)
    qn, sn = _np_quantize(w.numpy())
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert np.array_equal(q.numpy(), qn) and np.array_equal(s.numpy(), sn)
    assert float((q.float() * s[:, None] - w).abs().max()) <= float(s.max()) / 2 + 1e-6


def _ops():
    from vllite_platform_cpu import kernels
    from vllite_platform_cpu.model_ops import CpuModelOps

    out = [("torch default", ModelOps()), ("cpu torch ops", CpuModelOps(fused=False, packed_linear=True))]
    if kernels.available():
        out.append(("cpu kernels", CpuModelOps(fused=True, packed_linear=True)))
    if kernels.available() and kernels.int8_gemm_available():
        out.append(("cpu int8 gemm", CpuModelOps(fused=True, packed_linear=True, int8_gemm=True)))
    return out


@pytest.mark.parametrize("shape", [(1, 576, 192), (7, 33, 17), (64, 96, 80), (3, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_float64_formula(shape, dtype):
    m, k, n = shape
    g = torch.Generator().manual_seed(m * k + n)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g).to(dtype)
    qw, ws = quantize_rows_int8(w)
    qx, xs = _np_quantize(x.float().numpy())
    want = (qx.astype(np.float64) @ qw.numpy().astype(np.float64).T) * xs[:, None].astype(np.float64) \
        * ws.numpy().astype(np.float64)[None, :] + bias.float().numpy().astype(np.float64)
    results = {}
    with torch.inference_mode():
        for name, ops in _ops():
            got = ops.int8_linear(x, qw, ws, bias, {})
            assert got.dtype == dtype and got.shape == (m, n), name
            results[name] = got
            # float32 scaling of exact int32 sums, then one rounding to the dtype
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            np.testing.assert_allclose(got.float().numpy(), want, rtol=tol, atol=tol * 2, err_msg=name)
    for name in ("cpu kernels", "cpu int8 gemm"):  # the C++ passes and GEMM are the torch ops' arithmetic
        if name in results:
            assert torch.equal(results[name], results["cpu torch ops"]), name


def test_bad_quantization_values():
    with pytest.raises(ConfigError, match="quantization"):
        ModelConfig(quantization="int4")
    with pytest.raises(ConfigError, match="does not support"):
        quantize_model(torch.nn.Sequential(torch.nn.ReLU()), "int8")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama_int8")
    save_tiny(path, LlamaConfig(**TINY))
    return str(path)


def test_engine_int8_close_to_unquantized(tiny_llama):
    """The quantized engine's greedy logprobs stay near the unquantized model's, and its layers hold int8."""
    from vllite_core import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [3 + i, 40 + 7 * i, 9, 100 + i, 77]} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    base = LLM(model=tiny_llama, dtype="float32", num_threads=1).generate(prompts, sp)
    llm = LLM(model=tiny_llama, dtype="float32", num_threads=1, quantization="int8")
    model = llm.llm_engine.core.engine_core.worker.runner.model
    int8 = [p for n, p in model.named_parameters() if p.dtype == torch.int8]
    assert len(int8) == 2 * 2 * 2  # qkv, o, gate_up, down in each of 2 layers
    quant = llm.generate(prompts, sp)
    first = [b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]].logprob for b in base]
    # The first token's logprob under the quantized model of the unquantized model's choice.
    again = LLM(model=tiny_llama, dtype="float32", num_threads=1, quantization="int8").generate(
        prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=20, ignore_eos=True))
    for b, q, f in zip(base, again, first):
        t = b.outputs[0].token_ids[0]
        assert t in q.outputs[0].logprobs[0]
        assert abs(q.outputs[0].logprobs[0][t].logprob - f) < 0.15  # measured up to 0.053 here
    assert sum(b.outputs[0].token_ids == q.outputs[0].token_ids for b, q in zip(base, quant)) >= 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_lm_head_opt_in(tiny_llama, monkeypatch, dtype):
    """VLLITE_INT8_LM_HEAD=1: the head's rows are quantized as the layers' are and the logits are the int8 formula
    (ModelOps' float64 reference) on them; the greedy tokens stay near the bf16 head's."""
    from vllite_core import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [3 + i, 40 + 7 * i, 9, 100 + i, 77]} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(model=tiny_llama, dtype=dtype, num_threads=1, quantization="int8")
    plain_head = plain.llm_engine.core.engine_core.worker.runner.model.lm_head
    assert plain_head.quant_method.name == "unquantized"  # vLLM's default: the head as loaded
    monkeypatch.setenv("VLLITE_INT8_LM_HEAD", "1")
    llm = LLM(model=tiny_llama, dtype=dtype, num_threads=1, quantization="int8")
    model = llm.llm_engine.core.engine_core.worker.runner.model
    q, s = model.lm_head.quant_method.qweight, model.lm_head.quant_method.weight_scale
    want_q, want_s = quantize_rows_int8(model.lm_head.weight.detach())
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    h = torch.randn(7, model.hidden_size, generator=torch.Generator().manual_seed(3)).to(model.dtype)
    with torch.inference_mode():
        got = model.compute_logits(h).float()
    want = ModelOps().int8_linear(h, q, s, None, {}).float()
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    a, b = plain.generate(prompts, sp), llm.generate(prompts, sp)
    assert sum(x.outputs[0].token_ids[:4] == y.outputs[0].token_ids[:4] for x, y in zip(a, b)) >= 3


def test_int8_lm_head_needs_the_models_method(monkeypatch):
    class Model(torch.nn.Sequential):
        supported_quantization = ("int8",)

    monkeypatch.setenv("VLLITE_INT8_LM_HEAD", "1")
    with pytest.raises(ConfigError, match="VLLITE_INT8_LM_HEAD=1: Model cannot quantize its LM head"):
        quantize_model(Model(ReplicatedLinear(4, 4, False, torch.float32)), "int8")
