"""The platform's attention backend matches the reference paged attention."""
from __future__ import annotations

import pytest
import torch

from vllite_core.conformance.kit import STANDARD_CASES, assert_attention_matches, run_attention_case

from .conftest import dtype_name


def _dtypes(platform):
    out = [d for d in (torch.float32, torch.float16, torch.bfloat16) if d in platform.supported_dtypes()]
    return out


def _skip_unsupported(backend, case):
    if case.logits_soft_cap and not backend.supports_logits_soft_cap:
        pytest.skip(f"{backend.name} does not support logits_soft_cap")


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("case", STANDARD_CASES, ids=lambda c: c.name)
def test_matches_reference_float32(platform, backend, device, case, block_size):
    _skip_unsupported(backend, case)
    if torch.float32 not in platform.supported_dtypes():
        pytest.skip("the platform does not compute in float32")
    results = run_attention_case(backend, case, device, torch.float32, block_size=block_size)
    assert_attention_matches(results, torch.float32)


@pytest.mark.parametrize("case", STANDARD_CASES, ids=lambda c: c.name)
def test_matches_reference_half_precision(platform, backend, device, case):
    _skip_unsupported(backend, case)
    halves = [d for d in _dtypes(platform) if d != torch.float32]
    if not halves:
        pytest.skip("the platform supports no 16-bit dtype")
    for dtype in halves:
        results = run_attention_case(backend, case, device, dtype, seed=1)
        assert_attention_matches(results, dtype)


@pytest.mark.parametrize("case", [c for c in STANDARD_CASES if c.name in ("mixed-gqa", "decode")], ids=lambda c: c.name)
def test_fp8_kv_cache(platform, backend, device, case):
    names = [n for n in platform.supported_kv_cache_dtypes() if n != "auto"]
    if not names:
        pytest.skip("the platform supports no fp8 KV cache")
    dtype = torch.float32 if torch.float32 in platform.supported_dtypes() else platform.default_dtype()
    for name in names:
        cache_dtype = platform.kv_cache_torch_dtype(name, dtype)
        results = run_attention_case(backend, case, device, dtype, cache_dtype=cache_dtype, seed=2)
        try:
            assert_attention_matches(results, dtype)
        except AssertionError as exc:
            raise AssertionError(f"kv_cache_dtype={name} ({dtype_name(cache_dtype)}): {exc}") from None
