// Weight-only int4 linear for pre-quantized checkpoints (compressed-tensors W4A16, GPTQ, AWQ: all repacked at load
// into model_registry.layers.quantization.quant_weight.QuantWeight): out [M, N] = x [M, K] @ W^T in float32, with
//   W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],  g = k / group,
// codes two to a byte (column 2j in the low nibble, 2j + 1 in the high one), float32 scales [N, K / group] and
// float32 zero points [N, K / group] (or one symmetric zero for every group).
//
// Why: a decode step streams the weights once; int4 codes are a quarter of bf16's bytes. The zero point leaves the
// inner loop: per group, sum(x * (c - z)) = sum(x * c) - z * sum(x), with sum(x) per row and group made once per
// call. Each output row's codes are widened to float once per call and serve every input row. Output rows are
// split over threads (split_for: at::parallel_for, or the team of llama_decoder_stack's call), each computing whole
// rows: the same arithmetic whoever computes them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLLITE_WNA16_AVX2 1
#endif

#include "common.h"
#include "team.h"

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
  s = hsum8(_mm256_add_ps(acc0, acc1));
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
  split_for(N, 16, [&](int64_t begin, int64_t end) {
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

// ---- int8 activations: int4 x int8 dot products ----------------------------------------------------------------
// int4_linear_q8: the same product with the activations quantized first, per row (dynamic, per token):
// q[m, k] = round(x[m, k] / xs[m]), xs[m] = amax(|x[m, :]|) / 127, so that
//   out[m, n] = xs[m] * sum_g scale[n, g] * (sum_{k in g} q[m, k] * code[n, k] - zero[n, g] * sum_{k in g} q[m, k]).
// Why: the float kernel above widens every nibble to a float and spends one FMA per weight; with int8 activations
// one _mm256_maddubs_epi16 (unsigned codes x signed activations, pair sums that cannot saturate: 2 * 15 * 127)
// and one _mm256_madd_epi16 cover 32 weights, straight from the checkpoint's layout (no repacked copy): 32 bytes
// of codes are 64 columns, their low nibbles the even ones and their high nibbles the odd ones, so each row's
// int8 activations are stored per 64-column block as [32 even columns | 32 odd columns] once per call. The int32
// lane i of a block's sums then holds columns 8i .. 8i + 7: lanes 0-3 the block's first 32 columns, lanes 4-7 the
// next 32, so any group that is a multiple of 32 columns takes its scale per half block (a group of 64 or more:
// the int32 sums of its blocks first, one float FMA per group). The zero point's term is one short dot per
// output over the groups. Rows are taken four at a time, each block's nibbles split once for the four.
namespace {

constexpr int64_t QB = 64;      // columns per block of codes (32 bytes)
constexpr int64_t QB512 = 128;  // the same for the AVX512-VNNI tile (64 bytes)
constexpr int64_t MT = 4;   // activation rows per tile

struct QuantRows {
  std::vector<int8_t> q;       // [M, K], per block [even columns | odd columns]
  std::vector<float> xs;       // [M] the rows' scales
  std::vector<float> qsum;     // [M, G] sum of q over each group (float: exact, |sum| < 2^24)
};

// qb: the columns per block of the layout (QB, or QB512 for the AVX512-VNNI tiles).
QuantRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group, int64_t qb) {
  const int64_t G = K / group;
  QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M), std::vector<float>(M * G, 0.f)};
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    r.xs[m] = amax / 127.f;
    int8_t* qr = r.q.data() + m * K;
    for (int64_t k = 0; k < K; ++k) {
      const int v = static_cast<int>(std::nearbyint(xr[k] * inv));  // |v| <= 127 (round to nearest even)
      const int64_t b = k / qb, j = k % qb;
      qr[b * qb + (j & 1) * (qb / 2) + j / 2] = static_cast<int8_t>(v);
      r.qsum[m * G + k / group] += static_cast<float>(v);
    }
  }
  return r;
}

