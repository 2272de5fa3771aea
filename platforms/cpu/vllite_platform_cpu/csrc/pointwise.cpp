// The fused pointwise ops of a decoder layer (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary
// embedding), the sampler's row argmax and a matrix-vector linear for a few rows, compiled once per ISA variant beside paged attention.
//
// Why: a SmolLM2 decode step runs ~15 small torch ops per layer (pow, mean, rsqrt, mul, cat, neg,
// silu...), each its own OpenMP region; on a 2-core host the wake-ups and extra passes over memory cost
// a quarter of a batch-64 step and most of a batch-1 step. One pass per op, parallel over rows only when
// a row block is big enough to pay for the threads.
//
// Numerics follow the torch code they replace: float32 math, exp from ATen's vectorised path (the one
// torch.nn.functional.silu uses), results rounded to the tensor's dtype where torch rounds them.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "team.h"

// No fused multiply-add contraction here: torch rounds each product of these formulas separately.
// (After every header: in the single-string build these functions came after the attention source,
// so the pragma never reached ATen's or the attention code's inline functions; it still does not.)
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

using at::vec::Vectorized;
using fVec = Vectorized<float>;

// Rows per parallel task: at least ~16K elements each, so small batches stay on one thread.
static inline int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

template <typename T>
static inline float sum_squares(const T* x, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) {
      const float v = static_cast<float>(x[d + j]);
      part[j] += v * v;
    }
  float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; d < n; ++d) {
    const float v = static_cast<float>(x[d]);
    s += v * v;
  }
  return s;
}

// Types with the vector paths below (float64 keeps the scalar loops).
template <typename T>
constexpr bool kVecT = std::is_same_v<T, float> || at::vec::is_reduced_floating_point_v<T>;

// bfloat16 rounding of VL float32 lanes, as c10 rounds (nearest even; a NaN becomes 0x7FC0): the bits of the
// rounded value with the low 16 zero. Integer ops on the float bits: ATen's conversion packs and unpacks pairs of
// vectors, and the vector loops below were no faster than the scalar ones through it.
#if defined(CPU_CAPABILITY_AVX512)
static inline __m512i bf16_round_bits(const fVec& v) {
  const __m512 f = v;
  const __m512i r = _mm512_and_si512(bf16_round_high(f), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc00000));
}
#elif defined(CPU_CAPABILITY_AVX2)
static inline __m256i bf16_round_bits(const fVec& v) {
  const __m256 f = v;
  const __m256i b = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb),
                                     _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}
#endif

// VL values rounded to T as static_cast<T> rounds them (nearest even), widened back; float32 unchanged.
template <typename T>
static inline fVec round_to(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return fVec(_mm512_castsi512_ps(bf16_round_bits(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return fVec(_mm256_castsi256_ps(bf16_round_bits(v)));
#endif
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// VL float32 values stored to p as T (rounded as static_cast<T> rounds them).
template <typename T>
static inline void store_as(T* p, const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_srli_epi32(bf16_round_bits(v), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
#endif
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, VL);
  }
}

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(T): transformers' order (normalise in float32, round, scale).
template <typename T>
static inline void rms_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t d = 0; d < n; ++d) {
    const T h = static_cast<T>(static_cast<float>(x[d]) * inv);
    out[d] = static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(h));
  }
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && x.stride(1) == 1 && out.stride(1) == 1
                  && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: bad shapes");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), os = out.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(op + r * os, xp + r * xs, wp, n, static_cast<float>(eps));
    });
  });
}

// residual += x (in T, as `residual + x` would round), then x = rms_norm(residual): both in place.
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && x.stride(1) == 1 && residual.stride(1) == 1
                  && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm: bad shapes");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* xr = xp + r * xs;
        scalar_t* rr = rp + r * rs;
        for (int64_t d = 0; d < n; ++d)
          rr[d] = static_cast<scalar_t>(static_cast<float>(rr[d]) + static_cast<float>(xr[d]));
        rms_row(xr, rr, wp, n, static_cast<float>(eps));
      }
    });
  });
}

