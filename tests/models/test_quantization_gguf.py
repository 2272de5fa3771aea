"""quantization="gguf": GGUF Q8_0/Q4_0/Q4_1 linear weights computed from their blocks.

The repacked blocks against ``gguf.quants`` (the gguf package's own dequantisation) on the default model's
tensors; the CPU kernel of every ISA variant this CPU runs against a float64 matmul of the dequantised
weights (within the bound the per-block int8 activations allow) and against a float64 computation of the
same quantized arithmetic; and the engine on the default model against the dequantised float32 engine.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model_registry.layers.quantization.gguf import GGUF_GROUP, dequantize_gguf, pack_gguf, unpack_gguf
from model_registry.source import default_model_source
from vllite_core.errors import ConfigError
from vllite_core.model_ops import ModelOps

torch.set_num_threads(1)

QTYPES = ("Q8_0", "Q4_0", "Q4_1")


def _random_fields(qtype: str, n: int, k: int, seed: int):
    """GGUF's per-row fields: qs (int8 [N, K] or nibbles uint8 [N, K / 2]), fp16 d and (Q4_1) m [N, K / 32]."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    d = (torch.rand(n, nb, generator=g) * 0.02 + 0.001).half()
    if qtype == "Q8_0":
        qs = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)  # -128 too: the sign trick's edge
        return qs, d, None
    qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    m = (torch.randn(n, nb, generator=g) * 0.05).half() if qtype == "Q4_1" else None
    return qs, d, m


def _np_values(qtype: str, qs: torch.Tensor) -> np.ndarray:
    """Integer weight values [N, K] from GGUF's row layout (Q4 nibbles 0..15: byte j = weights j, j + 16)."""
    q = qs.numpy()
    if qtype == "Q8_0":
        return q.astype(np.int64)
    b = q.reshape(q.shape[0], -1, 16).astype(np.int64)
    return np.concatenate((b & 15, b >> 4), axis=2).reshape(q.shape[0], -1)