// sum_g scale[g] * zero[g] * qsum[g] (zero: per group, or the one symmetric z0)
inline float zero_term(const float* s, const float* z, float z0, const float* qs, int64_t G) {
  float acc = 0.f;
  for (int64_t g = 0; g < G; ++g) acc += s[g] * (z ? z[g] : z0) * qs[g];
  return acc;
}

#ifdef VLLITE_WNA16_AVX2
// int32 sums (lane i: columns 8i .. 8i + 7) of one 64-column block of codes against R rows' quantized block.
template <int R>
inline void block_dots(const uint8_t* codes, const int8_t* const* q, __m256i* dot) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  for (int r = 0; r < R; ++r) {
    const __m256i qe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r]));
    const __m256i qo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 32));
    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, qe), _mm256_maddubs_epi16(hi, qo));
    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(s16, ones));
  }
}

// R rows (m0 ..) of output column n: sum_g scale[n, g] * (int dot over g) as floats, before the zero term.
template <int R>
inline void row_tile(const uint8_t* codes, const float* s, const int8_t* q, int64_t m0, int64_t K, int64_t group,
                     float* res) {
  __m256 acc[R];
  const int8_t* qr[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  if (group % QB == 0) {
    const int64_t G = K / group, per = group / QB;
    for (int64_t g = 0; g < G; ++g) {
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int64_t b = g * per; b < (g + 1) * per; ++b) {
        for (int r = 0; r < R; ++r) qr[r] = q + (m0 + r) * K + b * QB;
        block_dots<R>(codes + b * (QB / 2), qr, dot);
      }
      const __m256 sg = _mm256_set1_ps(s[g]);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), sg, acc[r]);
    }
  } else {  // group 32, 96, ...: a scale per half block
    for (int64_t b = 0; b < K / QB; ++b) {
      __m256i dot[R];
      for (int r = 0; r < R; ++r) {
        dot[r] = _mm256_setzero_si256();
        qr[r] = q + (m0 + r) * K + b * QB;
      }
      block_dots<R>(codes + b * (QB / 2), qr, dot);
      const __m256 sv = _mm256_set_m128(_mm_set1_ps(s[(b * QB + 32) / group]), _mm_set1_ps(s[(b * QB) / group]));
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), sv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum8(acc[r]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VLLITE_WNA16_VNNI512 1
// The same as row_tile on 128-column blocks (64 bytes of codes: low nibbles the even columns, high nibbles the odd
// ones), the rows' quantized blocks laid out [64 even columns | 64 odd columns]: vpdpbusd (unsigned codes x signed
// activations, four products per int32 lane, no pair saturation) leaves in lane i the sums of columns 8i .. 8i + 7,
// so a group that is a multiple of 128 columns takes its scale per block, and any multiple of 32 per four lanes.
// Half of the AVX2 tile's instructions per weight (AVX-512 hosts with VNNI: Zen 4 and later, Xeons since Cascade
// Lake).
template <int R>
inline void row_tile512(const uint8_t* codes, const float* s, const int8_t* q, int64_t m0, int64_t K, int64_t group,
                        float* res) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  const int8_t* qr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    qr[r] = q + (m0 + r) * K;
  }
  auto dots = [&](int64_t b, __m512i* dot) {  // block b's int32 sums per row, added to dot
    const __m512i c = _mm512_loadu_si512(codes + b * (QB512 / 2));
    const __m512i lo = _mm512_and_si512(c, mask), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
    for (int r = 0; r < R; ++r) {
      const int8_t* qb = qr[r] + b * QB512;
      dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_loadu_si512(qb));
      dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_loadu_si512(qb + QB512 / 2));
    }
  };
  if (group % QB512 == 0) {
    const int64_t per = group / QB512;
    for (int64_t g = 0; g < K / group; ++g) {
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      for (int64_t b = g * per; b < (g + 1) * per; ++b) dots(b, dot);
      const __m512 sg = _mm512_set1_ps(s[g]);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), sg, acc[r]);
    }
  } else {  // group 32, 64, 96, ...: a scale per 32 columns (four lanes)
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t b = 0; b < K / QB512; ++b) {
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      dots(b, dot);
      const int64_t k = b * QB512;
      const __m128 s4 = _mm_setr_ps(s[k / group], s[(k + 32) / group], s[(k + 64) / group], s[(k + 96) / group]);
      const __m512 sv = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(s4));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), sv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

