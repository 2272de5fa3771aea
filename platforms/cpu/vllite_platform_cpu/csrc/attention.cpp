// Paged attention for the CPU platform, compiled once per ISA variant (setup.py; kernels.py as a fallback).
//
// Tasks are (request, 16-row query tile) with all KV heads, or one KV head each when there are too few
// tiles to busy the threads; a one-row tile (a decode token) takes the streaming ``decode_row`` path.
// Scores and sums are float32 whatever the cache dtype; softmax is online across key chunks.
// The cache may be float8 (e4m3fn or e5m2) under a float32 or bfloat16 query: its bytes are widened in
// registers (cache_load), the per-layer k_scale is folded into the query and v_scale into the output.
#include <ATen/ops/from_blob.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/logaddexp.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "team.h"

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

template <typename T>
static inline float to_f(T x) {
  return static_cast<float>(x);
}

// (AVec, VL and avec_load: common.h, shared with pointwise.cpp.)

template <typename C>
constexpr bool kFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

// VL cache elements as float32. float8 bytes become float16 bit patterns (e5m2 is the top byte of a
// float16; e4m3fn's exponent and mantissa shifted under a float16 exponent field give the value times
// 2^-8, subnormals included) that F16C / AVX-512 widen; the default variant converts one at a time.
// (e4m3fn's NaN byte reads as 480: writes saturate, so the cache holds none.)
template <typename C>
static inline AVec cache_load(const C* p) {
  if constexpr (kFp8<C>) {
    constexpr bool e5m2 = std::is_same_v<C, c10::Float8_e5m2>;
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = e5m2 ? _mm256_slli_epi16(w, 8)
                           : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                             _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    const AVec f(_mm512_cvtph_ps(h));
    return e5m2 ? f : f * AVec(256.f);
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = e5m2 ? _mm_slli_epi16(w, 8)
                           : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                          _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
    const AVec f(_mm256_cvtph_ps(h));
    return e5m2 ? f : f * AVec(256.f);
#else
    float lanes[VL];
    for (int64_t j = 0; j < VL; ++j) lanes[j] = static_cast<float>(p[j]);
    return AVec::loadu(lanes);
#endif
  } else {
    return avec_load(p);
  }
}

// Head sizes that are whole vectors take the vector path; others (and float64) the scalar loops.
template <typename T, int DC>
constexpr bool kVecHead = DC > 0 && DC % VL == 0 && !std::is_same_v<T, double>;

static inline float hsum(const AVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  float lanes[VL];
  v.store(lanes);
  float s = 0.f;
  for (int64_t j = 0; j < VL; ++j) s += lanes[j];
  return s;
#endif
}

// dot(q, k) over n elements with 8 independent partial sums (the scalar path: head sizes that are not
// whole vectors).
template <typename T>
static inline float dot_scalar(const float* q, const T* k, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += q[d + j] * to_f(k[d + j]);
  float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; d < n; ++d) s += q[d] * to_f(k[d]);
  return s;
}

// out[k] = sum of the lanes of a[k], k < 16. With AVX-512 the 16 are reduced together by a
// transpose-and-add (about 3 shuffles/adds per key instead of a full horizontal sum each).
static inline void reduce16(AVec* a, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [k0, k1, k0, k1] partial sums of the pair
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: keys 4j..4j+3
    c[j] =
        _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0x44), _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0xEE));
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD)));
#elif defined(CPU_CAPABILITY_AVX2)
  // 8 keys at a time: two rounds of pairwise horizontal adds leave each 128-bit half holding 4 keys'
  // partial sums; the halves of two such vectors are then added (7 shuffles/adds per 8 keys instead
  // of a store and 7 scalar adds per key).
  for (int g = 0; g < 2; ++g) {
    __m256 v[8];
    for (int i = 0; i < 8; ++i) v[i] = a[8 * g + i];
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_storeu_ps(out + 8 * g,
                     _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  }
#else
  for (int k = 0; k < 16; ++k) out[k] = hsum(a[k]);
#endif
}

// out[k] = dot(q, rows[k]) * scale for 16 cache rows of DC elements, read as stored. bfloat16 rows on a
// CPU with AVX512-BF16 multiply the query's own bfloat16 values pairwise (vdpbf16ps, float32 sums);
// otherwise rows are widened in registers and multiplied with the float32 query.
template <typename T, typename C, int DC>
static inline void dots16(const C* const* rows, const float* qv, const T* qraw, float scale, float* out) {
  AVec a[16];
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && DC % 32 == 0) {
    constexpr int64_t NB = DC / 32;
    __m512bh qb[NB];
    for (int64_t v = 0; v < NB; ++v) qb[v] = (__m512bh)_mm512_loadu_si512(qraw + v * 32);
    for (int k = 0; k < 16; ++k) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t v = 0; v < NB; ++v)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(rows[k] + v * 32), qb[v]);
      a[k] = acc;
    }
    reduce16(a, out);
    const AVec sv(scale);
    (AVec::loadu(out) * sv).store(out);
    return;
  }
#endif
  constexpr int64_t NV = DC / VL;
  AVec qr[NV];
  for (int64_t v = 0; v < NV; ++v) qr[v] = AVec::loadu(qv + v * VL);
  for (int k = 0; k < 16; ++k) {
    AVec s = cache_load(rows[k]) * qr[0];
    for (int64_t v = 1; v < NV; ++v) s = at::vec::fmadd(cache_load(rows[k] + v * VL), qr[v], s);
    a[k] = s;
  }
  reduce16(a, out);
}

