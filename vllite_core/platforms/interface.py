"""The Platform contract: everything the hardware-neutral core asks of a device.

A platform package implements a subclass and returns it from the
``vllite_register_platforms`` hook. The core never imports a device module;
it only calls these methods.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from vllite_core.errors import ConfigError

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig
    from vllite_core.distributed.communicator import Communicator
    from vllite_core.model_ops import ModelOps


# kv_cache_dtype names (vLLM's) -> torch dtypes. "auto" means the model dtype. A platform lists the names it
# supports in supported_kv_cache_dtypes() and may map them differently (ROCm MI300: the fnuz variant).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass
class Detection:
    """Answer of ``Platform.detect()``: can this platform run here, and how much it wants to."""

    available: bool
    priority: int = 0
    reason: str = ""
    devices: list[str] = field(default_factory=list)


class Platform(ABC):
    """One kind of hardware. Subclasses set the class attributes and implement the methods."""

    name: ClassVar[str] = "abstract"  # what users type: --device NAME / VLLITE_PLATFORM
    device_type: ClassVar[str] = "cpu"  # torch device type
    dist_backend: ClassVar[str] = "gloo"  # torch.distributed backend name
    plugin_api: ClassVar[tuple[int, int]] = (1, 0)  # VLLITE_PLUGIN_API the platform was written for

    # ---- identity and detection -------------------------------------------------
    @classmethod
    @abstractmethod
    def detect(cls) -> Detection:
        """Probe the machine cheaply (no device context). Never claim an absent device."""

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    @abstractmethod
    def device_name(self, index: int = 0) -> str:
        """Human-readable device name."""

    @abstractmethod
    def total_memory(self, index: int = 0) -> int:
        """Bytes of memory on the device."""

    # ---- capabilities -----------------------------------------------------------
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32]

    def default_dtype(self) -> torch.dtype:
        return self.supported_dtypes()[0]

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto"]

    def kv_cache_torch_dtype(self, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        """The torch dtype of the KV cache tensors for ``cache_config.kv_cache_dtype``."""
        if kv_cache_dtype == "auto":
            return model_dtype
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} (known: auto, {', '.join(KV_CACHE_DTYPES)})")
        return KV_CACHE_DTYPES[kv_cache_dtype]

    def check_kv_cache_dtype(self, config: "VlliteConfig") -> None:
        """ConfigError unless ``cache_config.kv_cache_dtype`` is one this platform supports."""

        kv = config.cache_config.kv_cache_dtype
        if kv == "auto":  # always supported; asks the device nothing
            return
        supported = self.supported_kv_cache_dtypes()
        if kv not in supported:
            raise ConfigError(f"kv_cache_dtype: the {self.name} platform supports {supported} here, got {kv!r}")

    @abstractmethod
    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        """The paged-attention backend to use for this config."""

    def model_ops(self, config: "VlliteConfig") -> "ModelOps":
        """The pointwise ops (linear, RMSNorm, SiLU-and-mul, rotary) models build their layers with;
        return a ``vllite_core.model_ops.ModelOps`` subclass to fuse them. Default: plain torch."""
        from vllite_core.model_ops import ModelOps

        return ModelOps()

    # ---- memory -------------------------------------------------------------------
    @abstractmethod
    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        """Bytes available for the KV cache after ``profile_run`` (a forward pass at the
        largest batch) has shown the peak activation memory, within the configured
        utilization fraction or the explicit ``kv_cache_memory``."""

    # ---- tensor parallelism ---------------------------------------------------------
    def device_count(self) -> int:
        """Devices one node can give tensor-parallel ranks (one rank per device); default: what
        ``detect()`` lists."""
        return max(1, len(self.detect().devices))

    def make_communicator(self, group: Any) -> "Communicator":
        """The tensor-parallel group's collectives (all-reduce, all-gather, broadcast) over the process
        group ``group`` (None: every rank), which the engine joined with ``dist_backend``. Return a
        ``vllite_core.distributed.communicator.Communicator`` subclass to use the device's own library."""
        from vllite_core.distributed.communicator import Communicator

        return Communicator(group)

    # ---- graphs -------------------------------------------------------------------
    def capture_graphs(
        self,
        forward: Callable[..., Any],
        batch_sizes: list[int],
        make_inputs: Callable[[int], dict[str, Any]],
        config: "VlliteConfig",
    ) -> dict[int, Callable[..., Any]]:
        """Capture or compile ``forward`` for each decode batch size. Returns a runner per
        captured size (the model runner pads a batch up to the next one); empty means eager.
        Must return {} when ``config.enforce_eager``.

        ``forward(**inputs)`` runs one model step; ``make_inputs(bs)`` returns the static input
        buffers for ``bs`` decode requests (``vllite_core.platforms.graphs.decode_inputs``). A
        runner is called with inputs of that structure (padded to its size), copies them into
        its buffers, replays and returns the output. ``vllite_core.platforms.graphs`` has the
        helpers (``capture_runners``, ``stream_graph_capture``) and the runner-side ones."""
        return {}

    # ---- lifecycle ----------------------------------------------------------------
    def check_and_update_config(self, config: "VlliteConfig") -> None:
        """Validate and adjust the config for this platform (dtype, kv dtype, block size...)."""

    def init_device(self, config: "VlliteConfig") -> None:
        """Prepare the process to use the device (threads, seeds, current device)."""

    def synchronize(self) -> None:
        """Wait for queued device work."""

    def empty_cache(self) -> None:
        """Hand device memory the framework's caching allocator keeps back to the driver (sleep mode frees
        the KV cache and the weights and wants the memory seen free); nothing where there is no such cache."""

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)

    def describe(self) -> dict[str, Any]:
        """Facts for `vllite env`."""
        det = self.detect()
        return {
            "name": self.name,
            "device_type": self.device_type,
            "device_name": self.device_name(),
            "total_memory": self.total_memory(),
            "devices": det.devices,
            "dist_backend": self.dist_backend,
            "device_count": self.device_count(),
            "supported_dtypes": [str(d).replace("torch.", "") for d in self.supported_dtypes()],
            "kv_cache_dtypes": self.supported_kv_cache_dtypes(),
            "pid": os.getpid(),
        }
