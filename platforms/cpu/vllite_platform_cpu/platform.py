"""The CPU platform: always available, lowest priority, so any accelerator wins."""
from __future__ import annotations

import functools
import logging
import os
import platform as pyplatform
import resource
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from vllite_core.errors import ConfigError
from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig
    from vllite_core.model_ops import ModelOps

logger = logging.getLogger("vllite.platforms.cpu")

GiB = 1 << 30
# Without an explicit size, the KV cache takes at most this much host memory:
# the profiled budget on a big host would otherwise starve everything else.
DEFAULT_KV_CACHE_CAP = 4 * GiB
_PROFILE_BYTES_PER_TOKEN = 1 << 20
KVCACHE_SPACE_ENV = "VLLITE_CPU_KVCACHE_SPACE"  # GiB, like vLLM's VLLM_CPU_KVCACHE_SPACE
FUSED_OPS_ENV = "VLLITE_CPU_FUSED_OPS"  # 0: torch pointwise ops instead of the C++ kernels
ONEDNN_ENV = "VLLITE_CPU_ONEDNN"  # 0: F.linear instead of oneDNN-prepacked weights
AVX2_GEMM_ENV = "VLLITE_CPU_AVX2_GEMM"  # 0: oneDNN instead of the AVX2 GEMM on AVX2 hosts
BF16_GEMM_ENV = "VLLITE_CPU_BF16_GEMM"  # 0: oneDNN instead of the bf16 GEMM on AVX512-BF16 hosts
AMX_ENV = "VLLITE_CPU_AMX"  # 0: the bf16 / int8 GEMMs on vdpbf16ps / vpdpbusd instead of AMX tiles on AMX hosts
KEEP_FREED_ENV = "VLLITE_CPU_KEEP_FREED"  # 0: glibc's default malloc thresholds (see keep_freed_memory)
INT8_GEMM_ENV = "VLLITE_CPU_INT8_GEMM"  # 0: torch._int_mm (oneDNN) instead of the int8 GEMM on VNNI hosts
MOE_ONE_CALL_ENV = "VLLITE_CPU_MOE_ONE_CALL"  # 0: the fused MoE op expert by expert in Python (moe_grouped)
COMPILE_ENV = "VLLITE_CPU_COMPILE"  # 1: torch.compile the decode step (off by default: not faster here)


