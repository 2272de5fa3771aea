"""Memory profiling returns a positive, bounded number of bytes for the KV cache."""
from __future__ import annotations

import torch

from vllite_core.config import CacheConfig, VlliteConfig


def _profile_run(device, mib):
    calls = []

    def run():
        calls.append(1)
        x = torch.ones(mib << 18, dtype=torch.float32, device=device)  # mib MiB
        y = (x * 2).sum()
        del x
        return y

    return run, calls


def test_explicit_kv_cache_memory_is_used_as_is(platform, device):
    run, _ = _profile_run(device, 1)
    cfg = VlliteConfig(cache_config=CacheConfig(kv_cache_memory=96 << 20))
    assert platform.determine_available_memory(cfg, run) == 96 << 20


def test_profiled_budget_is_positive_and_bounded(platform, device):
    run, calls = _profile_run(device, 16)
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=0.5))
    got = platform.determine_available_memory(cfg, run)
    assert isinstance(got, int) and 0 < got <= platform.total_memory()
    assert len(calls) <= 1


def test_bigger_activations_never_grow_the_budget(platform, device):
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=0.5))
    small = platform.determine_available_memory(cfg, _profile_run(device, 4)[0])
    big = platform.determine_available_memory(cfg, _profile_run(device, 256)[0])
    assert 0 < big <= small + (32 << 20)
