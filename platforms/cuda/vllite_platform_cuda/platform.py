"""The CUDA platform (NVIDIA GPUs).

Detection asks NVML (the driver's management library) so it creates no CUDA
context and stays fork-safe; it falls back to ``torch.cuda.is_available()``
when NVML is not present. Attention and memory profiling land with the
platforms issue (#8): until then those two methods raise NotImplementedError.
"""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from vllite_core.config import ConfigError
from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig

PRIORITY = 100
NOT_YET = "lands with the platforms issue (#8)"


def nvml_gpu_names() -> tuple[list[str] | None, str]:
    """GPU names as NVML sees them, or (None, why) when NVML cannot be used."""
    try:
        import pynvml  # nvidia-ml-py, when installed
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            return None, f"NVML init failed: {exc}"
        try:
            names = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                names.append(name.decode() if isinstance(name, bytes) else str(name))
            return names, "NVML (pynvml)"
        finally:
            pynvml.nvmlShutdown()
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, "libnvidia-ml.so.1 not found (no NVIDIA driver)"
    if lib.nvmlInit_v2() != 0:
        return None, "NVML init failed (driver not loaded?)"
    try:
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None, "nvmlDeviceGetCount failed"
        names = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            buf = ctypes.create_string_buffer(96)
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == 0 and \
                    lib.nvmlDeviceGetName(handle, buf, len(buf)) == 0:
                names.append(buf.value.decode(errors="replace"))
            else:
                names.append(f"NVIDIA GPU {i}")
        return names, "NVML (libnvidia-ml)"
    finally:
        lib.nvmlShutdown()


def apply_visible_devices(names: list[str], visible: str | None) -> list[str]:
    """What CUDA_VISIBLE_DEVICES leaves of NVML's list (NVML itself ignores it)."""
    if visible is None:
        return names
    kept: list[str] = []
    for item in (v.strip() for v in visible.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit():
            idx = int(item)
            if idx < 0 or idx >= len(names):
                break  # CUDA stops at the first invalid entry
            kept.append(names[idx])
        else:  # GPU-/MIG- UUIDs: trust them, names unknown here
            kept.append(item)
    return kept


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"

    @classmethod
    def detect(cls) -> Detection:
        hip = getattr(torch.version, "hip", None)
        if hip:
            return Detection(False, PRIORITY, f"this torch is a ROCm build (torch.version.hip={hip}); "
                                              "use the rocm platform")
        if not torch.version.cuda:
            return Detection(False, PRIORITY, "this torch has no CUDA support (torch.version.cuda is None)")
        names, source = nvml_gpu_names()
        if names is None:
            if not torch.cuda.is_available():  # NVML-less fallback; does not create a context
                return Detection(False, PRIORITY, f"no CUDA device: {source}; torch.cuda.is_available() is False")
            names, source = [f"NVIDIA GPU {i}" for i in range(torch.cuda.device_count())], "torch.cuda"
        names = apply_visible_devices(names, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not names:
            return Detection(False, PRIORITY, f"no NVIDIA GPU visible ({source}, "
                                              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        return Detection(True, PRIORITY, f"{len(names)} NVIDIA GPU(s) found by {source}; "
                                         f"torch built with CUDA {torch.version.cuda}", names)

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def total_memory(self, index: int = 0) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def supported_dtypes(self) -> list[torch.dtype]:
        if torch.cuda.get_device_capability(0) >= (8, 0):  # Ampere and newer: bf16
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto"]  # fp8 KV cache comes with the CUDA attention backend (#8)

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        raise NotImplementedError(f"CUDA attention backend {NOT_YET}")

    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        raise NotImplementedError(f"CUDA memory profiling {NOT_YET}")

    def check_and_update_config(self, config: "VlliteConfig") -> None:
        kv = config.cache_config.kv_cache_dtype
        if kv not in self.supported_kv_cache_dtypes():
            raise ConfigError(f"kv_cache_dtype: the cuda platform supports {self.supported_kv_cache_dtypes()}, "
                              f"got {kv!r}")

    def init_device(self, config: "VlliteConfig") -> None:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def synchronize(self) -> None:
        torch.cuda.synchronize()
