// A linear layer computed straight from GGUF block-quantized weights (quantization="gguf"): Q8_0, Q4_0 and
// Q4_1, compiled once per ISA variant (integer dot products with AVX2 where the variant has it, plain C++
// otherwise).
//
// Why: the default model ships as Q4_1 (0.625 bytes per weight); dequantised to float32 a decode step
// streams 6.4x the bytes, and a decode step at few rows is a stream of the weights. Here the weights stay
// in their blocks and the activations are quantized instead, as llama.cpp does (its Q8_0/Q8_1 activations;
// this is our own code): every input row, per block of 32 values, gets a float32 scale xd = max|x| / 127
// and int8 values xq = round-half-even(x / xd). A block's contribution to an output is then
//   Q8_0: d * xd * sum(q * xq)                       (q int8)
//   Q4_0: d * xd * sum(q * xq) - 8 * d * xd * sum(xq)   (q the stored nibble, 0..15)
//   Q4_1: d * xd * sum(q * xq) + m * xd * sum(xq)
// with the integer sums exact (AVX2: _mm256_maddubs_epi16 of unsigned weights by signed activations,
// never saturating at these ranges: 2 * 15 * 127 and, for Q8_0 through the sign trick, 2 * 128 * 127),
// and the float32 sums over blocks in lane order, then the bias.
//
// Layout (vllite_core.quantization.GGUFWeight, repacked once at load): qs [N, K/32 * 16] uint8 for the
// 4-bit types, byte j of a block holding weight j (low nibble) and j + 16 (high nibble), as GGUF stores
// them; qs [N, K] int8 for Q8_0; d (and m for Q4_1) [N, K/32] float32.
//
// Work: tasks of (a block of up to 64 input rows, a chunk of output columns), the row block's quantized
// activations staying in L2 while the chunk's weights stream once per row block; inside a task, tiles of
// up to 4 rows x 2 columns keep their 8 accumulators in registers.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // gemm.cpp's avx2_gemm_panel needs the same
#include <immintrin.h>
#define VLLITE_GGUF_AVX2 1
#endif

// The weights a panel is dequantised to are the dequantised load's: d * q, then + m, each rounded.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

#ifdef VLLITE_GGUF_AVX2
void avx2_gemm_panel(const float* A, int64_t M, int64_t K, const float* panel, float* C, int64_t ldc,
                     const float* bias, int64_t ncols);  // gemm.cpp
#endif

namespace gguf_impl {

constexpr int64_t QK = 32;       // weights per block
constexpr int64_t MB = 64;       // input rows per task
constexpr int64_t RM = 4;        // rows per register tile
constexpr int64_t RN = 2;        // columns per register tile
constexpr int64_t GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8;  // ggml's type ids

struct Weights {
  int64_t type;
  const uint8_t* qs;  // int8 for Q8_0
  int64_t ldq;        // bytes per output column
  const float* d;
  const float* m;  // Q4_1 only
  int64_t nb;      // blocks per column
};

struct Acts {
  const int8_t* q;   // [M, K]
  const float* d;    // [M, nb]
  const float* s;    // [M, nb]: d * sum(q) of the block
  int64_t K, nb;
};

// One row: per block scale and int8 values (round half to even), and d * sum(q).
static inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float xd = amax > 0.f ? amax / 127.f : 1.f;
    int32_t sum = 0;
    int8_t* qb = q + b * QK;
#ifdef VLLITE_GGUF_AVX2
    const __m256 dv = _mm256_set1_ps(xd);
    __m256i qi[4];
    for (int j = 0; j < 4; ++j)
      qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xb + 8 * j), dv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // |x / xd| <= 127 by construction: packing never saturates.
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p8);
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xb1)));
#else
    for (int64_t j = 0; j < QK; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] / xd));
      qb[j] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    d[b] = xd;
    s[b] = xd * static_cast<float>(sum);
  }
}

// The block-sum correction of the 4-bit types for one (row, column): sum over blocks of c_b * s_b.
static inline float correction(const Weights& w, int64_t n, const float* s) {
  if (w.type == GGML_Q8_0) return 0.f;
  const float* c = (w.type == GGML_Q4_1 ? w.m : w.d) + n * w.nb;
  float acc = 0.f;
  for (int64_t b = 0; b < w.nb; ++b) acc += c[b] * s[b];
  return w.type == GGML_Q4_1 ? acc : -8.f * acc;
}

#ifdef VLLITE_GGUF_AVX2
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 unsigned bytes in weight order (low nibbles first).
static inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// out[r][c] (r < R, c < C) = the integer-dot part summed over blocks, for rows x0.. and columns n0...
template <int R, int C, bool Q8>
static inline void tile(const Weights& w, int64_t n0, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < w.nb; ++b) {
    __m256i wv[C], wa[C];
    float wd[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = w.qs + (n0 + c) * w.ldq;
      if constexpr (Q8) {
        wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * QK));
        wa[c] = _mm256_sign_epi8(wv[c], wv[c]);  // |q| as unsigned bytes (-128 -> 128)
      } else {
        wa[c] = unpack_nibbles(p + b * (QK / 2));
      }
      wd[c] = w.d[(n0 + c) * w.nb + b];
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (r0 + r) * a.K + b * QK));
      const float xd = a.d[(r0 + r) * a.nb + b];
      for (int c = 0; c < C; ++c) {
        const __m256i xs = Q8 ? _mm256_sign_epi8(xv, wv[c]) : xv;
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[c], xs), ones);
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(wd[c] * xd), _mm256_cvtepi32_ps(p), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum(acc[r][c]);
}