def _np_dequant(qtype: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> np.ndarray:
    q = _np_values(qtype, qs)
    n = q.shape[0]
    q = q.reshape(n, -1, 32).astype(np.float64)
    dd = d.numpy().astype(np.float64)[:, :, None]
    if qtype == "Q8_0":
        out = dd * q
    elif qtype == "Q4_0":
        out = dd * (q - 8)
    else:
        out = dd * q + m.numpy().astype(np.float64)[:, :, None]
    return out.reshape(n, -1)


def _np_quantize_acts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row and 32-block: scale max|x| / 127 in float32 (1 for a zero block), round half to even."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2)
    xd = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    return np.round(xb / xd[:, :, None]).astype(np.int64), xd


def _np_quantized_linear(x: np.ndarray, qtype: str, fields) -> np.ndarray:
    """The kernel's arithmetic in float64: exact integer block sums, scaled by both block scales."""
    qs, d, m = fields
    xq, xd = _np_quantize_acts(x)
    q = _np_values(qtype, qs).reshape(qs.shape[0], -1, 32)
    if qtype == "Q4_0":
        q = q - 8
    dots = np.einsum("mbj,nbj->mnb", xq, q).astype(np.float64)
    y = (dots * xd.astype(np.float64)[:, None, :] * d.numpy().astype(np.float64)[None]).sum(-1)
    if qtype == "Q4_1":
        y += (xq.sum(-1) * xd.astype(np.float64)) @ m.numpy().astype(np.float64).T
    return y


def _variants():
    from vllite_platform_cpu import kernels

    return kernels.host_variants() if kernels.available() else []


def test_repack_matches_gguf_quants():
    """Blocks read from the default model's file (Q4_1 layers, the Q8_0 embedding) and a Q4_0 tensor made by
    the gguf package dequantise to exactly what gguf.quants computes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from model_registry.gguf_file import GGUFFile
    from model_registry.layers.quantization.gguf import repack

    f = GGUFFile(default_model_source().gguf_file)
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        info = f.tensors[name]
        raw = np.asarray(f.raw(name))[:200]
        w = repack(raw, info.ggml_type.name)
        want = dequantize(raw, info.ggml_type).reshape(-1, info.shape[1])
        assert torch.equal(dequantize_gguf(w), torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))
    a = np.random.RandomState(0).randn(40, 96).astype(np.float32)
    raw = quantize(a, GGMLQuantizationType.Q4_0)
    want = dequantize(raw, GGMLQuantizationType.Q4_0)
    assert torch.equal(dequantize_gguf(repack(raw, "Q4_0")), torch.from_numpy(want.astype(np.float32)))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [(37, 96), (3, 32), (64, 576), (17, 1536)])
def test_kernel_matches_float64(qtype, shape):
    """Every ISA variant, both paths (int8 activations; with AVX2 also dequantised float32 panels), rows 1..17
    and 70 (two int8 row blocks), odd column counts (panel and tile remainders), with and without bias."""
    from vllite_platform_cpu import kernels

    variants = _variants()
    if not variants:
        pytest.skip(f"no CPU kernels: {kernels.error()}")
    n, k = shape
    fields = _random_fields(qtype, n, k, seed=n * k)
    w, wd = pack_gguf(qtype, *fields), _np_dequant(qtype, *fields)
    assert np.array_equal(dequantize_gguf(w).numpy(), wd.astype(np.float32))
    g = torch.Generator().manual_seed(k)
    for rows in (*range(1, 18), 70):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        if rows == 5:
            x[2, :32] = 0.0  # an all-zero block: scale 1, values 0
        bias = torch.randn(n, generator=g) if rows % 2 else None
        xn = x.numpy().astype(np.float64)
        b = 0.0 if bias is None else bias.numpy().astype(np.float64)
        exact = xn @ wd.T + b  # the dequantised weights, unquantized input
        same = _np_quantized_linear(x.numpy(), qtype, fields) + b  # the kernel's own arithmetic
        _, xd = _np_quantize_acts(x.numpy())
        # |x - xd * xq| <= xd / 2 per element, so the activation rounding moves each output by at most
        # sum over blocks of (xd / 2) * sum |w| of the block; float32 sums add a relative 1e-5 of the magnitudes.
        wabs = np.abs(wd).reshape(n, -1, 32).sum(-1)
        bound = 0.5 * xd.astype(np.float64) @ wabs.T
        mag = np.abs(xn) @ np.abs(wd).T + np.abs(b)
        for v in variants:
            mod = kernels.load_variant(v)
            for min_rows in (1 << 30, 1):  # the int8 path at every row count, then the float32 panel path
                out = torch.empty(rows, n)
                mod.gguf_linear_x8(out, x, w.type_id, w.blocks, bias, min_rows, 1 << 30)
                got = out.numpy().astype(np.float64)
                what = f"{v} {rows} rows, gemm_min_rows {min_rows}"
                if min_rows == 1 and mod.avx2_gemm_available():  # dequantised weights, float32 sums
                    np.testing.assert_array_less(np.abs(got - exact), 1e-5 * mag + 1e-6, err_msg=what)
                    continue
                np.testing.assert_array_less(np.abs(got - same), 1e-5 * mag + 1e-6, err_msg=what)
                np.testing.assert_array_less(np.abs(got - exact), bound * 1.0001 + 1e-5 * mag + 1e-6, err_msg=what)


@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_layout(qtype):
    """pack_gguf puts row r's weight k of a group where GGUFWeight documents it, zero rows pad the last group
    (13 rows: 8 + 5), and unpack_gguf gives back the fields."""
    n, k = 13, 64
    qs, d, m = _random_fields(qtype, n, k, seed=7)
    w = pack_gguf(qtype, qs, d, m)
    rec = {"Q8_0": 272, "Q4_0": 144, "Q4_1": 160}[qtype]
    assert w.shape == (n, k) and w.blocks.shape == (2, 2 * rec) and w.nbytes() == 2 * 2 * rec
    blocks = w.blocks.numpy().reshape(2, 2, rec)
    values = _np_values(qtype, qs)
    q4 = qtype != "Q8_0"
    for row in (0, 7, 8, 12):
        g, r = divmod(row, GGUF_GROUP)
        for b in range(2):
            for j in range(32):
                t, i = divmod(j % 16 if q4 else j, 4)
                byte = int(blocks[g, b, 32 * t + 4 * r + i])
                got = ((byte >> 4) if j >= 16 else (byte & 15)) if q4 else np.int8(np.uint8(byte))
                assert got == values[row, 32 * b + j]
            scales = blocks[g, b, 128 if q4 else 256:].view(np.float16)
            assert scales[r] == d[row, b].item()
            if qtype == "Q4_1":
                assert scales[GGUF_GROUP + r] == m[row, b].item()
    qb = 256 if not q4 else 128
    pad = blocks[1].copy()  # the last group's rows 5..7 (past N): values and scales zero
    chunks = pad[:, :qb].reshape(2, -1, GGUF_GROUP, 4)
    assert not chunks[:, :, 5:].any() and not pad[:, qb:].reshape(2, -1, GGUF_GROUP, 2)[:, :, 5:].any()
    back = unpack_gguf(w)
    assert torch.equal(back[0], qs) and torch.equal(back[1], d.float())
    assert (back[2] is None) == (m is None) and (m is None or torch.equal(back[2], m.float()))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [(37, 96), (64, 576)])
def test_kernel_bfloat16_input(qtype, shape):
    """bfloat16 in and out, every ISA variant: below gemm_min_rows (and on CPUs without AVX512-BF16 at every row
    count) the float32 kernel on the widened input, rounded once; from gemm_min_rows on with AVX512-BF16,
    bfloat16 panels: bit for bit the bf16 GEMM on the dequantised weight rounded to bfloat16 (the dequantised
    bf16 model's linear), and within bf16 rounding of a float64 product. Rows 12..130: a partial tile, two
    120-row blocks; 37 columns: a partial panel."""
    from vllite_platform_cpu import kernels

    variants = _variants()
    if not variants:
        pytest.skip(f"no CPU kernels: {kernels.error()}")
    n, k = shape
    fields = _random_fields(qtype, n, k, seed=n + k)
    w = pack_gguf(qtype, *fields)
    wbf = torch.from_numpy(_np_dequant(qtype, *fields).astype(np.float32)).bfloat16()  # .to(bf16): RNE
    g = torch.Generator().manual_seed(n)
    for rows in (1, 5, 12, 13, 40, 130):
        x = (torch.randn(rows, k, generator=g) * 2).bfloat16()
        bias = torch.randn(n, generator=g) if rows % 2 else None
        for v in variants:
            mod = kernels.load_variant(v)
            for min_rows in (1 << 30, 12):
                what = f"{v} {rows} rows, gemm_min_rows {min_rows}"
                got = torch.empty(rows, n, dtype=torch.bfloat16)
                mod.gguf_linear_x8(got, x, w.type_id, w.blocks, bias, min_rows, 1 << 30)
                if rows >= min_rows and mod.bf16_gemm_available():
                    packed = torch.zeros(-(-n // 32), k // 2, 32, 2, dtype=torch.bfloat16)
                    mod.bf16_gemm_pack(packed, wbf)
                    want = torch.empty(rows, n, dtype=torch.bfloat16)
                    mod.bf16_gemm(want, x, packed, bias)
                    assert torch.equal(got, want), what
                    exact = x.double() @ wbf.double().T + (0.0 if bias is None else bias.double())
                    mag = x.double().abs() @ wbf.double().abs().T
                    assert ((got.double() - exact).abs() <= exact.abs() / 128 + 1e-5 * mag + 1e-6).all(), what
                else:
                    wide = torch.empty(rows, n)
                    mod.gguf_linear_x8(wide, x.float(), w.type_id, w.blocks, bias, min_rows, 1 << 30)
                    assert torch.equal(got, wide.bfloat16()), what


def test_kernel_split_over_threads():
    """The int8 path's groups split over 2 threads (grain 1 byte) give the one-thread result bit for bit, with
    a partial last group (70 rows: 8 groups + 6) and 1 to 9 input rows."""
    variants = [v for v in _variants() if v != "default"] or _variants()
    if not variants:
        pytest.skip("no CPU kernels")
    from vllite_platform_cpu import kernels

    w = pack_gguf("Q4_1", *_random_fields("Q4_1", 70, 96, seed=3))
    mod = kernels.load_variant(variants[-1])
    before = torch.get_num_threads()
    try:
        for rows in (1, 5, 9):
            x = torch.randn(rows, 96)
            one, two = torch.empty(rows, 70), torch.empty(rows, 70)
            torch.set_num_threads(1)
            mod.gguf_linear_x8(one, x, w.type_id, w.blocks, None, 1 << 30, 1 << 30)
            torch.set_num_threads(2)
            mod.gguf_linear_x8(two, x, w.type_id, w.blocks, None, 1 << 30, 1)
            assert torch.equal(one, two), rows
    finally:
        torch.set_num_threads(before)


def test_reference_op_and_cpu_op():
    """ModelOps.gguf_linear (dequantise, float32) and the CPU model op (the kernel; bfloat16 in and out)."""
    from vllite_platform_cpu.model_ops import CpuModelOps

    fields = _random_fields("Q4_1", 48, 64, seed=1)
    w = pack_gguf("Q4_1", *fields)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        ref = ModelOps().gguf_linear(x, w, None, {})
        want = x.numpy().astype(np.float64) @ _np_dequant("Q4_1", *fields).T
        np.testing.assert_allclose(ref.numpy(), want, rtol=1e-5, atol=1e-5)
        if _variants():
            got = CpuModelOps(fused=True, packed_linear=True).gguf_linear(x.bfloat16(), w, None, {})
            assert got.dtype == torch.bfloat16 and got.shape == (3, 48)
            same = _np_quantized_linear(x.bfloat16().float().numpy(), "Q4_1", fields)
            np.testing.assert_allclose(got.float().numpy(), same, rtol=1e-2, atol=1e-2)


def test_gguf_needs_a_gguf_checkpoint(tiny_path):
    from vllite_core import LLM

    with pytest.raises(ConfigError, match="GGUF"):
        LLM(model=tiny_path, dtype="float32", num_threads=1, quantization="gguf")


@pytest.mark.slow
def test_engine_gguf_on_the_default_model():
    """The default model with quantization="gguf": every linear layer from its Q4_1 blocks and the (tied) LM head
    from the Q8_0 embedding (the same weights the dequantised engine holds), and greedy tokens close to the
    dequantised float32 engine's."""
    from vllite_core import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    dense = LLM(dtype="float32", num_threads=1, max_model_len=128, enable_prefix_caching=False)
    base = dense.generate(prompts, sp)
    dense_model = dense.llm_engine.core.engine_core.worker.runner.model
    dense_w = {n: m.weight.detach().clone() for n, m in dense_model.named_modules() if hasattr(m, "checkpoint_names")}
    dense_head = dense_model.lm_head.weight.detach().clone()
    del dense
    llm = LLM(dtype="float32", num_threads=1, max_model_len=128, enable_prefix_caching=False, quantization="gguf")
    model = llm.llm_engine.core.engine_core.worker.runner.model
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "checkpoint_names")}
    assert len(layers) == 4 * 30 and all(m.quant_method.name == "gguf" for m in layers.values())
    for n, m in layers.items():  # shard order and the rotary row permutation of q and k
        assert torch.equal(dequantize_gguf(m.quant_method.gguf_weight), dense_w[n]), n
    head = model.lm_head.quant_method.gguf_weight
    assert head.qtype == "Q8_0" and torch.equal(dequantize_gguf(head), dense_head)
    out = llm.generate(prompts, sp)
    agree = [next((i for i, (a, b) in enumerate(zip(x.outputs[0].token_ids, y.outputs[0].token_ids)) if a != b), 24)
             for x, y in zip(base, out)]
    print("greedy tokens before the first divergence:", agree)
    # int8 activations per 32-block move logits slightly (as llama.cpp's Q8_1 activations do): a near-tie can
    # flip a token, after which the texts differ. Measured here: see the report; required: no early collapse.
    assert sum(agree) >= 2 * 24 and min(agree) >= 4


@pytest.mark.slow
def test_engine_gguf_bfloat16_batch_is_the_dequantised_bf16_model():
    """quantization="gguf" under dtype="bfloat16" with 12 requests at once (every step has GGUF_GEMM_MIN_ROWS rows
    or more): on a CPU whose bf16 layers run the platform's bf16 GEMM, the blocks' bf16 panels give the dequantised
    bf16 engine's tokens and logprobs exactly (the one-call decoder stack and the Python path alike)."""
    from vllite_platform_cpu import kernels
    from vllite_platform_cpu.platform import use_bf16_gemm

    from vllite_core import LLM, SamplingParams

    if not (_variants() and use_bf16_gemm()):
        pytest.skip("the dequantised bf16 engine does not run the platform's bf16 GEMM here")
    assert kernels.GGUF_GEMM_MIN_ROWS <= 12
    prompts = [f"Item {i}: the best thing about the number {i} is" for i in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = []
    for q in (None, "gguf"):
        llm = LLM(dtype="bfloat16", num_threads=2, max_model_len=128, enable_prefix_caching=False, quantization=q)
        runs.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                     for o in llm.generate(prompts, sp)])
        del llm
    assert runs[0] == runs[1]