// sg[j] = exp(sg[j] - m), a vector at a time (ATen's vectorised exp; scalar exp took a fifth of a
// batch-64 decode step).
static inline void softmax_exp(float* sg, int64_t n, float m) {
  const AVec mv(m);
  for (int64_t j = 0; j < n; j += VL) {
    const int64_t c = std::min<int64_t>(VL, n - j);
    (AVec::loadu(sg + j, c) - mv).exp().store(sg + j, c);
  }
}

// The cache rows of one request, position by position, without a division per position.
template <typename T>
struct RowWalk {
  const T* base;
  const int32_t* blocks;
  int64_t bs, s0, s1, b, off;
  RowWalk(const T* base_, const int32_t* blocks_, int64_t bs_, int64_t s0_, int64_t s1_, int64_t t)
      : base(base_), blocks(blocks_), bs(bs_), s0(s0_), s1(s1_), b(t / bs_), off(t % bs_) {}
  const T* row() const { return base + blocks[b] * s0 + off * s1; }
  void next() {
    if (++off == bs) {
      off = 0;
      ++b;
    }
  }
};

// Fetch HG head rows of D elements (s2 apart) into the cache: locality 3 (all levels) for rows read
// next, 2 (L2 and out) for later; __builtin_prefetch is portable (x86's T0 / T1, AArch64's PRFM).
template <typename T, int LOCALITY>
static inline void prefetch_rows(const T* row, int64_t HG, int64_t s2, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t h = 0; h < HG; ++h) {
    const char* p = reinterpret_cast<const char*>(row + h * s2);
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, LOCALITY);
  }
}

