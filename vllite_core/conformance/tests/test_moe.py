"""The platform's ``ModelOps.fused_moe`` (what every mixture-of-experts model calls) matches a float64 per-token
loop: uneven routings, one expert taking every token, experts no token chose (their weights NaN)."""
from __future__ import annotations

import pytest
import torch

from vllite_core.config import VlliteConfig
from vllite_core.conformance.kit import MOE_CASES, run_moe_case, tolerance

from .conftest import dtype_name


@pytest.fixture(scope="module")
def model_ops(platform):
    return platform.model_ops(VlliteConfig())


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: c.name)
def test_fused_moe_matches_reference(platform, model_ops, device, case):
    for dtype in [d for d in (torch.float32, torch.float16, torch.bfloat16) if d in platform.supported_dtypes()]:
        out, ref = run_moe_case(model_ops, case, device, dtype)
        atol, rtol = tolerance(dtype)
        torch.testing.assert_close(out, ref, atol=atol * 10 if dtype != torch.float32 else atol, rtol=rtol,
                                   msg=lambda m: f"{case.name} in {dtype_name(dtype)}: {m}")  # noqa: B023
