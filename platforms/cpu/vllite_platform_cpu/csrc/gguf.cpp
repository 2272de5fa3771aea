// A linear layer computed straight from GGUF block-quantized weights (quantization="gguf"): Q8_0, Q4_0 and
// Q4_1, and the K-quants Q4_K, Q5_K and Q6_K (super-blocks of 256; their record layout and arithmetic are
// described at klayout and kgroup_tile below), compiled once per ISA variant (integer dot products with AVX2 where the variant has it, vpdpbusd where it
// has AVX512-VNNI, plain C++ otherwise; many rows through dequantised panels and a GEMM's tiles).
//
// Why: the default model ships as Q4_1 (0.625 bytes per weight); dequantised to float32 a decode step
// streams 6.4x the bytes, and a decode step at few rows is a stream of the weights. Here the weights stay
// in their blocks and the activations are quantized instead, as llama.cpp does (its Q8_0/Q8_1 activations;
// this is our own code): every input row, per block of 32 values, gets a float32 scale xd = max|x| / 127
// and int8 values xq = round-half-even(x / xd). A block's contribution to an output is then
//   Q8_0: d * xd * sum(q * xq)                       (q int8)
//   Q4_0: d * (xd * sum(q * xq) - 8 * xd * sum(xq))   (q the stored nibble, 0..15)
//   Q4_1: d * xd * sum(q * xq) + m * xd * sum(xq)
// with the integer sums exact and the float32 sums over blocks in order, then the bias.
//
// Layout (model_registry.layers.quantization.gguf.GGUFWeight, repacked once at load): groups of 8 output rows; per (group,
// block) one record: the values in chunks of 32 bytes, byte 4r + i of chunk t holding row r's weight 4t + i
// (Q8_0, 8 chunks; int8) or weights 4t + i (low nibble) and 16 + 4t + i (high nibble) (Q4, 4 chunks), then the
// 8 rows' fp16 scales d and (Q4_1) minimums m. A group's records follow each other: one sequential stream.
//
// Why that layout (the idea of llama.cpp's repacked "x8" types): with 4 consecutive weights of each of the 8
// rows in one register and the matching 4 activation bytes broadcast to every lane, _mm256_maddubs_epi16 then
// _mm256_madd_epi16 leave row r's partial dot product in lane r: a block's 8 dot products come out as one
// vector, scaled by the 8 scales (one vcvtph2ps) in one FMA, with no horizontal sums. Q4's 8 maddubs results
// add up in int16 first (at most 8 * 2 * 15 * 127 = 30480); Q8_0 takes |q| and moves q's sign onto the
// activation (llama.cpp's sign trick: maddubs needs one unsigned operand), each pair sum then up to
// 2 * 128 * 127, so each chunk goes to int32 on its own. The unpacked weights serve up to 4 input rows.
//
// Work: the groups of output rows are split over threads in contiguous runs (one stream each), a call of at
// most grain_bytes of blocks staying on the calling thread (waking a sleeping one costs more than it saves on a
// layer read in a few tens of us). Input rows go 4 at a time over a group's records, which stay in L1.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include "common.h"
#include "team.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // gemm.cpp's avx2_gemm_panel needs the same
#include <immintrin.h>
#define VLLITE_GGUF_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VLLITE_GGUF_VNNI 1  // vpdpbusd on ymm: one instruction for maddubs + madd (+ add), the same exact sums
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // gemm.cpp's bf16 GEMM is built
#define VLLITE_GGUF_BF16 1  // a bfloat16 model's many rows: bfloat16 panels for the vdpbf16ps tiles
#endif
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
#ifdef VLLITE_GGUF_BF16
void bf16_gemm_panel(const uint16_t* A, int64_t M, int64_t K, const uint16_t* panel, uint16_t* C, int64_t ldc,
                     const float* bias, int64_t ncols);  // gemm.cpp
#endif

