"""The cuda/rocm/xpu/tpu platforms with their probes controlled: detection, capability and config rules,
backend choice, memory sizing and graph-capture gating. No device is pretended to exist where the code
would really use it: tests that need device facts replace the platform's own probe methods.

The packages are not installed here; they are imported from their source dirs.
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from plugin_fakes import PLATFORM_SRC

from vllite_core.attention.sdpa import SdpaPagedAttention
from vllite_core.config import CacheConfig, ConfigError, ModelConfig, VlliteConfig

torch.set_num_threads(1)


def load(name: str):
    if str(PLATFORM_SRC[name]) not in sys.path:
        sys.path.append(str(PLATFORM_SRC[name]))
    pkg = importlib.import_module(f"vllite_platform_{name}")
    mod = importlib.import_module(f"vllite_platform_{name}.platform")
    (cls,) = pkg.vllite_register_platforms()
    assert pkg.VLLITE_PLUGIN_API == (1, 0)
    return mod, cls


def kv_config(kv: str) -> VlliteConfig:
    return VlliteConfig(cache_config=CacheConfig(kv_cache_dtype=kv))


def never_called(*_a, **_k):
    raise AssertionError("must not run")


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv("VLLITE_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def cuda(monkeypatch):
    mod, cls = load("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return mod, cls


# ---- identity and detection -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu", "tpu"])
def test_unavailable_on_this_machine(name):
    _, cls = load(name)
    det = cls.detect()
    assert not det.available and det.reason and det.devices == []


@pytest.mark.parametrize("name, backend, priority", [("cuda", "nccl", 100), ("rocm", "nccl", 100),
                                                     ("xpu", "xccl", 90), ("tpu", "xla", 80)])
def test_identity(name, backend, priority):
    _, cls = load(name)
    assert cls.name == name and cls.dist_backend == backend and cls.detect().priority == priority


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


def test_rocm_detection_through_torch(monkeypatch):
    mod, cls = load("rocm")
    monkeypatch.setattr(mod, "amdsmi_gpu_names", lambda: (None, "amdsmi is not installed"))
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


def test_rocm_detection_through_amdsmi(monkeypatch):
    mod, cls = load("rocm")
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    monkeypatch.setattr(mod, "amdsmi_gpu_names", lambda: (["AMD Instinct MI300X"] * 4, "amdsmi"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("amdsmi answered: no HIP call"))
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    assert len(cls.detect().devices) == 4
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "3,1")
    assert cls.detect().devices == ["AMD Instinct MI300X"] * 2
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    det = cls.detect()
    assert not det.available and "HIP_VISIBLE_DEVICES" in det.reason


def test_amdsmi_probe_is_safe_here():
    mod, _ = load("rocm")
    names, why = mod.amdsmi_gpu_names()
    assert names is None and "not installed" in why


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


# ---- CUDA capability and config rules ---------------------------------------------------------

@pytest.mark.parametrize("cap, kv", [((9, 0), ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
                                     ((8, 9), ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
                                     ((8, 0), ["auto", "fp8_e5m2"]), ((7, 5), ["auto", "fp8_e5m2"]),
                                     ((7, 0), ["auto"])])
def test_cuda_kv_cache_dtypes_by_capability(cuda, monkeypatch, cap, kv):
    mod, cls = cuda
    assert mod.kv_cache_dtypes_for_capability(cap) == kv
    monkeypatch.setattr(cls, "capability", lambda self, index=None: cap)
    p = cls()
    assert p.supported_kv_cache_dtypes() == kv
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        if name in kv:
            p.check_and_update_config(kv_config(name))
            assert p.kv_cache_torch_dtype(name, torch.float16).itemsize == 1
        else:
            with pytest.raises(ConfigError, match=f"kv_cache_dtype.*{name}"):
                p.check_and_update_config(kv_config(name))


def test_cuda_auto_kv_dtype_asks_the_device_nothing(cuda, monkeypatch):
    _, cls = cuda
    monkeypatch.setattr(cls, "capability", never_called)
    cls().check_and_update_config(VlliteConfig())


def test_cuda_bf16_from_ampere(cuda):
    mod, _ = cuda
    assert torch.bfloat16 in mod.dtypes_for_capability((8, 0))
    assert mod.dtypes_for_capability((7, 5)) == [torch.float16, torch.float32]


def test_cuda_attention_choice(cuda, monkeypatch):
    mod, cls = cuda
    import vllite_triton_kernels

    status = {"value": (True, "triton with backends nvidia")}
    monkeypatch.setattr(vllite_triton_kernels, "triton_status", lambda backend=None: status["value"])
    assert mod.choose_attention((9, 0))[0] == "triton"
    assert mod.choose_attention((7, 0))[0] == "sdpa"  # below Triton's minimum
    assert mod.choose_attention((9, 0), "sdpa") == ("sdpa", "VLLITE_ATTENTION_BACKEND=sdpa")
    with pytest.raises(ValueError, match="VLLITE_ATTENTION_BACKEND"):
        mod.choose_attention((9, 0), "flash")
    status["value"] = (False, "triton is not installed")
    kind, why = mod.choose_attention((9, 0))
    assert kind == "sdpa" and "triton is not installed" in why
    with pytest.raises(RuntimeError, match="Triton cannot be used"):
        mod.choose_attention((9, 0), "triton")
    # The platform hands out the matching backend.
    monkeypatch.setattr(cls, "capability", lambda self, index=None: (9, 0))
    assert isinstance(cls().get_attention_backend(VlliteConfig()), SdpaPagedAttention)
    status["value"] = (True, "ok")
    from vllite_triton_kernels import TritonPagedAttention

    assert isinstance(cls().get_attention_backend(VlliteConfig()), TritonPagedAttention)


def test_cuda_graphs_gated(cuda, monkeypatch):
    _, cls = cuda
    p = cls()
    monkeypatch.setattr(cls, "attention_choice", lambda self: ("triton", "ok"))
    # enforce_eager: nothing captured, nothing run, CUDA untouched.
    assert p.capture_graphs(never_called, [1, 2, 4], never_called, VlliteConfig(enforce_eager=True)) == {}
    assert p.capture_graphs(never_called, [], never_called, VlliteConfig()) == {}
    # The SDPA fallback plans on the host each step: never captured.
    monkeypatch.setattr(cls, "attention_choice", lambda self: ("sdpa", "fallback"))
    assert p.capture_graphs(never_called, [1, 2, 4], never_called, VlliteConfig()) == {}


def test_cuda_memory_explicit_size_touches_no_device(cuda, monkeypatch):
    _, cls = cuda
    monkeypatch.setattr(torch.cuda, "current_device", never_called)
    cfg = VlliteConfig(cache_config=CacheConfig(kv_cache_memory=5 << 30))
    assert cls().determine_available_memory(cfg, never_called) == 5 << 30


# ---- ROCm capability rules ---------------------------------------------------------------------

@pytest.mark.parametrize("arch, kv, e4m3", [
    ("gfx942:sramecc+:xnack-", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], torch.float8_e4m3fnuz),
    ("gfx950", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], torch.float8_e4m3fn),
    ("gfx1201", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], torch.float8_e4m3fn),
    ("gfx90a", ["auto"], None), ("gfx1100", ["auto"], None)])
def test_rocm_capabilities_by_arch(monkeypatch, arch, kv, e4m3):
    mod, cls = load("rocm")
    monkeypatch.setattr(cls, "arch", lambda self, index=None: mod.base_arch(arch))
    p = cls()
    assert p.supported_kv_cache_dtypes() == kv
    if e4m3 is None:
        with pytest.raises(ConfigError, match="kv_cache_dtype"):
            p.check_and_update_config(kv_config("fp8"))
        with pytest.raises(ValueError, match="not supported"):
            p.kv_cache_torch_dtype("fp8", torch.bfloat16)
    else:
        p.check_and_update_config(kv_config("fp8"))
        assert p.kv_cache_torch_dtype("fp8", torch.bfloat16) == e4m3
    assert p.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_rocm_uses_the_shared_kernels(monkeypatch):
    """Not a copy: the rocm platform hands out the very class the cuda platform does."""
    mod, cls = load("rocm")
    import vllite_triton_kernels

    monkeypatch.setattr(vllite_triton_kernels, "triton_status", lambda backend=None: (backend == "amd", backend))
    backend = cls().get_attention_backend(VlliteConfig())
    from vllite_triton_kernels.backend import TritonPagedAttention

    assert type(backend) is TritonPagedAttention
    assert cls().capture_graphs(never_called, [1], never_called, VlliteConfig(enforce_eager=True)) == {}


# ---- XPU ---------------------------------------------------------------------------------------

def test_xpu_ipex_only_when_matching(monkeypatch):
    mod, _ = load("xpu")
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: None)
    assert mod.ipex_status("2.13.0") == (False, "intel-extension-for-pytorch is not installed")
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(mod.importlib.metadata, "version", lambda name: "2.8.10+xpu")
    ok, why = mod.ipex_status("2.13.0+xpu")
    assert not ok and "does not match torch 2.13.0+xpu" in why
    assert mod.ipex_status("2.8.0+xpu") == (True, "intel-extension-for-pytorch 2.8.10+xpu")


def test_xpu_attention_and_config(monkeypatch):
    _, cls = load("xpu")
    import vllite_triton_kernels

    monkeypatch.setattr(vllite_triton_kernels, "triton_status",
                        lambda backend=None: (False, f"this triton build has no {backend!r} backend"))
    p = cls()
    kind, why = p.attention_choice()
    assert kind == "sdpa" and "'intel'" in why
    assert isinstance(p.get_attention_backend(VlliteConfig()), SdpaPagedAttention)
    assert p.capture_graphs(never_called, [1], never_called, VlliteConfig()) == {}  # SDPA: eager
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        p.check_and_update_config(kv_config("fp8"))
    monkeypatch.setattr(torch.xpu, "current_device", never_called)
    cfg = VlliteConfig(cache_config=CacheConfig(kv_cache_memory=1 << 30))
    assert p.determine_available_memory(cfg, never_called) == 1 << 30


# ---- TPU ---------------------------------------------------------------------------------------

def test_tpu_static_shapes_and_config():
    mod, cls = load("tpu")
    assert [mod.token_bucket(n) for n in (1, 16, 17, 100, 2048)] == [16, 16, 32, 128, 2048]
    assert mod.token_bucket(3000, max_tokens=2048) == 4096  # past the cap: still rounded up, never down
    assert mod.token_bucket(1500, max_tokens=2048) == 2048
    p = cls()
    backend = p.get_attention_backend(VlliteConfig())
    assert isinstance(backend, SdpaPagedAttention) and backend.bucket(5) == 8 and backend.bucket(1) == 1
    assert p.capture_graphs(never_called, [1, 8], never_called, VlliteConfig(enforce_eager=True)) == {}
    with pytest.raises(ConfigError, match="float16"):
        p.check_and_update_config(VlliteConfig(model_config=ModelConfig(dtype="float16")))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        p.check_and_update_config(kv_config("fp8"))
    cfg = VlliteConfig(cache_config=CacheConfig(kv_cache_memory=3 << 30))
    assert p.determine_available_memory(cfg, never_called) == 3 << 30
    assert "torch_xla" not in sys.modules


def test_tpu_memory_from_xla(monkeypatch):
    """The XLA memory report after the profile run (fake torch_xla modules: there is no TPU here)."""
    mod, cls = load("tpu")
    calls = []
    xm = types.SimpleNamespace(
        get_memory_info=lambda dev: {"bytes_limit": 16 << 30, "bytes_used": 2 << 30, "peak_bytes_used": 3 << 30},
        wait_device_ops=lambda: calls.append("wait"))
    fake = types.ModuleType("torch_xla")
    fake.sync = lambda: calls.append("sync")
    fake.device = lambda index=0: torch.device("cpu")
    core = types.ModuleType("torch_xla.core")
    xla_model = types.ModuleType("torch_xla.core.xla_model")
    xla_model.get_memory_info, xla_model.wait_device_ops = xm.get_memory_info, xm.wait_device_ops
    monkeypatch.setitem(sys.modules, "torch_xla", fake)
    monkeypatch.setitem(sys.modules, "torch_xla.core", core)
    monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model", xla_model)
    fake.core, core.xla_model = core, xla_model
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=0.5))
    got = cls().determine_available_memory(cfg, lambda: calls.append("profile"))
    assert got == (8 << 30) - (3 << 30) and calls[:2] == ["profile", "sync"]
    assert cls().total_memory() == 16 << 30
    runners = cls().capture_graphs(lambda **kw: kw["x"] * 2, [2, 1], lambda bs: {"x": torch.ones(bs)}, VlliteConfig())
    assert sorted(runners) == [1, 2] and runners[2](x=torch.full((2,), 3.0)).tolist() == [6.0, 6.0]


@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu"])
def test_model_ops_follow_the_attention_choice(name, monkeypatch):
    """Triton attention: TritonModelOps (multi-LoRA's shrink/expand kernels, graph-safe); the SDPA fallback:
    the torch ops."""
    from vllite_triton_kernels import TritonModelOps

    from vllite_core.model_ops import ModelOps

    _, cls = load(name)
    p = cls()
    monkeypatch.setattr(cls, "attention_choice", lambda self: ("triton", "chosen"))
    ops = p.model_ops(VlliteConfig())
    assert isinstance(ops, TritonModelOps) and ops.lora_graph_safe
    monkeypatch.setattr(cls, "attention_choice", lambda self: ("sdpa", "fallback"))
    assert type(p.model_ops(VlliteConfig())) is ModelOps
