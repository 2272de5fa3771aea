"""The CPU platform's fused model ops against the torch formulas they replace (ModelOps defaults).

The references are plain torch expressions written here, not the C++ kernels: RMSNorm in float32 then
rounded and scaled (transformers' order), SiLU * up, NeoX rotary, F.linear.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllite_core.model_ops import ModelOps

kernels = pytest.importorskip("vllite_platform_cpu.kernels")
if not kernels.available():
    pytest.skip(f"CPU kernels not built here: {kernels.error()}", allow_module_level=True)

from vllite_platform_cpu.model_ops import SMALL_LINEAR_MAX_ROWS, CpuModelOps  # noqa: E402

FAST = CpuModelOps(fused=True, packed_linear=True)
DTYPES = [torch.float32, torch.bfloat16]


def ref_rms(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def close(a, b, dtype):
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_fused_residual(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    r = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    with torch.inference_mode():
        close(FAST.rms_norm(x, w, 1e-5), ref_rms(x, w, 1e-5), dtype)
        h, res = FAST.add_rms_norm(x.clone(), r.clone(), w, 1e-5)
        assert torch.equal(res, r + x)  # the residual add rounds exactly like torch's
        close(h, ref_rms(r + x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul_is_torchs(dtype, rows):
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    with torch.inference_mode():
        assert torch.equal(FAST.silu_and_mul(x), F.silu(gate) * up)  # same vectorised exp, same rounding


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_qkv_views(dtype):
    t, h, hkv, d = 37, 9, 3, 64
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    q, k, _ = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, h, d), k.view(t, hkv, d)

    def neox(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]

    want_q, want_k = neox(q), neox(k)
    v_before = qkv[:, (h + hkv) * d:].clone()
    with torch.inference_mode():
        got_q, got_k = FAST.rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.data_ptr() == q.data_ptr()  # in place, inside the fused qkv output
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)  # v untouched


@pytest.mark.parametrize("rows", [1, 2, SMALL_LINEAR_MAX_ROWS, SMALL_LINEAR_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1539, 576), (576, 1536), (7, 13)])
def test_linear_paths_match_f_linear(rows, bias, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 7 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    state: dict = {}
    with torch.inference_mode():
        got = FAST.linear(x, w, b, state)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        if rows > SMALL_LINEAR_MAX_ROWS:
            assert "packed" in state  # the oneDNN copy was made...
            w.add_(1.0)  # ...and an in-place change of the weight is seen
            torch.testing.assert_close(FAST.linear(x, w, b, state), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_16bit_linear_widened_is_the_16bit_matmul(dtype, rows):
    # Without native 16-bit math the layer runs in float32 on exact widenings of the 16-bit values and
    # rounds once: the reference is that arithmetic written in torch (float64 products, then rounded).
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((rows, 576), (1000, 576), (1000,)))
    ops = CpuModelOps(fused=True, packed_linear=True, widen_16bit=True)
    with torch.inference_mode():
        got = ops.linear(x, w, b, {})
        exact = (x.double() @ w.double().T + b.double()).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), exact.float(), rtol=1e-2, atol=1e-2)
    # and within rounding of torch's own 16-bit linear
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_bf16_linear_native_runs_onednn_packed_bf16(rows):
    # With native bf16 math every row count runs oneDNN's packed bf16 kernel: bf16 products, float32
    # sums, one rounding. Reference: float64 arithmetic on the same bf16 values.
    from vllite_platform_cpu.platform import has_fast_bf16

    if not has_fast_bf16():
        pytest.skip("no native bf16 math on this CPU")
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((rows, 576), (1000, 576), (1000,)))
    ops = CpuModelOps(fused=True, packed_linear=True, widen_16bit=False)
    state: dict = {}
    with torch.inference_mode():
        got = ops.linear(x, w, b, state)
        assert got.dtype == torch.bfloat16 and state["packed"].dtype == torch.bfloat16
        exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
        torch.testing.assert_close(got.float(), exact.float(), rtol=1e-2, atol=1e-2)
        w.mul_(-1.0)  # an in-place change of the weight is seen
        exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
        torch.testing.assert_close(ops.linear(x, w, b, state).float(), exact.float(), rtol=1e-2, atol=1e-2)


def test_unsupported_inputs_fall_back_to_torch():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64)
    out = FAST.rms_norm(x, w, 1e-6)  # grad mode: the torch formula, differentiable
    out.sum().backward()
    assert x.grad is not None
    base = ModelOps()
    y = torch.randn(6, 5).t()  # last dimension not contiguous: the torch path
    with torch.inference_mode():
        assert torch.equal(FAST.silu_and_mul(y), base.silu_and_mul(y))


needs_avx2_gemm = pytest.mark.skipif(not kernels.avx2_gemm_available(), reason="AVX2 GEMM not built on this CPU")
AVX2 = CpuModelOps(fused=True, packed_linear=True, avx2_gemm=True)


@needs_avx2_gemm
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 97, 200])
@pytest.mark.parametrize("shape", [(960, 576), (49, 1536), (16, 3), (1, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_gemm_matches_float64(rows, shape, bias):
    # Every row count and every column remainder of the 6 x 16 tiles (rows past a 96-row block, columns
    # past a 16-column panel); the reference is float64 arithmetic on the same float32 values.
    n, k = shape
    g = torch.Generator().manual_seed(rows * 31 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    state: dict = {}

    def exact():
        return F.linear(x.double(), w.double(), None if b is None else b.double()).float()

    with torch.inference_mode():
        got = AVX2.linear(x, w, b, state)
        assert state["packed"].shape == (-(-n // 16), k, 16)  # the GEMM's panels, not oneDNN's copy
        torch.testing.assert_close(got, exact(), rtol=1e-5, atol=1e-5 * k ** 0.5)
        w.mul_(-0.5)  # an in-place change of the weight is repacked
        torch.testing.assert_close(AVX2.linear(x, w, b, state), exact(), rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_avx2_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
@pytest.mark.parametrize("shape", [(49, 77), (33, 576)])
def test_avx2_gemm_16bit_panels_match_float64(dtype, rows, shape):
    # bf16/fp16 without native math: the weight packed as 16-bit panels (no float32 copy) and widened in
    # registers, at every row count (the 6-row tiles' remainders, odd N and K). The GEMM's float32 output is
    # float64 arithmetic on the widened values to float32 rounding; the layer's output is that rounded once.
    n, k = shape
    g = torch.Generator().manual_seed(rows * 7 + n)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((rows, k), (n, k), (n,)))
    ops = CpuModelOps(fused=True, packed_linear=True, widen_16bit=True, avx2_gemm=True)
    state: dict = {}

    def exact():
        return x.double() @ w.double().T + b.double()

    with torch.inference_mode():
        got = ops.linear(x, w, b, state)
        assert got.dtype == dtype
        assert state["packed"].dtype == dtype and state["packed"].shape == (-(-n // 16), k, 16)
        out = torch.empty(rows, n)
        kernels.avx2_gemm(out, x.float(), state["packed"], state["bias"])
        torch.testing.assert_close(out, exact().float(), rtol=1e-5, atol=1e-5 * k ** 0.5)
        # the layer's output: the float32 sums rounded once to the 16-bit type (both roundings agree but at ties)
        torch.testing.assert_close(got.float(), exact().to(dtype).float(), rtol=1e-2, atol=1e-2)
        w.mul_(-0.5)  # an in-place change of the weight is repacked
        torch.testing.assert_close(ops.linear(x, w, b, state).float(), exact().to(dtype).float(), rtol=1e-2,
                                   atol=1e-2)


@needs_avx2_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 33), (81, 77), (200, 5), (1040, 1101)])
@pytest.mark.parametrize("threads", [1, 2])
def test_avx2_gemm_few_rows_bit_identical_to_many_rows(dtype, shape, threads):
    # 1-3 rows take their own path (2-4 panels at once, its own thread split); each output element is the
    # same FMA chain, so a row's output is bit for bit the same whether it comes alone or in a 13-row call
    # (6-row tiles); and 4 rows (4-row tiles). Columns: under one panel, 16 k + 1, a half panel, and 65 panels
    # (split at 2 threads); odd K.
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    x, w, b = torch.randn(13, k, generator=g), torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    packed = kernels.avx2_gemm_pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for gemm, bias in ((kernels.avx2_gemm, None), (kernels.avx2_gemm, b), (kernels.avx2_gemm_gelu, b)):
            many = torch.empty(13, n)
            gemm(many, x, packed, bias)
            for rows in (1, 2, 3, 4):
                for r0 in (0, 13 - rows):
                    few = torch.empty(rows, n)
                    gemm(few, x[r0:r0 + rows].contiguous(), packed, bias)
                    assert torch.equal(few, many[r0:r0 + rows]), (gemm, bias is None, rows, r0)
    finally:
        torch.set_num_threads(before)


@needs_avx2_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [11, 12, 13, 97, 200])
@pytest.mark.parametrize("shape", [(49, 77), (81, 2048)])
@pytest.mark.parametrize("threads", [1, 2])
def test_avx2_gemm_16bit_panels_widened_once_per_block(dtype, rows, shape, threads):
    # From 12 rows in a 96-row block a 16-bit panel is widened to float32 once and the block's tiles run on
    # that copy (csrc/gemm.cpp, widen_panel): below that (11 rows) each tile widens as it loads. Either way the
    # sums are float64 arithmetic on the widened values to float32 rounding, and bit for bit those of float32
    # panels of the widened weight (the widening is exact). Rows: both sides of the threshold, a block's
    # remainder (97: 96 + 1; 200: two blocks + 8); columns: a partial last panel; K: odd, and the 1B's 2,048.
    n, k = shape
    g = torch.Generator().manual_seed(rows * 3 + n + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, wide = torch.empty(rows, n), torch.empty(rows, n)
        kernels.avx2_gemm(out, x, kernels.avx2_gemm_pack(w), b)
        kernels.avx2_gemm(wide, x, kernels.avx2_gemm_pack(w.float()), b)
    finally:
        torch.set_num_threads(before)
    exact = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert torch.equal(out, wide)


@needs_avx2_gemm
def test_avx2_gemm_chosen_only_on_avx2_hosts_without_avx512(monkeypatch):
    from vllite_platform_cpu import platform as cpu_platform

    monkeypatch.setattr(kernels, "avx2_gemm_available", lambda: True)
    assert cpu_platform.use_avx2_gemm({"avx2", "fma"})
    assert not cpu_platform.use_avx2_gemm({"avx2", "fma", "avx512f"})  # oneDNN's AVX-512 kernels stay
    assert not cpu_platform.use_avx2_gemm({"avx", "sse4_2"})
    monkeypatch.setenv(cpu_platform.AVX2_GEMM_ENV, "0")
    assert not cpu_platform.use_avx2_gemm({"avx2", "fma"})


def test_bf16_gemm_chosen_with_avx512_bf16(monkeypatch):
    from vllite_platform_cpu import platform as cpu_platform

    monkeypatch.setattr(kernels, "bf16_gemm_available", lambda: True)
    assert cpu_platform.use_bf16_gemm({"avx2", "fma", "avx512f", "avx512_bf16"})
    assert cpu_platform.use_bf16_gemm({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})  # on AMX tiles
    assert not cpu_platform.use_bf16_gemm({"avx2", "fma", "avx512f"})
    monkeypatch.setenv(cpu_platform.BF16_GEMM_ENV, "0")
    assert not cpu_platform.use_bf16_gemm({"avx2", "fma", "avx512f", "avx512_bf16"})
    assert cpu_platform.use_amx()
    monkeypatch.setenv(cpu_platform.AMX_ENV, "0")
    assert not cpu_platform.use_amx()


def test_bf16_gemm_pack_layout():
    """[N, K] -> [ceil(N / 32), K / 2, 32, 2]: per pair of k, 32 columns' (w[k], w[k + 1]), columns past N zero
    (plain C++: checked on every host)."""
    w = torch.randn(37, 6).bfloat16()
    packed = kernels.bf16_gemm_pack(w)
    want = torch.zeros(64, 6, dtype=torch.bfloat16)
    want[:37] = w
    want = want.view(2, 32, 3, 2).permute(0, 2, 1, 3)  # (panel, k pair, column, k in pair)
    assert packed.shape == (2, 3, 32, 2) and torch.equal(packed, want)
    with pytest.raises(RuntimeError, match="K even"):
        kernels.bf16_gemm_pack(torch.randn(4, 5).bfloat16())


needs_bf16_gemm = pytest.mark.skipif(not kernels.bf16_gemm_available(), reason="AVX512-BF16 GEMM not built here")


needs_amx = pytest.mark.skipif(not kernels.amx_available(), reason="no AMX-BF16 tiles on this CPU / OS")


@pytest.fixture(params=[False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
def amx(request):
    """The bf16 GEMM on vdpbf16ps, then (where the CPU has them) on AMX tiles; the default state restored."""
    from vllite_platform_cpu.platform import use_amx

    assert kernels.set_amx(request.param) == request.param
    yield request.param
    kernels.set_amx(use_amx())


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 4, 11, 12, 13, 16, 17, 33, 64, 121, 250, 300])
@pytest.mark.parametrize("shape", [(49, 78), (960, 576), (33, 2), (47, 96), (80, 64), (40, 8192)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_gemm_matches_float64(rows, shape, bias, threads, amx):
    # Every tile height (1-12 rows of vdpbf16ps, 1-32 of AMX tiles (one or two A tiles), their row blocks and
    # remainders), partial 32-column panels, K of one pair (vdpbf16ps only: AMX takes K in steps of 32); from 256
    # rows the 64-column tiles (a partial second panel; 80 columns: a last panel alone); K = 8,192: AMX sums in
    # blocks of K (over all of a row block's panels from 33 rows). The
    # reference is float64 arithmetic on the same bf16 values; the kernel's float32 sums (plus the float32 bias)
    # are rounded once to bf16, so each output is within a bf16 rounding of the exact value.
    n, k = shape
    g = torch.Generator().manual_seed(rows * 13 + n + k)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.bf16_gemm(out, x, kernels.bf16_gemm_pack(w), b)
    finally:
        torch.set_num_threads(before)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    err = (out.double() - exact).abs()
    assert torch.all(err <= exact.abs() * 2 ** -8 + 1e-5 * k ** 0.5), float(err.max())


@needs_bf16_gemm
@pytest.mark.parametrize("k", [576, 8192])
def test_bf16_gemm_row_does_not_depend_on_the_batch(amx, k):
    """A row's output is the same alone and among 299 others (its sums in the same order whatever the tile; K =
    8,192 on AMX: 300 rows take the blocks of K over all panels, one row each tile's blocks in turn), so a request's
    tokens do not depend on what it is batched with."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, k, generator=g).bfloat16(), torch.randn(200, k, generator=g).bfloat16()
    packed, b = kernels.bf16_gemm_pack(w), torch.randn(200, generator=g)
    whole = torch.empty(300, 200, dtype=torch.bfloat16)
    kernels.bf16_gemm(whole, x, packed, b)
    for r in (0, 17, 255, 299):
        one = torch.empty(1, 200, dtype=torch.bfloat16)
        kernels.bf16_gemm(one, x[r:r + 1].contiguous(), packed, b)
        assert torch.equal(one[0], whole[r])


