"""The TPU platform (Google TPUs through PyTorch/XLA).

``torch_xla`` is imported lazily, only inside methods: importing it starts the
PJRT runtime, which detection must not do. Detection looks for the TPU chips
the kernel exposes and for PJRT's settings.

XLA traces a step into a graph and compiles it per distinct set of shapes, so
shapes must stay few: attention is the core's SDPA paged attention with its
padded batch sizes bucketed to powers of two, and the runner pads token counts
to ``token_bucket`` sizes. Graph capture is XLA compilation: ``capture_graphs``
runs the decode step once per padded batch size (compiling it), and replays
re-run the traced step, which hits XLA's compilation cache.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from vllite_core.errors import ConfigError
from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig

logger = logging.getLogger("vllite.platforms.tpu")

PRIORITY = 80
MIN_TOKEN_BUCKET = 16


def has_module(name: str) -> bool:
    """Installed, without importing it."""
    return importlib.util.find_spec(name) is not None


def tpu_device_nodes() -> list[str]:
    """TPU chips exposed by the kernel (/dev/accel* on v2-v4, vfio on v5+)."""
    nodes = sorted(glob.glob("/dev/accel*"))
    if not nodes and has_module("libtpu"):
        nodes = sorted(p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit())
    return nodes


def token_bucket(n: int, max_tokens: int | None = None) -> int:
    """Padded token count for a step of ``n`` tokens: a power of two from 16, capped at ``max_tokens``."""
    from vllite_core.platforms.graphs import pow2_bucket

    return pow2_bucket(n, MIN_TOKEN_BUCKET, max_tokens)


def xla_sync() -> None:
    """Cut the traced graph here: compile (or fetch from cache) and run it."""
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:  # torch_xla < 2.5
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def xla_capture(fn: Callable[[], Any]) -> Callable[[], Any]:
    """'Capture' = trace and compile ``fn`` for its (static) input shapes once; replay re-traces, which is cheap,
    and runs the cached executable."""
    fn()
    xla_sync()

    def replay() -> Any:
        out = fn()
        xla_sync()
        return out

    return replay


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

    def _memory_info(self, index: int = 0) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        return dict(xm.get_memory_info(self.device(index)))

    def total_memory(self, index: int = 0) -> int:
        info = self._memory_info(index)
        if "bytes_limit" in info:
            return int(info["bytes_limit"])
        return int(info["kb_total"]) * 1024  # older torch_xla

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto"]

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        from vllite_core.attention.sdpa import SdpaPagedAttention
        from vllite_core.platforms.graphs import pow2_bucket

        return SdpaPagedAttention(bucket=lambda n: pow2_bucket(n, 1))

    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        """``memory_utilization * HBM`` minus the peak the profile run reached (weights + activations)."""
        cc = config.cache_config
        if cc.kv_cache_memory is not None:
            return int(cc.kv_cache_memory)
        profile_run()
        xla_sync()
        self.synchronize()
        info = self._memory_info()
        if "bytes_limit" in info:
            limit = int(info["bytes_limit"])
            used = int(info.get("peak_bytes_used", info.get("bytes_used", 0)))
        else:  # older torch_xla reports KiB free/total
            limit = int(info["kb_total"]) * 1024
            used = limit - int(info["kb_free"]) * 1024
        budget = int(limit * cc.memory_utilization) - used
        logger.info("tpu memory: limit %.2f GiB, peak used %.2f GiB, KV budget %.2f GiB",
                    limit / 2**30, used / 2**30, budget / 2**30)
        if budget <= 0:
            raise ConfigError(f"memory_utilization: {cc.memory_utilization} of {limit / 2**30:.2f} GiB HBM leaves "
                              f"no room for the KV cache ({used / 2**30:.2f} GiB in use after profiling)")
        return budget

    def capture_graphs(self, forward: Callable[..., Any], batch_sizes: list[int],
                       make_inputs: Callable[[int], dict[str, Any]],
                       config: "VlliteConfig") -> dict[int, Callable[..., Any]]:
        if config.enforce_eager or not batch_sizes:
            return {}
        from vllite_core.platforms.graphs import capture_runners

        runners = capture_runners(forward, batch_sizes, make_inputs, xla_capture)
        logger.info("tpu: compiled the decode step for batch sizes %s", sorted(runners))
        return dict(runners)

    def check_and_update_config(self, config: "VlliteConfig") -> None:
        self.check_kv_cache_dtype(config)
        if config.model_config.dtype in ("float16", "half", "fp16"):
            raise ConfigError("dtype: TPUs compute in bfloat16 or float32, not float16")

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