namespace gguf_impl {

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t G = 8;    // output rows per group
constexpr int64_t RM = 4;   // input rows per tile
constexpr int64_t GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8;  // ggml's type ids
constexpr int64_t GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14;
constexpr int64_t QKK = 256;  // weights per K-quant super-block (one record)

static inline bool is_kquant(int64_t type) { return type >= GGML_Q4_K && type <= GGML_Q6_K; }

// A K-quant record (GGUFWeight's layout for Q4_K / Q5_K / Q6_K): 8 rows x one super-block of 256 weights.
//   [0, 1024): 32 chunks of 32 bytes; byte 4r + i of chunk t = 8jj + c holds row r's weight 64jj + 4c + i in its
//              low nibble and weight 64jj + 32 + 4c + i in its high one (the low 4 bits of the value);
//   Q5_K [1024, 1280): the 5th bits, 8 vectors of 32 bytes, vector 2jj + h (h: 0 low nibbles, 1 high ones):
//              bit c of byte b = the 5th bit of that nibble of byte b of chunk 8jj + c;
//   Q6_K [1024, 1536): the 5th and 6th bits, 16 vectors, vector 4jj + 2h + u: bits 2c', 2c' + 1 of byte b =
//              the two high bits of that nibble of byte b of chunk 8jj + 4u + c';
//   then the scales as bytes [sub-block][row] (Q4_K/Q5_K: 8 sub-blocks of 32, uint8 0..63; Q6_K: 16 of 16,
//   int8), the minimums [8][8] uint8 (Q4_K/Q5_K), the 8 rows' fp16 d and (Q4_K/Q5_K) fp16 dmin.
// Weight values (gguf.quants' float32 arithmetic): Q4_K/Q5_K (d * sc) * q - (dmin * m); Q6_K (d * sc) * (q - 32).
struct KLayout {
  int64_t sc, mn, d, dmin, rec;
};
static inline KLayout klayout(int64_t type) {
  if (type == GGML_Q4_K) return {1024, 1088, 1152, 1168, 1184};
  if (type == GGML_Q5_K) return {1280, 1344, 1408, 1424, 1440};
  return {1536, -1, 1664, -1, 1680};
}

struct Weights {
  int64_t type;
  const uint8_t* p;  // [groups][nb][rec]
  int64_t nb, rec;   // records per group (blocks of 32, or super-blocks of 256 for K-quants), bytes per record
  int64_t qbytes;    // value bytes of a record (256 or 128): the scales follow, then the minimums (not K-quants)
  int64_t per;       // weights per record along K: 32, or 256 (K-quants)
  const uint8_t* record(int64_t g, int64_t b) const { return p + (g * nb + b) * rec; }
};

// The record layout of a [N, K] weight of ggml ``type`` over its blocks ``p`` (nb: records per group of 8 rows).
static inline Weights weights_of(int64_t type, int64_t K, const uint8_t* p) {
  const bool kq = is_kquant(type);
  const int64_t qbytes = type == GGML_Q8_0 ? 256 : 128, per = kq ? QKK : QK;
  const int64_t rec = kq ? klayout(type).rec : qbytes + 2 * G * (type == GGML_Q4_1 ? 2 : 1);
  return Weights{type, p, K / per, rec, qbytes, per};
}

struct Acts {
  const int8_t* q;    // [M, K]
  const float* d;     // [M, nb]
  const float* s;     // [M, nb]: d * sum(q) of the block
  const uint32_t* bs; // [M, nb] (Q6_K only): sum(q) of the block's first 16 values, and (high half) of its last 16
  int64_t K, nb;
};

static inline float half_at(const uint8_t* p, int64_t i) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * i, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

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

// Row r's weight k of a record (the integer value as stored: int8, or the nibble 0..15).
static inline int32_t weight_at(const Weights& w, const uint8_t* rec, int64_t r, int64_t k) {
  if (w.type == GGML_Q8_0) return static_cast<int8_t>(rec[(k / 4) * 32 + 4 * r + k % 4]);
  const int64_t j = k % 16;
  const uint8_t byte = rec[(j / 4) * 32 + 4 * r + j % 4];
  return k < 16 ? (byte & 0x0f) : (byte >> 4);
}

// Plain C++: out[i * ldo + r] for rows r0 .. r0 + rows of the input and the group's 8 outputs.
static void group_scalar(const Weights& w, int64_t g, const Acts& a, int64_t r0, int64_t rows, float* out,
                         int64_t ldo) {
  for (int64_t i = 0; i < rows; ++i) {
    float acc[G] = {};
    const int8_t* xq = a.q + (r0 + i) * a.K;
    for (int64_t b = 0; b < w.nb; ++b) {
      const uint8_t* rec = w.record(g, b);
      const float xd = a.d[(r0 + i) * a.nb + b], xs = a.s[(r0 + i) * a.nb + b];
      for (int64_t r = 0; r < G; ++r) {
        int32_t dot = 0;
        for (int64_t k = 0; k < QK; ++k) dot += weight_at(w, rec, r, k) * xq[b * QK + k];
        const float d = half_at(rec + w.qbytes, r), v = xd * static_cast<float>(dot);
        if (w.type == GGML_Q4_0)
          acc[r] += d * (v - 8.f * xs);
        else if (w.type == GGML_Q4_1)
          acc[r] += d * v + half_at(rec + w.qbytes + 2 * G, r) * xs;
        else
          acc[r] += d * v;
      }
    }
    for (int64_t r = 0; r < G; ++r) out[i * ldo + r] = acc[r];
  }
}

// Row r's integer value of weight k (0..255) of a K-quant record (0..15, 0..31 or 0..63).
static inline int32_t kq_value(int64_t type, const uint8_t* rec, int64_t r, int64_t k) {
  const int64_t jj = k / 64, h = (k % 64) / 32, c = (k % 32) / 4, byte = 4 * r + k % 4;
  const uint8_t v = rec[32 * (8 * jj + c) + byte];
  int32_t q = h ? (v >> 4) : (v & 15);
  if (type == GGML_Q5_K) q |= ((rec[1024 + 32 * (2 * jj + h) + byte] >> c) & 1) << 4;
  if (type == GGML_Q6_K) q |= ((rec[1024 + 32 * (4 * jj + 2 * h + c / 4) + byte] >> (2 * (c % 4))) & 3) << 4;
  return q;
}

// Row r's scale of sub-block j (of 32 weights; of 16 for Q6_K) and minimum (Q4_K/Q5_K).
static inline int32_t kq_scale(int64_t type, const uint8_t* rec, int64_t r, int64_t j) {
  const uint8_t b = rec[klayout(type).sc + 8 * j + r];
  return type == GGML_Q6_K ? static_cast<int32_t>(static_cast<int8_t>(b)) : static_cast<int32_t>(b);
}
static inline int32_t kq_min(int64_t type, const uint8_t* rec, int64_t r, int64_t j) {
  return rec[klayout(type).mn + 8 * j + r];
}

// Plain C++ for K-quants: per super-block and row, sum over 32-blocks of xd * (integer sums times the integer
// scales), minus dmin * sum(m * xs); Q6_K's -32 as 32 * sum(sc * sum(xq)) per 16.
static void kgroup_scalar(const Weights& w, int64_t g, const Acts& a, int64_t r0, int64_t rows, float* out,
                          int64_t ldo) {
  const KLayout L = klayout(w.type);
  for (int64_t i = 0; i < rows; ++i) {
    float acc[G] = {};
    const int8_t* xq = a.q + (r0 + i) * a.K;
    for (int64_t sb = 0; sb < w.nb; ++sb) {
      const uint8_t* rec = w.record(g, sb);
      for (int64_t r = 0; r < G; ++r) {
        float accs = 0.f, accm = 0.f;
        for (int64_t j = 0; j < QKK / QK; ++j) {
          const int64_t b = sb * (QKK / QK) + j;
          const int8_t* xb = xq + b * QK;
          int32_t isum = 0;
          if (w.type == GGML_Q6_K) {
            for (int64_t u = 0; u < 2; ++u) {
              int32_t dot = 0, bsum = 0;
              for (int64_t l = 16 * u; l < 16 * u + 16; ++l) {
                dot += kq_value(w.type, rec, r, j * QK + l) * xb[l];
                bsum += xb[l];
              }
              isum += kq_scale(w.type, rec, r, 2 * j + u) * (dot - 32 * bsum);
            }
          } else {
            int32_t dot = 0;
            for (int64_t l = 0; l < QK; ++l) dot += kq_value(w.type, rec, r, j * QK + l) * xb[l];
            isum = kq_scale(w.type, rec, r, j) * dot;
            accm += static_cast<float>(kq_min(w.type, rec, r, j)) * a.s[(r0 + i) * a.nb + b];
          }
          accs += a.d[(r0 + i) * a.nb + b] * static_cast<float>(isum);
        }
        acc[r] += half_at(rec + L.d, r) * accs;
        if (w.type != GGML_Q6_K) acc[r] -= half_at(rec + L.dmin, r) * accm;
      }
    }
    for (int64_t r = 0; r < G; ++r) out[i * ldo + r] = acc[r];
  }
}

#ifdef VLLITE_GGUF_AVX2
static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// out[i * ldo + 0..8] = the group's 8 outputs for input rows r0 .. r0 + R.
template <int R, int64_t TYPE>
static inline void group_tile(const Weights& w, int64_t g, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
  const uint8_t* rec = w.record(g, 0);
  for (int64_t b = 0; b < w.nb; ++b, rec += w.rec) {
    // 8 records ahead (past the group's end too: the next group follows): 12.0 against 10.5 GB/s without,
    // 9.0 at 4 records, 10.8 at 16 (benchmarks/gguf_linear_bw.py, one thread).
    const char* ahead = reinterpret_cast<const char*>(rec + 8 * w.rec);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    if constexpr (TYPE == GGML_Q8_0) _mm_prefetch(ahead + 192, _MM_HINT_T0);
    __m256i dot[R];
    if constexpr (TYPE == GGML_Q8_0) {
      for (int i = 0; i < R; ++i) dot[i] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * t));
        const __m256i qa = _mm256_sign_epi8(q, q);  // |q| as unsigned bytes (-128 -> 128)
        for (int i = 0; i < R; ++i) {
          const __m256i xs = _mm256_sign_epi8(bcast4(a.q + (r0 + i) * a.K + b * QK + 4 * t), q);
#ifdef VLLITE_GGUF_VNNI
          dot[i] = _mm256_dpbusd_epi32(dot[i], qa, xs);
#else
          dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xs), ones));