static inline float vmax(const float* x, int64_t n) {
  int64_t j = 0;
  float m = -INFINITY;
  if (n >= VL) {
    AVec mv = AVec::loadu(x);
    for (j = VL; j + VL <= n; j += VL) mv = at::vec::maximum(mv, AVec::loadu(x + j));
    float lanes[VL];
    mv.store(lanes);
    for (int64_t i = 0; i < VL; ++i) m = std::max(m, lanes[i]);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

static inline float vsum(const float* x, int64_t n) {
  AVec sv(0.f);
  int64_t j = 0;
  for (; j + VL <= n; j += VL) sv = sv + AVec::loadu(x + j);
  float s = hsum(sv);
  for (; j < n; ++j) s += x[j];
  return s;
}

// The partial-sum vectors of NQ query heads (qv, D floats apart) against one key row in registers (kv),
// each as two interleaved FMA chains: 2 * NQ independent chains hide the FMA latency that one 8-deep
// chain per head exposed. Stored 16 vectors apart (dst: [head][16 positions][VL]).
template <int NQ, int64_t NV>
static inline void dots_g(const AVec* kv, const float* qv, int64_t D, float* dst) {
  AVec s0[NQ], s1[NQ];
  for (int i = 0; i < NQ; ++i) {
    s0[i] = kv[0] * AVec::loadu(qv + i * D);
    s1[i] = NV > 1 ? kv[1] * AVec::loadu(qv + i * D + VL) : AVec(0.f);
  }
  for (int64_t v = 2; v < NV; v += 2)
    for (int i = 0; i < NQ; ++i) {
      s0[i] = at::vec::fmadd(kv[v], AVec::loadu(qv + i * D + v * VL), s0[i]);
      if (v + 1 < NV) s1[i] = at::vec::fmadd(kv[v + 1], AVec::loadu(qv + i * D + (v + 1) * VL), s1[i]);
    }
  for (int i = 0; i < NQ; ++i) (s0[i] + s1[i]).store(dst + i * 16 * VL);
}

// The value accumulators of NQ query heads (acc rows D floats apart; weights p, rows pstride apart) over m
// value rows: each row widened once for all NQ heads. Per head the same fused multiply-adds in the same order
// as one head at a time.
template <int NQ, int64_t NV, typename C>
static inline void values_g(const C* const* vrows, int64_t m, const float* p, int64_t pstride, float* acc, int64_t D) {
  AVec a[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < NV; ++v) a[i][v] = AVec::loadu(acc + i * D + v * VL);
  for (int64_t k = 0; k < m; ++k) {
    AVec vv[NV];
    for (int64_t v = 0; v < NV; ++v) vv[v] = cache_load(vrows[k] + v * VL);
    for (int i = 0; i < NQ; ++i) {
      const AVec wt(p[i * pstride + k]);
      for (int64_t v = 0; v < NV; ++v) a[i][v] = at::vec::fmadd(wt, vv[v], a[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < NV; ++v) a[i][v].store(acc + i * D + v * VL);
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
// decode_row's values on AVX512-BF16 (a bfloat16 cache and query): the value rows of two positions interleaved
// word by word (vpunpck{l,h}wd) make bfloat16 pairs (v[t][d], v[t + 1][d]) that one vdpbf16ps multiplies by the
// pair (p[t], p[t + 1]) of the state's weights rounded to bfloat16 (pw: one pair per dword, as torch's CPU flash
// attention rounds its exponentials before multiplying by V): one instruction per 16 dims and 2 positions where
// values_g widens each row (2 instructions per 16 dims) and does 2 fused multiply-adds. The rounding's cost: the
// batch-64 step's output 5.67e-4 RMS from a float64 reference against 5.01e-4 (bfloat16's own rounding of the
// exact result, which the float32 weights reach). Splitting each weight into two bfloat16 (nearest + rest, two
// vdpbf16ps) reached 5.01e-4 too, but that step took 12 ms from DRAM against 9 (docs/benchmarks.md). m is even. The
// accumulators' lanes are in the interleaving's order: acc[16 * (2 * v + s) + 4 * l + j] holds dim
// 32 * v + 8 * l + 4 * s + j, which decode_row undoes when it writes the output.
template <int NQ, int64_t NB>
static inline void values_bf16(const c10::BFloat16* const* vrows, int64_t m, const uint32_t* pw, int64_t pstride,
                               float* acc, int64_t D) {
  __m512 a[NQ][2 * NB];
  for (int i = 0; i < NQ; ++i)
    for (int64_t u = 0; u < 2 * NB; ++u) a[i][u] = _mm512_loadu_ps(acc + i * D + u * 16);
  for (int64_t k = 0; k < m; k += 2) {
    __m512i x[2 * NB];
    for (int64_t v = 0; v < NB; ++v) {
      const __m512i r0 = _mm512_loadu_si512(vrows[k] + v * 32), r1 = _mm512_loadu_si512(vrows[k + 1] + v * 32);
      x[2 * v] = _mm512_unpacklo_epi16(r0, r1);
      x[2 * v + 1] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int i = 0; i < NQ; ++i) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[i * pstride + k / 2]));
      for (int64_t u = 0; u < 2 * NB; ++u) a[i][u] = _mm512_dpbf16_ps(a[i][u], (__m512bh)x[u], pv);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int64_t u = 0; u < 2 * NB; ++u) _mm512_storeu_ps(acc + i * D + u * 16, a[i][u]);
}
#endif

// One chunk's step of the online softmax: sv[0:n] becomes exp(sv - max so far), the running max and sum
// are updated, and the factor the accumulator must be scaled by is returned (0 on the first chunk).
static inline float online_softmax(float* sv, int64_t n, float& mx, float& total) {
  const float m_new = std::max(mx, vmax(sv, n));
  softmax_exp(sv, n, m_new);
  const float f = m_new == mx ? 1.f : std::exp(mx - m_new);
  total = total * f + vsum(sv, n);
  mx = m_new;
  return f;
}

// Gemma 2's attention logit soft-capping: each scaled score s becomes cap * tanh(s / cap) before the softmax
// (cap 0: none), as transformers computes it (divide, tanh, multiply, in float32).
static inline void soft_cap_scores(float* sv, int64_t n, float cap) {
  if (cap <= 0.f) return;
  for (int64_t j = 0; j < n; ++j) sv[j] = std::tanh(sv[j] / cap) * cap;
}

// decode_row's scores through AVX512-BF16 dot products: a bfloat16 query and cache where the CPU has them.
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
template <typename T, typename C, int DC>
constexpr bool kBf16Dots = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && DC % 32 == 0;
#else
template <typename T, typename C, int DC>
constexpr bool kBf16Dots = false;
#endif

// Query heads whose value accumulators stay in registers together (values_g, with one widened value row): 4 of
// 64 dims with AVX-512 (20 of its 32 registers), 2 of 128; one with AVX2's 16.
template <int DC>
constexpr int kValueHeads = VL == 16 && DC >= VL ? static_cast<int>(std::clamp<int64_t>(24 / (DC / VL) - 1, 1, 4)) : 1;

// A row of zeros standing in for the positions past a group's end.
template <typename C, int DC>
static const C kZeroRow[DC] = {};

// Per-thread buffers of decode_row, kept across its tasks.
struct DecodeScratch {
  std::vector<float> qf, acc, mx, total, scores, part;
  std::vector<uint32_t> pw;  // values_bf16's weights, bfloat16 pairs
};

// The K rows of the decode row a thread takes next (positions lo .. lo + n - 1 of its request, its group of KV
// heads from kbase): decode_row fetches them into L2 while it sums its own values from L2, when the memory
// would otherwise sit idle (n = 0: none).
template <typename C>
struct NextRows {
  const C* kbase = nullptr;
  const int32_t* blocks = nullptr;
  int64_t lo = 0, n = 0;
};

// Attention of one query row (a decode step's token) over positions [t_lo, t_hi] of its request, for
// KV heads h0 .. h0 + HG - 1 and the G query heads of each. Why not the tile path: that one walks one
// head's rows at a time (768-byte strides for SmolLM2, the same rows again per query head). Here each
// position's rows of the group's heads are read once, in order, for all G query heads, and the rows PD
// positions ahead are prefetched (K into L1, V into L2 for the pass over V that follows each chunk).
// With the cache in L2 or L3 that made a batch-64 step 1.15x / 1.4x faster on the AVX2 host; from
// DRAM both paths take about a plain read of the blocks plus the compute (docs/benchmarks.md, 16). A
// bfloat16 query and cache on AVX512-BF16 take the scores through dots16 (vdpbf16ps on the stored pairs, each
// state's 16 partial sums reduced in registers) and the values through values_bf16 (two positions' rows per
// vdpbf16ps, the weights rounded to bfloat16): on Zen 4 that made the batch-64 step's 30 layers 7.4 against 9.4
// ms with the cache in L2 (`benchmarks/attention_decode.py --dtype bfloat16 --context 192 --same-blocks`), and
// 8.9-9.8 against 11.8-12.1 from DRAM with the cache on huge pages (as attention.py allocates it; on 4 KiB pages
// both took ~12.5: the TLB misses bound them).
template <typename T, typename C, int DC>
static void decode_row(const T* qrow, int64_t qs1, T* orow, int64_t os1, const C* kc, const C* vc, int64_t ks0,
                       int64_t ks1, int64_t ks2, int64_t vs0, int64_t vs1, int64_t vs2, const int32_t* row_blocks,
                       int64_t BS, int64_t h0, int64_t HG, int64_t G, int64_t t_lo, int64_t t_hi, float sc,
                       float v_scale, float cap, DecodeScratch& w, const NextRows<C>& next) {
  constexpr int64_t D = DC, NV = DC / VL, KC = 256, PD = 16;
  constexpr int QG = kValueHeads<DC>;
  const int64_t N = HG * G;  // states, st = h * G + g (query head (h0 + h) * G + g)
  w.acc.assign(N * D, 0.f);
  w.mx.assign(N, -INFINITY);
  w.total.assign(N, 0.f);
  w.scores.resize(N * KC + 16);
  if constexpr (!kBf16Dots<T, C, DC>) {  // the scaled float32 query and the partial sums (bf16 dots need neither)
    w.part.resize(N * 16 * VL);
    w.qf.resize(N * D);
    for (int64_t st = 0; st < N; ++st) {
      const T* qp = qrow + (h0 * G + st) * qs1;
      for (int64_t d = 0; d < D; ++d) w.qf[st * D + d] = to_f(qp[d]) * sc;
    }
  }
  const C* kbase = kc + h0 * ks2;
  const C* vbase = vc + h0 * vs2;
  RowWalk<C> kw(kbase, row_blocks, BS, ks0, ks1, t_lo), vw(vbase, row_blocks, BS, vs0, vs1, t_lo);
  RowWalk<C> kpf = kw;  // PD positions ahead of kw
  RowWalk<C> npf(next.n ? next.kbase : kbase, next.n ? next.blocks : row_blocks, BS, ks0, ks1, next.lo);
  int64_t next_done = 0;
  int64_t t_pf = t_lo;
  for (int64_t i = 0; i < PD && t_pf <= t_hi; ++i, ++t_pf, kpf.next()) prefetch_rows<C, 3>(kpf.row(), HG, ks2, D);
  for (int64_t c0 = t_lo; c0 <= t_hi; c0 += KC) {
    const int64_t n = std::min<int64_t>(t_hi + 1, c0 + KC) - c0;
    RowWalk<C> vpf = vw;  // this chunk's V rows go to L2 while K is read
    // Scores: 16 positions at a time, one vector of partial sums per (state, position), then reduced.
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - j0);
      const C* krows[16];
      for (int64_t k = 0; k < m; ++k) {
        if (t_pf <= t_hi) {
          prefetch_rows<C, 3>(kpf.row(), HG, ks2, D);
          kpf.next();
          ++t_pf;
        }
        prefetch_rows<C, 2>(vpf.row(), HG, vs2, D);
        vpf.next();
        const C* kr = kw.row();
        if constexpr (kBf16Dots<T, C, DC>) {  // dots16 below, on the rows collected
          krows[k] = kr;
          kw.next();
          continue;
        }
        for (int64_t h = 0; h < HG; ++h) {
          AVec kv[NV];
          for (int64_t v = 0; v < NV; ++v) kv[v] = cache_load(kr + h * ks2 + v * VL);
          for (int64_t g = 0; g < G; g += 4) {
            const float* qv = w.qf.data() + (h * G + g) * D;
            float* dst = w.part.data() + ((h * G + g) * 16 + k) * VL;
            switch (std::min<int64_t>(4, G - g)) {
              case 4: dots_g<4, NV>(kv, qv, D, dst); break;
              case 3: dots_g<3, NV>(kv, qv, D, dst); break;
              case 2: dots_g<2, NV>(kv, qv, D, dst); break;
              default: dots_g<1, NV>(kv, qv, D, dst); break;
            }
          }
        }
        kw.next();
      }
      if constexpr (kBf16Dots<T, C, DC>) {  // per state, 16 positions' partial sums kept in registers and reduced
        for (int64_t h = 0; h < HG; ++h) {
          const C* rows[16];
          for (int64_t k = 0; k < 16; ++k) rows[k] = k < m ? krows[k] + h * ks2 : kZeroRow<C, DC>;
          for (int64_t g = 0; g < G; ++g)  // scores has 16 floats of slack past KC
            dots16<T, C, DC>(rows, nullptr, qrow + (h0 * G + h * G + g) * qs1, sc, w.scores.data() + (h * G + g) * KC + j0);
        }
        continue;
      }
      for (int64_t st = 0; st < N; ++st) {
        AVec a[16];
        for (int64_t k = 0; k < 16; ++k) a[k] = k < m ? AVec::loadu(w.part.data() + (st * 16 + k) * VL) : AVec(0.f);
        reduce16(a, w.scores.data() + st * KC + j0);  // scores has 16 floats of slack past KC
      }
    }
    // Online softmax over the chunk, per state.
    for (int64_t st = 0; st < N; ++st) {
      soft_cap_scores(w.scores.data() + st * KC, n, cap);
      const float f = online_softmax(w.scores.data() + st * KC, n, w.mx[st], w.total[st]);
      if (f != 1.f) {
        const AVec fv(f);
        for (int64_t v = 0; v < NV; ++v)
          (AVec::loadu(w.acc.data() + st * D + v * VL) * fv).store(w.acc.data() + st * D + v * VL);
      }
    }
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
    if constexpr (kBf16Dots<T, C, DC>) {  // the weights as bfloat16 pairs for values_bf16, an odd tail's partner 0
      w.pw.resize(N * KC / 2 + 8);
      for (int64_t st = 0; st < N; ++st) {
        float* sv = w.scores.data() + st * KC;
        if (n % 2) sv[n] = 0.f;  // scores has 16 floats of slack past KC
        for (int64_t j = 0; j < n; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.pw.data() + st * KC / 2 + j / 2),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sv + j)));
      }
    }
#endif
    // Values: 16 positions at a time per state, the accumulator in registers, the rows from L1.
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - j0);
      // The next row's K, in step with this pass over the whole context.
      for (const int64_t due = next.n * (c0 - t_lo + j0 + m) / (t_hi - t_lo + 1); next_done < due; ++next_done) {
        prefetch_rows<C, 2>(npf.row(), HG, ks2, D);
        npf.next();
      }
      const C* vrows[16];
      for (int64_t k = 0; k < m; ++k) {
        vrows[k] = vw.row();
        vw.next();
      }
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
      if constexpr (kBf16Dots<T, C, DC>) {
        const int64_t me = (m + 1) / 2 * 2;  // an odd tail's partner: a zero row, its weight 0
        for (int64_t h = 0; h < HG; ++h) {
          const C* vh[16];
          for (int64_t k = 0; k < m; ++k) vh[k] = vrows[k] + h * vs2;
          if (me > m) vh[m] = kZeroRow<C, DC>;
          for (int64_t g = 0; g < G; g += QG) {
            const int64_t st = h * G + g;
            with_height<QG>(std::min<int64_t>(QG, G - g), [&](auto nq) {
              values_bf16<decltype(nq)::value, DC / 32>(vh, me, w.pw.data() + st * KC / 2 + j0 / 2, KC / 2,
                                                        w.acc.data() + st * D, D);
            });
          }
        }
        continue;
      }
