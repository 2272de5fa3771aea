// float8 e4m3 weight linear for pre-quantized fp8 checkpoints (``fp8``, compressed-tensors FP8: repacked at load into
// model_registry.layers.quantization.quant_weight.QuantWeight): out [M, N] = x [M, K] @ W^T in float32, with
//   W[n, k] = e4m3(code[n, k]) * scale[n, k / group],
// codes one byte each [N, K] (float8_e4m3fn as stored in the checkpoint), float32 scales [N, ceil(K / group)]:
// per tensor and per channel are one group of K columns, a 128x128 block one scale per row and 128 columns.
//
// Why: a decode step streams every weight once, and an fp8 weight is half of bf16's bytes, so the widening must
// cost less than the bytes saved: no dequantised copy, each code widened in registers on the way to its FMA.
// AVX2 has no fp8 conversion, but F16C converts float16: an e4m3 byte b (sign, 4 exponent bits biased by 7, 3
// mantissa bits) sign-extended to 16 bits and shifted left by 7 is, with bit 14 cleared, the float16 (exponent
// bias 15) whose value is e4m3(b) / 256 exactly, subnormals included (e4m3's smallest, 2^-9, becomes 2^-17, a
// float16 subnormal). So 16 codes are 1 load, 1 sign extension, 1 shift, 1 AND and 2 vcvtph2ps, and the 256
// goes into the group's scale. Scales are applied once per group to a float accumulator of that group's
// products. Activation rows are taken four at a time (each group of codes widened once for the four), output
// columns in chunks of 16 so a tile's activations stay in cache; N is split over threads (at::parallel_for),
// each computing whole columns: the same arithmetic whoever computes them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VLLITE_FP8W_AVX2 1
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

namespace {

constexpr int64_t FP8_MT = 4;   // activation rows per tile
constexpr int64_t FP8_NC = 16;  // output columns per chunk (one tile of rows runs over them before the next)

// Every e4m3fn byte's value (0x7F / 0xFF: NaN).
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float v = e == 15 && m == 7 ? NAN : e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
      t[b] = b & 0x80 ? -v : v;
    }
    return t;
  }();
  return table;
}

// Columns [k0, k1) of one weight row against R activation rows (stride K), plainly: the default variant's whole
// product and the SIMD variant's tail of a group.
template <int R>
inline void dot_plain(const uint8_t* w, const float* x, int64_t K, int64_t k0, int64_t k1, const float* tab,
                      float* acc) {
  for (int r = 0; r < R; ++r) {
    float s = 0.f;
    for (int64_t k = k0; k < k1; ++k) s += x[r * K + k] * tab[w[k]];
    acc[r] = s;
  }
}

#ifdef VLLITE_FP8W_AVX2
inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// 16 e4m3 codes -> their values / 256 as two vectors of 8 floats (exact, through float16: see the top).
inline void widen16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// One output column (weight row w, scales s) for R activation rows x (stride K) -> res[R].
template <int R>
inline void column_tile(const uint8_t* w, const float* s, const float* x, int64_t K, int64_t group, const float* tab,
                        float* res) {
  __m256 tot[R];
  float tail[R];
  for (int r = 0; r < R; ++r) {
    tot[r] = _mm256_setzero_ps();
    tail[r] = 0.f;
  }
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t k1 = std::min(K, k0 + group);
    __m256 lo[R], hi[R];  // two chains per row: the FMA latency is not the bound at one row
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
      __m256 wl, wh;
      widen16(w + k, wl, wh);
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wl, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), wh, hi[r]);
      }
    }
    const __m256 sg = _mm256_set1_ps(s[g] * 256.f);
    for (int r = 0; r < R; ++r) tot[r] = _mm256_fmadd_ps(_mm256_add_ps(lo[r], hi[r]), sg, tot[r]);
    if (k < k1) {  // a group's last columns short of 16
      float part[R];
      dot_plain<R>(w, x, K, k, k1, tab, part);
      for (int r = 0; r < R; ++r) tail[r] += part[r] * s[g];
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum8(tot[r]) + tail[r];
}
#else
template <int R>
inline void column_tile(const uint8_t* w, const float* s, const float* x, int64_t K, int64_t group, const float* tab,
                        float* res) {
  for (int r = 0; r < R; ++r) res[r] = 0.f;
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    float part[R];
    dot_plain<R>(w, x, K, k0, std::min(K, k0 + group), tab, part);
    for (int r = 0; r < R; ++r) res[r] += part[r] * s[g];
  }
}
#endif

}  // namespace

void fp8_linear(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && codes.dim() == 2 && scales.dim() == 2 && x.is_contiguous()
                  && out.is_contiguous() && codes.is_contiguous() && scales.is_contiguous()
                  && x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat
                  && (codes.scalar_type() == at::kFloat8_e4m3fn || codes.scalar_type() == at::kByte)
                  && scales.scalar_type() == at::kFloat,
              "fp8_linear: contiguous float32 x [M, K], out [M, N], scales [N, ceil(K / group)]; float8_e4m3fn "
              "(or its bytes as uint8) codes [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group > 0 && codes.size(1) == K && out.size(0) == M && out.size(1) == N && scales.size(0) == N
                  && scales.size(1) == (K + group - 1) / group,
              "fp8_linear: shapes (codes [N, K], scales [N, ceil(K / group)], out [M, N])");
  if (M == 0 || N == 0) return;
  const int64_t G = scales.size(1);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* tab = e4m3_values().data();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1));  // >= 64 KiB of codes
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float res[FP8_MT];
    for (int64_t n0 = begin; n0 < end; n0 += FP8_NC) {
      const int64_t n1 = std::min(end, n0 + FP8_NC);
      for (int64_t m0 = 0; m0 < M; m0 += FP8_MT) {
        const int64_t R = std::min(FP8_MT, M - m0);
        const float* xm = xp + m0 * K;
        for (int64_t n = n0; n < n1; ++n) {
          const uint8_t* wn = cp + n * K;
          const float* sn = sp + n * G;
          switch (R) {
            case 4: column_tile<4>(wn, sn, xm, K, group, tab, res); break;
            case 3: column_tile<3>(wn, sn, xm, K, group, tab, res); break;
            case 2: column_tile<2>(wn, sn, xm, K, group, tab, res); break;
            default: column_tile<1>(wn, sn, xm, K, group, tab, res); break;
          }
          for (int64_t r = 0; r < R; ++r) op[(m0 + r) * N + n] = res[r];
        }
      }
    }
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