#endif
        }
      }
    } else {
      // VNNI: straight into int32; else int16 sums (at most 30480: no saturation) widened once per block.
      __m256i s16[R];
      for (int i = 0; i < R; ++i) dot[i] = s16[i] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * t));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < R; ++i) {
          const int8_t* xq = a.q + (r0 + i) * a.K + b * QK + 4 * t;
#ifdef VLLITE_GGUF_VNNI
          dot[i] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(dot[i], lo, bcast4(xq)), hi, bcast4(xq + 16));
#else
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, bcast4(xq)));
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, bcast4(xq + 16)));
#endif
        }
      }
#ifndef VLLITE_GGUF_VNNI
      for (int i = 0; i < R; ++i) dot[i] = _mm256_madd_epi16(s16[i], ones);
#endif
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + w.qbytes)));
    __m256 m;
    if constexpr (TYPE == GGML_Q4_1)
      m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + w.qbytes + 2 * G)));
    for (int i = 0; i < R; ++i) {
      const __m256 xd = _mm256_set1_ps(a.d[(r0 + i) * a.nb + b]);
      const __m256 v = _mm256_mul_ps(xd, _mm256_cvtepi32_ps(dot[i]));
      if constexpr (TYPE == GGML_Q8_0) {
        acc[i] = _mm256_fmadd_ps(d, v, acc[i]);
      } else {
        const __m256 xs = _mm256_set1_ps(a.s[(r0 + i) * a.nb + b]);
        if constexpr (TYPE == GGML_Q4_0)
          acc[i] = _mm256_fmadd_ps(d, _mm256_fnmadd_ps(_mm256_set1_ps(8.f), xs, v), acc[i]);
        else
          acc[i] = _mm256_add_ps(acc[i], _mm256_fmadd_ps(m, xs, _mm256_mul_ps(d, v)));
      }
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * ldo, acc[i]);
}

template <int64_t TYPE>
static void group_rows(int rows, const Weights& w, int64_t g, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  switch (rows) {
    case 4: group_tile<4, TYPE>(w, g, a, r0, out, ldo); break;
    case 3: group_tile<3, TYPE>(w, g, a, r0, out, ldo); break;
    case 2: group_tile<2, TYPE>(w, g, a, r0, out, ldo); break;
    default: group_tile<1, TYPE>(w, g, a, r0, out, ldo); break;
  }
}

// 8 bytes (one per row) as int32 lanes holding the value in both 16-bit halves (madd_epi16's multiplier).
static inline __m256i pair_u8(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(x, _mm256_slli_epi32(x, 16));
}
// Two sets of 8 int8 (one per row): lane r = (a[r], b[r]) as two int16.
static inline __m256i pair_s8(const uint8_t* a, const uint8_t* b) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
  const __m256i y = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm256_blend_epi16(x, _mm256_slli_epi32(y, 16), 0xAA);
}