#endif
      for (int64_t h = 0; h < HG; ++h) {
        const C* vh[16];
        for (int64_t k = 0; k < m; ++k) vh[k] = vrows[k] + h * vs2;
        for (int64_t g = 0; g < G; g += QG) {
          const int64_t st = h * G + g;
          with_height<QG>(std::min<int64_t>(QG, G - g), [&](auto nq) {
            values_g<decltype(nq)::value, NV>(vh, m, w.scores.data() + st * KC + j0, KC, w.acc.data() + st * D, D);
          });
        }
      }
    }
  }
  for (int64_t st = 0; st < N; ++st) {
    const float inv = v_scale / w.total[st];
    T* op = orow + (h0 * G + st) * os1;
    const float* ap = w.acc.data() + st * D;
    if constexpr (kBf16Dots<T, C, DC>) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
      // values_bf16's lanes back in dim order (its 128-bit quarters interleaved), scaled, rounded as c10 rounds.
      const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      const __m512 iv = _mm512_set1_ps(inv);
      for (int64_t v = 0; v < D / 32; ++v) {
        const __m512 lo = _mm512_loadu_ps(ap + 32 * v), hi = _mm512_loadu_ps(ap + 32 * v + 16);
        for (int half = 0; half < 2; ++half) {
          const __m512 x = _mm512_mul_ps(_mm512_permutex2var_ps(lo, half ? second : first, hi), iv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + 32 * v + 16 * half), bf16_pack16(x));
        }
      }
