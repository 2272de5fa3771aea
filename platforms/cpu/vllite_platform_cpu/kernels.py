"""Small C++ kernels for the CPU (paged attention of ``attention_src.py``, the AVX2 float32 GEMM of
``gemm_src.py`` and the fused pointwise ops of ``pointwise_src.py``), built on first use and cached.

``paged_attention`` computes attention for the query rows of selected requests
straight from the paged KV cache: no gathered copy of the context (the torch-ops
path copies every context block twice per layer, which dominates a decode step
at batch 64). Work is split over (request, 16-row query tile) tasks, each with
all KV heads (whole cache rows) or, when there are too few tiles to busy the
threads, one KV head each; the ``H / Hkv`` query heads that share a KV head read
each key/value row once per tile, as stored (bfloat16 keys go through AVX512-BF16
dot products where the CPU has them). A one-row tile (a decode token) takes a
streaming path instead: positions in order, each one's rows of the task's KV heads
read once for all their query heads, rows ahead prefetched. Scores and sums are float32 whatever the
cache dtype (float32, bfloat16, float16); softmax is online across key chunks.

The extension is compiled with the host compiler (``-O3 -march=native``) through
``torch.utils.cpp_extension.load_inline`` into ``~/.cache/vllite/torch_extensions``
(``VLLITE_CACHE_ROOT`` or ``XDG_CACHE_HOME`` move it); the build is keyed by the
source, torch's version and the CPU's flags, so a later start only loads it.
``VLLITE_CPU_ATTENTION_KERNEL=0`` turns it off; without a compiler the backend
falls back to torch ops (``available()`` is False and says why in ``error()``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from typing import Any

import torch

from vllite_platform_cpu import attention_src, gemm_src, pointwise_src

logger = logging.getLogger("vllite.platforms.cpu.kernels")

_lock = threading.Lock()
_module: Any = None
_error: str | None = None
_tried = False


def cache_root() -> str:
    root = os.environ.get("VLLITE_CACHE_ROOT")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllite")
    return root


def _build_name() -> str:
    from vllite_platform_cpu.platform import cpu_flags

    key = "|".join([attention_src.SOURCE, gemm_src.SOURCE, gemm_src.BINDINGS, pointwise_src.SOURCE, pointwise_src.BINDINGS,
                    torch.__version__, " ".join(sorted(cpu_flags())), sys.version])
    return "vllite_cpu_paged_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _vec_flags() -> list[str]:
    """Which of ATen's vector implementations (``at::vec::Vectorized``) to compile against."""
    from vllite_platform_cpu.platform import cpu_flags

    flags = set(cpu_flags())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def load() -> Any:
    """The compiled module, building it on first use; None (and ``error()`` says why) when it cannot be."""
    global _module, _error, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("VLLITE_CPU_ATTENTION_KERNEL", "1") == "0":
            _error = "disabled by VLLITE_CPU_ATTENTION_KERNEL=0"
            return None
        try:
            from torch.utils import cpp_extension

            # A ninja installed in this venv (requirements.txt) is found even when the venv is not on PATH.
            bindir = os.path.dirname(sys.executable)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
            name = _build_name()
            build_dir = os.path.join(cache_root(), "torch_extensions", name)
            os.makedirs(build_dir, exist_ok=True)
            import time

            t0 = time.perf_counter()
            _module = cpp_extension.load_inline(
                name=name, cpp_sources=[attention_src.SOURCE + gemm_src.SOURCE + pointwise_src.SOURCE
                                        + "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {"
                                        " m.def(\"paged_attention\", &paged_attention); "
                                        + gemm_src.BINDINGS + pointwise_src.BINDINGS + " }\n"],
                build_directory=build_dir,
                # -fopenmp: at::parallel_for is OpenMP inline code; without it every kernel ran on one
                # thread. libgomp resolves to the copy torch already loaded (same soname).
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-DNDEBUG", *_vec_flags()],
                extra_ldflags=["-fopenmp"],
                verbose=False, with_cuda=False)
            logger.info("cpu paged-attention kernel ready in %.1fs (%s)", time.perf_counter() - t0, build_dir)
        except Exception as e:  # noqa: BLE001 - no compiler, no headers...: fall back to torch ops
            _module = None
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            logger.warning("cpu paged-attention kernel unavailable, using torch ops: %s", _error)
        return _module


def available() -> bool:
    return load() is not None


def error() -> str | None:
    load()
    return _error


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    req_ids: torch.Tensor, scale: float, window: int = 0) -> None:
    """Write into ``out`` the attention of the query rows of requests ``req_ids`` (causal, each query row
    at the end of its request's ``seq_lens`` context, optional sliding ``window``; 0 = none)."""
    mod = load()
    assert mod is not None, error()
    mod.paged_attention(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids,
                        float(scale), int(window))


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    load().rms_norm(out, x, weight, float(eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``."""
    load().add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    load().silu_and_mul(out, x)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on ``q`` and ``k`` ([T, heads, D], rows may be strided); ``cos``/``sin`` are [T, D]."""
    load().rotary(q, k, cos, sin)


def small_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """float32 ``out = x @ weight.T + bias`` for a few rows, streaming the weight once."""
    load().small_linear(out, x, weight, bias)


def avx2_gemm_available() -> bool:
    """The AVX2/FMA float32 GEMM was compiled in (the host compiler targets a CPU with both)."""
    mod = load()
    return mod is not None and bool(mod.avx2_gemm_available())


def avx2_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] as the GEMM's panels [ceil(N / 16), K, 16]."""
    return load().avx2_gemm_pack(weight)


def avx2_gemm(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
    """float32 ``out = x @ weight.T + bias`` with the weight packed by ``avx2_gemm_pack``."""
    load().avx2_gemm(out, x, packed, bias)