def _compile_on(config: "VlliteConfig") -> bool:
    """torch.compile of the decode step: opt-in (VLLITE_CPU_COMPILE=1), never with enforce_eager."""
    return os.environ.get(COMPILE_ENV, "0") == "1" and not config.enforce_eager


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """First processor block of /proc/cpuinfo (empty off Linux)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                key, _, value = line.partition(":")
                out.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return out


def cpu_model_name() -> str:
    info = _cpuinfo()
    for key in ("model name", "hardware", "cpu model", "processor"):
        value = info.get(key, "")
        if value and not value.isdigit():
            return value
    return pyplatform.processor() or pyplatform.machine() or "cpu"


def cpu_flags() -> set[str]:
    info = _cpuinfo()
    return set((info.get("flags") or info.get("features") or "").split())


def has_fast_bf16(flags: set[str] | None = None) -> bool:
    """Native bf16 math: AVX512-BF16 or AMX on x86, the bf16 extension on Arm."""
    flags = cpu_flags() if flags is None else flags
    if pyplatform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def has_fast_int8(flags: set[str] | None = None) -> bool:
    """An int8 dot-product instruction that oneDNN's int8 GEMM (``torch._int_mm``) uses: VNNI (AVX-512 or
    AVX) or AMX on x86, the dot-product extension on Arm. Without one, ``_int_mm`` ran at about 1.3 GMAC/s on
    an AVX2 host, 65x slower than the float32 GEMM."""
    flags = cpu_flags() if flags is None else flags
    if pyplatform.machine().lower() in ("aarch64", "arm64"):
        return "asimddp" in flags
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def use_avx2_gemm(flags: set[str] | None = None) -> bool:
    """The AVX2 float32 GEMM serves the linear layers on AVX2/FMA hosts without AVX-512, where it beat
    oneDNN (on AVX-512 hosts oneDNN's wider kernels stay); ``VLLITE_CPU_AVX2_GEMM=0`` turns it off."""
    from vllite_platform_cpu import kernels

    flags = cpu_flags() if flags is None else flags
    if os.environ.get(AVX2_GEMM_ENV, "1") == "0" or "avx512f" in flags or not {"avx2", "fma"} <= flags:
        return False
    return kernels.avx2_gemm_available()


def use_bf16_gemm(flags: set[str] | None = None) -> bool:
    """With AVX512-BF16 bfloat16 layers run on the CPU platform's own bf16 GEMM (csrc/gemm.cpp; on AMX tiles
    where the CPU has them, csrc/amx.cpp), faster than oneDNN's packed bf16 kernel at every row count measured
    on Zen 4 and on a Xeon with AMX; ``VLLITE_CPU_BF16_GEMM=0`` keeps oneDNN."""
    from vllite_platform_cpu import kernels

    flags = cpu_flags() if flags is None else flags
    if os.environ.get(BF16_GEMM_ENV, "1") == "0" or "avx512_bf16" not in flags:
        return False
    return kernels.bf16_gemm_available()


def use_amx() -> bool:
    """The bf16 and int8 GEMMs on AMX tiles where the CPU and OS have them (``VLLITE_CPU_AMX=0``: vdpbf16ps and
    vpdpbusd)."""
    return os.environ.get(AMX_ENV, "1") != "0"


def use_int8_gemm(flags: set[str] | None = None) -> bool:
    """With AVX512-VNNI W8A8 layers (``quantization="int8"``) run on the CPU platform's own int8 GEMM
    (csrc/quant.cpp; on AMX tiles where the CPU has them, the same int32 sums), which quantizes, multiplies and
    scales back in one call: 1.2-2.5x the ``torch._int_mm`` path over SmolLM2's layers on Zen 4, and faster at
    every row count on a Xeon with AMX; ``VLLITE_CPU_INT8_GEMM=0`` keeps ``_int_mm``."""
    from vllite_platform_cpu import kernels

    flags = cpu_flags() if flags is None else flags
    if os.environ.get(INT8_GEMM_ENV, "1") == "0" or "avx512_vnni" not in flags:
        return False
    return kernels.int8_gemm_available()


def _cgroup_limit() -> int | None:
    """The container's memory limit, if one is set (cgroup v2, then v1)."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            return int(raw)
    return None


def physical_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot determine the host memory size")


def current_rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Process high-water mark of resident memory (bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


# Largest block malloc takes from its heap (glibc's default: 128 KiB, adapting up to 32 MiB) and the free memory it
# keeps at the heap's top (default 128 KiB, adapting likewise).
MALLOC_MMAP_THRESHOLD = 256 << 20
MALLOC_TRIM_THRESHOLD = 512 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Let glibc's malloc reuse a step's large activations instead of handing them back to the OS (once per
    process; ``VLLITE_CPU_KEEP_FREED=0``: the defaults). Above 32 MiB glibc maps every block afresh and unmaps it
    on free, so each prefill step of a 1B model (gate_up's output alone 64 MiB at 2,048 rows) took its
    activations as new zeroed pages: 5% of its profile in the kernel's page clearing and faults; with these
    thresholds a quarter fewer faults and two prefill steps 6.7 -> 5.8 s (Llama-1B shape, 2 Xeon cores,
    docs/benchmarks-notebook.md 2026-12-07).
    vLLM's CPU docs preload tcmalloc for the same reason. Returns whether the thresholds were set."""
    if os.environ.get(KEEP_FREED_ENV, "1") == "0" or sys.platform != "linux":
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def kvcache_space_from_env() -> int | None:
    raw = os.environ.get(KVCACHE_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        raise ConfigError(f"{KVCACHE_SPACE_ENV}: expected a size in GiB, got {raw!r}") from None
    if gib <= 0:
        raise ConfigError(f"{KVCACHE_SPACE_ENV}: must be positive, got {raw!r}")
    return int(gib * GiB)


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"

    @classmethod
    def detect(cls) -> Detection:
        return Detection(available=True, priority=0, reason="the host CPU is always usable (lowest priority)",
                         devices=[cpu_model_name()])

    def device_name(self, index: int = 0) -> str:
        return cpu_model_name()

    def total_memory(self, index: int = 0) -> int:
        total = physical_memory()
        limit = _cgroup_limit()
        return min(total, limit) if limit else total

    def supported_dtypes(self) -> list[torch.dtype]:
        if has_fast_bf16():
            return [torch.bfloat16, torch.float32]
        return [torch.float32, torch.bfloat16]

    def supported_kv_cache_dtypes(self) -> list[str]:
        # float8 caches are read by the C++ kernel (widened in registers) and by the torch fallback.
        return ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        from vllite_platform_cpu.attention import TorchPagedAttention

        return TorchPagedAttention()

    def model_ops(self, config: "VlliteConfig") -> "ModelOps":
        """Fused C++ pointwise kernels and packed float32 linears: the AVX2 GEMM on AVX2 hosts, oneDNN's
        elsewhere (``VLLITE_CPU_FUSED_OPS=0``, ``VLLITE_CPU_AVX2_GEMM=0`` and ``VLLITE_CPU_ONEDNN=0``
        turn them off; ``VLLITE_CPU_MOE_ONE_CALL=0`` runs the fused MoE op expert by expert in Python). Under
        ``VLLITE_CPU_COMPILE=1`` the torch ops stay, for inductor to fuse."""
        from vllite_core.model_ops import ModelOps
        from vllite_platform_cpu import kernels
        from vllite_platform_cpu.model_ops import CpuModelOps, onednn_linear_available

        if _compile_on(config):
            return ModelOps()
        fused = os.environ.get(FUSED_OPS_ENV, "1") != "0" and kernels.available()
        packed = os.environ.get(ONEDNN_ENV, "1") != "0" and onednn_linear_available()
        kernels.set_amx(use_amx())
        return CpuModelOps(fused=fused, packed_linear=packed, widen_16bit=not has_fast_bf16(),
                           avx2_gemm=use_avx2_gemm(), bf16_gemm=use_bf16_gemm(), int8_gemm=use_int8_gemm(),
                           int8_panels=not has_fast_int8(),
                           moe_one_call=os.environ.get(MOE_ONE_CALL_ENV, "1") != "0")

    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        """Explicit size (``kv_cache_memory``, then VLLITE_CPU_KVCACHE_SPACE) if given; otherwise
        ``memory_utilization * host memory`` minus what the process holds after a profile run,
        capped at 4 GiB."""
        cc = config.cache_config
        if cc.kv_cache_memory is not None:
            return int(cc.kv_cache_memory)
        from_env = kvcache_space_from_env()
        if from_env is not None:
            return from_env
        from vllite_core.distributed import get_tp

        ranks = get_tp().local_world_size  # tensor-parallel ranks on this host share its memory
        rss_before, peak_before = current_rss(), peak_rss()
        total = self.total_memory() // ranks
        tokens = config.scheduler_config.max_num_batched_tokens
        # Skipping the profile run (a forward pass of max_num_batched_tokens, 1.5-7 s of start-up) is safe
        # when even a generous bound on what it could show leaves the capped cache room: packed weight
        # copies no larger than everything held now, and 1 MiB of activations per token.
        bound = 2 * rss_before + tokens * _PROFILE_BYTES_PER_TOKEN + GiB
        if int(cc.memory_utilization * total) - bound >= DEFAULT_KV_CACHE_CAP:
            logger.info("cpu memory: total %.2f GiB, process uses %.2f GiB; the %d GiB KV cache cap fits beside "
                        "a %.2f GiB bound on the peak, so no profile run", total / GiB, rss_before / GiB,
                        DEFAULT_KV_CACHE_CAP // GiB, bound / GiB)
            return DEFAULT_KV_CACHE_CAP
        profile_run()
        rss_after, peak_after = current_rss(), peak_rss()
        used = rss_after
        if peak_after > peak_before:  # the activation peak happened during profiling
            used = max(used, peak_after)
        budget = int(cc.memory_utilization * total) - used
        logger.info("cpu memory: total %.2f GiB%s, process uses %.2f GiB after profiling (grew %.2f GiB), "
                    "budget %.2f GiB", total / GiB, f" (this rank's 1/{ranks})" if ranks > 1 else "", used / GiB,
                    (used - rss_before) / GiB, budget / GiB)
        if budget <= 0:
            raise ConfigError(
                f"memory_utilization: {cc.memory_utilization} of {total / GiB:.2f} GiB leaves no room for the KV "
                f"cache (the process already uses {used / GiB:.2f} GiB); raise it, or set kv_cache_memory "
                f"or {KVCACHE_SPACE_ENV}")
        cap = DEFAULT_KV_CACHE_CAP // ranks
        if budget > cap:
            logger.info("cpu KV cache capped at %.1f GiB per rank; set kv_cache_memory or %s for more",
                        cap / GiB, KVCACHE_SPACE_ENV)
        return min(budget, cap)

    def check_and_update_config(self, config: "VlliteConfig") -> None:
        kv = config.cache_config.kv_cache_dtype
        if kv not in self.supported_kv_cache_dtypes():
            raise ConfigError(f"kv_cache_dtype: the cpu platform supports {self.supported_kv_cache_dtypes()}, "
                              f"got {kv!r}")
        threads = config.device_config.num_threads
        if threads is not None and threads <= 0:
            raise ConfigError(f"num_threads: must be positive, got {threads}")
        if config.model_config.quantization == "int8" and not has_fast_int8():
            logger.warning("quantization='int8': this CPU (%s) has no VNNI/AMX int8 instructions, so the int8 "
                           "GEMM runs tens of times slower than float32 here; quantization='gguf' (a GGUF "
                           "checkpoint) or dtype='bfloat16' are the faster choices on it", cpu_model_name())

    def device_count(self) -> int:
        """Tensor-parallel ranks on this host: one per usable core (each rank computes with its own threads)."""
        return usable_cpus()

    def init_device(self, config: "VlliteConfig") -> None:
        """torch threads: ``num_threads``, else this rank's share of the cores (all of them on one rank)."""
        from vllite_core.distributed import get_tp

        share = max(1, usable_cpus() // get_tp().local_world_size)
        torch.set_num_threads(config.device_config.num_threads or share)
        keep_freed_memory()

    def capture_graphs(self, forward: Callable[..., Any], batch_sizes: list[int],
                       make_inputs: Callable[[int], dict[str, Any]],
                       config: "VlliteConfig") -> dict[int, Callable[..., Any]]:
        """Decode graphs through ``torch.compile`` (inductor, dynamic batch dimension), opt-in.

        Off unless ``VLLITE_CPU_COMPILE=1``: measured on AVX2 hosts it was not faster than
        eager (the step is matmul-bound and attention is a C++ kernel), and compiling
        costs about a minute per start on a cold cache. When on, attention stays eager
        (an opaque call inside the graph, so it keeps reading the step's real context
        lengths), one compiled function serves every size, and each size is warmed up
        here so compile time is paid at start-up (reported by ``vllite bench``). The
        inductor cache lives in ``~/.cache/vllite/inductor`` unless TORCHINDUCTOR_CACHE_DIR
        is set."""
        if not batch_sizes or not _compile_on(config):
            return {}
        from vllite_core.platforms.graphs import capture_runners
        from vllite_platform_cpu import kernels
        from vllite_platform_cpu.attention import TorchPagedAttention

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(kernels.cache_root(), "inductor"))
        if not getattr(TorchPagedAttention.forward, "_vllite_eager", False):
            eager_forward = torch.compiler.disable(TorchPagedAttention.forward)
            eager_forward._vllite_eager = True  # type: ignore[attr-defined]
            TorchPagedAttention.forward = eager_forward  # type: ignore[method-assign]
        compiled = torch.compile(forward, dynamic=True)
        t0 = time.perf_counter()

        def capture(fn: Callable[[], Any]) -> Callable[[], Any]:
            fn()  # compile (first size) or reuse the dynamic graph, at start-up
            return fn

        runners = capture_runners(compiled, batch_sizes, make_inputs, capture)
        logger.info("cpu: torch.compile of the decode step for %d batch sizes took %.1fs", len(runners),
                    time.perf_counter() - t0)
        return runners

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["num_threads"] = torch.get_num_threads()
        facts["fast_bf16"] = has_fast_bf16()
        return facts