#endif
    } else {
      for (int64_t d = 0; d < D; ++d) op[d] = static_cast<T>(ap[d] * inv);
    }
  }
}

// One task = one request, a group of its KV heads, a tile of up to ROWS query rows. Keys go in chunks
// whose rows are read in place (as stored; one chunk of a head stays in L2) by every query row of the
// tile and every query head sharing the KV head. Softmax is online across chunks (running max and sum,
// the accumulator rescaled when the max grows), so nothing grows with the context length.
template <typename scalar_t, typename cache_t, int DC>
static void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                const at::Tensor& req_ids, double scale, int64_t window, float k_scale, float v_scale, float cap) {
  const int64_t R = req_ids.size(0);
  const int64_t H = query.size(1), D = DC > 0 ? DC : query.size(2);
  const int64_t BS = key_cache.size(1), HKV = key_cache.size(2);
  const int64_t G = H / HKV;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const cache_t* kc = static_cast<const cache_t*>(key_cache.data_ptr());
  const cache_t* vc = static_cast<const cache_t*>(value_cache.data_ptr());
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
  const float sc = static_cast<float>(scale) * k_scale;  // k_scale folded into the query

  constexpr int64_t ROWS = 16;
  int64_t work = 0, tiles = 0;  // work: query rows x keys x heads (a batch-1 decode stays on one thread)
  for (int64_t j = 0; j < R; ++j) {
    const int64_t r = rid[j];
    const int64_t qlen = qsl[r + 1] - qsl[r];
    work += qlen * sl[r] * H;
    tiles += (qlen + ROWS - 1) / ROWS;
  }
  // All KV heads in one task when there are tiles enough to keep the threads busy; else one head each.
  const int64_t HG = tiles >= 4 * at::get_num_threads() ? HKV : 1;
  // Keys per chunk: a multiple of 16 (dots16), at most ~32K elements of K (and of V) over all KV heads, so a
  // chunk stays in L2 while every query row of the tile reads it. Sized for all heads even where a task takes
  // one (HG = 1): the chunks set where the online softmax rescales, so they must not depend on how the step's
  // other requests made HG, or a request's output would depend on its batch (llama_decoder_stack runs parts
  // of a step as separate calls).
  const int64_t KC = std::max<int64_t>(16, std::min<int64_t>(256, 32768 / (HKV * D)) / 16 * 16);
  constexpr int QG = kValueHeads<DC>;  // query heads of a tile row whose values are summed together
  std::vector<int64_t> task_item, task_row;
  for (int64_t j = 0; j < R; ++j) {
    const int64_t r = rid[j];
    const int64_t qlen = qsl[r + 1] - qsl[r];
    for (int64_t h0 = 0; h0 < HKV; h0 += HG)
      for (int64_t i0 = 0; i0 < qlen; i0 += ROWS) {
        task_item.push_back(j * HKV + h0);
        task_row.push_back(i0);
      }
  }
  const int64_t ntasks = static_cast<int64_t>(task_item.size());
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, mx, total, scores;
    DecodeScratch dscratch;
    std::vector<const cache_t*> krow(KC * HG), vrow(KC * HG);           // [head][key] -> cache row
    const std::vector<cache_t> zero_row(D, static_cast<cache_t>(0.f));  // pads a 16-key group
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task_item[task];
      const int64_t r = rid[item / HKV];
      const int64_t h0 = item % HKV;  // first KV head of the group
      const int64_t L = sl[r];
      const int64_t q0 = qsl[r], qlen = qsl[r + 1] - q0;
      const int32_t* row_blocks = bt + r * bts;
      const int64_t ia = task_row[task], nr = std::min<int64_t>(qlen, ia + ROWS) - ia;
      const int64_t p_first = L - qlen + ia, p_last = p_first + nr - 1;  // positions of the tile's rows
      if constexpr (kVecHead<scalar_t, DC>) {
        if (nr == 1) {  // a decode row (or a one-row tile): the streaming path
          const int64_t t_lo = window > 0 ? std::max<int64_t>(0, p_first - window + 1) : 0;
          NextRows<cache_t> next;
          if (task + 1 < end) {  // this thread's next task, when it is a decode row too
            const int64_t item2 = task_item[task + 1];
            const int64_t r2 = rid[item2 / HKV];
            if (qsl[r2 + 1] - qsl[r2] == 1) {
              const int64_t p2 = sl[r2] - 1;
              next.kbase = kc + (item2 % HKV) * ks2;
              next.blocks = bt + r2 * bts;
              next.lo = window > 0 ? std::max<int64_t>(0, p2 - window + 1) : 0;
              next.n = p2 - next.lo + 1;
            }
          }
          decode_row<scalar_t, cache_t, DC>(q + (q0 + ia) * qs0, qs1, o + (q0 + ia) * os0, os1, kc, vc, ks0, ks1, ks2,
                                            vs0, vs1, vs2, row_blocks, BS, h0, HG, G, t_lo, p_first, sc, v_scale,
                                            cap, dscratch, next);
          continue;
        }
      }
      const int64_t RG = nr * G;  // per KV head: (row, query head) pairs, row-major
      const int64_t N = HG * RG;  // state index: h * RG + rg
      qf.resize(N * D);
      acc.assign(N * D, 0.f);
      mx.assign(N, -INFINITY);
      total.assign(N, 0.f);
      scores.resize(QG * KC + 16);  // dots16 writes whole groups of 16
      for (int64_t h = 0; h < HG; ++h)
        for (int64_t rr = 0; rr < nr; ++rr)
          for (int64_t g = 0; g < G; ++g) {
            const scalar_t* qp = q + (q0 + ia + rr) * qs0 + ((h0 + h) * G + g) * qs1;
            float* dst = qf.data() + (h * RG + rr * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = to_f(qp[d]) * sc;
          }
      // Where context rows ta..tb-1 of each head of the group lie, block by block (no division per
      // position); rows up to the next multiple of 16 point at zeros.
      auto collect_rows = [&](int64_t ta, int64_t tb, int64_t padded) {
        for (int64_t t = ta; t < tb;) {
          const int64_t stop = std::min<int64_t>(tb, t - t % BS + BS);
          const int64_t blk = row_blocks[t / BS];
          for (; t < stop; ++t)
            for (int64_t h = 0; h < HG; ++h) {
              krow[h * KC + (t - ta)] = kc + blk * ks0 + (t % BS) * ks1 + (h0 + h) * ks2;
              vrow[h * KC + (t - ta)] = vc + blk * vs0 + (t % BS) * vs1 + (h0 + h) * vs2;
            }
        }
        for (int64_t h = 0; h < HG; ++h)
          for (int64_t j = tb - ta; j < padded; ++j) krow[h * KC + j] = zero_row.data();
      };
      const int64_t t_lo = window > 0 ? std::max<int64_t>(0, p_first - window + 1) : 0;
      for (int64_t c0 = t_lo; c0 <= p_last; c0 += KC) {
        const int64_t c1 = std::min<int64_t>(p_last + 1, c0 + KC), nc = c1 - c0;
        const int64_t ncp = (nc + 15) / 16 * 16;
        collect_rows(c0, c1, ncp);
        for (int64_t h = 0; h < HG; ++h) {
          const cache_t* const* kr = krow.data() + h * KC;
          const cache_t* const* vr_rows = vrow.data() + h * KC;
          // Per tile row, its G query heads see the same keys: scores and softmax for up to QG of them, then their
          // values in one pass, each V row widened once for all of them (values_g; the same FMAs per head).
          for (int64_t rr = 0; rr < nr; ++rr) {
            const int64_t p = p_first + rr;  // this row sees keys [max(c0, p - window + 1), min(c1 - 1, p)]
            const int64_t jlo = window > 0 ? std::max<int64_t>(0, p - window + 1 - c0) : 0;
            const int64_t jhi = std::min<int64_t>(nc - 1, p - c0);
            if (jlo > jhi) continue;
            const int64_t n = jhi - jlo + 1;
            for (int64_t g0 = 0; g0 < G; g0 += QG) {
              const int64_t ng = std::min<int64_t>(QG, G - g0);
              for (int64_t g = g0; g < g0 + ng; ++g) {
                const int64_t rg = rr * G + g, st = h * RG + rg;
                float* sg = scores.data() + (g - g0) * KC;
                const float* qv = qf.data() + st * D;
                if constexpr (kVecHead<scalar_t, DC>) {
                  for (int64_t j = jlo / 16 * 16; j <= jhi; j += 16)
                    dots16<scalar_t, cache_t, DC>(kr + j, qv, q + (q0 + ia + rr) * qs0 + ((h0 + h) * G + g) * qs1, sc,
                                                  sg + j);
                } else {
                  for (int64_t j = jlo; j <= jhi; ++j) sg[j] = dot_scalar(qv, kr[j], D);
                }
                soft_cap_scores(sg + jlo, n, cap);
                const float f = online_softmax(sg + jlo, n, mx[st], total[st]);
                float* ap = acc.data() + st * D;
                for (int64_t d = 0; d < D; ++d) ap[d] *= f;
                if constexpr (!kVecHead<scalar_t, DC>) {
                  for (int64_t j = 0; j < n; ++j) {
                    const float w = sg[jlo + j];
                    const cache_t* vr = vr_rows[jlo + j];
                    for (int64_t d = 0; d < D; ++d) ap[d] += w * to_f(vr[d]);
                  }
                }
              }
              if constexpr (kVecHead<scalar_t, DC>) {
                with_height<QG>(ng, [&](auto nq) {
                  values_g<decltype(nq)::value, DC / VL>(vr_rows + jlo, n, scores.data() + jlo, KC,
                                                          acc.data() + (h * RG + rr * G + g0) * D, D);
                });
              }
            }
          }
        }
      }
      for (int64_t h = 0; h < HG; ++h)
        for (int64_t rr = 0; rr < nr; ++rr)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t st = h * RG + rr * G + g;
            const float inv = v_scale / total[st];
            scalar_t* op = o + (q0 + ia + rr) * os0 + ((h0 + h) * G + g) * os1;
            for (int64_t d = 0; d < D; ++d) op[d] = static_cast<scalar_t>(acc[st * D + d] * inv);
          }
    }
  };
  // Inside llama_decoder_stack's team (a decode step of 1-4 rows) the tasks split over it: at::parallel_for runs
  // inline there, which left a long context's attention on one thread while the other spun (batch 1 at 4,000
  // positions: 10% of the step on the master alone). Each task's output is its own, whoever computes it.
  if (work >= 32768 && current_team != nullptr)
    current_team->split(ntasks, body);
  else
    at::parallel_for(0, ntasks, work < 32768 ? std::max<int64_t>(ntasks, 1) : 1, body);
}

