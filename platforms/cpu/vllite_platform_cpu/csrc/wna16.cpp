// Weight-only int4 linear for pre-quantized checkpoints (compressed-tensors W4A16, GPTQ, AWQ: all repacked at load
// into model_registry.layers.quantization.quant_weight.QuantWeight): out [M, N] = x [M, K] @ W^T in float32, with
//   W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],  g = k / group,
// codes two to a byte (column 2j in the low nibble, 2j + 1 in the high one), float32 scales [N, K / group] and
// float32 zero points [N, K / group] (or one symmetric zero for every group).
//
// Why: a decode step streams the weights once; int4 codes are a quarter of bf16's bytes. The zero point leaves the
// inner loop: per group, sum(x * (c - z)) = sum(x * c) - z * sum(x), with sum(x) per row and group made once per
// call. Each output row's codes are widened to float once per call and serve every input row. Output rows are
// split over threads (at::parallel_for), each computing whole rows: the same arithmetic whoever computes them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLLITE_WNA16_AVX2 1
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

namespace {

// codes [K / 2] of one output row -> float values [K] (column order)
inline void widen_row(const uint8_t* codes, int64_t K, float* w) {
  int64_t k = 0;
#ifdef VLLITE_WNA16_AVX2
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (; k + 16 <= K; k += 16) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k / 2));
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i v = _mm_unpacklo_epi8(lo, hi);  // columns k .. k + 15 in order
    _mm256_storeu_ps(w + k, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    _mm256_storeu_ps(w + k + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
  }
#endif
  for (; k < K; k += 2) {
    const uint8_t b = codes[k / 2];
    w[k] = static_cast<float>(b & 0x0F);
    w[k + 1] = static_cast<float>(b >> 4);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef VLLITE_WNA16_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  s = _mm_cvtss_f32(r);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void int4_linear(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales, std::optional<at::Tensor> zeros,
                 int64_t zero, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && codes.dim() == 2 && scales.dim() == 2 && x.is_contiguous()
                  && out.is_contiguous() && codes.is_contiguous() && scales.is_contiguous()
                  && x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat
                  && codes.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat,
              "int4_linear: contiguous float32 x [M, K], out [M, N], scales [N, K / group]; uint8 codes [N, K / 2]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group > 0 && K % group == 0 && group % 2 == 0 && codes.size(1) * 2 == K && out.size(0) == M
                  && out.size(1) == N && scales.size(0) == N && scales.size(1) == K / group,
              "int4_linear: shapes (K a multiple of an even group)");
  const float* zp = nullptr;
  if (zeros.has_value() && zeros->defined()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kFloat && zeros->size(0) == N
                    && zeros->size(1) == K / group, "int4_linear: zeros [N, K / group] float32");
    zp = zeros->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const int64_t G = K / group;
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(M * G);  // sum of each row's group of inputs: the zero point's term
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += xp[m * K + g * group + i];
      xsum[m * G + g] = s;
    }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float z0 = static_cast<float>(zero);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(K);
    for (int64_t n = begin; n < end; ++n) {
      widen_row(cp + n * (K / 2), K, w.data());
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const float z = zp ? zp[n * G + g] : z0;
          acc += sp[n * G + g] * (dot(xp + m * K + g * group, w.data() + g * group, group) - z * xsum[m * G + g]);
        }
        op[m * N + n] = acc;
      }
    }
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