// K-quants: out[i * ldo + 0..8] = the group's 8 outputs for input rows r0 .. r0 + R. Per super-block and half of
// 64 weights (h: the low nibbles, one 32-block; the high nibbles, the next), maddubs sums of a chunk's 4 weights
// of the 8 rows add up in int16 (Q4_K 8 chunks: at most 8 * 2 * 15 * 127 = 30480; Q5_K 4 chunks, 31 as the
// largest value; Q6_K 2 chunks, 63) and madd_epi16 widens them times the rows' integer scales; per 32-block one
// float FMA by the activation scale; per super-block the rows' d (and dmin times sum(m * xs)).
template <int R, int64_t TYPE>
static inline void kgroup_tile(const Weights& w, int64_t g, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  constexpr bool Q5 = TYPE == GGML_Q5_K, Q6 = TYPE == GGML_Q6_K;
  constexpr int FLUSH = Q6 ? 2 : Q5 ? 4 : 8;
  const KLayout L = klayout(TYPE);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), bit5 = _mm256_set1_epi8(0x10), bits56 = _mm256_set1_epi8(0x30);
  const uint8_t* rec = w.record(g, 0);
  for (int64_t sb = 0; sb < w.nb; ++sb, rec += w.rec) {
    const char* ahead = reinterpret_cast<const char*>(rec + 2 * w.rec);  // the group's stream, 2 records on
    for (int64_t o = 0; o < w.rec; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    __m256 accs[R], accm[R];
    for (int i = 0; i < R; ++i) accs[i] = accm[i] = _mm256_setzero_ps();
    for (int jj = 0; jj < 4; ++jj) {
      for (int h = 0; h < 2; ++h) {
        const int64_t b = sb * (QKK / QK) + 2 * jj + h;  // the activations' 32-block
        __m256i sc16[2], hb[2];
        if constexpr (Q6) {
          sc16[0] = pair_s8(rec + L.sc + 8 * (4 * jj + 2 * h), rec + L.sc + 8 * (4 * jj + 2 * h));
          sc16[1] = pair_s8(rec + L.sc + 8 * (4 * jj + 2 * h + 1), rec + L.sc + 8 * (4 * jj + 2 * h + 1));
          for (int u = 0; u < 2; ++u)
            hb[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 1024 + 32 * (4 * jj + 2 * h + u)));
        } else {
          sc16[0] = sc16[1] = pair_u8(rec + L.sc + 8 * (2 * jj + h));
          if constexpr (Q5) hb[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 1024 + 32 * (2 * jj + h)));
        }
        __m256i s16[R], d32[R];
        for (int i = 0; i < R; ++i) s16[i] = d32[i] = _mm256_setzero_si256();
        __m256i hcur = Q5 ? hb[0] : _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * (8 * jj + c)));
          __m256i q = h ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
          if constexpr (Q5) {  // bit c of each byte to bit 4
            q = _mm256_or_si256(q, _mm256_and_si256(_mm256_slli_epi16(hcur, 4), bit5));
            hcur = _mm256_srli_epi16(hcur, 1);
          }
          if constexpr (Q6) {  // bits 2c', 2c' + 1 of each byte to bits 4, 5
            if (c % 4 == 0) hcur = hb[c / 4];
            q = _mm256_or_si256(q, _mm256_and_si256(_mm256_slli_epi16(hcur, 4), bits56));
            hcur = _mm256_srli_epi16(hcur, 2);
          }
          for (int i = 0; i < R; ++i)
            s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(q, bcast4(a.q + (r0 + i) * a.K + b * QK + 4 * c)));
          if ((c + 1) % FLUSH == 0) {
            const __m256i sc = sc16[Q6 ? c / 4 : 0];
            for (int i = 0; i < R; ++i) {
              d32[i] = _mm256_add_epi32(d32[i], _mm256_madd_epi16(s16[i], sc));
              s16[i] = _mm256_setzero_si256();
            }
          }
        }
        if constexpr (Q6) {  // - 32 * (sc_u0 * sum16_0 + sc_u1 * sum16_1)
          const __m256i pairs = pair_s8(rec + L.sc + 8 * (4 * jj + 2 * h), rec + L.sc + 8 * (4 * jj + 2 * h + 1));
          for (int i = 0; i < R; ++i) {
            const __m256i bs = _mm256_set1_epi32(static_cast<int32_t>(a.bs[(r0 + i) * a.nb + b]));
            d32[i] = _mm256_sub_epi32(d32[i], _mm256_slli_epi32(_mm256_madd_epi16(pairs, bs), 5));
          }
        }
        __m256 mf = _mm256_setzero_ps();
        if constexpr (!Q6)
          mf = _mm256_cvtepi32_ps(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + L.mn + 8 * (2 * jj + h)))));
        for (int i = 0; i < R; ++i) {
          accs[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32[i]), _mm256_set1_ps(a.d[(r0 + i) * a.nb + b]), accs[i]);
          if constexpr (!Q6) accm[i] = _mm256_fmadd_ps(mf, _mm256_set1_ps(a.s[(r0 + i) * a.nb + b]), accm[i]);
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L.d)));
    for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(d, accs[i], acc[i]);
    if constexpr (!Q6) {
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L.dmin)));
      for (int i = 0; i < R; ++i) acc[i] = _mm256_fnmadd_ps(dmin, accm[i], acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * ldo, acc[i]);
}

template <int64_t TYPE>
static void kgroup_rows(int rows, const Weights& w, int64_t g, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  switch (rows) {
    case 4: kgroup_tile<4, TYPE>(w, g, a, r0, out, ldo); break;
    case 3: kgroup_tile<3, TYPE>(w, g, a, r0, out, ldo); break;
    case 2: kgroup_tile<2, TYPE>(w, g, a, r0, out, ldo); break;
    default: kgroup_tile<1, TYPE>(w, g, a, r0, out, ldo); break;
  }
}

