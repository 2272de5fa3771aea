"""The TPU platform (Google TPUs through PyTorch/XLA).

``torch_xla`` is imported lazily, only inside methods: importing it starts the
PJRT runtime, which detection must not do. Attention and memory profiling land
with the platforms issue (#8): until then those two methods raise
NotImplementedError.
"""
from __future__ import annotations

import glob
import importlib.util
import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from vllite_core.config import ConfigError
from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig

PRIORITY = 80
NOT_YET = "lands with the platforms issue (#8)"


def has_module(name: str) -> bool:
    """Installed, without importing it."""
    return importlib.util.find_spec(name) is not None


def tpu_device_nodes() -> list[str]:
    """TPU chips exposed by the kernel (/dev/accel* on v2-v4, vfio on v5+)."""
    nodes = sorted(glob.glob("/dev/accel*"))
    if not nodes and has_module("libtpu"):
        nodes = sorted(p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit())
    return nodes


class TpuPlatform(Platform):
    name: ClassVar[str] = "tpu"
    device_type: ClassVar[str] = "xla"
    dist_backend: ClassVar[str] = "xla"

    @classmethod
    def detect(cls) -> Detection:
        if not has_module("torch_xla"):
            return Detection(False, PRIORITY, "torch_xla is not installed")
        pjrt = os.environ.get("PJRT_DEVICE", "").strip()
        if pjrt and pjrt.upper() != "TPU":
            return Detection(False, PRIORITY, f"PJRT_DEVICE={pjrt} selects another XLA device, not a TPU")
        nodes = tpu_device_nodes()
        accel_type = os.environ.get("TPU_ACCELERATOR_TYPE", "").strip()
        if nodes:
            return Detection(True, PRIORITY, f"{len(nodes)} TPU chip(s) found ({accel_type or 'type unknown'})", nodes)
        if pjrt.upper() == "TPU" or accel_type:
            why = "PJRT_DEVICE=TPU" if pjrt else f"TPU_ACCELERATOR_TYPE={accel_type}"
            return Detection(True, PRIORITY, f"{why} is set", [accel_type or "TPU"])
        return Detection(False, PRIORITY, "torch_xla is installed but no TPU was found "
                                          "(no /dev/accel* or vfio TPU, PJRT_DEVICE/TPU_ACCELERATOR_TYPE unset)")

    def device(self, index: int = 0) -> torch.device:
        import torch_xla

        return torch_xla.device(index)

    def device_name(self, index: int = 0) -> str:
        import torch_xla.tpu

        try:
            return f"TPU v{torch_xla.tpu.version()}"
        except Exception:
            return os.environ.get("TPU_ACCELERATOR_TYPE", "TPU")

    def total_memory(self, index: int = 0) -> int:
        import torch_xla.core.xla_model as xm

        info: dict[str, Any] = xm.get_memory_info(self.device(index))
        if "bytes_limit" in info:
            return int(info["bytes_limit"])
        return int(info["kb_total"]) * 1024  # older torch_xla

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto"]

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        raise NotImplementedError(f"TPU attention backend {NOT_YET}")

    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        raise NotImplementedError(f"TPU memory profiling {NOT_YET}")

    def check_and_update_config(self, config: "VlliteConfig") -> None:
        kv = config.cache_config.kv_cache_dtype
        if kv not in self.supported_kv_cache_dtypes():
            raise ConfigError(f"kv_cache_dtype: the tpu platform supports {self.supported_kv_cache_dtypes()}, "
                              f"got {kv!r}")

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