// One instantiation per head size with a vector path (64, 128) and the generic one.
template <typename scalar_t, typename cache_t>
static void run_heads(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& query_start_loc, const at::Tensor& req_ids, double scale, int64_t window,
                      float k_scale, float v_scale, float cap) {
  const int64_t D = query.size(2);
  if (D == 64)
    run<scalar_t, cache_t, 64>(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids,
                               scale, window, k_scale, v_scale, cap);
  else if (D == 128)
    run<scalar_t, cache_t, 128>(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids,
                                scale, window, k_scale, v_scale, cap);
  else
    run<scalar_t, cache_t, 0>(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, req_ids,
                              scale, window, k_scale, v_scale, cap);
}

// Query rows from which a request's attention goes to ATen's CPU flash attention (a prefill chunk of a long prompt).
// Its tiles multiply blocks of queries by blocks of keys as GEMMs (oneDNN's brgemm: AMX tiles where the CPU has
// them), where run's 16-row tiles take one dot product per (row, key): on an AMX Xeon a 4,096-token prompt's attention
// took 9.7 s of its 17.2 s prefill in run (Llama-1B shape, 2 cores), and SDPA does a layer's 2,048-row chunks in a
// third of run's time (docs/benchmarks-notebook.md, 2026-12-07). Below this many rows run's tiles stay: the batched
// workloads' 128-token prompts are what they were measured on.
constexpr int64_t kFlashMinRows = 256;

