"""The XPU platform (Intel GPUs through PyTorch's native ``torch.xpu``).

Attention and memory profiling land with the platforms issue (#8): until then
those two methods raise NotImplementedError.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from vllite_core.config import ConfigError
from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig

PRIORITY = 90
NOT_YET = "lands with the platforms issue (#8)"


class XpuPlatform(Platform):
    name: ClassVar[str] = "xpu"
    device_type: ClassVar[str] = "xpu"
    dist_backend: ClassVar[str] = "xccl"

    @classmethod
    def detect(cls) -> Detection:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return Detection(False, PRIORITY, "this torch has no torch.xpu module")
        if not xpu.is_available():
            return Detection(False, PRIORITY, "torch.xpu.is_available() is False "
                                              "(no Intel GPU, or torch built without XPU support)")
        names = [f"Intel XPU {i}" for i in range(xpu.device_count())]
        return Detection(True, PRIORITY, f"{len(names)} Intel GPU(s) through torch.xpu", names)

    def device_name(self, index: int = 0) -> str:
        return torch.xpu.get_device_name(index)

    def total_memory(self, index: int = 0) -> int:
        return int(torch.xpu.get_device_properties(index).total_memory)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto"]

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        raise NotImplementedError(f"XPU attention backend {NOT_YET}")

    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        raise NotImplementedError(f"XPU memory profiling {NOT_YET}")

    def check_and_update_config(self, config: "VlliteConfig") -> None:
        kv = config.cache_config.kv_cache_dtype
        if kv not in self.supported_kv_cache_dtypes():
            raise ConfigError(f"kv_cache_dtype: the xpu platform supports {self.supported_kv_cache_dtypes()}, "
                              f"got {kv!r}")

    def init_device(self, config: "VlliteConfig") -> None:
        torch.xpu.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def synchronize(self) -> None:
        torch.xpu.synchronize()
