"""Detection logic of the cuda/rocm/xpu/tpu platforms, with their probes faked.

The packages are not installed here; they are imported from their source dirs.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from plugin_fakes import PLATFORM_SRC
from vllite_core.config import CacheConfig, ConfigError, VlliteConfig

torch.set_num_threads(1)


def load(name: str):
    if str(PLATFORM_SRC[name]) not in sys.path:
        sys.path.append(str(PLATFORM_SRC[name]))
    pkg = importlib.import_module(f"vllite_platform_{name}")
    mod = importlib.import_module(f"vllite_platform_{name}.platform")
    (cls,) = pkg.vllite_register_platforms()
    assert pkg.VLLITE_PLUGIN_API == (1, 0)
    return mod, cls


@pytest.fixture
def cuda(monkeypatch):
    mod, cls = load("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return mod, cls


@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu", "tpu"])
def test_unavailable_on_this_machine(name):
    _, cls = load(name)
    det = cls.detect()
    assert not det.available and det.reason and det.devices == []


@pytest.mark.parametrize("name, backend, priority", [("cuda", "nccl", 100), ("rocm", "nccl", 100),
                                                     ("xpu", "xccl", 90), ("tpu", "xla", 80)])
def test_identity_and_unfinished_parts(name, backend, priority):
    _, cls = load(name)
    assert cls.name == name and cls.dist_backend == backend and cls.detect().priority == priority
    platform = cls()
    with pytest.raises(NotImplementedError, match="#8"):
        platform.get_attention_backend(VlliteConfig())
    with pytest.raises(NotImplementedError, match="#8"):
        platform.determine_available_memory(VlliteConfig(), lambda: None)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        platform.check_and_update_config(VlliteConfig(cache_config=CacheConfig(kv_cache_dtype="fp8")))


def test_cuda_refuses_hip_torch(cuda, monkeypatch):
    mod, cls = cuda
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    monkeypatch.setattr(mod, "nvml_gpu_names", lambda: (["H100"], "NVML"))
    det = cls.detect()
    assert not det.available and "rocm" in det.reason


def test_cuda_refuses_cpu_only_torch(cuda, monkeypatch):
    mod, cls = cuda
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "torch.version.cuda is None" in cls.detect().reason


def test_cuda_available_through_nvml(cuda, monkeypatch):
    mod, cls = cuda
    monkeypatch.setattr(mod, "nvml_gpu_names", lambda: (["NVIDIA H100", "NVIDIA H100"], "NVML"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("must not touch the CUDA runtime"))
    det = cls.detect()
    assert det.available and det.priority == 100 and det.devices == ["NVIDIA H100", "NVIDIA H100"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert cls.detect().devices == ["NVIDIA H100"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not cls.detect().available


def test_cuda_without_nvml_falls_back_to_torch(cuda, monkeypatch):
    mod, cls = cuda
    monkeypatch.setattr(mod, "nvml_gpu_names", lambda: (None, "libnvidia-ml.so.1 not found"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    det = cls.detect()
    assert not det.available and "libnvidia-ml" in det.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cls.detect().available


def test_nvml_probe_is_safe_here():
    mod, _ = load("cuda")
    names, why = mod.nvml_gpu_names()
    assert names is None or names == [] or all(isinstance(n, str) for n in names)
    assert why


def test_visible_devices_parsing():
    mod, _ = load("cuda")
    names = ["a", "b", "c"]
    assert mod.apply_visible_devices(names, None) == names
    assert mod.apply_visible_devices(names, "2,0") == ["c", "a"]
    assert mod.apply_visible_devices(names, "0,7,1") == ["a"]  # stops at the first invalid index
    assert mod.apply_visible_devices(names, "-1") == []
    assert mod.apply_visible_devices(names, "GPU-1234") == ["GPU-1234"]


def test_rocm_detection(monkeypatch):
    mod, cls = load("rocm")
    monkeypatch.setattr(torch.version, "hip", None)
    assert "not a ROCm build" in cls.detect().reason
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cls.detect().available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    det = cls.detect()
    assert det.available and det.priority == 100 and len(det.devices) == 2
    # ...and on that HIP torch the cuda platform stands down.
    _, cuda_cls = load("cuda")
    assert not cuda_cls.detect().available


def test_xpu_detection(monkeypatch):
    _, cls = load("xpu")
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    det = cls.detect()
    assert det.available and det.priority == 90 and det.devices == ["Intel XPU 0"]
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert "torch.xpu.is_available() is False" in cls.detect().reason


def test_tpu_detection(monkeypatch):
    mod, cls = load("tpu")
    for var in ("PJRT_DEVICE", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(var, raising=False)
    installed = {"torch_xla"}
    monkeypatch.setattr(mod, "has_module", lambda name: name in installed)
    monkeypatch.setattr(mod, "tpu_device_nodes", lambda: [])
    assert "no TPU was found" in cls.detect().reason
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert "not a TPU" in cls.detect().reason
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    det = cls.detect()
    assert det.available and det.priority == 80
    monkeypatch.delenv("PJRT_DEVICE")
    monkeypatch.setattr(mod, "tpu_device_nodes", lambda: ["/dev/accel0", "/dev/accel1"])
    assert cls.detect().devices == ["/dev/accel0", "/dev/accel1"]
    installed.clear()
    assert cls.detect().reason == "torch_xla is not installed"
    assert "torch_xla" not in sys.modules  # detection never imports it