// Request r's rows [q0, q0 + qlen) of out: causal attention over its L cached positions (the rows are the last qlen
// of them) through ATen's CPU flash attention, the keys and values gathered from the cache's blocks. A chunk after
// cached positions is two calls: every row over the P = L - qlen earlier positions (no mask), and the chunk's own
// positions causally (a square: the kernel skips the blocks above the diagonal); the two outputs are merged by their
// log-sum-exps. One call with a [qlen, L] mask computed every masked block and read the mask in each: a 2,048-row
// chunk after 2,048 positions took 128 ms a layer against 87 split (Llama-1B heads, 2 threads, AMX Xeon).
static void flash_request(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_table, int64_t r, int64_t L,
                          int64_t q0, int64_t qlen, double scale) {
  const int64_t BS = key_cache.size(1), nb = (L + BS - 1) / BS, P = L - qlen;
  const at::Tensor blocks = block_table.select(0, r).narrow(0, 0, nb).toType(at::kLong);
  auto gather = [&](const at::Tensor& cache) {  // [1, HKV, L, D]
    return cache.index_select(0, blocks).flatten(0, 1).narrow(0, 0, L).transpose(0, 1).unsqueeze(0);
  };
  const at::Tensor q = query.narrow(0, q0, qlen).transpose(0, 1).unsqueeze(0);  // [1, H, qlen, D]
  const at::Tensor k = gather(key_cache), v = gather(value_cache);
  // Positions [from, from + n): (output [1, H, qlen, D], log-sum-exp [1, H, qlen] float32).
  auto flash = [&](int64_t from, int64_t n, bool causal) {
    return at::_scaled_dot_product_flash_attention_for_cpu(q, k.narrow(2, from, n), v.narrow(2, from, n), 0.0, causal,
                                                           std::nullopt, scale);
  };
  at::Tensor o;
  if (P == 0) {
    o = std::get<0>(flash(0, L, true));
  } else {
    const auto [o1, l1] = flash(0, P, false);   // the earlier positions
    const auto [o2, l2] = flash(P, qlen, true);  // the chunk's own, causally
    const at::Tensor lse = at::logaddexp(l1, l2);
    o = o1.to(at::kFloat).mul_(l1.sub(lse).exp_().unsqueeze(-1))
            .add_(o2.to(at::kFloat).mul_(l2.sub(lse).exp_().unsqueeze(-1)));
  }
  out.narrow(0, q0, qlen).copy_(o.squeeze(0).transpose(0, 1));
}

