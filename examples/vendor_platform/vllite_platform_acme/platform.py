"""The Acme platform: an imaginary accelerator, emulated on the host CPU.

Every method marks the spot where a vendor calls its own runtime; here the
"device" is the CPU with a fixed memory size, so the package runs anywhere and
passes the conformance kit (``pytest --vllite-platform acme``).
"""
from __future__ import annotations

import logging
import os
import resource
import sys
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from vllite_core.errors import ConfigError
from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig

logger = logging.getLogger("vllite.platforms.acme")

GiB = 1 << 30
MEMORY_ENV = "ACME_DEVICE_MEMORY_GIB"  # size of the emulated device memory (default 4 GiB)
VISIBLE_ENV = "ACME_VISIBLE_DEVICES"  # like CUDA_VISIBLE_DEVICES: set it empty to hide the device


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class AcmePlatform(Platform):
    name: ClassVar[str] = "acme"
    device_type: ClassVar[str] = "cpu"  # a real vendor: its torch device type (PrivateUse1 backend name)
    dist_backend: ClassVar[str] = "gloo"  # a real vendor: its collective library's torch.distributed backend

    @classmethod
    def detect(cls) -> Detection:
        # Cheap, no device context, never claims an absent device. A vendor asks its driver here.
        if os.environ.get(VISIBLE_ENV, "0").strip() == "":
            return Detection(False, -5, f"{VISIBLE_ENV} is empty: no Acme device visible")
        # Priority -5: below the CPU platform (0), so Acme runs only when asked for (VLLITE_PLATFORM=acme).
        return Detection(True, -5, "Acme accelerator (emulated on the CPU)", ["acme0"])

    def device_name(self, index: int = 0) -> str:
        return f"Acme Accelerator {index} (CPU emulation)"

    def total_memory(self, index: int = 0) -> int:
        return int(float(os.environ.get(MEMORY_ENV, "4")) * GiB)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16]

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        from vllite_platform_acme.attention import AcmePagedAttention

        return AcmePagedAttention()

    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        """``memory_utilization`` of the device, minus what the profile run needed at its peak."""
        cc = config.cache_config
        if cc.kv_cache_memory is not None:
            return int(cc.kv_cache_memory)
        before = _peak_rss()
        profile_run()
        grew = max(0, _peak_rss() - before)  # a vendor reads its allocator's peak instead
        budget = int(cc.memory_utilization * self.total_memory()) - grew
        if budget <= 0:
            raise ConfigError(f"memory_utilization: {cc.memory_utilization} leaves no Acme memory for the KV cache")
        return budget

    def capture_graphs(self, forward: Callable[..., Any], batch_sizes: list[int],
                       make_inputs: Callable[[int], dict[str, Any]],
                       config: "VlliteConfig") -> dict[int, Callable[..., Any]]:
        if config.enforce_eager:
            return {}
        # A vendor passes its own capture function (record the step on the device, return a replay);
        # the emulation replays by calling the step again on the same static buffers.
        from vllite_core.platforms.graphs import capture_runners, eager_capture

        return dict(capture_runners(forward, batch_sizes, make_inputs, eager_capture))

    def check_and_update_config(self, config: "VlliteConfig") -> None:
        self.check_kv_cache_dtype(config)
        if config.cache_config.block_size > 128:
            raise ConfigError("block_size: Acme pages hold at most 128 tokens")

    def init_device(self, config: "VlliteConfig") -> None:
        if config.device_config.num_threads:
            torch.set_num_threads(config.device_config.num_threads)

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["emulated"] = True
        return facts
