"""Small C++ kernels for the CPU (paged attention, and the fused pointwise ops of
``pointwise_src.py``), built on first use and cached.

``paged_attention`` computes attention for the query rows of selected requests
straight from the paged KV cache: no gathered copy of the context (the torch-ops
path copies every context block twice per layer, which dominates a decode step
at batch 64). Work is split over (request, KV head) pairs with ``at::parallel_for``;
the ``H / Hkv`` query heads that share a KV head read each key/value row once.
Scores and sums are float32 whatever the cache dtype (float32, bfloat16, float16).

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

from vllite_platform_cpu import pointwise_src

logger = logging.getLogger("vllite.platforms.cpu.kernels")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// dot(q, k) over D floats with 8 independent partial sums: vectorises (one 8-lane FMA per step) without
// -ffast-math, and keeps the summation order fixed.
template <typename scalar_t, int DC>
static inline float dot(const float* q, const scalar_t* k, int64_t D) {
  const int64_t n = DC > 0 ? DC : D;
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += q[d + j] * to_f(k[d + j]);
  float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; d < n; ++d) s += q[d] * to_f(k[d]);
  return s;
}

template <typename scalar_t, int DC>
static inline void axpy(float* acc, float w, const scalar_t* v, int64_t D) {
  const int64_t n = DC > 0 ? DC : D;
  for (int64_t d = 0; d < n; ++d) acc[d] += w * to_f(v[d]);
}

// sg[j] = exp(sg[j] - m), eight or sixteen lanes at a time (ATen's vectorised exp; scalar exp took a
// fifth of a batch-64 decode step).
static inline void softmax_exp(float* sg, int64_t n, float m) {
  using fVec = at::vec::Vectorized<float>;
  const fVec mv(m);
  for (int64_t j = 0; j < n; j += fVec::size()) {
    const int64_t c = std::min<int64_t>(fVec::size(), n - j);
    (fVec::loadu(sg + j, c) - mv).exp().store(sg + j, c);
  }
}

template <typename scalar_t, int DC>
static void run(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                const torch::Tensor& value_cache, const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                const torch::Tensor& query_start_loc, const torch::Tensor& req_ids, double scale, int64_t window) {
  const int64_t R = req_ids.size(0);
  const int64_t H = query.size(1), D = DC > 0 ? DC : query.size(2);
  const int64_t BS = key_cache.size(1), HKV = key_cache.size(2);
  const int64_t G = H / HKV;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* rid = req_ids.data_ptr<int32_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1), vs2 = value_cache.stride(2);
  const int64_t bts = block_table.stride(0);
  const float sc = static_cast<float>(scale);

  // Tasks: (request, KV head, block of up to 16 query rows), so a prefill spreads over the threads too.
  constexpr int64_t ROWS = 16;
  std::vector<int64_t> task_item, task_row;
  int64_t work = 0;  // query rows x keys x heads: a batch-1 decode is not worth waking a second thread
  for (int64_t j = 0; j < R; ++j) {
    const int64_t r = rid[j];
    const int64_t qlen = qsl[r + 1] - qsl[r];
    work += qlen * sl[r] * H;
    for (int64_t kh = 0; kh < HKV; ++kh)
      for (int64_t i0 = 0; i0 < qlen; i0 += ROWS) { task_item.push_back(j * HKV + kh); task_row.push_back(i0); }
  }
  const int64_t ntasks = static_cast<int64_t>(task_item.size());
  at::parallel_for(0, ntasks, work < 32768 ? std::max<int64_t>(ntasks, 1) : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, mx(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task_item[task];
      const int64_t r = rid[item / HKV];
      const int64_t kh = item % HKV;
      const int64_t L = sl[r];
      const int64_t q0 = qsl[r], q1 = qsl[r + 1];
      const int64_t qlen = q1 - q0;
      const int32_t* row_blocks = bt + r * bts;
      const int64_t i_end = std::min<int64_t>(qlen, task_row[task] + ROWS);
      for (int64_t i = task_row[task]; i < i_end; ++i) {
        const int64_t p = L - qlen + i;  // position of this query row
        const int64_t t0 = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
        const int64_t n = p - t0 + 1;
        if (n <= 0) continue;
        scores.resize(G * n);
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* qp = q + (q0 + i) * qs0 + (kh * G + g) * qs1;
          for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(qp[d]) * sc;
          mx[g] = -INFINITY;
        }
        // Context rows t0..p of this KV head, block by block (no division per position).
        auto for_each_row = [&](const scalar_t* cache, int64_t s0, int64_t s1, int64_t s2, auto&& fn) {
          for (int64_t t = t0; t <= p;) {
            const int64_t stop = std::min<int64_t>(p + 1, t - t % BS + BS);
            const scalar_t* base = cache + row_blocks[t / BS] * s0 + kh * s2;
            for (; t < stop; ++t) fn(t - t0, base + (t % BS) * s1);
          }
        };
        for_each_row(kc, ks0, ks1, ks2, [&](int64_t j, const scalar_t* kp) {
          for (int64_t g = 0; g < G; ++g) {
            const float s = dot<scalar_t, DC>(qf.data() + g * D, kp, D);
            scores[g * n + j] = s;
            mx[g] = std::max(mx[g], s);
          }
        });
        for (int64_t g = 0; g < G; ++g) {
          float total = 0.f;
          float* sg = scores.data() + g * n;
          const float m = mx[g];
          softmax_exp(sg, n, m);
          for (int64_t j = 0; j < n; ++j) total += sg[j];
          const float inv = 1.f / total;
          for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
          std::fill(acc.begin() + g * D, acc.begin() + (g + 1) * D, 0.f);
        }
        for_each_row(vc, vs0, vs1, vs2, [&](int64_t j, const scalar_t* vp) {
          for (int64_t g = 0; g < G; ++g) axpy<scalar_t, DC>(acc.data() + g * D, scores[g * n + j], vp, D);
        });
        for (int64_t g = 0; g < G; ++g) {
          scalar_t* op = o + (q0 + i) * os0 + (kh * G + g) * os1;
          for (int64_t d = 0; d < D; ++d) op[d] = static_cast<scalar_t>(acc[g * D + d]);
        }
      }
    }
  });
}

void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                     torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                     torch::Tensor req_ids, double scale, int64_t window) {
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type()
              && out.scalar_type() == query.scalar_type(), "paged_attention: query, cache and out must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "paged_attention: head dimension must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32
              && query_start_loc.scalar_type() == torch::kInt32 && req_ids.scalar_type() == torch::kInt32,
              "paged_attention: index tensors must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous()
              && req_ids.is_contiguous(), "paged_attention: index tensors must be contiguous");
  const int64_t D = query.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, query.scalar_type(),
                                  "paged_attention", [&] {
    if (D == 64)
      run<scalar_t, 64>(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids, scale,
                        window);
    else if (D == 128)
      run<scalar_t, 128>(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids, scale,
                         window);
    else
      run<scalar_t, 0>(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids, scale,
                       window);
  });
}
"""

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

    key = "|".join([_SOURCE, pointwise_src.SOURCE, pointwise_src.BINDINGS, torch.__version__, " ".join(sorted(cpu_flags())), sys.version])
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
                name=name, cpp_sources=[_SOURCE + pointwise_src.SOURCE
                                        + "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {"
                                        " m.def(\"paged_attention\", &paged_attention); "
                                        + pointwise_src.BINDINGS + " }\n"],
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
