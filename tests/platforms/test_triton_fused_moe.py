"""The Triton fused-MoE kernels (``vllite_triton_kernels.moe_kernels`` through ``TritonModelOps.fused_moe``) against a
float64 per-token loop, under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors; no GPU here), in float32 and
float16: uneven routings, one expert taking every token, experts no token chose (NaN weights: a read would show),
a row count past one tile."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's import (tests/conftest.py sets it for the whole run)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-test.txt)")

from vllite_triton_kernels import TritonModelOps  # noqa: E402

from vllite_core.conformance.kit import MoeCase, moe_case_inputs, moe_reference  # noqa: E402

CASES = (MoeCase("decode", 1, 2, hidden=32, intermediate=24), MoeCase("uneven", 13, 2, hidden=48, intermediate=40),
         MoeCase("top3", 5, 3, hidden=32, intermediate=24),
         MoeCase("one-expert-takes-all", 21, 1, routing="one-expert", hidden=32, intermediate=24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_fused_moe_matches_a_float64_loop(case, dtype, monkeypatch):
    from vllite_core.model_ops import ModelOps

    monkeypatch.setattr(ModelOps, "fused_moe", lambda *a, **k: pytest.fail("fell back to the torch default"))
    x, w13, w2, weights, ids = moe_case_inputs(case, seed=3)
    x, w13, w2, weights = (t.to(dtype) for t in (x, w13, w2, weights))
    ops = TritonModelOps(block_m=16, block_n=16, block_k=16)  # several output and K tiles at these sizes
    out = ops.fused_moe(x, w13, w2, weights, ids)
    want = moe_reference(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), want, **tol)
