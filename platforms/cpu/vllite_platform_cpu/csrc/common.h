// What every kernel translation unit (attention.cpp, gemm.cpp, pointwise.cpp) includes first.
//
// Each of them is compiled once per ISA variant (vllite_platform_cpu/isa.py lists the variants and their
// flags) into the one extension module: the build defines VLLITE_CPU_ISA, the variant's namespace
// (isa_default, isa_avx2, isa_avx512, isa_avx512_bf16), and CPU_CAPABILITY / CPU_CAPABILITY_AVX2 /
// CPU_CAPABILITY_AVX512, which pick ATen's at::vec::Vectorized implementation (itself in an inline
// namespace named after CPU_CAPABILITY). So no function of one variant can stand in for another's at
// link time. bindings.cpp (kernels.h) declares every variant's entry points.
#pragma once

#ifndef VLLITE_CPU_ISA
#error "VLLITE_CPU_ISA (the ISA variant's namespace, e.g. isa_avx2) must be defined by the build"
#endif

// ATen's core headers only, so the kernels name at::Tensor, at::zeros, at::kInt (the string build's
// torch::Tensor, torch::zeros, torch::kInt32 are the same entities): <torch/extension.h> or <torch/types.h>
// (pybind11, Python, the autograd API) doubled the time to compile a translation unit, and there are a
// dozen of them. bindings.cpp includes <torch/python.h>.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/zeros.h>

#include <optional>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <type_traits>

#include "kernels.h"

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

using AVec = at::vec::Vectorized<float>;
constexpr int64_t VL = AVec::size();  // 16 float lanes with AVX-512, 8 with AVX2

template <typename T>
static inline AVec avec_load(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return AVec::loadu(p);
  } else {
    AVec v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

// A GEMM's optional float32 bias of n values (contiguous; checked): its data, or nullptr without one.
static inline const float* float_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* what) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == at::kFloat, what,
              ": bias must be float32 [N], contiguous");
  return bias->data_ptr<float>();
}

#if defined(__AVX512F__)
// A 32-column GEMM tile's edge: its two 16-lane masks (the first ncols columns live) and its float32 bias
// (zeros without one, or past ncols), for the bf16 and int8 GEMMs' epilogues.
struct TileEdge32 {
  __mmask16 m0, m1;
  __m512 b0, b1;
};
static inline TileEdge32 tile_edge32(int64_t ncols, const float* bias) {
  TileEdge32 e;
  e.m0 = ncols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  e.m1 = ncols >= 32 ? __mmask16(0xFFFF) : ncols <= 16 ? __mmask16(0) : __mmask16((1u << (ncols - 16)) - 1);
  e.b0 = bias ? _mm512_maskz_loadu_ps(e.m0, bias) : _mm512_setzero_ps();
  e.b1 = bias ? _mm512_maskz_loadu_ps(e.m1, bias + 16) : _mm512_setzero_ps();
  return e;
}

// 16 float32 values rounded to bfloat16 as c10 rounds finite values (to nearest, ties to even), the result in the
// high 16 bits of each 32-bit lane (the low 16 not cleared): shift right by 16 for the bfloat16 bits.
static inline __m512i bf16_round_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

// Two cache lines (128 bytes: one k step of a 32-column panel, int8 or bfloat16) fetched into L2.
static inline void prefetch_l2_128(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  _mm_prefetch(static_cast<const char*>(p) + 64, _MM_HINT_T1);
}

// Whether a GEMM's first tile of each panel fetches the next panel as it goes: where M rows are one task of
// several tiles (a thread then works through consecutive panels, each read from memory by its first tile and
// from cache by the rest). At 32 rows a thread (llama_decoder_stack's split by requests) ran its first tiles
// 10-20% slower than the others without it; at one tile per panel the hardware prefetcher streams the panels.
static inline bool next_panel_tiles(int64_t M, int64_t MR, int64_t MC) { return M > MR && M <= MC; }

// The same rounding, packed: the 16 bfloat16 bit patterns, for a store.
static inline __m256i bf16_pack16(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_high(v), 16)); }
#endif

#if defined(__AVX2__)
// The sum of a vector's 8 float32 lanes ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)): the int4 and fp8 weight kernels'
// reduction of a row's float accumulator (wna16.cpp, fp8_linear.cpp).
static inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

// silu_and_mul's bfloat16 arithmetic on a tile's rounded gate and up rows (pointwise.cpp), for the gate_up GEMMs'
// fused epilogues (bf16_gemm_silu, int8_gemm_silu).
void silu_mul_bf16_rows(const c10::BFloat16* g, const c10::BFloat16* u, int64_t ld, c10::BFloat16* out, int64_t ldo,
                        int64_t rows, int64_t n);

// f(std::integral_constant<int, r>{}) for the runtime r = rows in [1, MAX]: a GEMM tile's (or a group's) height
// as a template argument, so that its accumulators are a fixed-size array the compiler keeps in registers.
template <int MAX, typename F>
static inline void with_height(int64_t rows, const F& f) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return with_height<MAX - 1>(rows, f);
  }
  f(std::integral_constant<int, MAX>{});
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