// A chunk's 32 bytes (4 weights of 8 rows, byte 4r + i) reordered to 8 bytes (rows 0..7) per weight: the shuffle
// makes each 128-bit lane's 4 rows x 4 bytes 4 bytes (rows) per weight, the permute puts the two lanes' rows side
// by side. Stored to bytes[32]: bytes[8i + r] = row r's weight i.
static inline void rows_by_weight(__m256i v, uint8_t* bytes) {
  const __m256i tr = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,  //
                                      0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, tr), lanes));
}

static inline __m256 u8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Each byte's bits [shift, shift + width) moved to bits [4, 4 + width): a Q5_K / Q6_K value's high bits (klayout).
static inline __m256i high_bits(__m256i v, int64_t shift, int width) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << width) - 1));
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi64_si128(shift)), mask), 4);
}

// A K-quant record's 256 x 8 weights as float32, k-major (out[k * ldo + r]), 8 rows a vector: gguf.quants' values
// and float32 operations in its order, (d * sc) * q - (dmin * m), or (d * sc) * (q - 32) for Q6_K.
static void kq_dequant_record_avx2(int64_t type, const uint8_t* rec, float* out, int64_t ldo) {
  const KLayout L = klayout(type);
  const bool q6 = type == GGML_Q6_K;
  const __m256i low = _mm256_set1_epi8(0x0f), v32 = _mm256_set1_epi32(32);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L.d)));
  const __m256 dmin =
      q6 ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L.dmin)));
  alignas(32) uint8_t bytes[32];
  for (int64_t jj = 0; jj < 4; ++jj)
    for (int64_t h = 0; h < 2; ++h) {  // weights 64jj + 32h .. + 31: one sub-block of 32 (two of 16 for Q6_K)
      __m256 sc = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
      if (!q6) {
        sc = _mm256_mul_ps(d, u8x8_ps(rec + L.sc + 8 * (2 * jj + h)));
        mn = _mm256_mul_ps(dmin, u8x8_ps(rec + L.mn + 8 * (2 * jj + h)));
      }
      for (int64_t c = 0; c < 8; ++c) {  // weights 64jj + 32h + 4c + i, i < 4
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * (8 * jj + c)));
        __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low);
        if (type == GGML_Q5_K)
          q = _mm256_or_si256(
              q, high_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 1024 + 32 * (2 * jj + h))), c, 1));
        if (q6) {
          const int64_t sub16 = 4 * jj + 2 * h + c / 4;  // its high bits' vector and its scales (one per 16 weights)
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 1024 + 32 * sub16));
          q = _mm256_or_si256(q, high_bits(hb, 2 * (c % 4), 2));
          const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + L.sc + 8 * sub16));
          sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)));
        }
        rows_by_weight(q, bytes);
        for (int64_t i = 0; i < 4; ++i) {
          const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i)));
          const __m256 x = q6 ? _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_sub_epi32(qi, v32)))
                              : _mm256_sub_ps(_mm256_mul_ps(sc, _mm256_cvtepi32_ps(qi)), mn);
          _mm256_storeu_ps(out + (64 * jj + 32 * h + 4 * c + i) * ldo, x);
        }
      }
    }
}

// A record's 32 x 8 weights as float32 (the dequantised load's values), k-major: out[k * ldo + r], r < 8.
static inline void dequant_record(const Weights& w, const uint8_t* rec, float* out, int64_t ldo) {
  if (is_kquant(w.type)) {  // 256 weights
    kq_dequant_record_avx2(w.type, rec, out, ldo);
    return;
  }
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + w.qbytes)));
  const __m256 m = w.type == GGML_Q4_1
                       ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + w.qbytes + 2 * G)))
                       : _mm256_setzero_ps();
  const __m256 eight = _mm256_set1_ps(8.f);
  alignas(32) uint8_t bytes[32];
  auto emit = [&](__m256i v, int64_t k0, bool is_signed) {  // v: 4 weights k0.. of the 8 rows, as 4r + i
    rows_by_weight(v, bytes);
    for (int64_t i = 0; i < 4; ++i) {
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i));
      const __m256 f = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b8) : _mm256_cvtepu8_epi32(b8));
      __m256 x;
      if (w.type == GGML_Q4_0)
        x = _mm256_mul_ps(d, _mm256_sub_ps(f, eight));
      else if (w.type == GGML_Q4_1)
        x = _mm256_add_ps(_mm256_mul_ps(d, f), m);
      else
        x = _mm256_mul_ps(d, f);
      _mm256_storeu_ps(out + (k0 + i) * ldo, x);
    }
  };
  if (w.type == GGML_Q8_0) {
    for (int64_t t = 0; t < 8; ++t)
      emit(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * t)), 4 * t, true);
  } else {
    for (int64_t t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * t));
      emit(_mm256_and_si256(v, low), 4 * t, false);
      emit(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), 16 + 4 * t, false);
    }
  }
}

constexpr int64_t NR = 16;  // columns per float32 panel (gemm.cpp's): two groups

// panel [K][16] float32 = the weights of groups 2p and 2p + 1 (zero past the last group), gemm.cpp's panel layout.
static void dequant_panel(const Weights& w, int64_t groups, int64_t p, float* panel) {
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t g = 2 * p + h;
    for (int64_t b = 0; b < w.nb; ++b) {
      float* o = panel + b * w.per * NR + h * G;
      if (g < groups) {
        dequant_record(w, w.record(g, b), o, NR);
      } else {
        for (int64_t k = 0; k < w.per; ++k) _mm256_storeu_ps(o + k * NR, _mm256_setzero_ps());
      }
    }
  }
}
#endif

#ifdef VLLITE_GGUF_BF16
constexpr int64_t NB16 = 32;  // columns per bfloat16 panel (gemm.cpp's bf16 GEMM): four groups

// 16 finite float32 values rounded to bfloat16 (to nearest, ties to even: torch's .to(torch.bfloat16)), as the
// low 16 bits of each 32-bit lane.
static inline __m512i bf16_bits(__m512 v) { return _mm512_srli_epi32(bf16_round_high(v), 16); }

