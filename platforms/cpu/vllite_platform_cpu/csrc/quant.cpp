// The two passes around an int8 GEMM (quantization="int8", W8A8 with dynamic activations), compiled once
// per ISA variant: each input row quantized with its own scale, and the int32 sums scaled back.
//
// Why: in torch these are ten small ops per linear layer (float, abs, amax, where, div, round, clamp, to;
// float, mul, mul, add, to) at 3,840 calls per 32 decode steps: 3.6 s of a 13 s run, more than the int8
// GEMMs saved. One pass each, parallel over rows only when a row block pays for the threads.
//
// Numerics are those of vllite_core.quantization.quantize_rows_int8 and the CPU model ops' torch code:
// scale = max|x| / 127 (1 for an all-zero row), q = round-half-even(x / scale) clamped to +-127, and
// y = ((float(acc) * x_scale) * w_scale) + bias, rounded once to the output dtype; no FMA contraction.
#include <algorithm>
#include <cmath>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VLLITE_QUANT_AVX512 1
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

static inline int64_t quant_grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

#ifdef VLLITE_QUANT_AVX512
// 16 values widened to float32 (bfloat16: a shift; float16: F16C).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 load16(const double* p) {
  alignas(64) float t[16];
  for (int j = 0; j < 16; ++j) t[j] = static_cast<float>(p[j]);
  return _mm512_load_ps(t);
}
// 16 float32 values rounded to the output dtype as c10 rounds them (nearest even; NaN not special-cased).
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
static inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void store16(double* p, __m512 v) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  for (int j = 0; j < 16; ++j) p[j] = t[j];
}
#endif

// q [M, K] int8, scale [M] float32 from x [M, K] (float32 / bfloat16 / float16, rows contiguous).
void quantize_rows_int8(at::Tensor q, at::Tensor scale, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.sizes() == x.sizes() && x.stride(1) == 1 && q.is_contiguous()
                  && q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && scale.is_contiguous()
                  && scale.numel() == x.size(0),
              "quantize_rows_int8: bad shapes or dtypes");
  const int64_t M = x.size(0), K = x.size(1), xs = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "quantize_rows_int8", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, M, quant_grain(K), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* row = xp + r * xs;
        float amax = 0.f;
        int64_t k0 = 0;
#ifdef VLLITE_QUANT_AVX512
        __m512 m = _mm512_setzero_ps();
        for (; k0 + 16 <= K; k0 += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(row + k0)));
        amax = _mm512_reduce_max_ps(m);
#endif
        for (int64_t k = k0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(row[k])));
        const float s = amax > 0.f ? amax / 127.f : 1.f;
        sp[r] = s;
        int8_t* out = qp + r * K;
        int64_t k1 = 0;
#ifdef VLLITE_QUANT_AVX512
        const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
        for (; k1 + 16 <= K; k1 += 16) {
          __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(row + k1), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k1), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
        }
#endif
        for (int64_t k = k1; k < K; ++k) {
          const float v = std::nearbyint(static_cast<float>(row[k]) / s);
          out[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        }
      }
    });
  });
}

// out [M, N] (float32 / bfloat16 / float16) = acc [M, N] int32 * x_scale[:, None] * w_scale[None, :] + bias.
void dequantize_int32(at::Tensor out, at::Tensor acc, at::Tensor x_scale, at::Tensor w_scale,
                      std::optional<at::Tensor> bias) {
  TORCH_CHECK(acc.dim() == 2 && out.dim() == 2 && out.sizes() == acc.sizes() && acc.is_contiguous()
                  && out.is_contiguous() && acc.scalar_type() == at::kInt && x_scale.scalar_type() == at::kFloat
                  && w_scale.scalar_type() == at::kFloat && x_scale.is_contiguous() && w_scale.is_contiguous()
                  && x_scale.numel() == acc.size(0) && w_scale.numel() == acc.size(1),
              "dequantize_int32: bad shapes or dtypes");
  const int64_t M = acc.size(0), N = acc.size(1);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "dequantize_int32: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, out.scalar_type(), "dequantize_int32", [&] {
    const int32_t* ap = acc.data_ptr<int32_t>();
    const float* xsp = x_scale.data_ptr<float>();
    const float* wsp = w_scale.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, quant_grain(N), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int32_t* a = ap + r * N;
        scalar_t* o = op + r * N;
        const float xsr = xsp[r];
        int64_t c0 = 0;
#ifdef VLLITE_QUANT_AVX512
        const __m512 xv = _mm512_set1_ps(xsr);
        for (; c0 + 16 <= N; c0 += 16) {
          __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + c0)), xv),
                                   _mm512_loadu_ps(wsp + c0));
          if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + c0));
          store16(o + c0, v);
        }
#endif
        a += c0;
        o += c0;
        const float* wsr = wsp + c0;
        const float* br = bp ? bp + c0 : nullptr;
        const int64_t n = N - c0;
        if (br) {
          for (int64_t c = 0; c < n; ++c) o[c] = static_cast<scalar_t>(static_cast<float>(a[c]) * xsr * wsr[c] + br[c]);
        } else {
          for (int64_t c = 0; c < n; ++c) o[c] = static_cast<scalar_t>(static_cast<float>(a[c]) * xsr * wsr[c]);
        }
      }
    });
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