def _gate_up_silu_fused_and_two_steps(fused_fn, gemm_fn, x, packed, bias, inter, threads):
    """(fused, two-step) outputs of a gate_up GEMM with SiLU-and-mul on `threads` threads: fused_fn(out, x, packed,
    bias) against gemm_fn into [rows, 2 * inter] then silu_and_mul."""
    rows = x.shape[0]
    fused = torch.full((rows, inter), float("nan"), dtype=torch.bfloat16)
    both, want = torch.empty(rows, 2 * inter, dtype=torch.bfloat16), torch.empty(rows, inter, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused_fn(fused, x, packed, bias)
        gemm_fn(both, x, packed, bias)
        kernels.silu_and_mul(want, both)
    finally:
        torch.set_num_threads(before)
    return fused, want


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 7, 33, 64, 65, 100, 121, 250])
@pytest.mark.parametrize("shape", [(32, 2), (64, 78), (96, 576), (32, 2080)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_gemm_silu_is_gemm_then_silu_and_mul_bit_for_bit(rows, shape, bias, threads, amx):
    """The gate_up projection with SiLU-and-mul in its epilogue gives what the two kernels give one after the
    other (vdpbf16ps: from 64 rows the fused tiles, heights of 5-6 rows, the next-panel prefetch up to 120 rows,
    row blocks past it, below 64 the two steps; AMX: every row count fused, K = 2,080 in two blocks of K, which
    bf16_gemm runs k-blocked from 33 rows; a bias on both halves), and is near the float64 value of
    silu(gate) * up."""
    inter, k = shape
    g = torch.Generator().manual_seed(rows * 7 + inter + k)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(2 * inter, k, generator=g).bfloat16()
    b = torch.randn(2 * inter, generator=g) if bias else None
    fused, want = _gate_up_silu_fused_and_two_steps(kernels.load().bf16_gemm_silu, kernels.bf16_gemm, x,
                                                    kernels.bf16_gemm_pack(w), b, inter, threads)
    assert torch.equal(fused.view(torch.int16), want.view(torch.int16))
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    gate, up = exact[:, :inter], exact[:, inter:]
    ref = torch.nn.functional.silu(gate) * up
    # gate, up, silu(gate) and the product each rounded once to bf16: a few roundings of the largest factor.
    bound = (gate.abs() + 1) * up.abs() * 2 ** -6 + 1e-4 * k ** 0.5 * (gate.abs() + up.abs() + 1)
    assert torch.all((fused.double() - ref).abs() <= bound), float(((fused.double() - ref).abs() - bound).max())


@needs_bf16_gemm
def test_bf16_gemm_silu_checks_shapes():
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(2 * 48, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bf16_gemm_silu: shapes"):  # 48 outputs: not whole 32-column panels
        kernels.load().bf16_gemm_silu(torch.empty(3, 48, dtype=torch.bfloat16), x, kernels.bf16_gemm_pack(w), None)


@needs_amx
def test_amx_tiles_agree_with_vdpbf16ps():
    """The two instruction paths differ only in the order of the float32 additions: their bf16 outputs differ by
    at most one bf16 rounding step where they differ at all."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(40, 1536, generator=g).bfloat16(), torch.randn(96, 1536, generator=g).bfloat16()
    packed = kernels.bf16_gemm_pack(w)
    from vllite_platform_cpu.platform import use_amx

    outs = []
    for on in (False, True):
        kernels.set_amx(on)
        try:
            outs.append(torch.empty(40, 96, dtype=torch.bfloat16))
            kernels.bf16_gemm(outs[-1], x, packed, None)
        finally:
            kernels.set_amx(use_amx())
    diff = (outs[0].float() - outs[1].float()).abs()
    assert torch.all(diff <= outs[0].float().abs() * 2 ** -7 + 1e-3), float(diff.max())


@needs_bf16_gemm
def test_bf16_route_serves_every_row_count():
    """With the bf16 GEMM on, a bfloat16 layer (K even) takes it at every row count, through one packed copy,
    bit for bit the kernel's output; K odd and float32 layers keep their routes."""
    ops = CpuModelOps(fused=True, packed_linear=True, widen_16bit=False, bf16_gemm=True)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    assert ops.linear_route(torch.bfloat16, 1, w) == ops.linear_route(torch.bfloat16, 500, w) == "bf16"
    assert ops.linear_route(torch.bfloat16, 1, w[:, :63]) != "bf16"
    assert ops.linear_route(torch.float32, 1, w.float()) == "small"
    state: dict = {}
    with torch.inference_mode():
        for rows in (1, 5, 70):
            x = torch.randn(rows, 64, generator=g).bfloat16()
            got = ops.linear(x, w, b, state)
            want = torch.empty(rows, 96, dtype=torch.bfloat16)
            kernels.bf16_gemm(want, x, kernels.bf16_gemm_pack(w), b.float())
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        packed = state["packed"]
        ops.linear(torch.randn(3, 64).bfloat16(), w, b, state)
        assert state["packed"] is packed  # packed once
        w.mul_(-1)  # an in-place change is packed again
        ops.linear(torch.randn(3, 64).bfloat16(), w, b, state)
        assert state["packed"] is not packed


def test_int8_gemm_chosen_with_vnni(monkeypatch):
    from vllite_platform_cpu import platform as cpu_platform

    monkeypatch.setattr(kernels, "int8_gemm_available", lambda: True)
    assert cpu_platform.use_int8_gemm({"avx512f", "avx512_vnni"})
    assert cpu_platform.use_int8_gemm({"avx512f", "avx512_vnni", "amx_int8"})  # on AMX tiles
    assert not cpu_platform.use_int8_gemm({"avx2", "avx_vnni"})
    monkeypatch.setenv(cpu_platform.INT8_GEMM_ENV, "0")
    assert not cpu_platform.use_int8_gemm({"avx512f", "avx512_vnni"})


def test_int8_gemm_pack_layout():
    """[N, K] int8 -> [ceil(N / 32), K * 32 + 256]: per 4 k, 32 columns' 4 values; then 32 int32 128 * sum(w) and
    32 float32 scales; columns past N zero (plain C++: checked on every host)."""
    from vllite_core.model_ops import quantize_rows_int8

    q, scale = quantize_rows_int8(torch.randn(37, 8))
    packed = kernels.int8_gemm_pack(q, scale)
    assert packed.shape == (2, 8 * 32 + 256) and packed.dtype == torch.int8
    padded = torch.zeros(64, 8, dtype=torch.int8)
    padded[:37] = q
    want = padded.view(2, 32, 2, 4).permute(0, 2, 1, 3).reshape(2, 256)  # (panel, k quad, column, k in quad)
    assert torch.equal(packed[:, :256], want)
    tail = packed[:, 256:].contiguous()
    comp, scales = tail[:, :128].view(torch.int32).reshape(64), tail[:, 128:].view(torch.float32).reshape(64)
    assert torch.equal(comp[:37], 128 * q.int().sum(1)) and not comp[37:].any()
    assert torch.equal(scales[:37], scale) and not scales[37:].any()
    with pytest.raises(RuntimeError, match="multiple of 4"):
        kernels.int8_gemm_pack(q[:, :6].contiguous(), scale)


def _int_mm_path(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 numbers through the separate kernels: quantize_rows_int8, exact int32 sums (int64 matmul here),
    dequantize_int32."""
    xq = torch.empty(x.shape, dtype=torch.int8)
    xs = torch.empty(x.shape[0])
    kernels.quantize_rows_int8(xq, xs, x)
    acc = (xq.long() @ q.long().T).int()
    out = torch.empty(acc.shape, dtype=x.dtype)
    kernels.dequantize_int32(out, acc, xs, scale, bias)
    return out


needs_int8_gemm = pytest.mark.skipif(not kernels.int8_gemm_available(), reason="AVX512-VNNI int8 GEMM not built here")


@needs_int8_gemm
@pytest.mark.parametrize("rows", [1, 4, 11, 12, 13, 16, 17, 33, 64, 121, 250, 300])
@pytest.mark.parametrize("shape", [(49, 76), (960, 576), (33, 4), (47, 128), (40, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_gemm_is_the_separate_passes_bit_for_bit(rows, shape, dtype, threads, amx):
    # Every tile height (1-12 rows of vpdpbusd, 1-32 of AMX tiles, their row blocks and remainders), partial
    # 32-column panels, K of one quad (vpdpbusd only: AMX takes K in steps of 64; K = 8,192: AMX tasks of 128 rows,
    # amx::rows_per_task); inputs large enough
    # that the unsigned offset and its compensation matter (|q| up to 127). The
    # int32 sums are exact, the epilogue dequantize_int32's: equal bit for bit to the separate passes, and
    # within float32 rounding of the float64 formula.
    n, k = shape
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    from vllite_core.model_ops import quantize_rows_int8

    q, scale = quantize_rows_int8(torch.randn(n, k, generator=g))
    x = (torch.randn(rows, k, generator=g) * 5).to(dtype)
    bias = torch.randn(n, generator=g) if rows % 2 else None
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.int8_gemm(out, x, kernels.int8_gemm_pack(q, scale), bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, _int_mm_path(x, q, scale, bias))
    xq = torch.empty(x.shape, dtype=torch.int8)
    xs = torch.empty(rows)
    kernels.quantize_rows_int8(xq, xs, x)
    exact = (xq.double() @ q.double().T) * xs.double()[:, None] * scale.double()
    if bias is not None:
        exact += bias.double()
    tol = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -20
    assert torch.all((out.double() - exact).abs() <= exact.abs() * tol + 1e-6)


@needs_int8_gemm
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 33, 64, 121, 250])
@pytest.mark.parametrize("shape", [(32, 4), (64, 76), (96, 576)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_gemm_silu_is_gemm_then_silu_and_mul_bit_for_bit(rows, shape, bias, threads, amx):
    """The int8 gate_up projection with SiLU-and-mul in its epilogue gives what int8_gemm and silu_and_mul give one
    after the other (tile heights 1-12, one row block with the panels fetched ahead up to 120 rows, several past it,
    a bias on both halves; on AMX the two steps), and is near the float64 value of silu(gate) * up on the quantized
    values."""
    from vllite_core.model_ops import quantize_rows_int8

    inter, k = shape
    g = torch.Generator().manual_seed(rows * 5 + inter + k)
    q, scale = quantize_rows_int8(torch.randn(2 * inter, k, generator=g))
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    b = torch.randn(2 * inter, generator=g) if bias else None
    fused, want = _gate_up_silu_fused_and_two_steps(kernels.load().int8_gemm_silu, kernels.int8_gemm, x,
                                                    kernels.int8_gemm_pack(q, scale), b, inter, threads)
    assert torch.equal(fused.view(torch.int16), want.view(torch.int16))
    xq, xs = torch.empty(x.shape, dtype=torch.int8), torch.empty(rows)
    kernels.quantize_rows_int8(xq, xs, x)
    exact = (xq.double() @ q.double().T) * xs.double()[:, None] * scale.double() + (0 if b is None else b.double())
    gate, up = exact[:, :inter], exact[:, inter:]
    ref = torch.nn.functional.silu(gate) * up
    # gate, up, silu(gate) and the product each rounded once to bf16: a few roundings of the largest factor.
    bound = (gate.abs() + 1) * up.abs() * 2 ** -6 + 1e-6
    assert torch.all((fused.double() - ref).abs() <= bound), float(((fused.double() - ref).abs() - bound).max())


@needs_int8_gemm
def test_int8_gemm_silu_checks_operands():
    from vllite_core.model_ops import quantize_rows_int8

    q, scale = quantize_rows_int8(torch.randn(2 * 48, 64))
    packed, x = kernels.int8_gemm_pack(q, scale), torch.randn(3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="int8_gemm_silu: shapes"):  # 48 outputs: not whole 32-column panels
        kernels.load().int8_gemm_silu(torch.empty(3, 48, dtype=torch.bfloat16), x, packed, None)
    with pytest.raises(RuntimeError, match="int8_gemm_silu: bfloat16"):  # silu_and_mul's bf16 arithmetic only
        kernels.load().int8_gemm_silu(torch.empty(3, 48), x.float(), packed, None)


@needs_int8_gemm
def test_int8_route_packs_once_and_again_on_change():
    """With the int8 GEMM on, int8_linear takes it for float32/bfloat16 rows with K a multiple of 4 through one
    packed copy in the layer's state (remade when the weight, its scale or the bias change); other K keep _int_mm.
    Both give the same numbers."""
    from vllite_core.model_ops import quantize_rows_int8

    on = CpuModelOps(fused=True, packed_linear=True, int8_gemm=True)
    off = CpuModelOps(fused=True, packed_linear=True, int8_gemm=False)
    assert "int8-gemm" in on.name and "int8-gemm" not in off.name
    g = torch.Generator().manual_seed(0)
    q, scale = quantize_rows_int8(torch.randn(96, 64, generator=g))
    bias = torch.randn(96, generator=g).bfloat16()
    assert on.int8_route(torch.bfloat16, q) and not on.int8_route(torch.bfloat16, q[:, :62])
    assert not on.int8_route(torch.float16, q) and not off.int8_route(torch.bfloat16, q)
    state: dict = {}
    with torch.inference_mode():
        for rows in (1, 5, 70):
            x = torch.randn(rows, 64, generator=g).bfloat16()
            got = on.int8_linear(x, q, scale, bias, state)
            assert got.dtype == torch.bfloat16 and torch.equal(got, off.int8_linear(x, q, scale, bias, {}))
        packed = state["packed"]
        on.int8_linear(torch.randn(3, 64).bfloat16(), q, scale, bias, state)
        assert state["packed"] is packed
    scale.mul_(2)  # an in-place change (outside inference mode) is packed again
    with torch.inference_mode():
        x = torch.randn(3, 64).bfloat16()
        got = on.int8_linear(x, q, scale, bias, state)
        assert state["packed"] is not packed and torch.equal(got, off.int8_linear(x, q, scale, bias, {}))


@needs_avx2_gemm
@pytest.mark.parametrize("rows", [1, 7, 200])
@pytest.mark.parametrize("shape", [(1536, 384), (37, 20)])
def test_avx2_gemm_gelu_matches_float64(rows, shape):
    # The GELU epilogue (its own exp and torch's erf approximation) against float64 erf-GELU of the float64 GEMM.
    n, k = shape
    g = torch.Generator().manual_seed(rows + n)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
    with torch.inference_mode():
        got = AVX2.linear_gelu(x, w, b, {})
        torch.testing.assert_close(got, F.gelu(F.linear(x.double(), w.double(), b.double())).float(),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_add_layer_norm_matches_float64(rows):
    g = torch.Generator().manual_seed(rows)
    x, r = torch.randn(rows, 384, generator=g) * 3, torch.randn(rows, 384, generator=g)
    w, b = torch.randn(384, generator=g), torch.randn(384, generator=g)
    ref = F.layer_norm((x + r).double(), (384,), w.double(), b.double(), 1e-12).float()
    with torch.inference_mode():
        got = FAST.add_layer_norm(x.clone(), r, w, b, 1e-12)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_encoder_attention_matches_float64_sdpa_per_prompt():
    # Prompts of 1 to 130 tokens (and an empty one) packed in one step; head sizes a multiple of the vector
    # width (the vector paths) and not (the plain sums). Reference: SDPA in float64, prompt by prompt.
    from vllite_core.attention.encoder import PackedPrompts

    g = torch.Generator().manual_seed(0)
    lens = [1, 2, 3, 7, 8, 9, 16, 17, 50, 0, 130]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    prompts = PackedPrompts(starts, torch.device("cpu"))
    for heads, size in ((12, 32), (3, 20)):
        qkv = torch.randn(starts[-1], 3, heads, size, generator=g) * 2
        with torch.inference_mode():
            got = FAST.encoder_attention(qkv, prompts, size ** -0.5)
            torch_path = ModelOps().encoder_attention(qkv, prompts, size ** -0.5)
        ref = torch.empty_like(got)
        for a, e in zip(starts[:-1], starts[1:]):
            if e > a:
                q, k, v = (qkv[a:e, i].double().transpose(0, 1) for i in range(3))
                ref[a:e] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).float()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch_path, ref, rtol=1e-5, atol=1e-5)


def _argmax_cases(dtype):
    """Rows of every awkward kind beside plain random ones: ties (within a lane and across lanes), NaN (one,
    several, in the vector part and in the tail), +inf, a row of -inf, widths below one vector and with tails."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 17, 31, 33, 1000, 49152):
        x = torch.randn(12, n, generator=g).to(dtype)
        x[1] = 0.0  # all tied: index 0
        x[2, :] = float("-inf")
        if n > 3:
            x[3, [n // 3, n - 1]] = 100.0  # tie between two positions (different lanes when n is large)
            x[4, n - 1] = float("nan")  # NaN in the tail (or the vectors)
            x[5, [n // 2, 1]] = float("nan")  # two NaNs: the first wins
            x[6, n // 2] = float("inf")
            x[7, 0] = 50.0
            x[8, -2:] = 50.0
        yield x
    x = torch.randn(9, 300, generator=g).to(dtype)
    yield x[:, 7:250]  # a strided view (row stride 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torchs_on_every_variant(dtype):
    """The sampler's argmax (first largest, a NaN first) is torch.argmax's, on every ISA variant this CPU runs."""
    runnable = kernels.host_variants() if kernels.origin() == "installed" else [kernels.variant()]
    for x in _argmax_cases(dtype):
        want = x.argmax(dim=-1)
        torch.testing.assert_close(FAST.argmax_rows(x), want)
        for name in runnable:
            out = torch.empty(x.shape[0], dtype=torch.int64)
            kernels.load_variant(name).argmax_rows(out, x)
            torch.testing.assert_close(out, want, msg=lambda m, n=name, w=x.shape[1]: f"{n}, {w} columns: {m}")


needs_int8_panels = pytest.mark.skipif(
    not kernels.avx2_gemm_available() or torch.bfloat16 not in kernels.avx2_gemm_dtypes(),
    reason="the AVX2 GEMM with bfloat16 panels is not built here")


@needs_int8_panels
@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32])
@pytest.mark.parametrize("shape", [(37, 64), (2048, 2048)])  # tiny (a partial panel), the Llama-3.2-1B o_proj
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_on_avx2_panels_matches_float64_reference(rows, shape, dtype):
    """W8A8 on the AVX2 GEMM's bfloat16 panels (hosts without an int8 dot product) gives the float64 reference's
    numbers (ModelOps.int8_linear: the same per-row quantization, exact integer sums, both scales, the bias) to
    float32 rounding, and in bfloat16 to the output's own rounding."""
    from vllite_core.model_ops import quantize_rows_int8

    n, k = shape
    g = torch.Generator().manual_seed(rows * 7 + n)
    q, scale = quantize_rows_int8(torch.randn(n, k, generator=g))
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    ops = CpuModelOps(fused=True, packed_linear=False, avx2_gemm=True, int8_panels=True)
    assert ops.int8_panels and "int8-panels" in ops.name
    state: dict = {}
    got = ops.int8_linear(x, q, scale, bias, state)
    assert "packed" in state and state["packed"].dtype == torch.bfloat16  # the panels path, not _int_mm
    xq, xs = quantize_rows_int8(x)
    want = ((xq.double() @ q.double().T) * xs.double()[:, None] * scale.double()[None, :] + bias.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2 ** -7, atol=1e-3)
    # a second call reuses the panels; a changed weight (in place) is repacked
    packed = state["packed"]
    ops.int8_linear(x, q, scale, bias, state)
    assert state["packed"] is packed
    q[0].neg_()
    got2 = ops.int8_linear(x, q, scale, bias, state)
    assert state["packed"] is not packed
    want2 = ((xq.double() @ q.double().T) * xs.double()[:, None] * scale.double()[None, :] + bias.double())
    torch.testing.assert_close(got2.double()[:, 0], want2.to(dtype).double()[:, 0], rtol=2 ** -7, atol=1e-3)