// panel [K / 2][32][2] bfloat16 (gemm.cpp's bf16 panel layout) = the weights of groups 4p .. 4p + 3 (zero past the
// last group): the dequantised load's float32 values rounded as its .to(torch.bfloat16) rounds them, so the sums
// are those of the bf16 GEMM on the dequantised bfloat16 weight. tmp: w.per x 32 floats (one record of the 4
// groups).
static void dequant_panel_bf16(const Weights& w, int64_t groups, int64_t p, uint16_t* panel, float* tmp) {
  for (int64_t b = 0; b < w.nb; ++b) {
    for (int64_t h = 0; h < 4; ++h) {
      const int64_t g = 4 * p + h;
      if (g < groups) {
        dequant_record(w, w.record(g, b), tmp + h * G, NB16);
      } else {
        for (int64_t k = 0; k < w.per; ++k) _mm256_storeu_ps(tmp + k * NB16 + h * G, _mm256_setzero_ps());
      }
    }
    uint16_t* dst = panel + b * w.per * NB16;  // the record's pairs of k
    for (int64_t kk = 0; kk < w.per / 2; ++kk)
      for (int64_t c = 0; c < NB16; c += 16) {  // k = 2kk in the low half of each column's 32 bits, 2kk + 1 above
        const __m512i lo = bf16_bits(_mm512_loadu_ps(tmp + 2 * kk * NB16 + c));
        const __m512i hi = bf16_bits(_mm512_loadu_ps(tmp + (2 * kk + 1) * NB16 + c));
        _mm512_storeu_si512(dst + (kk * NB16 + c) * 2, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
  }
}
#endif

}  // namespace gguf_impl

// out [M, N] = x [M, K] @ W^T (+ float32 bias), W given by its GGUF blocks (the layout above); x and out both
// float32 or both bfloat16. From gemm_min_rows rows on (AVX2 variants), dequantised panels and the float32 GEMM
// instead (the caller's choice: kernels.py's GGUF_GEMM_MIN_ROWS); below, a call over grain_bytes of blocks (times
// row tiles) is split. bfloat16 is float32 on the widened input, rounded once at the end, except from
// gemm_min_rows rows on where the CPU has AVX512-BF16: there bfloat16 panels and the bf16 GEMM's tiles (the
// dequantised bfloat16 model's arithmetic, at about twice the float32 GEMM's rate).
void gguf_linear_x8(at::Tensor out, at::Tensor x, int64_t type, at::Tensor blocks, std::optional<at::Tensor> bias,
                    int64_t gemm_min_rows, int64_t grain_bytes) {
  using namespace gguf_impl;
  TORCH_CHECK(type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0 || is_kquant(type),
              "gguf_linear: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && blocks.dim() == 2 && x.is_contiguous() && out.is_contiguous()
                  && blocks.is_contiguous() && (bf16 || x.scalar_type() == at::kFloat)
                  && out.scalar_type() == x.scalar_type() && blocks.scalar_type() == at::kByte,
              "gguf_linear: contiguous x [M, K] and out [M, N], both float32 or both bfloat16; contiguous uint8 blocks");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(0) == M ? out.size(1) : -1;
  const bool kq = is_kquant(type);
  const Weights w = weights_of(type, K, blocks.data_ptr<uint8_t>());
  const int64_t nb = K / QK, groups = (N + G - 1) / G;
  TORCH_CHECK(N >= 0 && K % w.per == 0 && blocks.size(0) == groups && blocks.size(1) == w.nb * w.rec,
              "gguf_linear: shapes (K a multiple of 32, of 256 for K-quants; blocks [ceil(N / 8), K / (32 or 256) * "
              "record bytes])");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, "gguf_linear: bias");
    bp = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  if (bf16) {
#ifdef VLLITE_GGUF_BF16
    if (M >= gemm_min_rows) {
      // Tasks (panel, row block), a panel's row blocks in a row: each thread dequantises a panel once per run.
      constexpr int64_t MC = 120;  // gemm.cpp's bf16 row block
      const int64_t P = (N + NB16 - 1) / NB16, row_blocks = (M + MC - 1) / MC;
      const auto* A = reinterpret_cast<const uint16_t*>(x.data_ptr());
      auto* C = reinterpret_cast<uint16_t*>(out.data_ptr());
      split_for(P * row_blocks, 1, [&](int64_t tb, int64_t te) {
        std::vector<uint16_t> panel(K * NB16);
        std::vector<float> tmp(QKK * NB16);
        int64_t have = -1;
        for (int64_t t = tb; t < te; ++t) {
          const int64_t p = t / row_blocks, m0 = (t % row_blocks) * MC, m1 = std::min(M, m0 + MC), n0 = p * NB16;
          if (p != have) dequant_panel_bf16(w, groups, have = p, panel.data(), tmp.data());
          bf16_gemm_panel(A + m0 * K, m1 - m0, K, panel.data(), C + m0 * N + n0, N, bp ? bp + n0 : nullptr,
                          std::min(NB16, N - n0));
        }
      });
      return;
    }
#endif
    at::Tensor wide = at::empty({M, N}, out.options().dtype(at::kFloat));
    gguf_linear_x8(wide, x.to(at::kFloat), type, blocks, bias, gemm_min_rows, grain_bytes);
    out.copy_(wide);
    return;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();

#ifdef VLLITE_GGUF_AVX2
  if (M >= gemm_min_rows) {
    // Many rows: each task dequantises one 16-column panel to float32 (in L1/L2) and runs the float32 GEMM
    // micro-kernel over its row block; the weights are still read as blocks, and the input is not rounded.
    constexpr int64_t MC = 96;
    const int64_t P = (groups + 1) / 2, row_blocks = (M + MC - 1) / MC;
    split_for(row_blocks * P, 1, [&](int64_t tb, int64_t te) {
      std::vector<float> panel_buf(K * NR + 8);
      float* panel = panel_buf.data();
      for (int64_t t = tb; t < te; ++t) {
        const int64_t m0 = (t / P) * MC, m1 = std::min(M, m0 + MC), p = t % P, n0 = p * NR;
        dequant_panel(w, groups, p, panel);
        avx2_gemm_panel(xp + m0 * K, m1 - m0, K, panel, op + m0 * N + n0, N, bp ? bp + n0 : nullptr,
                        std::min(NR, N - n0));
      }
    });
    return;
  }
#endif
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  for (int64_t r = 0; r < M; ++r)
    quantize_row(xp + r * K, nb, xq.data() + r * K, xd.data() + r * nb, xs.data() + r * nb);
  std::vector<uint32_t> bs(type == GGML_Q6_K ? M * nb : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(bs.size()); ++i) {  // Q6_K: sums of each half of each block
    const int8_t* qb = xq.data() + i * QK;
    int32_t lo = 0, hi = 0;
    for (int64_t j = 0; j < QK / 2; ++j) lo += qb[j], hi += qb[QK / 2 + j];
    bs[i] = (static_cast<uint32_t>(static_cast<uint16_t>(lo))) | (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
  }
  const Acts a{xq.data(), xd.data(), xs.data(), bs.data(), K, nb};

  // Each thread a contiguous run of groups (one stream), all input rows; small calls on this thread alone.
  const int64_t group_bytes = w.nb * w.rec * ((M + RM - 1) / RM);
  const int64_t grain = std::max<int64_t>(1, (grain_bytes + group_bytes - 1) / group_bytes);
  split_for(groups, grain, [&](int64_t gb, int64_t ge) {
    alignas(32) float tmp[RM * G];
    for (int64_t g = gb; g < ge; ++g) {
      const int64_t n0 = g * G, cols = std::min(G, N - n0);
      for (int64_t r = 0; r < M; r += RM) {
        const int rows = static_cast<int>(std::min(RM, M - r));
        const bool direct = cols == G;  // a full group writes straight into out
        float* o = direct ? op + r * N + n0 : tmp;
        const int64_t ldo = direct ? N : G;
#ifdef VLLITE_GGUF_AVX2
        if (type == GGML_Q4_K)
          kgroup_rows<GGML_Q4_K>(rows, w, g, a, r, o, ldo);
        else if (type == GGML_Q5_K)
          kgroup_rows<GGML_Q5_K>(rows, w, g, a, r, o, ldo);
        else if (type == GGML_Q6_K)
          kgroup_rows<GGML_Q6_K>(rows, w, g, a, r, o, ldo);
        else if (type == GGML_Q8_0)
          group_rows<GGML_Q8_0>(rows, w, g, a, r, o, ldo);
        else if (type == GGML_Q4_1)
          group_rows<GGML_Q4_1>(rows, w, g, a, r, o, ldo);
        else
          group_rows<GGML_Q4_0>(rows, w, g, a, r, o, ldo);
#else
        if (kq)
          kgroup_scalar(w, g, a, r, rows, o, ldo);
        else
          group_scalar(w, g, a, r, rows, o, ldo);
#endif
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < cols; ++c) {
            const float v = o[i * ldo + c];
            op[(r + i) * N + n0 + c] = bp ? v + bp[n0 + c] : v;
          }
      }
    }
  });
}

// out [T, K] (float32 or bfloat16) = rows ids[0:T] of the weight W [N, K] given by its GGUF blocks: an embedding
// table kept as blocks (quantization="gguf"), looked up without its float copy. Each value is the dequantised
// load's (gguf.quants' float32 operations in its order: Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m; K-quants
// (d * sc) * q - (dmin * m), Q6_K (d * sc) * (q - 32)), then rounded to bfloat16 as .to(torch.bfloat16) rounds it.
// Plain C++ per value: a prompt's rows are a few hundred thousand values, a decode step's a few thousand.
void gguf_rows(at::Tensor out, at::Tensor ids, int64_t type, at::Tensor blocks) {
  using namespace gguf_impl;
  TORCH_CHECK(type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0 || is_kquant(type),
              "gguf_rows: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous()
                  && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && ids.dim() == 1
                  && ids.is_contiguous() && ids.scalar_type() == at::kLong && ids.size(0) == out.size(0)
                  && blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte,
              "gguf_rows: contiguous out [T, K] float32 or bfloat16, int64 ids [T], uint8 blocks");
  const int64_t T = out.size(0), K = out.size(1), groups = blocks.size(0);
  const bool kq = is_kquant(type);
  const Weights w = weights_of(type, K, blocks.data_ptr<uint8_t>());
  TORCH_CHECK(K % w.per == 0 && blocks.size(1) == w.nb * w.rec,
              "gguf_rows: blocks [groups, K / (32 or 256) * record bytes]");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < groups * G, "gguf_rows: id ", ip[t], " outside the table's ", groups * G,
                " rows");
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  auto* ob = bf16 ? reinterpret_cast<c10::BFloat16*>(out.data_ptr()) : nullptr;
  at::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t tb, int64_t te) {
    std::vector<float> row(K);
    for (int64_t t = tb; t < te; ++t) {
      const int64_t g = ip[t] / G, r = ip[t] % G;
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* p = w.record(g, b);
        float* o = row.data() + b * w.per;
        if (kq) {
          const KLayout L = klayout(type);
          const float d = half_at(p + L.d, r);
          const int64_t sub = type == GGML_Q6_K ? 16 : 32;
          for (int64_t j = 0; j < w.per / sub; ++j) {
            const float ds = d * static_cast<float>(kq_scale(type, p, r, j));
            if (type == GGML_Q6_K) {
              for (int64_t k = j * sub; k < (j + 1) * sub; ++k)
                o[k] = ds * (static_cast<float>(kq_value(type, p, r, k)) - 32.f);
            } else {
              const float dm = half_at(p + L.dmin, r) * static_cast<float>(kq_min(type, p, r, j));
              for (int64_t k = j * sub; k < (j + 1) * sub; ++k)
                o[k] = ds * static_cast<float>(kq_value(type, p, r, k)) - dm;
            }
          }
        } else {
          const float d = half_at(p + w.qbytes, r);
          for (int64_t k = 0; k < QK; ++k) {
            const float q = static_cast<float>(weight_at(w, p, r, k));
            o[k] = type == GGML_Q4_0   ? d * (q - 8.f)
                   : type == GGML_Q4_1 ? d * q + half_at(p + w.qbytes + 2 * G, r)
                                       : d * q;
          }
        }
      }
      if (bf16)
        for (int64_t k = 0; k < K; ++k) ob[t * K + k] = static_cast<c10::BFloat16>(row[k]);
      else
        std::memcpy(of + t * K, row.data(), K * sizeof(float));
    }
  });
}