// silu(g).to(T) * u over whole vectors of 16-bit values; returns how many were done. bfloat16 takes ATen's
// exp_u20 (a polynomial, inline; up to 20 float32 ulps against SLEEF's 1, out of line) and rounds by integer ops
// (round_to, store_as): 1.2x faster at 64 and 2,048 rows on Zen 4, and torch's silu bit for bit on 6.3M values
// (the variant test compares every whole vector). float16, 8x finer, keeps SLEEF's exp: exp_u20 moved 937 of
// 6.3M float16 results by one ulp.
template <typename T>
static inline int64_t silu_mul_16bit(const T* gr, const T* ur, T* orow, int64_t n) {
  int64_t d = 0;
  const fVec one(1.f);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; d + VL <= n; d += VL) {
      const fVec g = avec_load(gr + d);
      store_as(orow + d, round_to<T>(g / (one + g.neg().exp_u20())) * avec_load(ur + d));
    }
  } else if constexpr (at::vec::is_reduced_floating_point_v<T>) {
    using hVec = Vectorized<T>;
    for (; d + hVec::size() <= n; d += hVec::size()) {
      auto [g0, g1] = at::vec::convert_to_float<T>(hVec::loadu(gr + d));
      auto [u0, u1] = at::vec::convert_to_float<T>(hVec::loadu(ur + d));
      auto [s0, s1] = at::vec::convert_to_float<T>(
          at::vec::convert_from_float<T>(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp())));
      at::vec::convert_from_float<T>(s0 * u0, s1 * u1).store(orow + d);
    }
  }
  return d;
}

// silu_and_mul's bfloat16 arithmetic on `rows` rows of n values (a multiple of VL): out[r * ldo + d] =
// silu(g[r * ld + d]).to(bf16) * u[r * ld + d], bit for bit what silu_and_mul gives on the same values. For the
// gate_up GEMMs' fused epilogues (bf16_gemm_silu, int8_gemm_silu), which keep their rounded gate and up tile in L1.
void silu_mul_bf16_rows(const c10::BFloat16* g, const c10::BFloat16* u, int64_t ld, c10::BFloat16* out, int64_t ldo,
                        int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) silu_mul_16bit(g + r * ld, u + r * ld, out + r * ldo, n);
}

// out[:, :I] = silu(x[:, :I]).to(T) * x[:, I:]
void silu_and_mul(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(1) == 2 * out.size(1) && x.size(0) == out.size(0)
                  && x.stride(1) == 1 && out.stride(1) == 1,
              "silu_and_mul: bad shapes");
  const int64_t rows = x.size(0), n = out.size(1), xs = x.stride(0), os = out.stride(0);
  constexpr int64_t V = fVec::size();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t b, int64_t e) {
      float g[V], u[V];
      const fVec one(1.f);
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* gr = xp + r * xs;
        const scalar_t* ur = gr + n;
        scalar_t* orow = op + r * os;
        int64_t d = 0;
        if constexpr (std::is_same_v<scalar_t, float>) {  // whole vectors straight from memory
          for (; d + V <= n; d += V) {
            const fVec gv = fVec::loadu(gr + d);
            ((gv / (one + gv.neg().exp())) * fVec::loadu(ur + d)).store(orow + d);
          }
        } else {
          d = silu_mul_16bit(gr, ur, orow, n);
        }
        for (; d < n; d += V) {
          const int64_t m = std::min<int64_t>(V, n - d);
          for (int64_t j = 0; j < m; ++j) {
            g[j] = static_cast<float>(gr[d + j]);
            u[j] = static_cast<float>(ur[d + j]);
          }
          const fVec gv = fVec::loadu(g, m);
          (gv / (one + gv.neg().exp())).store(g, m);
          for (int64_t j = 0; j < m; ++j)
            orow[d + j] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(g[j])) * u[j]);
        }
      }
    });
  });
}

