"""The CPU platform's ``fused_moe`` (tokens grouped by expert, each expert's GEMMs on the platform's kernels)
against a float64 per-token loop written here, on uneven routings (experts no token chose, whose weights are
NaN so reading them would show; one expert taking every token; a single decode token), on every kernel path
this host runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vllite_platform_cpu import kernels
from vllite_platform_cpu.model_ops import CpuModelOps
from vllite_platform_cpu.platform import has_fast_bf16, use_avx2_gemm, use_bf16_gemm

E, H, INTER = 6, 32, 24


def _paths() -> dict[str, tuple[CpuModelOps, torch.dtype]]:
    if not kernels.available():
        return {}
    native = has_fast_bf16()
    out = {"onednn-f32": (CpuModelOps(fused=True, packed_linear=True), torch.float32),
           "bf16": (CpuModelOps(fused=True, packed_linear=True, widen_16bit=not native, avx2_gemm=use_avx2_gemm(),
                                bf16_gemm=use_bf16_gemm()), torch.bfloat16)}
    if use_avx2_gemm():
        out["avx2-f32"] = (CpuModelOps(fused=True, packed_linear=True, avx2_gemm=True), torch.float32)
        out["avx2-f32-grouped"] = (CpuModelOps(fused=True, packed_linear=True, avx2_gemm=True, moe_one_call=False),
                                   torch.float32)
        out["avx2-f16"] = (CpuModelOps(fused=True, packed_linear=True, widen_16bit=True, avx2_gemm=True),
                           torch.float16)
    return out


def _one_call(ops: CpuModelOps, dtype: torch.dtype) -> bool:
    """Whether ``ops.fused_moe`` takes the one-call C++ path (csrc/moe.cpp) for ``dtype``."""
    return ops.moe_one_call_on and (dtype == torch.float32 or ops.widen_16bit)


PATHS = _paths()


def _routing(kind: str, t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Expert ids [t, k], distinct per token; experts 4 and 5 never chosen except where said."""
    if kind == "one-expert-takes-all":
        ids = torch.stack([torch.full((t,), 2), torch.randint(0, 2, (t,), generator=gen)], 1)[:, :k]
    else:  # uneven: a permutation of experts 0-3 per token, skewed towards 0
        ids = torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(t)])
        ids[: t // 2, 0] = 0
        ids[: t // 2, 1:] = torch.where(ids[: t // 2, 1:] == 0, 3, ids[: t // 2, 1:])
    return ids


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.skipif(not PATHS, reason="the CPU kernels are not built")
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind,t,k", [("uneven", 37, 2), ("uneven", 1, 2), ("uneven", 3, 3),
                                      ("one-expert-takes-all", 19, 1), ("one-expert-takes-all", 9, 2)])
def test_cpu_fused_moe_matches_a_float64_loop(path, kind, t, k):
    ops, dtype = PATHS[path]
    gen = torch.Generator().manual_seed(t * 10 + k)
    x = torch.randn(t, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=gen) * 0.2).to(dtype)
    w13[4:], w2[4:] = float("nan"), float("nan")  # never chosen: any read shows as NaN
    ids = _routing(kind, t, k, gen)
    weights = torch.rand(t, k, generator=gen).to(dtype)
    state: dict = {}
    with torch.inference_mode():
        out = ops.fused_moe(x, w13, w2, weights, ids, state)
        again = ops.fused_moe(x, w13, w2, weights, ids, state)  # cached packing reused
    want = _reference(x, w13, w2, weights, ids)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.double(), want, **tol)
    assert torch.equal(out, again) and out.dtype == dtype
    chosen = set(ids.flatten().tolist())
    if _one_call(ops, dtype):  # only the experts that received tokens were packed
        assert set(state["moe_ready"].nonzero().flatten().tolist()) == chosen
    else:
        assert {e for _, e in state} == chosen


ONE_CALL = [p for p in PATHS if _one_call(*PATHS[p])]


@pytest.mark.skipif(not ONE_CALL, reason="no one-call (AVX2 panels) path on this host")
@pytest.mark.parametrize("path", ONE_CALL)
def test_one_call_op_on_ragged_shapes_and_batches(path):
    """Widths that are not whole 16-column panels (hidden 40, gate/up 2 x 20), every batch from 1 to 8 rows and 13
    (the GEMM's 1-3-row and 6-row-tile paths and their remainders, expert by expert), a token choosing one expert
    twice, and an expert's weights changed in place after packing (its panels remade): the float64 loop."""
    ops, dtype = PATHS[path]
    e, h, inter = 5, 40, 20
    gen = torch.Generator().manual_seed(7)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.2).to(dtype)
    w13[4], w2[4] = float("nan"), float("nan")
    state: dict = {}
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for t in [*range(1, 9), 13]:
        x = torch.randn(t, h, generator=gen).to(dtype)
        ids = torch.randint(0, 4, (t, 3), generator=gen)
        ids[0] = torch.tensor([1, 1, 3])
        weights = torch.rand(t, 3, generator=gen).to(dtype)
        with torch.inference_mode():
            out = ops.fused_moe(x, w13, w2, weights, ids, state)
        torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids), **tol)
    w13[1].mul_(-0.5)  # in place, outside inference mode: the weight's version moves on
    with torch.inference_mode():
        out = ops.fused_moe(x, w13, w2, weights, ids, state)
    torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids), **tol)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="expert id 5 outside"):
        ops.fused_moe(x, w13, w2, weights, torch.full_like(ids, 5), state)


def test_moe_one_call_switch(monkeypatch):
    """``VLLITE_CPU_MOE_ONE_CALL=0`` gives the platform's ops the Python path (``moe_grouped``) back."""
    from vllite_platform_cpu import platform as cpu_platform

    from vllite_core.config import VlliteConfig

    monkeypatch.setenv(cpu_platform.MOE_ONE_CALL_ENV, "0")
    assert not cpu_platform.CpuPlatform().model_ops(VlliteConfig()).moe_one_call_on
    monkeypatch.setenv(cpu_platform.MOE_ONE_CALL_ENV, "1")
    assert cpu_platform.CpuPlatform().model_ops(VlliteConfig()).moe_one_call_on == use_avx2_gemm()
