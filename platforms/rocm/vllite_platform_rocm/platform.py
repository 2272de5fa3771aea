"""The ROCm platform (AMD GPUs). PyTorch's ROCm build reuses the ``torch.cuda``
API over HIP, so the device type is "cuda" and the collective backend is NCCL's
API served by RCCL. Attention and memory profiling land with the platforms
issue (#8): until then those two methods raise NotImplementedError.
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

PRIORITY = 100
NOT_YET = "lands with the platforms issue (#8)"


class RocmPlatform(Platform):
    name: ClassVar[str] = "rocm"
    device_type: ClassVar[str] = "cuda"  # torch's HIP build keeps the "cuda" device type
    dist_backend: ClassVar[str] = "nccl"  # served by RCCL on ROCm

    @classmethod
    def detect(cls) -> Detection:
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return Detection(False, PRIORITY, "this torch is not a ROCm build (torch.version.hip is None)")
        if not torch.cuda.is_available():  # counts devices; creates no context
            return Detection(False, PRIORITY, f"ROCm torch (HIP {hip}) sees no AMD GPU "
                                              f"(HIP_VISIBLE_DEVICES={os.environ.get('HIP_VISIBLE_DEVICES')!r})")
        names = [f"AMD GPU {i}" for i in range(torch.cuda.device_count())]
        return Detection(True, PRIORITY, f"{len(names)} AMD GPU(s) through HIP {hip}", names)

    def device_name(self, index: int = 0) -> str:
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "")
        return f"{props.name} ({arch})" if arch else props.name

    def total_memory(self, index: int = 0) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]  # all CDNA/RDNA GPUs ROCm supports do bf16

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto"]  # fp8 KV cache comes with the ROCm attention backend (#8)

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        raise NotImplementedError(f"ROCm attention backend {NOT_YET}")

    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        raise NotImplementedError(f"ROCm memory profiling {NOT_YET}")

    def check_and_update_config(self, config: "VlliteConfig") -> None:
        kv = config.cache_config.kv_cache_dtype
        if kv not in self.supported_kv_cache_dtypes():
            raise ConfigError(f"kv_cache_dtype: the rocm platform supports {self.supported_kv_cache_dtypes()}, "
                              f"got {kv!r}")

    def init_device(self, config: "VlliteConfig") -> None:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def describe(self) -> dict:
        facts = super().describe()
        facts["dist_backend"] = "nccl (rccl)"
        return facts