// One block of column n as 32 float32 weights (the dequantised load's values).
static inline void dequant_block(const Weights& w, int64_t n, int64_t b, float* out) {
  const __m256 d = _mm256_set1_ps(w.d[n * w.nb + b]);
  __m128i q[2];  // 32 bytes: int8 (Q8_0) or unsigned nibble values
  bool is_signed = w.type == GGML_Q8_0;
  if (is_signed) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * w.ldq + b * QK));
    q[0] = _mm256_castsi256_si128(v);
    q[1] = _mm256_extracti128_si256(v, 1);
  } else {
    const __m256i v = unpack_nibbles(w.qs + n * w.ldq + b * (QK / 2));
    q[0] = _mm256_castsi256_si128(v);
    q[1] = _mm256_extracti128_si256(v, 1);
  }
  const __m256 m = w.type == GGML_Q4_1 ? _mm256_set1_ps(w.m[n * w.nb + b]) : _mm256_setzero_ps();
  const __m256 eight = _mm256_set1_ps(8.f);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 2; ++j) {
      const __m128i part = j ? _mm_srli_si128(q[h], 8) : q[h];
      const __m256 f = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part));
      __m256 v;
      if (w.type == GGML_Q4_0)
        v = _mm256_mul_ps(d, _mm256_sub_ps(f, eight));
      else if (w.type == GGML_Q4_1)
        v = _mm256_add_ps(_mm256_mul_ps(d, f), m);
      else
        v = _mm256_mul_ps(d, f);
      _mm256_store_ps(out + h * 16 + j * 8, v);
    }
}

// r[i] (8 floats each) transposed in place.
static inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

constexpr int64_t NR = 16;  // columns per float32 panel (gemm.cpp's)

// panel [K][16] float32 = the weights of columns n0 .. n0 + ncols (zero beyond), the layout of gemm.cpp's panels.
static void dequant_panel(const Weights& w, int64_t n0, int64_t ncols, float* panel) {
  alignas(32) float col[NR][QK];
  for (int64_t b = 0; b < w.nb; ++b) {
    for (int64_t j = 0; j < NR; ++j) {
      if (j < ncols)
        dequant_block(w, n0 + j, b, col[j]);
      else
        std::fill(col[j], col[j] + QK, 0.f);
    }
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t k8 = 0; k8 < QK; k8 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(col[half * 8 + i] + k8);
        transpose8(r);  // r[t] = columns half*8 .. +8 at k = k8 + t
        for (int t = 0; t < 8; ++t) _mm256_storeu_ps(panel + (b * QK + k8 + t) * NR + half * 8, r[t]);
      }
  }
}

template <bool Q8>
static void tile_any(int64_t rows, int64_t cols, const Weights& w, int64_t n0, const Acts& a, int64_t r0, float* out,
                     int64_t ldo) {
#define VG_CASE(R)                                       \
  case R:                                                \
    if (cols == 2)                                       \
      tile<R, 2, Q8>(w, n0, a, r0, out, ldo);            \
    else                                                 \
      tile<R, 1, Q8>(w, n0, a, r0, out, ldo);            \
    break;
  switch (rows) {
    VG_CASE(4)
    VG_CASE(3)
    VG_CASE(2)
    default: VG_CASE(1)
  }
#undef VG_CASE
}
#else
// Plain C++: the same sums, one (row, column) at a time.
static void tile_scalar(int64_t rows, int64_t cols, const Weights& w, int64_t n0, const Acts& a, int64_t r0,
                        float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t n = n0 + c;
      const int8_t* xq = a.q + (r0 + r) * a.K;
      float acc = 0.f;
      for (int64_t b = 0; b < w.nb; ++b) {
        int32_t dot = 0;
        if (w.type == GGML_Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(w.qs + n * w.ldq) + b * QK;
          for (int64_t j = 0; j < QK; ++j) dot += int32_t(q[j]) * xq[b * QK + j];
        } else {
          const uint8_t* q = w.qs + n * w.ldq + b * (QK / 2);
          for (int64_t j = 0; j < QK / 2; ++j)
            dot += int32_t(q[j] & 0x0f) * xq[b * QK + j] + int32_t(q[j] >> 4) * xq[b * QK + j + QK / 2];
        }
        acc += w.d[n * w.nb + b] * a.d[(r0 + r) * a.nb + b] * static_cast<float>(dot);
      }
      out[r * ldo + c] = acc;
    }
}
#endif

}  // namespace gguf_impl

