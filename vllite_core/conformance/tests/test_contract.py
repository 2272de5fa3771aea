"""The Platform contract methods answer sensibly."""
from __future__ import annotations

import pytest
import torch

from vllite_core.attention import AttentionBackend
from vllite_core.config import CacheConfig, ConfigError, VlliteConfig
from vllite_core.platforms.interface import KV_CACHE_DTYPES, Detection, Platform
from vllite_core.plugins.loading import normalize_name


def test_identity(platform, platform_name, resolution):
    assert isinstance(platform, Platform)
    assert normalize_name(platform.name) == normalize_name(platform_name)
    assert isinstance(platform.device_type, str) and platform.device_type
    assert isinstance(platform.dist_backend, str) and platform.dist_backend
    assert tuple(platform.plugin_api)[0] == 1
    assert resolution.chosen is not None and resolution.chosen.available


def test_selected_by_vllite_platform(platform, monkeypatch):
    from vllite_core.platforms.resolve import resolve_platform

    monkeypatch.setenv("VLLITE_PLATFORM", platform.name)
    res = resolve_platform()
    assert type(res.platform) is type(platform) and f"VLLITE_PLATFORM={platform.name}" in res.reason


def test_detect_is_available_and_stable(platform):
    first, second = type(platform).detect(), type(platform).detect()
    assert isinstance(first, Detection)
    assert first.available and isinstance(first.priority, int) and first.reason
    assert (second.available, second.priority) == (first.available, first.priority)
    assert all(isinstance(d, str) for d in first.devices)


def test_device_holds_tensors(platform, device):
    assert isinstance(device, torch.device) and device.type == platform.device_type
    x = torch.arange(8, dtype=torch.float32, device=device) * 2
    platform.synchronize()
    assert x.cpu().tolist() == [float(2 * i) for i in range(8)]


def test_device_facts(platform):
    name = platform.device_name()
    assert isinstance(name, str) and name.strip()
    total = platform.total_memory()
    assert isinstance(total, int) and (64 << 20) < total < (1 << 50)
    facts = platform.describe()
    assert facts["name"] == platform.name and facts["total_memory"] == total


def test_dtypes(platform):
    dtypes = platform.supported_dtypes()
    assert dtypes and all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes)
    assert platform.default_dtype() in dtypes
    kv = platform.supported_kv_cache_dtypes()
    assert "auto" in kv and set(kv) <= {"auto", *KV_CACHE_DTYPES}
    assert platform.kv_cache_torch_dtype("auto", torch.float16) == torch.float16
    for name in kv:
        if name != "auto":
            dt = platform.kv_cache_torch_dtype(name, torch.float16)
            assert dt.is_floating_point and dt.itemsize == 1, f"{name} maps to {dt}"


def test_config_rules(platform):
    platform.check_and_update_config(VlliteConfig())
    supported = set(platform.supported_kv_cache_dtypes())
    for name in KV_CACHE_DTYPES:
        cfg = VlliteConfig(cache_config=CacheConfig(kv_cache_dtype=name))
        if name in supported:
            platform.check_and_update_config(cfg)
        else:
            with pytest.raises(ConfigError, match="kv_cache_dtype"):
                platform.check_and_update_config(cfg)


def test_enforce_eager_captures_nothing(platform):
    def forward(**_):
        raise AssertionError("capture_graphs ran the model although enforce_eager is set")

    assert platform.capture_graphs(forward, [1, 2], lambda bs: {}, VlliteConfig(enforce_eager=True)) == {}


def test_attention_backend(backend):
    assert isinstance(backend, AttentionBackend) and backend.name
    one = backend.get_kv_cache_shape(1, 16, 2, 64)
    two = backend.get_kv_cache_shape(2, 16, 2, 64)
    assert all(isinstance(s, int) and s > 0 for s in one)
    assert torch.Size(two).numel() == 2 * torch.Size(one).numel() >= 2 * 16 * 2 * 64
