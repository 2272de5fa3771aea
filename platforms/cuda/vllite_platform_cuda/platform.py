"""The CUDA platform (NVIDIA GPUs).

Detection asks NVML (the driver's management library) so it creates no CUDA
context and stays fork-safe; it falls back to ``torch.cuda.is_available()``
when NVML is not present. Attention is the shared Triton paged attention
(``vllite-triton-kernels``), or torch SDPA where Triton is missing or the GPU
is too old for it. Memory is sized from a profile run with torch.cuda's
allocator statistics; decode steps are captured as CUDA graphs; fp8 KV caches
follow the compute capability.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from vllite_triton_kernels.platform_choice import BACKEND_ENV, TritonChoiceMixin, choose_backend

from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.config import VlliteConfig

logger = logging.getLogger("vllite.platforms.cuda")

PRIORITY = 100
MIN_TRITON_CAPABILITY = (7, 5)  # Triton's NVIDIA backend: Turing and newer


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


def kv_cache_dtypes_for_capability(capability: tuple[int, int]) -> list[str]:
    """KV cache dtypes the Triton kernels handle on a GPU of this compute capability.

    e4m3 (``fp8``/``fp8_e4m3``) needs sm_89+ (Ada, Hopper, Blackwell) in Triton; e5m2 converts in
    software from Turing on."""
    if capability >= (8, 9):
        return ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    if capability >= MIN_TRITON_CAPABILITY:
        return ["auto", "fp8_e5m2"]
    return ["auto"]


def dtypes_for_capability(capability: tuple[int, int]) -> list[torch.dtype]:
    if capability >= (8, 0):  # Ampere and newer: bf16
        return [torch.bfloat16, torch.float16, torch.float32]
    return [torch.float16, torch.float32]


def choose_attention(capability: tuple[int, int], requested: str | None = None) -> tuple[str, str]:
    """("triton" | "sdpa", why) for a GPU of ``capability``; ``requested`` is VLLITE_ATTENTION_BACKEND."""
    unfit = (None if capability >= MIN_TRITON_CAPABILITY
             else f"compute capability {capability[0]}.{capability[1]} is below Triton's 7.5")
    return choose_backend("nvidia", requested, unfit)


class CudaPlatform(TritonChoiceMixin, Platform):
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

    # ---- device facts (these initialise CUDA; never called from detect) -------------------
    def capability(self, index: int | None = None) -> tuple[int, int]:
        return tuple(torch.cuda.get_device_capability(self._index(index)))  # type: ignore[return-value]

    @staticmethod
    def _index(index: int | None) -> int:
        return torch.cuda.current_device() if index is None else index

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def total_memory(self, index: int = 0) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def supported_dtypes(self) -> list[torch.dtype]:
        return dtypes_for_capability(self.capability())

    def supported_kv_cache_dtypes(self) -> list[str]:
        return kv_cache_dtypes_for_capability(self.capability())

    # ---- attention -----------------------------------------------------------------------
    def attention_choice(self) -> tuple[str, str]:
        return choose_attention(self.capability(), os.environ.get(BACKEND_ENV))

    # ---- memory and graphs ---------------------------------------------------------------
    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        from vllite_core.platforms.memory import available_kv_cache_memory

        return available_kv_cache_memory(torch.cuda, config, profile_run, device_label="GPU")

    def capture_graphs(self, forward: Callable[..., Any], batch_sizes: list[int],
                       make_inputs: Callable[[int], dict[str, Any]],
                       config: "VlliteConfig") -> dict[int, Callable[..., Any]]:
        if config.enforce_eager or not batch_sizes:
            return {}
        kind, _ = self.attention_choice()
        if kind != "triton":  # the SDPA fallback plans each step on the host: not replayable
            logger.info("cuda: no CUDA graphs with the SDPA attention fallback; running eagerly")
            return {}
        from vllite_core.platforms.graphs import capture_runners, stream_graph_capture

        runners = capture_runners(forward, batch_sizes, make_inputs,
                                  stream_graph_capture(torch.cuda, torch.cuda.CUDAGraph))
        torch.cuda.synchronize()
        logger.info("cuda: captured CUDA graphs for decode batch sizes %s", sorted(runners))
        return dict(runners)

    # ---- lifecycle -----------------------------------------------------------------------
    def check_and_update_config(self, config: "VlliteConfig") -> None:
        self.check_kv_cache_dtype(config)

    def init_device(self, config: "VlliteConfig") -> None:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        cap = self.capability()
        facts["compute_capability"] = f"{cap[0]}.{cap[1]}"
        facts["attention"] = "%s (%s)" % self.attention_choice()
        return facts