// rotary_one's rows for a head of NV whole vectors: each head in registers (its cos and sin rows widened once
// per row), the same products and roundings as the scalar loop; a head's values went through memory before, and
// the loop ran at ~2.4 cycles per value.
template <typename T, int NV>
static void rotary_rows(T* xp, int64_t rows, int64_t heads, int64_t s0, int64_t s1, const T* c, const T* s, int64_t cs) {
  at::parallel_for(0, rows, row_grain(heads * NV * VL), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      fVec cv[NV], sv[NV];
      for (int i = 0; i < NV; ++i) {
        cv[i] = avec_load(c + r * cs + i * VL);
        sv[i] = avec_load(s + r * cs + i * VL);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + r * s0 + h * s1;
        fVec x[NV];
        for (int i = 0; i < NV; ++i) x[i] = avec_load(v + i * VL);
        for (int i = 0; i < NV; ++i) {
          const fVec rot = i < NV / 2 ? x[i + NV / 2].neg() : x[i - NV / 2];
          store_as(v + i * VL, round_to<T>(x[i] * cv[i]) + round_to<T>(rot * sv[i]));
        }
      }
    }
  });
}

// In place on x [T, heads, D] (rows may be strided views of a fused qkv output):
// x = x * cos + rotate_half(x) * sin, with cos/sin [T, D] (the HF/NeoX layout), each product rounded to T.
template <typename T>
static void rotary_one(at::Tensor& x, const T* c, const T* s, int64_t cs) {
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  if constexpr (kVecT<T>) {
    if (D == 4 * VL) return rotary_rows<T, 4>(xp, rows, heads, s0, s1, c, s, cs);
    if (D == 8 * VL) return rotary_rows<T, 8>(xp, rows, heads, s0, s1, c, s, cs);
  }
  at::parallel_for(0, rows, row_grain(heads * D), [&](int64_t b, int64_t e) {
    std::vector<float> tmp(D);
    for (int64_t r = b; r < e; ++r) {
      const T* cr = c + r * cs;
      const T* sr = s + r * cs;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + r * s0 + h * s1;
        for (int64_t d = 0; d < D; ++d) tmp[d] = static_cast<float>(v[d]);
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -tmp[d + half] : tmp[d - half];
          const T a = static_cast<T>(tmp[d] * static_cast<float>(cr[d]));
          const T bb = static_cast<T>(rot * static_cast<float>(sr[d]));
          v[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(bb));
        }
      }
    }
  });
}

void rotary(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.stride(2) == 1
                  && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "rotary: bad q/k");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) == q.size(2)
                  && cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0),
              "rotary: bad cos/sin");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "rotary", [&] {
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    rotary_one<scalar_t>(q, c, s, cos.stride(0));
    rotary_one<scalar_t>(k, c, s, cos.stride(0));
  });
}

// out[r] = x[r].argmax() as torch computes it: the first index of the row's largest value, a NaN counting as the
// largest (the first NaN wins). One pass: each lane keeps its largest value and where it was (only a strictly
// larger value replaces it, so a lane keeps its first), then the lanes' winners are compared, equal values
// going to the lower index. Positions are carried as float32 (exact below 2^24, checked). Why: torch's argmax
// reads ~2.4 GB/s here (1.3 ms of a batch-64 step over 49,152 logits), where a pass of its amax reads ~40.
template <typename T>
static int64_t argmax_row(const T* x, int64_t n) {
  int64_t d = 0, at = 0;
  float best = -INFINITY;
  if (n >= VL) {
    float lanes[VL], where[VL];
    for (int64_t i = 0; i < VL; ++i) where[i] = static_cast<float>(i);
    fVec mx(-INFINITY), idx = fVec::loadu(where), pos = idx, nan(0.f);
    const fVec step(static_cast<float>(VL));
    for (; d + VL <= n; d += VL) {
      const fVec v = avec_load(x + d);
      const fVec gt = v > mx;
      mx = fVec::blendv(mx, v, gt);
      idx = fVec::blendv(idx, pos, gt);
      nan = nan | v.isnan();
      pos = pos + step;
    }
    if (nan.zero_mask() != (1 << VL) - 1) {  // a NaN before d: the first one
      for (int64_t j = 0;; ++j)
        if (std::isnan(static_cast<float>(x[j]))) return j;
    }
    mx.store(lanes);
    idx.store(where);
    best = lanes[0];
    at = static_cast<int64_t>(where[0]);
    for (int64_t i = 1; i < VL; ++i) {
      const int64_t w = static_cast<int64_t>(where[i]);
      if (lanes[i] > best || (lanes[i] == best && w < at)) {
        best = lanes[i];
        at = w;
      }
    }
  }
  for (; d < n; ++d) {
    const float v = static_cast<float>(x[d]);
    if (std::isnan(v)) return d;
    if (v > best) {
      best = v;
      at = d;
    }
  }
  return at;
}