void paged_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                     at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor req_ids,
                     double scale, int64_t window, double k_scale, double v_scale, double soft_cap) {
  const auto ct = key_cache.scalar_type();
  const bool fp8 = ct == at::ScalarType::Float8_e4m3fn || ct == at::ScalarType::Float8_e5m2;
  TORCH_CHECK(ct == value_cache.scalar_type() && out.scalar_type() == query.scalar_type()
                  && (ct == query.scalar_type()
                      || (fp8 && (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16))),
              "paged_attention: query and out must share a dtype, and the cache that dtype or float8 (under a "
              "float32 or bfloat16 query)");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "paged_attention: head dimension must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt
                  && query_start_loc.scalar_type() == at::kInt && req_ids.scalar_type() == at::kInt,
              "paged_attention: index tensors must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous()
                  && req_ids.is_contiguous(),
              "paged_attention: index tensors must be contiguous");
  // Long prefill chunks through flash attention (the cache in the query's dtype, no window, soft-capping or scales:
  // what SDPA computes); the other requests through run.
  if (ct == query.scalar_type() && window <= 0 && soft_cap == 0.0 && k_scale == 1.0 && v_scale == 1.0) {
    const int32_t* rid = req_ids.data_ptr<int32_t>();
    const int32_t* sl = seq_lens.data_ptr<int32_t>();
    const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
    std::vector<int32_t> rest;
    for (int64_t j = 0; j < req_ids.size(0); ++j) {
      const int32_t r = rid[j];
      const int64_t qlen = qsl[r + 1] - qsl[r];
      if (qlen >= kFlashMinRows)
        flash_request(out, query, key_cache, value_cache, block_table, r, sl[r], qsl[r], qlen, scale);
      else
        rest.push_back(r);
    }
    if (rest.empty()) return;
    if (static_cast<int64_t>(rest.size()) < req_ids.size(0))
      req_ids = at::from_blob(rest.data(), {static_cast<int64_t>(rest.size())}, at::kInt).clone();
  }
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale), cap = static_cast<float>(soft_cap);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, query.scalar_type(),
                                  "paged_attention", [&] {
    if (ct == query.scalar_type()) {
      run_heads<scalar_t, scalar_t>(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                    req_ids, scale, window, ks, vs, cap);
    } else if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
      if (ct == at::ScalarType::Float8_e4m3fn)
        run_heads<scalar_t, c10::Float8_e4m3fn>(out, query, key_cache, value_cache, block_table, seq_lens,
                                                query_start_loc, req_ids, scale, window, ks, vs, cap);
      else
        run_heads<scalar_t, c10::Float8_e5m2>(out, query, key_cache, value_cache, block_table, seq_lens,
                                              query_start_loc, req_ids, scale, window, ks, vs, cap);
    }
  });
}

// The step's new keys and values stored into the cache, then paged_attention over it: one call per layer
// instead of two index_copy_ and their views (a batch-1 decode step spends microseconds per layer on each
// small torch op, the store itself being a few hundred bytes). kv_cache [2, blocks, block_size, Hkv, D] in
// the query's dtype; row t of key/value [T, Hkv, D] goes to slot slots[t] (block * block_size + offset),
// rows t >= slots.size(0) and rows with a negative slot (padding) are not stored. Serial: at most a few
// kilobytes per row.
void paged_attention_store(at::Tensor out, at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                           at::Tensor slots, at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start_loc,
                           at::Tensor req_ids, double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && key.dim() == 3 && value.sizes() == key.sizes()
                  && key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4)
                  && key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type()
                  && key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(4) == 1,
              "paged_attention_store: key/value [T, Hkv, D] in the cache's dtype, kv_cache [2, blocks, block_size, "
              "Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous()
                  && slots.size(0) <= key.size(0),
              "paged_attention_store: slots must be int64 [<= T]");
  const int64_t n = slots.size(0), hkv = key.size(1), D = key.size(2);
  const int64_t bs = kv_cache.size(2), capacity = kv_cache.size(1) * bs;
  const int64_t c1 = kv_cache.stride(1), c2 = kv_cache.stride(2), c3 = kv_cache.stride(3);
  const int64_t half = kv_cache.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t esize = kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < capacity, "paged_attention_store: slot ", slot, " beyond the cache's ", capacity);
    const int64_t row = (slot / bs) * c1 + (slot % bs) * c2;
    for (int64_t h = 0; h < hkv; ++h) {
      std::memcpy(base + (row + h * c3) * esize, kp + (t * key.stride(0) + h * key.stride(1)) * esize, D * esize);
      std::memcpy(base + (half + row + h * c3) * esize, vp + (t * value.stride(0) + h * value.stride(1)) * esize,
                  D * esize);
    }
  }
  paged_attention(out, query, kv_cache.select(0, 0), kv_cache.select(0, 1), block_table, seq_lens, query_start_loc,
                  req_ids, scale, window, 1.0, 1.0, soft_cap);
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