// out [ceil(N / 8), N_sb * record] (uint8, zeros) = GGUF K-quant blocks raw [N, N_sb * block bytes] (Q4_K 144, Q5_K
// 176, Q6_K 210 bytes a super-block) as the records described at klayout: model_registry/layers/quantization/
// kquants.py's pack_kquant(decode_blocks(raw)) byte for byte, without numpy's passes over [N, K] arrays (a
// Llama-1B Q4_K_M file's tensors: ~3.7 s of the start). Rows past N stay zero.
void gguf_repack_kquant(at::Tensor out, at::Tensor raw, int64_t type) {
  using namespace gguf_impl;
  TORCH_CHECK(is_kquant(type), "gguf_repack_kquant: type must be Q4_K, Q5_K or Q6_K");
  const int64_t bb = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;
  const KLayout L = klayout(type);
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.size(1) % bb == 0
                  && out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kByte,
              "gguf_repack_kquant: contiguous uint8 raw [N, super-blocks * block bytes] and out");
  const int64_t N = raw.size(0), nsb = raw.size(1) / bb, groups = (N + G - 1) / G;
  TORCH_CHECK(out.size(0) == groups && out.size(1) == nsb * L.rec, "gguf_repack_kquant: out [ceil(N / 8), "
              "super-blocks * record bytes]");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) {
    uint8_t q[QKK], sc[16], mn[8];
    for (int64_t g = gb; g < ge; ++g)
      for (int64_t r = 0; r < G && g * G + r < N; ++r)
        for (int64_t s = 0; s < nsb; ++s) {
          const uint8_t* b = src + (g * G + r) * nsb * bb + s * bb;
          uint8_t* rec = dst + (g * nsb + s) * L.rec;
          int64_t nsub = 8;
          if (type == GGML_Q6_K) {  // ql 128, qh 64, 16 int8 scales, fp16 d
            for (int64_t h2 = 0; h2 < 2; ++h2)
              for (int64_t i = 0; i < 64; ++i) {
                const uint8_t lo = b[64 * h2 + i];
                q[128 * h2 + i] = lo & 15;
                q[128 * h2 + 64 + i] = lo >> 4;
              }
            for (int64_t h2 = 0; h2 < 2; ++h2)
              for (int64_t t = 0; t < 4; ++t)
                for (int64_t i = 0; i < 32; ++i)
                  q[128 * h2 + 32 * t + i] |= ((b[128 + 32 * h2 + i] >> (2 * t)) & 3) << 4;
            nsub = 16;
            for (int64_t j = 0; j < 16; ++j) sc[j] = b[192 + j];
            std::memcpy(rec + L.d + 2 * r, b + 208, 2);
          } else {  // fp16 d and dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 of 5th bits), 128 of nibbles
            const uint8_t* s6 = b + 4;
            for (int64_t j = 0; j < 4; ++j) {
              sc[j] = s6[j] & 63;
              mn[j] = s6[4 + j] & 63;
              sc[4 + j] = (s6[8 + j] & 15) | ((s6[j] >> 6) << 4);
              mn[4 + j] = (s6[8 + j] >> 4) | ((s6[4 + j] >> 6) << 4);
            }
            const uint8_t* qs = b + bb - 128;
            for (int64_t c4 = 0; c4 < 4; ++c4)
              for (int64_t i = 0; i < 32; ++i) {
                q[64 * c4 + i] = qs[32 * c4 + i] & 15;
                q[64 * c4 + 32 + i] = qs[32 * c4 + i] >> 4;
              }
            if (type == GGML_Q5_K)
              for (int64_t j = 0; j < 8; ++j)
                for (int64_t i = 0; i < 32; ++i) q[32 * j + i] |= ((b[16 + i] >> j) & 1) << 4;
            for (int64_t j = 0; j < 8; ++j) rec[L.mn + 8 * j + r] = mn[j];
            std::memcpy(rec + L.d + 2 * r, b, 2);
            std::memcpy(rec + L.dmin + 2 * r, b + 2, 2);
          }
          for (int64_t j = 0; j < nsub; ++j) rec[L.sc + 8 * j + r] = sc[j];
          for (int64_t k = 0; k < QKK; ++k) {
            const int64_t jj = k / 64, h = (k % 64) / 32, c = (k % 32) / 4, byte = 4 * r + k % 4;
            rec[32 * (8 * jj + c) + byte] |= static_cast<uint8_t>((q[k] & 15) << (4 * h));
            const int high = q[k] >> 4;
            if (type == GGML_Q5_K) rec[1024 + 32 * (2 * jj + h) + byte] |= static_cast<uint8_t>((high & 1) << c);
            if (type == GGML_Q6_K)
              rec[1024 + 32 * (4 * jj + 2 * h + c / 4) + byte] |= static_cast<uint8_t>((high & 3) << (2 * (c % 4)));
          }
        }
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