void argmax_rows(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 1 && out.size(0) == x.size(0) && out.is_contiguous()
                  && out.scalar_type() == at::kLong && x.size(1) > 0 && x.size(1) < (int64_t(1) << 24),
              "argmax_rows: x [rows, n] with unit column stride, 0 < n < 2^24; out int64 [rows]");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](const auto* xp) {
    at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * xs, n);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(x.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "argmax_rows: x must be float32, bfloat16 or float16");
  }
}

// out[M, N] = x[M, K] @ w[N, K]^T (+ bias) for a few rows (a decode of one or a few requests). The weight
// is streamed once, four rows at a time, each row block reused for every x row while it sits in L1: the
// product is bound by memory bandwidth, where MKL's GEMV reached half of what a plain read gets here.
// (avec_load, a float32/bf16/fp16 vector widened to float32: common.h, shared with attention.cpp.)

template <int R, typename W>
static inline void dot_rows(float* out, int64_t out_stride, const float* x, int64_t M, const W* w, int64_t K,
                            const float* bias) {
  constexpr int64_t V = fVec::size();
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    fVec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = fVec(0.f);
    int64_t k = 0;
    for (; k + V <= K; k += V) {
      const fVec xv = fVec::loadu(xm + k);
      for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(avec_load(w + r * K + k), xv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float lanes[V];
      acc[r].store(lanes);
      float s = 0.f;
      for (int64_t j = 0; j < V; ++j) s += lanes[j];
      for (int64_t kk = k; kk < K; ++kk) s += xm[kk] * static_cast<float>(w[r * K + kk]);
      out[m * out_stride + r] = bias ? s + bias[r] : s;
    }
  }
}

// x and out float32; the weight float32, bfloat16 or float16 (read as stored, widened in registers:
// a 16-bit weight streams half the bytes, and its products with float32 are exact).
void small_linear(at::Tensor out, at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.size(1) == w.size(1) && out.size(0) == x.size(0)
                  && out.size(1) == w.size(0) && x.is_contiguous() && w.is_contiguous() && out.is_contiguous()
                  && x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "small_linear: float32 contiguous x [M, K] and out [M, N], contiguous w [N, K]");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == w.size(0) && bias->scalar_type() == at::kFloat,
                "small_linear: bias");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + 3) / 4;
  auto run = [&](auto* wp) {
    split_for(blocks, std::max<int64_t>(1, 16384 / (4 * K)), [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t n0 = blk * 4;
        if (n0 + 4 <= N) {
          dot_rows<4>(op + n0, N, xp, M, wp + n0 * K, K, bp ? bp + n0 : nullptr);
        } else {
          for (int64_t n = n0; n < N; ++n) dot_rows<1>(op + n, N, xp, M, wp + n * K, K, bp ? bp + n : nullptr);
        }
      }
    });
  };
  switch (w.scalar_type()) {
    case at::kFloat: run(w.data_ptr<float>()); break;
    case at::kBFloat16: run(w.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(w.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "small_linear: weight must be float32, bfloat16 or float16");
  }
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
