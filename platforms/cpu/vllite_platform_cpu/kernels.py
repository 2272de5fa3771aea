"""Small C++ kernels for the CPU (paged attention of ``csrc/attention.cpp``, the AVX2 float32 GEMM of
``csrc/gemm.cpp``, the fused pointwise ops of ``csrc/pointwise.cpp``, the int8 passes of ``csrc/quant.cpp``
the GGUF block linear of ``csrc/gguf.cpp``, the encoder (BERT) attention and add + LayerNorm of
``csrc/encoder.cpp`` and a mixture of experts' routed experts in one call, ``csrc/moe.cpp``), compiled when the
package is installed, for several instruction sets, and picked at run time for this CPU.

``paged_attention`` computes attention for the query rows of selected requests
straight from the paged KV cache: no gathered copy of the context (the torch-ops
path copies every context block twice per layer, which dominates a decode step
at batch 64). Work is split over (request, 16-row query tile) tasks, each with
all KV heads (whole cache rows) or, when there are too few tiles to busy the
threads, one KV head each; the ``H / Hkv`` query heads that share a KV head read
each key/value row once per tile, as stored (bfloat16 keys, and a decode row's values, go through AVX512-BF16
dot products where the CPU has them). A one-row tile (a decode token) takes a
streaming path instead: positions in order, each one's rows of the task's KV heads
read once for all their query heads, rows ahead prefetched. Scores and sums are float32 whatever the
cache dtype (float32, bfloat16, float16, or float8 e4m3fn / e5m2 widened in registers, its per-layer
scales folded into the query and the output); softmax is online across key chunks.

Build: ``pip install --no-build-isolation -e platforms/cpu`` (``setup.py``) compiles the kernel
files once per ISA variant of ``isa.py`` (x86-64: ``default``, ``avx2`` (+FMA/F16C/BMI2), ``avx512``
(F/BW/VL/DQ), ``avx512_bf16``; other CPUs: ``default``), each with its own flags and C++ namespace,
into one module, ``vllite_platform_cpu._C``, with one submodule per variant. No ``-march=native``: the
build runs on any CPU of its architecture. ``load()`` takes the highest variant the CPU (and OS)
supports, from the module's own CPUID check; ``VLLITE_CPU_ISA=default|avx2|avx512|avx512_bf16`` caps it
(as ``ATEN_CPU_CAPABILITY`` caps ATen's), and ``load_variant(name)`` returns any variant this CPU runs,
for tests and benchmarks.

Fallback: when that module is missing or does not import (installed without torch or a compiler at
build time, or built for another torch), or was built from other sources than the package's ``csrc/``
(``isa.sources_digest``: an editable install not rebuilt since a kernel file changed), the chosen
variant alone is compiled on first use from the same files (shipped in the package) with the same
flags, through ``torch.utils.cpp_extension.load``, into ``~/.cache/vllite/torch_extensions``
(``VLLITE_CACHE_ROOT`` or ``XDG_CACHE_HOME`` move it); the build is keyed by the sources, the flags,
torch's and Python's versions and the environment (``sys.prefix``), so a later start only loads it
and two environments never rebuild each other's.
``VLLITE_CPU_ATTENTION_KERNEL=0`` turns the kernels off; with neither module nor compiler the backend
falls back to torch ops (``available()`` is False and says why in ``error()``).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import logging
import os
import re
import sys
import threading
import time
from typing import Any

import torch

from vllite_platform_cpu import isa

logger = logging.getLogger("vllite.platforms.cpu.kernels")

# Every variant's functions (bindings.cpp): an installed module lacking one was built from older sources
# (an editable install not rebuilt since), so the first-use build from these sources takes its place.
ENTRY_POINTS = ("paged_attention", "avx2_gemm_available", "avx2_gemm_dtypes", "avx2_gemm_pack", "avx2_gemm",
                "avx2_gemm_gelu", "small_linear", "rms_norm", "add_rms_norm", "silu_and_mul", "rotary",
                "quantize_rows_int8", "dequantize_int32", "encoder_attention", "add_layer_norm", "gguf_linear_x8",
                "lora_add", "paged_attention_store", "llama_decoder_layer", "llama_decoder_stack",
                "bf16_gemm_available", "bf16_gemm_pack", "bf16_gemm", "bf16_gemm_silu", "int8_gemm_available",
                "int8_gemm_pack", "int8_gemm", "int8_gemm_silu", "argmax_rows", "amx_available", "set_amx",
                "decoder_split_step", "int4_linear", "int4_linear_q8", "moe_experts", "fp8_linear",
                "fp8_linear_act", "gguf_rows", "gguf_repack_kquant")
KERNEL_ENV = "VLLITE_CPU_ATTENTION_KERNEL"  # 0: no C++ kernels (torch ops)
ISA_ENV = "VLLITE_CPU_ISA"  # the highest variant to use: default, avx2, avx512 or avx512_bf16

_lock = threading.RLock()
_module: Any = None
_error: str | None = None
_tried = False
_variant: str | None = None  # the variant load() chose
_origin: str | None = None  # "installed" (the module built at install time) or "jit" (built on first use)
_variant_modules: dict[str, Any] = {}  # load_variant()'s, by name
_installed_state: tuple[Any, str | None] | None = None  # (module or None, why not)


def cache_root() -> str:
    root = os.environ.get("VLLITE_CACHE_ROOT")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllite")
    return root


def csrc_dir() -> str:
    """The C++ sources, inside the package (also in a non-editable install)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _short(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def _installed() -> tuple[Any, str | None]:
    """The extension module built at install time, or None and why not."""
    global _installed_state
    if _installed_state is None:
        try:
            mod = importlib.import_module("vllite_platform_cpu._C")
            built_for = getattr(mod, "torch_version", None)  # major.minor.patch of the headers it was built with
            running = re.match(r"\d+\.\d+\.\d+", torch.__version__)
            running = running.group(0) if running else torch.__version__
            if built_for and built_for != running:
                raise ImportError(f"built for torch {built_for}, this is torch {running}: reinstall platforms/cpu")
            if getattr(mod, "sources_digest", None) != isa.sources_digest(csrc_dir()):
                raise ImportError("built from other sources than the package's csrc/: reinstall platforms/cpu")
            missing = sorted({f for v in mod.variants for f in ENTRY_POINTS if not hasattr(getattr(mod, v), f)})
            if missing:
                raise ImportError(f"built from older sources (no {', '.join(missing)}): reinstall platforms/cpu")
            _installed_state = (mod, None)
        except Exception as e:  # noqa: BLE001 - missing, or an ABI mismatch (undefined symbol...)
            _installed_state = (None, _short(e))
    return _installed_state


def host_features() -> set[str]:
    """The CPU features the variants need that this CPU and OS support (names as in /proc/cpuinfo): the
    installed module's CPUID check, else ``platform.cpu_flags()``."""
    mod, _ = _installed()
    if mod is not None:
        return set(mod.cpu_features())
    from vllite_platform_cpu.platform import cpu_flags

    return cpu_flags()


def _built_variants() -> tuple[str, ...]:
    """The variants that can be had here: the installed module's, else every one of this architecture."""
    mod, _ = _installed()
    if mod is not None:
        return tuple(mod.variants)
    return tuple(v.name for v in isa.variants())


def host_variants() -> list[str]:
    """The variants this CPU runs (of the installed module's, or of those a first-use build makes), lowest
    first."""
    features = host_features()
    return [name for name in _built_variants() if isa.runs_on(name, features)]


def _isa_cap() -> str | None:
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if not raw or raw in ("native", "auto", "best"):
        return None
    if raw not in isa.NAMES:
        logger.warning("%s=%s is not a CPU kernel variant (%s); ignored", ISA_ENV, raw, ", ".join(isa.NAMES))
        return None
    return raw


def _build_name(v: isa.Variant) -> str:
    """The first-use build's name (and folder): what it is built from, where from, and for which environment.
    The source folder is part of it because torch's build file names the sources by path: two checkouts
    with equal sources sharing one folder would each rewrite it and recompile on every start."""
    parts = [v.name, *isa.variant_flags(v), *isa.LINK_FLAGS, torch.__version__, sys.version, sys.prefix,
             os.path.realpath(csrc_dir()), isa.sources_digest(csrc_dir())]
    return f"vllite_cpu_{v.name}_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


class _build_owner:
    """Hold an OS file lock on the build folder while building. torch's own ``lock`` file outlives a killed
    build and makes every later start wait on it forever, silently; the OS lock dies with its process, so
    whoever holds it knows a ``lock`` file it finds is stale and removes it. Builds in other processes
    still go one at a time (the later one waits here, then finds the module built)."""

    def __init__(self, build_dir: str) -> None:
        self.path = os.path.join(build_dir, "vllite-build.flock")
        self.fh: Any = None

    def __enter__(self) -> None:
        self.fh = open(self.path, "w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        stale = os.path.join(os.path.dirname(self.path), "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a cpu kernels build that was killed", stale)
            os.remove(stale)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def _jit_build(name: str) -> Any:
    """Compile one variant on first use (the fallback): a module with that variant's submodule."""
    from torch.utils import cpp_extension

    v = isa.get(name)
    # A ninja installed in this venv (requirements.txt) is found even when the venv is not on PATH.
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    build_name = _build_name(v)
    build_dir = os.path.join(cache_root(), "torch_extensions", build_name)
    os.makedirs(build_dir, exist_ok=True)
    t0 = time.perf_counter()
    src = csrc_dir()
    with _build_owner(build_dir):
        mod = cpp_extension.load(
            name=build_name, sources=[os.path.join(src, f) for f in (isa.BINDINGS_SOURCE, *isa.KERNEL_SOURCES)],
            build_directory=build_dir, extra_include_paths=[src],
            extra_cflags=[*isa.variant_flags(v), f"-DVLLITE_CPU_WITH_{v.namespace}"],
            extra_ldflags=list(isa.LINK_FLAGS), verbose=False, with_cuda=False)
    logger.info("cpu kernels (%s) built in %.1fs (%s)", name, time.perf_counter() - t0, build_dir)
    return getattr(mod, name)


def _variant_module(name: str) -> tuple[Any, str]:
    """One variant's kernels and where they come from; the caller checked that this CPU runs it."""
    mod, _ = _installed()
    if mod is not None and name in mod.variants:
        return getattr(mod, name), "installed"
    return _jit_build(name), "jit"


def load() -> Any:
    """The kernels of the best variant for this CPU (a module), building them on first use when the
    package was installed without them; None (and ``error()`` says why) when they cannot be had."""
    global _module, _error, _tried, _variant, _origin
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get(KERNEL_ENV, "1") == "0":
            _error = f"disabled by {KERNEL_ENV}=0"
            return None
        try:
            installed, why_not = _installed()
            if installed is None:
                logger.warning("cpu kernels: the installed extension is unavailable (%s); building them for this "
                               "CPU (once per environment)", why_not)
            cap = _isa_cap()
            runnable = [n for n in host_variants() if cap is None or isa.rank(n) <= isa.rank(cap)]
            if not runnable:
                raise RuntimeError(f"no CPU kernel variant of {_built_variants()} runs on this CPU"
                                   + (f" at {ISA_ENV}={cap}" if cap else ""))
            _variant = runnable[-1]
            _module, _origin = _variant_module(_variant)
            _variant_modules[_variant] = _module
            logger.info("cpu kernels: %s variant (%s)", _variant, _origin)
        except Exception as e:  # noqa: BLE001 - no compiler, no headers...: fall back to torch ops
            _module = None
            _error = _short(e)
            logger.warning("cpu paged-attention kernel unavailable, using torch ops: %s", _error)
        return _module


def load_variant(name: str) -> Any:
    """The kernels of one variant (``isa.NAMES``) whatever ``load()`` chose, for tests and benchmarks;
    ValueError when this CPU cannot run it."""
    v = isa.get(name)
    with _lock:
        if name not in _variant_modules:
            features = host_features()
            if not isa.runs_on(name, features):
                missing = sorted(set(v.requires) - features)
                raise ValueError(f"this CPU cannot run the {name} CPU kernels (lacks {', '.join(missing)})")
            _variant_modules[name] = _variant_module(name)[0]
        return _variant_modules[name]


def variant() -> str | None:
    """The variant ``load()`` chose (None when the kernels are unavailable)."""
    load()
    return _variant


def origin() -> str | None:
    """Where ``load()``'s kernels come from: "installed" (built with the package) or "jit" (first use)."""
    load()
    return _origin


def available() -> bool:
    return load() is not None


def error() -> str | None:
    load()
    return _error


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    req_ids: torch.Tensor, scale: float, window: int = 0, k_scale: float = 1.0,
                    v_scale: float = 1.0, soft_cap: float = 0.0) -> None:
    """Write into ``out`` the attention of the query rows of requests ``req_ids`` (causal, each query row
    at the end of its request's ``seq_lens`` context, optional sliding ``window``; 0 = none). A float8
    cache (e4m3fn or e5m2, under a float32 or bfloat16 query) is read as stored value x ``k_scale`` /
    ``v_scale``. ``soft_cap`` > 0: each scaled score s is ``soft_cap * tanh(s / soft_cap)`` (Gemma 2)."""
    mod = load()
    assert mod is not None, error()
    mod.paged_attention(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids,
                        float(scale), int(window), float(k_scale), float(v_scale), float(soft_cap))


def paged_attention_store(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor, req_ids: torch.Tensor, scale: float,
                          window: int = 0, soft_cap: float = 0.0) -> None:
    """``paged_attention`` after storing ``key``/``value`` row t at cache slot ``slots[t]`` (int64; negative:
    not stored) of ``kv_cache`` ``[2, blocks, block_size, Hkv, D]`` in the query's dtype: one call per layer."""
    load().paged_attention_store(out, query, key, value, kv_cache, slots, block_table, seq_lens, query_start_loc,
                                 req_ids, float(scale), int(window), float(soft_cap))


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    load().rms_norm(out, x, weight, float(eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``."""
    load().add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    load().silu_and_mul(out, x)


def argmax_rows(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out[r] = x[r].argmax()`` (int64 out, x [rows, n] with unit column stride, float32/bf16/fp16)."""
    load().argmax_rows(out, x)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on ``q`` and ``k`` ([T, heads, D], rows may be strided); ``cos``/``sin`` are [T, D]."""
    load().rotary(q, k, cos, sin)


def small_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """float32 ``out = x @ weight.T + bias`` for a few rows, streaming the weight once."""
    load().small_linear(out, x, weight, bias)


def avx2_gemm_available() -> bool:
    """The AVX2/FMA float32 GEMM is in the chosen variant (avx2 and up)."""
    mod = load()
    return mod is not None and bool(mod.avx2_gemm_available())


def avx2_gemm_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes the AVX2 GEMM's panels hold (float32, and bfloat16/float16 widened in registers)."""
    mod = load()
    return tuple(getattr(torch, n) for n in mod.avx2_gemm_dtypes()) if mod is not None else ()


def avx2_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32, bfloat16 or float16 weight [N, K] as the GEMM's panels [ceil(N / 16), K, 16], same dtype."""
    return load().avx2_gemm_pack(weight)


def bf16_gemm_available() -> bool:
    """The AVX512-BF16 GEMM is in the chosen variant (avx512_bf16)."""
    mod = load()
    return mod is not None and bool(mod.bf16_gemm_available())


def set_amx(on: bool) -> bool:
    """Whether the bf16 and int8 GEMMs run on AMX tiles (csrc/amx.h) where the CPU and OS have them; returns the
    state now (False without AMX or without the kernels)."""
    mod = load()
    return mod is not None and bool(mod.set_amx(on))


def amx_available() -> bool:
    """AMX-TILE, AMX-BF16 and AMX-INT8 on this CPU, the OS's leave to use them, and kernels built for them."""
    mod = load()
    return mod is not None and bool(mod.amx_available())


def bf16_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] (K even) as the bf16 GEMM's panels [ceil(N / 32), K / 2, 32, 2]."""
    n, k = weight.shape
    out = torch.zeros(-(-n // 32), k // 2, 32, 2, dtype=torch.bfloat16)
    load().bf16_gemm_pack(out, weight.contiguous())
    return out


def bf16_gemm(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
    """bfloat16 ``out = x @ weight.T + bias`` (float32 sums and bias, rounded once) with the weight packed by
    ``bf16_gemm_pack``; x and out bfloat16, bias float32."""
    load().bf16_gemm(out, x, packed, bias)


def avx2_gemm(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
    """float32 ``out = x @ weight.T + bias`` with the weight packed by ``avx2_gemm_pack`` (16-bit panels are
    widened to float32 as they are read); x, out and bias float32."""
    load().avx2_gemm(out, x, packed, bias)


def avx2_gemm_gelu(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
    """float32 ``out = gelu(x @ weight.T + bias)`` (torch's exact GELU, applied to each tile as it is stored)."""
    load().avx2_gemm_gelu(out, x, packed, bias)


def encoder_attention(out: torch.Tensor, qkv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> None:
    """float32 bidirectional attention within each packed prompt: ``qkv`` [T, 3, H, D] -> ``out`` [T, H, D];
    ``cu_seqlens`` int64 [B + 1] on the host."""
    load().encoder_attention(out, qkv, cu_seqlens, scale)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> None:
    """float32 ``x = layer_norm(x + residual) * weight + bias``, in place in ``x``."""
    load().add_layer_norm(x, residual, weight, bias, eps)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, order: torch.Tensor,
             seg_slots: list[int], seg_starts: list[int], ranks: list[int]) -> None:
    """Multi-LoRA in place (``csrc/lora.cpp``): ``y[t] += x[t] @ lora_a[s, :r].T @ lora_b[s, :r]`` for the rows
    ``t`` in ``order[seg_starts[i]:seg_starts[i + 1]]`` of slot ``s = seg_slots[i]``, ``r = ranks[s]``."""
    load().lora_add(y, x, lora_a, lora_b, order, seg_slots, seg_starts, ranks)


def moe_experts(out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, p13: torch.Tensor, p2: torch.Tensor, ready: torch.Tensor) -> None:
    """A whole MoE layer's routed experts in one call (``csrc/moe.cpp``): ``out[t] = sum_j topk_weights[t, j] *
    w2[e] @ (silu(gate) * up)`` with ``e = topk_ids[t, j]``, on the AVX2 GEMM's panels. ``p13`` / ``p2`` are the
    experts' stacked panel buffers ([E, ceil(2I / 16), H, 16] and [E, ceil(H / 16), I, 16], x's dtype), packed from
    ``w13`` / ``w2`` the first time an expert is chosen (``ready`` uint8 [E] marks them)."""
    load().moe_experts(out, x, topk_ids, topk_weights, w13, w2, p13, p2, ready)


def quantize_rows_int8(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> None:
    """int8 ``q`` and float32 ``scale`` per row of ``x`` (model_registry.layers.quantization's rounding)."""
    load().quantize_rows_int8(q, scale, x)


def int8_gemm_available() -> bool:
    """Whether the chosen variant has the AVX512-VNNI int8 GEMM (``csrc/quant.cpp``)."""
    mod = load()
    return mod is not None and bool(mod.int8_gemm_available())


def int8_gemm_pack(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 weight [N, K] (K a multiple of 4) and its float32 scale per row as the int8 GEMM's panels."""
    n, k = qweight.shape
    out = torch.zeros((n + 31) // 32, k * 32 + 256, dtype=torch.int8)
    load().int8_gemm_pack(out, qweight.contiguous(), scale.float().contiguous())
    return out


def int8_gemm(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out = x @ W.T + bias`` in W8A8 (x quantized per row, exact int32 sums, both scales), W packed by
    ``int8_gemm_pack``; x and out float32 or bfloat16, bias float32."""
    load().int8_gemm(out, x, packed, bias)


def dequantize_int32(out: torch.Tensor, acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> None:
    """``out = acc * x_scale[:, None] * w_scale + bias`` (float32 math, one rounding to ``out``'s dtype)."""
    load().dequantize_int32(out, acc, x_scale, w_scale, bias)


# From this many rows on, the GGUF linear dequantises 16-column panels for the float32 GEMM (AVX2 variants) instead of
# quantizing the input to int8, so a prompt's rows (prefill) are not rounded: on the engine prompts of
# tests/models/test_quantization_gguf.py, greedy tokens agree with the float32 engine's for 89 of 96 with 12 here, 61
# of 96 with 64. Speed alone would say 64: with 8 rows' blocks interleaved the int8 path is the faster one up to 64
# rows on this AVX2 host (benchmarks/gguf_linear_bw.py, all linears of a step, one thread, CPU ms, int8 / panels: 24 /
# 61 at 8 rows, 65 / 91 at 16, 90 / 127 at 32, 179 / 224 at 64).
GGUF_GEMM_MIN_ROWS = 12
# The int8 path splits a call over threads only above this many bytes of blocks (times 4-row tiles): waking a
# sleeping thread costs about what it saves on a small layer (qkv 0.35 MB, o 0.2, down 0.55 stay on one thread;
# gate_up 1.1 and the head 30 MB split). Measured at 2 threads on a loaded 2-core host (benchmarks/gguf_linear_bw.py,
# wall ms of a step's linears): 9.35 at 1 MiB, 9.9-11.4 at 64 and 256 KiB, 11.0 never split; noisy. Inside
# llama_decoder_stack's thread team (decode steps, csrc/team.h) a split costs little and every call splits.
GGUF_GRAIN_BYTES = 1 << 20


def int4_linear(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, zero: int, group: int) -> None:
    """``out = x @ W.T`` (float32) from a 4-bit ``QuantWeight``'s codes (two a byte), scales and zero points (or one
    symmetric ``zero``), groups of ``group`` columns (csrc/wna16.cpp)."""
    load().int4_linear(out, x, codes, scales, zeros, int(zero), int(group))


def int4_linear_q8(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, zero: int, group: int) -> None:
    """``int4_linear`` with the activations quantized to int8 per row first (dynamic, amax / 127) and int4 x int8
    dot products (csrc/wna16.cpp): ``group`` a multiple of 32, K of 64."""
    load().int4_linear_q8(out, x, codes, scales, zeros, int(zero), int(group))


def fp8_linear(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> None:
    """``out = x @ W.T`` (float32) from float8 e4m3 weight codes [N, K] widened in registers, each ``group`` columns
    of a row scaled by ``scales`` [N, ceil(K / group)] (csrc/fp8_linear.cpp)."""
    load().fp8_linear(out, x, codes, scales, int(group))


def fp8_linear_act(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
                   act_mode: int, act_group: int, act_scale: float) -> None:
    """``fp8_linear`` with the activations quantized to fp8 first as ``quant_weight.fake_quant`` does: ``act_mode``
    0 none, 1 per token, 2 per token and ``act_group`` columns, 3 one static ``act_scale``."""
    load().fp8_linear_act(out, x, codes, scales, int(group), int(act_mode), int(act_group), float(act_scale))


def gguf_rows(out: torch.Tensor, ids: torch.Tensor, type_id: int, blocks: torch.Tensor) -> None:
    """``out [T, K]`` (float32 or bfloat16) = rows ``ids`` (int64 [T]) of the weight given by GGUF blocks (as
    ``gguf_linear``'s): an embedding table kept as blocks, each value the dequantised load's (csrc/gguf.cpp)."""
    load().gguf_rows(out, ids, int(type_id), blocks)


def gguf_repack_kquant(out: torch.Tensor, raw: torch.Tensor, type_id: int) -> None:
    """``out`` (uint8 zeros [ceil(N / 8), super-blocks * record]) = GGUF K-quant blocks ``raw`` (uint8 [N,
    super-blocks * block bytes]) as ``GGUFWeight`` records (csrc/gguf.cpp; kquants.py's numpy repack byte for
    byte)."""
    load().gguf_repack_kquant(out, raw, int(type_id))


def gguf_linear(out: torch.Tensor, x: torch.Tensor, type_id: int, blocks: torch.Tensor, bias: torch.Tensor | None,
                gemm_min_rows: int | None = None, grain_bytes: int | None = None) -> None:
    """``out = x @ W.T + bias`` (``x`` and ``out`` both float32 or both bfloat16, float32 bias) from GGUF blocks
    (``model_registry.layers.quantization.gguf.GGUFWeight.blocks``, 8 rows interleaved; ``type_id`` ggml's: Q4_0 2,
    Q4_1 3, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14): below ``gemm_min_rows`` rows ``x`` quantized per 32-block to int8
    and integer dot products, from there dequantised panels and the float32 GEMM, or for bfloat16 on AVX512-BF16
    bfloat16 panels and the bf16 GEMM (csrc/gguf.cpp)."""
    rows = GGUF_GEMM_MIN_ROWS if gemm_min_rows is None else gemm_min_rows
    grain = GGUF_GRAIN_BYTES if grain_bytes is None else grain_bytes
    load().gguf_linear_x8(out, x, int(type_id), blocks, bias, int(rows), int(grain))