// The same sums without SIMD (the default variant), in the same order of groups.
inline void row_scalar(const uint8_t* codes, const float* s, const int8_t* q, int64_t K, int64_t group, float* res) {
  float acc = 0.f;
  for (int64_t g = 0; g < K / group; ++g) {
    int32_t d = 0;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const uint8_t c = k % 2 ? codes[k / 2] >> 4 : codes[k / 2] & 0x0F;
      const int64_t b = k / QB, j = k % QB;
      d += static_cast<int32_t>(c) * q[b * QB + (j & 1) * (QB / 2) + j / 2];
    }
    acc += s[g] * static_cast<float>(d);
  }
  *res = acc;
}

}  // namespace

void int4_linear_q8(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales, std::optional<at::Tensor> zeros,
                    int64_t zero, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && codes.dim() == 2 && scales.dim() == 2 && x.is_contiguous()
                  && out.is_contiguous() && codes.is_contiguous() && scales.is_contiguous()
                  && x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat
                  && codes.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat,
              "int4_linear_q8: contiguous float32 x [M, K], out [M, N], scales [N, K / group]; uint8 codes [N, K / 2]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0 && K % QB == 0 && codes.size(1) * 2 == K
                  && out.size(0) == M && out.size(1) == N && scales.size(0) == N && scales.size(1) == K / group,
              "int4_linear_q8: shapes (a group of a multiple of 32 columns, K a multiple of the group and of 64)");
  const float* zp = nullptr;
  if (zeros.has_value() && zeros->defined()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kFloat && zeros->size(0) == N
                    && zeros->size(1) == K / group, "int4_linear_q8: zeros [N, K / group] float32");
    zp = zeros->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const int64_t G = K / group;
#ifdef VLLITE_WNA16_VNNI512
  const bool wide = K % QB512 == 0;  // the 128-column tiles (else the AVX2 ones, on 64-column blocks)
#else
  constexpr bool wide = false;
#endif
  const QuantRows qx = quantize_rows(x.data_ptr<float>(), M, K, group, wide ? QB512 : QB);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float z0 = static_cast<float>(zero);
  split_for(N, 16, [&](int64_t begin, int64_t end) {
    float res[MT];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* cn = cp + n * (K / 2);
      const float* sn = sp + n * G;
      const float* zn = zp ? zp + n * G : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t R = std::min(MT, M - m0);
#ifdef VLLITE_WNA16_VNNI512
        if (wide) {
          switch (R) {
            case 4: row_tile512<4>(cn, sn, qx.q.data(), m0, K, group, res); break;
            case 3: row_tile512<3>(cn, sn, qx.q.data(), m0, K, group, res); break;
            case 2: row_tile512<2>(cn, sn, qx.q.data(), m0, K, group, res); break;
            default: row_tile512<1>(cn, sn, qx.q.data(), m0, K, group, res); break;
          }
        } else
#endif
#ifdef VLLITE_WNA16_AVX2
        switch (R) {
          case 4: row_tile<4>(cn, sn, qx.q.data(), m0, K, group, res); break;
          case 3: row_tile<3>(cn, sn, qx.q.data(), m0, K, group, res); break;
          case 2: row_tile<2>(cn, sn, qx.q.data(), m0, K, group, res); break;
          default: row_tile<1>(cn, sn, qx.q.data(), m0, K, group, res); break;
        }
#else
        for (int64_t r = 0; r < R; ++r) row_scalar(cn, sn, qx.q.data() + (m0 + r) * K, K, group, res + r);
#endif
        for (int64_t r = 0; r < R; ++r) {
          const int64_t m = m0 + r;
          op[m * N + n] = qx.xs[m] * (res[r] - zero_term(sn, zn, z0, qx.qsum.data() + m * G, G));
        }
      }
    }
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