// out [M, N] float32 = x [M, K] float32 @ W^T (+ bias), W given by its GGUF blocks (the layout above).
// From gemm_min_rows rows on (AVX2 variants), dequantised panels and the float32 GEMM instead (the caller's
// choice: kernels.py's GGUF_GEMM_MIN_ROWS).
void gguf_linear(at::Tensor out, at::Tensor x, int64_t type, at::Tensor qs, at::Tensor d, std::optional<at::Tensor> m,
                 std::optional<at::Tensor> bias, int64_t gemm_min_rows) {
  using namespace gguf_impl;
  TORCH_CHECK(type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0,
              "gguf_linear: type must be Q4_0, Q4_1 or Q8_0");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && qs.dim() == 2 && d.dim() == 2 && x.is_contiguous()
                  && out.is_contiguous() && qs.is_contiguous() && d.is_contiguous() && x.scalar_type() == at::kFloat
                  && out.scalar_type() == at::kFloat && d.scalar_type() == at::kFloat,
              "gguf_linear: float32 contiguous x [M, K], out [M, N], d [N, K/32]; contiguous qs");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(0) == M ? out.size(1) : -1;
  TORCH_CHECK(N >= 0 && K % QK == 0 && qs.size(0) == N && d.size(0) == N && d.size(1) == K / QK,
              "gguf_linear: shapes (K must be a multiple of 32)");
  const bool q8 = type == GGML_Q8_0;
  TORCH_CHECK(qs.scalar_type() == (q8 ? at::kChar : at::kByte) && qs.size(1) == (q8 ? K : K / 2),
              "gguf_linear: qs must be int8 [N, K] (Q8_0) or uint8 [N, K/2] (Q4_0, Q4_1)");
  const float* mp = nullptr;
  if (type == GGML_Q4_1) {
    TORCH_CHECK(m.has_value() && m->defined() && m->sizes() == d.sizes() && m->is_contiguous()
                    && m->scalar_type() == at::kFloat,
                "gguf_linear: Q4_1 needs float32 m like d");
    mp = m->data_ptr<float>();
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, "gguf_linear: bias");
    bp = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const int64_t nb = K / QK;
  const Weights w{type, static_cast<const uint8_t*>(qs.data_ptr()), qs.size(1), d.data_ptr<float>(), mp, nb};

#ifdef VLLITE_GGUF_AVX2
  if (M >= gemm_min_rows) {
    // Many rows: each task dequantises one 16-column panel to float32 (in L1/L2) and runs the float32 GEMM
    // micro-kernel over its row block; the weights are still read as blocks, and the input is not rounded.
    constexpr int64_t MC = 96;
    const int64_t P = (N + NR - 1) / NR, row_blocks = (M + MC - 1) / MC;
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, row_blocks * P, 1, [&](int64_t tb, int64_t te) {
      std::vector<float> panel_buf(K * NR + 8);
      float* panel = panel_buf.data();
      for (int64_t t = tb; t < te; ++t) {
        const int64_t m0 = (t / P) * MC, m1 = std::min(M, m0 + MC), n0 = (t % P) * NR;
        const int64_t ncols = std::min(NR, N - n0);
        dequant_panel(w, n0, ncols, panel);
        avx2_gemm_panel(xp + m0 * K, m1 - m0, K, panel, op + m0 * N + n0, N, bp ? bp + n0 : nullptr, ncols);
      }
    });
    return;
  }
#endif
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      quantize_row(xp + r * K, nb, xq.data() + r * K, xd.data() + r * nb, xs.data() + r * nb);
  });
  const Acts a{xq.data(), xd.data(), xs.data(), K, nb};

  float* op = out.data_ptr<float>();
  // Column chunks of at least ~64K multiply-adds per row so small layers stay on one thread.
  const int64_t chunk = std::max<int64_t>(RN, (65536 / K + RN - 1) / RN * RN);
  const int64_t chunks = (N + chunk - 1) / chunk, row_blocks = (M + MB - 1) / MB;
  at::parallel_for(0, row_blocks * chunks, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int64_t m0 = (t / chunks) * MB, m1 = std::min(M, m0 + MB);
      const int64_t c0 = (t % chunks) * chunk, c1 = std::min(N, c0 + chunk);
      for (int64_t n = c0; n < c1; n += RN) {
        const int64_t cols = std::min(RN, c1 - n);
        for (int64_t r = m0; r < m1; r += RM) {
          const int64_t rows = std::min(RM, m1 - r);
          float* o = op + r * N + n;
#ifdef VLLITE_GGUF_AVX2
          if (q8)
            tile_any<true>(rows, cols, w, n, a, r, o, N);
          else
            tile_any<false>(rows, cols, w, n, a, r, o, N);
#else
          tile_scalar(rows, cols, w, n, a, r, o, N);
#endif
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < cols; ++c) {
              float v = o[i * N + c] + correction(w, n + c, xs.data() + (r + i) * nb);
              o[i * N + c] = bp ? v + bp[n + c] : v;
            }
        }
      }
    }
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
