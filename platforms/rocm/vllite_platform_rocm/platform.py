"""The ROCm platform (AMD GPUs). PyTorch's ROCm build reuses the ``torch.cuda``
API over HIP, so the device type is "cuda" and the collective backend is NCCL's
API served by RCCL.

Detection needs a ROCm torch (``torch.version.hip``); it lists GPUs through
amdsmi when that is installed (no HIP context), else through torch. Attention
is the Triton paged attention shared with the CUDA platform (Triton's "amd"
backend compiles the same kernels), or torch SDPA. Capabilities follow the
GPU's gfx architecture: MI300 (gfx942) stores fp8 KV in the "fnuz" variants,
MI350 (gfx950) and RDNA4 (gfx12) in the OCP ones, older GPUs not at all.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from vllite_triton_kernels.platform_choice import BACKEND_ENV, TritonChoiceMixin, choose_backend

from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.config import VlliteConfig


PRIORITY = 100
FP8_FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")  # MI300 series: fp8 with the "fnuz" encoding
FP8_OCP_PREFIXES = ("gfx950", "gfx12")  # MI350 series, RDNA4: OCP fp8 (e4m3fn / e5m2)


def amdsmi_gpu_names() -> tuple[list[str] | None, str]:
    """GPU names from amdsmi (the ROCm management library), or (None, why)."""
    try:
        import amdsmi
    except ImportError:
        return None, "amdsmi is not installed"
    try:
        amdsmi.amdsmi_init()
    except Exception as exc:
        return None, f"amdsmi init failed: {exc}"
    try:
        names = []
        for i, handle in enumerate(amdsmi.amdsmi_get_processor_handles()):
            try:
                names.append(str(amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name") or f"AMD GPU {i}"))
            except Exception:
                names.append(f"AMD GPU {i}")
        return names, "amdsmi"
    finally:
        amdsmi.amdsmi_shut_down()


def visible_devices_env() -> tuple[str, str] | None:
    """The visibility variable HIP honours, first one set wins (name, value)."""
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value is not None:
            return var, value
    return None


def apply_visible(names: list[str], visible: str | None) -> list[str]:
    """Indices kept by a HIP visibility list (amdsmi ignores those variables); stops at the first bad entry."""
    if visible is None:
        return names
    kept: list[str] = []
    for item in (v.strip() for v in visible.split(",")):
        if not item.isdigit() or int(item) >= len(names):
            break
        kept.append(names[int(item)])
    return kept


def base_arch(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'."""
    return gcn_arch_name.split(":")[0].strip().lower()


def kv_cache_dtypes_for_arch(arch: str) -> list[str]:
    arch = base_arch(arch)
    if arch in FP8_FNUZ_ARCHS or arch.startswith(FP8_OCP_PREFIXES):
        return ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    return ["auto"]


def fp8_dtypes_for_arch(arch: str) -> dict[str, torch.dtype]:
    """kv_cache_dtype name -> torch dtype on this architecture (empty: no fp8)."""
    arch = base_arch(arch)
    if arch in FP8_FNUZ_ARCHS:
        e4m3, e5m2 = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    elif arch.startswith(FP8_OCP_PREFIXES):
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    else:
        return {}
    return {"fp8": e4m3, "fp8_e4m3": e4m3, "fp8_e5m2": e5m2}


class RocmPlatform(TritonChoiceMixin, Platform):
    name: ClassVar[str] = "rocm"
    device_type: ClassVar[str] = "cuda"  # torch's HIP build keeps the "cuda" device type
    dist_backend: ClassVar[str] = "nccl"  # served by RCCL on ROCm

    @classmethod
    def detect(cls) -> Detection:
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return Detection(False, PRIORITY, "this torch is not a ROCm build (torch.version.hip is None)")
        names, source = amdsmi_gpu_names()
        if names is not None:
            env = visible_devices_env()
            names = apply_visible(names, env[1] if env else None)
            if not names:
                where = f"{env[0]}={env[1]!r}" if env else "no GPU listed"
                return Detection(False, PRIORITY, f"ROCm torch (HIP {hip}) but no AMD GPU visible ({source}, {where})")
            return Detection(True, PRIORITY, f"{len(names)} AMD GPU(s) found by {source}; HIP {hip}", names)
        if not torch.cuda.is_available():  # counts devices; creates no context
            return Detection(False, PRIORITY, f"ROCm torch (HIP {hip}) sees no AMD GPU ({source}; "
                                              f"HIP_VISIBLE_DEVICES={os.environ.get('HIP_VISIBLE_DEVICES')!r})")
        names = [f"AMD GPU {i}" for i in range(torch.cuda.device_count())]
        return Detection(True, PRIORITY, f"{len(names)} AMD GPU(s) through HIP {hip}", names)

    # ---- device facts --------------------------------------------------------------------
    def arch(self, index: int | None = None) -> str:
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
        return base_arch(getattr(props, "gcnArchName", "") or "")

    def device_name(self, index: int = 0) -> str:
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "")
        return f"{props.name} ({arch})" if arch else props.name

    def total_memory(self, index: int = 0) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]  # all CDNA/RDNA GPUs ROCm supports do bf16

    def supported_kv_cache_dtypes(self) -> list[str]:
        return kv_cache_dtypes_for_arch(self.arch())

    def kv_cache_torch_dtype(self, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        if kv_cache_dtype == "auto":
            return model_dtype
        table = fp8_dtypes_for_arch(self.arch())
        if kv_cache_dtype not in table:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported on {self.arch() or 'this GPU'}")
        return table[kv_cache_dtype]

    # ---- attention -----------------------------------------------------------------------
    def attention_choice(self) -> tuple[str, str]:
        return choose_backend("amd", os.environ.get(BACKEND_ENV))

    # ---- memory and graphs (HIP serves torch.cuda's allocator and graph APIs) -------------
    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        from vllite_core.platforms.memory import available_kv_cache_memory

        return available_kv_cache_memory(torch.cuda, config, profile_run, device_label="GPU")

    def capture_graphs(self, forward: Callable[..., Any], batch_sizes: list[int],
                       make_inputs: Callable[[int], dict[str, Any]],
                       config: "VlliteConfig") -> dict[int, Callable[..., Any]]:
        if config.enforce_eager or not batch_sizes or self.attention_choice()[0] != "triton":
            return {}
        from vllite_core.platforms.graphs import capture_runners, stream_graph_capture

        runners = capture_runners(forward, batch_sizes, make_inputs,
                                  stream_graph_capture(torch.cuda, torch.cuda.CUDAGraph))  # HIP graphs
        torch.cuda.synchronize()
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

    def describe(self) -> dict:
        facts = super().describe()
        facts["dist_backend"] = "nccl (rccl)"
        facts["gfx_arch"] = self.arch()
        facts["attention"] = "%s (%s)" % self.attention_choice()
        return facts
