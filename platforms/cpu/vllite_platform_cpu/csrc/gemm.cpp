// A float32 GEMM for AVX2/FMA hosts (no AVX-512), compiled once per ISA variant: only the variants built
// with AVX2, FMA and F16C (avx2, avx512, avx512_bf16) have it; elsewhere avx2_gemm_available() is false.
//
// Why: on a 2-core AVX2 host a decode step streams every weight from memory (540 MB in float32 for
// SmolLM2-135M), and oneDNN's packed kernel overlaps that poorly: the model's 121 linear layers at 64
// rows took 190 ms per step against 140 ms here, at 5 rows 72 against 38 ms, at 1 row as fast as a
// plain read of the weights (docs/benchmarks.md, speed work item 14).
//
// Layout: the weight is packed once into panels of 16 output columns, [ceil(N/16)][K][16], so a
// panel is one contiguous stream. A 6-row x 16-column micro-tile keeps its 12 accumulators in
// registers (with the two weight vectors and one broadcast input: 15 of the 16 ymm registers) and
// walks K once; the panel is reused from L2 by every row tile, while the first tile prefetches the
// next panel into L2. Work is split over (row block, panel) tasks. 1-3 rows (decode) go over 2-4 panels at
// once instead (tile_panels). Each output element is one fused multiply-add chain over k in order (float32
// accumulation), the bias added at the end, whatever the path.
//
// 16-bit weights (bfloat16, float16) keep their own type in the panels and are widened to float32 as each
// panel row is loaded (bfloat16: a 16-bit shift; float16: F16C), so a decode step streams half the bytes
// of float32 panels and no float32 copy of the weight is kept. The widening is exact and so is every
// product of two 16-bit values in float32: the sums are those of a float32 GEMM on the widened weight.
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/ops/empty.h>

#include "common.h"
// after common.h
#include "amx.h"
#include "team.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VLLITE_AVX2_GEMM 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define VLLITE_BF16_GEMM 1
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

#ifdef VLLITE_AVX2_GEMM
namespace avx2_gemm_impl {
constexpr int64_t NR = 16;  // output columns per panel: two ymm vectors
constexpr int64_t MR = 6;   // rows per micro-tile
constexpr int64_t MC = 96;  // rows per task: a 96 x K input block stays in L2

// exp(x) for x <= 0 (GELU's exp(-z^2)): x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial,
// 2^n put in the exponent bits; about one ulp. Inline (a call to ATen's Sleef exp per vector was slower).
static inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// torch's exact GELU, x * 0.5 * (1 + erf(x / sqrt(2))), with the erf torch's vectorised path uses
// (Abramowitz and Stegun 7.1.26: sign(z) (1 - (a1 t + ... + a5 t^5) exp(-z^2)), t = 1 / (1 + p |z|)).
static inline __m256 gelu(__m256 x) {
  const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));
  const __m256 sign = _mm256_and_ps(z, _mm256_set1_ps(-0.f));
  const __m256 az = _mm256_xor_ps(z, sign);
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), az,
                                                                        _mm256_set1_ps(1.f)));
  __m256 r = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), t, _mm256_set1_ps(-1.453152027f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(1.421413741f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-0.284496736f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(0.254829592f));
  const __m256 e = exp_neg(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(z, z)));
  const __m256 erf = _mm256_xor_ps(_mm256_fnmadd_ps(_mm256_mul_ps(e, t), r, _mm256_set1_ps(1.f)), sign);
  return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), _mm256_add_ps(_mm256_set1_ps(1.f), erf));
}

// One panel row (16 columns) as two float32 vectors, widened from the panel's type.
static inline void load_row(const float* p, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(p);
  b1 = _mm256_loadu_ps(p + 8);
}
static inline __m256 widen_bf16(const void* p) {  // bfloat16 bits are a float32's upper half
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline void load_row(const c10::BFloat16* p, __m256& b0, __m256& b1) {
  b0 = widen_bf16(p);
  b1 = widen_bf16(p + 8);
}
static inline void load_row(const c10::Half* p, __m256& b0, __m256& b1) {
  b0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// Named accumulators: GCC spilled an array of them to the stack on every FMA.
#define VG_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define VG_FMA(r)                                          \
  if constexpr (R > r) {                                   \
    const __m256 a = _mm256_broadcast_ss(A + r * lda + k); \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);             \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);             \
  }
#define VG_OUT(r)        \
  if constexpr (R > r) { \
    o[r][0] = c##r##0;   \
    o[r][1] = c##r##1;   \
  }

// GELU in place over a stored tile (still in L1), rows ldc apart. Out of line: inlined into the tile, its
// constants were kept in registers through the K loop and the accumulators spilled.
__attribute__((noinline)) static void gelu_tile(float* C, int64_t ldc, int rows, int64_t ncols) {
  for (int r = 0; r < rows; ++r) {
    float* c = C + r * ldc;
    if (ncols == NR) {
      _mm256_storeu_ps(c, gelu(_mm256_loadu_ps(c)));
      _mm256_storeu_ps(c + 8, gelu(_mm256_loadu_ps(c + 8)));
    } else {
      alignas(32) float t[NR] = {0.f};
      for (int64_t j = 0; j < ncols; ++j) t[j] = c[j];
      _mm256_store_ps(t, gelu(_mm256_load_ps(t)));
      _mm256_store_ps(t + 8, gelu(_mm256_load_ps(t + 8)));
      for (int64_t j = 0; j < ncols; ++j) c[j] = t[j];
    }
  }
}

// C[0:R, 0:ncols] = A[0:R, 0:K] * B[0:K, 0:16] (+ bias, then GELU when gelu_out); rows of A lda apart, rows of C
// ldc apart. prefetch: the next panel (same K x 16 layout), fetched into L2 one cache line per 64 bytes of
// panel read; may be null. W: the panel's type (float, c10::BFloat16, c10::Half).
template <int R, typename W>
static inline void tile(const float* __restrict A, int64_t lda, const W* __restrict B, int64_t K,
                        float* __restrict C, int64_t ldc, const float* bias, int64_t ncols, const W* prefetch,
                        bool gelu_out) {
  constexpr int64_t line_rows = 64 / (NR * sizeof(W));  // panel rows per cache line: 1 (float32) or 2
  VG_DECL(0)
  VG_DECL(1)
  VG_DECL(2)
  VG_DECL(3)
  VG_DECL(4)
  VG_DECL(5)
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0, b1;
    load_row(B + k * NR, b0, b1);
    VG_FMA(0)
    VG_FMA(1)
    VG_FMA(2)
    VG_FMA(3)
    VG_FMA(4)
    VG_FMA(5)
    if (prefetch && k % line_rows == 0) _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * NR), _MM_HINT_T1);
  }
  __m256 o[MR][2];
  VG_OUT(0)
  VG_OUT(1)
  VG_OUT(2)
  VG_OUT(3)
  VG_OUT(4)
  VG_OUT(5)
  if (bias) {
    alignas(32) float bb[NR] = {0.f};
    for (int64_t j = 0; j < ncols; ++j) bb[j] = bias[j];
    const __m256 v0 = _mm256_load_ps(bb), v1 = _mm256_load_ps(bb + 8);
    for (int r = 0; r < R; ++r) {
      o[r][0] = _mm256_add_ps(o[r][0], v0);
      o[r][1] = _mm256_add_ps(o[r][1], v1);
    }
  }
  if (ncols == NR) {
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(C + r * ldc, o[r][0]);
      _mm256_storeu_ps(C + r * ldc + 8, o[r][1]);
    }
  } else {
    alignas(32) float t[NR];
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(t, o[r][0]);
      _mm256_store_ps(t + 8, o[r][1]);
      for (int64_t j = 0; j < ncols; ++j) C[r * ldc + j] = t[j];
    }
  }
  if (gelu_out) gelu_tile(C, ldc, R, ncols);
}
#undef VG_DECL
#undef VG_FMA
#undef VG_OUT

// Few rows (a decode step's 1-3): one panel at a time leaves one or two FMA chains per 8 columns and a single
// memory stream, and the K loop runs at FMA latency, not at memory speed (1 row: 8-10 GB/s against ~15 for a plain
// read). Here R rows x NP whole panels go together: 2 R NP independent chains and NP streams, each prefetched
// kPrefetchBytes ahead (a stream's prefetch past its panel's end goes to the same stream of the next group). Every
// output element is still one FMA chain over k in order from zero, then the bias: the operations of tile, so a
// row's result does not depend on how many rows share the call. 4 rows (as 1 x 4 or 2 x 2 rows x 3 panels) were
// no faster than the 6-row tile and stay there (benchmarks/linear_layers.py, 1 and 2 threads).
constexpr int64_t kPrefetchBytes = 512;  // bf16 1 row: 17.9 ms against 19.6 without, 18.9 at 256, 17.9 at 1024

#define VS_DECL(r, j) __m256 s##r##j##0 = _mm256_setzero_ps(), s##r##j##1 = _mm256_setzero_ps();
#define VS_DECL_ROW(r) VS_DECL(r, 0) VS_DECL(r, 1) VS_DECL(r, 2) VS_DECL(r, 3)
#define VS_FMA(r, j)                                    \
  if constexpr (R > r) {                                \
    s##r##j##0 = _mm256_fmadd_ps(a##r, b0, s##r##j##0); \
    s##r##j##1 = _mm256_fmadd_ps(a##r, b1, s##r##j##1); \
  }
#define VS_PANEL(j)                                        \
  if constexpr (NP > j) {                                  \
    __m256 b0, b1;                                         \
    load_row(B + j * PS + k * NR, b0, b1);                 \
    VS_FMA(0, j)                                           \
    VS_FMA(1, j)                                           \
    VS_FMA(2, j)                                           \
  }
#define VS_A(r) const __m256 a##r = R > r ? _mm256_broadcast_ss(A + r * lda + k) : _mm256_setzero_ps();
#define VS_OUT(r, j)               \
  if constexpr (R > r && NP > j) { \
    o[r][j][0] = s##r##j##0;       \
    o[r][j][1] = s##r##j##1;       \
  }
#define VS_OUT_ROW(r) VS_OUT(r, 0) VS_OUT(r, 1) VS_OUT(r, 2) VS_OUT(r, 3)

// C[0:R, 0:16 NP] = A[0:R, 0:K] * NP consecutive whole panels from B (+ bias, then GELU when gelu_out).
template <int R, int NP, typename W>
static inline void tile_panels(const float* __restrict A, int64_t lda, const W* __restrict B, int64_t K,
                               float* __restrict C, int64_t ldc, const float* bias, bool gelu_out) {
  static_assert(R >= 1 && R <= 3 && NP >= 1 && NP <= 4 && R * NP <= 6, "12 accumulators at most");
  constexpr int64_t line_rows = 64 / (NR * sizeof(W));
  constexpr int64_t ahead = kPrefetchBytes / sizeof(W);
  const int64_t PS = K * NR;  // elements per panel
  VS_DECL_ROW(0)
  VS_DECL_ROW(1)
  VS_DECL_ROW(2)
  for (int64_t k = 0; k < K; ++k) {
    if (k % line_rows == 0) {
      const int64_t at = k * NR + ahead;
      const W* pf = B + at + (at >= PS ? (NP - 1) * PS : 0);
      for (int j = 0; j < NP; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * PS), _MM_HINT_T0);
    }
    VS_A(0)
    VS_A(1)
    VS_A(2)
    VS_PANEL(0)
    VS_PANEL(1)
    VS_PANEL(2)
    VS_PANEL(3)
  }
  __m256 o[R][NP][2];
  VS_OUT_ROW(0)
  VS_OUT_ROW(1)
  VS_OUT_ROW(2)
  for (int j = 0; j < NP; ++j) {
    if (bias) {
      const __m256 v0 = _mm256_loadu_ps(bias + j * NR), v1 = _mm256_loadu_ps(bias + j * NR + 8);
      for (int r = 0; r < R; ++r) {
        o[r][j][0] = _mm256_add_ps(o[r][j][0], v0);
        o[r][j][1] = _mm256_add_ps(o[r][j][1], v1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(C + r * ldc + j * NR, o[r][j][0]);
      _mm256_storeu_ps(C + r * ldc + j * NR + 8, o[r][j][1]);
    }
    if (gelu_out) gelu_tile(C + j * NR, ldc, R, NR);
  }
}
#undef VS_DECL
#undef VS_DECL_ROW
#undef VS_FMA
#undef VS_PANEL
#undef VS_A
#undef VS_OUT
#undef VS_OUT_ROW

template <typename W>
static inline void tile_rows(int64_t rows, const float* A, int64_t lda, const W* B, int64_t K, float* C,
                             int64_t ldc, const float* bias, int64_t ncols, const W* prefetch, bool gelu) {
  switch (rows) {
    case 6: tile<6, W>(A, lda, B, K, C, ldc, bias, ncols, prefetch, gelu); break;
    case 5: tile<5, W>(A, lda, B, K, C, ldc, bias, ncols, prefetch, gelu); break;
    case 4: tile<4, W>(A, lda, B, K, C, ldc, bias, ncols, prefetch, gelu); break;
    case 3: tile<3, W>(A, lda, B, K, C, ldc, bias, ncols, prefetch, gelu); break;
    case 2: tile<2, W>(A, lda, B, K, C, ldc, bias, ncols, prefetch, gelu); break;
    default: tile<1, W>(A, lda, B, K, C, ldc, bias, ncols, prefetch, gelu); break;
  }
}
}  // namespace avx2_gemm_impl
#endif

#ifdef VLLITE_AVX2_GEMM
// C[0:M, 0:ncols] = A[0:M, 0:K] (rows K apart) * panel [K][16] (+ bias), rows of C ldc apart: the micro-kernel
// over one packed panel, for a caller that makes its own panels (gguf.cpp dequantises GGUF blocks into them).
void avx2_gemm_panel(const float* A, int64_t M, int64_t K, const float* panel, float* C, int64_t ldc,
                     const float* bias, int64_t ncols) {
  using namespace avx2_gemm_impl;
  for (int64_t m = 0; m < M; m += MR)
    tile_rows<float>(std::min(MR, M - m), A + m * K, K, panel, K, C + m * ldc, ldc, bias, ncols, nullptr, false);
}
#endif

bool avx2_gemm_available() {
#ifdef VLLITE_AVX2_GEMM
  return true;
#else
  return false;
#endif
}

// The weight types the GEMM's panels hold in this variant (none where it is not built): an installed module
// built before 16-bit panels lacks this entry point, so kernels.py rebuilds it from these sources.
std::vector<std::string> avx2_gemm_dtypes() {
#ifdef VLLITE_AVX2_GEMM
  return {"float32", "bfloat16", "float16"};
#else
  return {};
#endif
}

// [N, K] -> [ceil(N / 16), K, 16] panels of the weight's own type (float32, bfloat16 or float16; 16-bit
// values copied bit for bit), columns past N zero.
template <typename T>
static void pack_panels(const T* src, T* dst, int64_t N, int64_t K) {
  constexpr int64_t NR = 16;
  at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
        const T* s = src + (p * NR + j) * K;
        T* d = dst + p * K * NR + j;
        for (int64_t k = 0; k < K; ++k) d[k * NR] = s[k];
      }
  });
}

at::Tensor avx2_gemm_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "avx2_gemm_pack: weight [N, K]");
  w = w.contiguous();
  constexpr int64_t NR = 16;
  const int64_t N = w.size(0), K = w.size(1);
  auto out = at::zeros({(N + NR - 1) / NR, K, NR}, w.options());
  switch (w.scalar_type()) {
    case at::kFloat: pack_panels(w.data_ptr<float>(), out.data_ptr<float>(), N, K); break;
    case at::kBFloat16: pack_panels(w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K); break;
    case at::kHalf: pack_panels(w.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), N, K); break;
    default: TORCH_CHECK(false, "avx2_gemm_pack: weight must be float32, bfloat16 or float16");
  }
  return out;
}

#ifdef VLLITE_AVX2_GEMM
// Few rows: each thread a contiguous run of panel groups (NP streams at a time); a call of at most
// kFewRowsGrainBytes of weights stays on the calling thread, as gguf.cpp's int8 path does (at 2 threads on this
// benchmark 1 byte, 256 KiB and 1 MiB measured alike; waking a sleeping thread for a 0.2 MB layer does not pay).
constexpr int64_t kFewRowsGrainBytes = int64_t(1) << 20;

template <int R, int NP, typename W>
static void gemm_few_rows(const float* A, const W* Bp, float* C, const float* bp, int64_t K, int64_t N, int64_t P,
                          bool gelu) {
  using namespace avx2_gemm_impl;
  const int64_t groups = (P + NP - 1) / NP, group_bytes = NP * K * NR * static_cast<int64_t>(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, (kFewRowsGrainBytes + group_bytes - 1) / group_bytes);
  split_for(groups, grain, [&](int64_t gb, int64_t ge) {
    for (int64_t g = gb; g < ge; ++g) {
      const int64_t p0 = g * NP, n0 = p0 * NR;
      if (n0 + NP * NR <= N) {
        tile_panels<R, NP, W>(A, K, Bp + p0 * K * NR, K, C + n0, N, bp ? bp + n0 : nullptr, gelu);
        continue;
      }
      for (int64_t p = p0; p < P; ++p) {  // the last group, short or with a partial panel
        const int64_t n = p * NR, ncols = std::min(NR, N - n);
        if (ncols == NR)
          tile_panels<R, 1, W>(A, K, Bp + p * K * NR, K, C + n, N, bp ? bp + n : nullptr, gelu);
        else
          tile<R, W>(A, K, Bp + p * K * NR, K, C + n, N, bp ? bp + n : nullptr, ncols, nullptr, gelu);
      }
    }
  });
}

// From this many rows in a task's row block, a 16-bit panel is widened to float32 once (widen_panel) and every
// tile of the block runs on the float32 copy (in L2: K x 64 bytes), instead of each 6-row tile widening every
// panel row again as it loads it (two shifts and two zero-extensions per k beside the 12 FMAs, on the FMA
// ports). The widening is exact, so the sums are bit for bit those of the tiles on the 16-bit panel.
constexpr int64_t kWidenMinRows = 2 * avx2_gemm_impl::MR;

// dst[K][16] float32 = the panel [K][16] widened; the next panel (may be null) fetched into L2 alongside.
template <typename W>
static void widen_panel(const W* panel, int64_t K, float* dst, const W* next) {
  using namespace avx2_gemm_impl;
  constexpr int64_t line_rows = 64 / (NR * sizeof(W));
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0, b1;
    load_row(panel + k * NR, b0, b1);
    _mm256_storeu_ps(dst + k * NR, b0);
    _mm256_storeu_ps(dst + k * NR + 8, b1);
    if (next && k % line_rows == 0) _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T1);
  }
}

template <typename W>
static void gemm_panels(const float* A, const W* Bp, float* C, const float* bp, int64_t M, int64_t K, int64_t N,
                        int64_t P, bool gelu) {
  using namespace avx2_gemm_impl;
  // Panels per group: 2 R NP accumulators, 8 to 12 of the 16 registers (1 row: 4 panels 17.9 ms against 21.8 at 2
  // and 17.5 at 6, bf16 one thread; 2 rows: 3 panels 25.5 against 29.0 at 2).
  switch (M) {
    case 1: return gemm_few_rows<1, 4>(A, Bp, C, bp, K, N, P, gelu);
    case 2: return gemm_few_rows<2, 3>(A, Bp, C, bp, K, N, P, gelu);
    case 3: return gemm_few_rows<3, 2>(A, Bp, C, bp, K, N, P, gelu);
    default: break;
  }
  const int64_t blocks = (M + MC - 1) / MC;
  // Consecutive tasks share a row block, so each thread keeps its block of x in its own L2.
  split_for(blocks * P, 1, [&](int64_t b, int64_t e) {
    std::vector<float> wide;  // a 16-bit panel widened once for the task's tiles (widen_panel)
    for (int64_t t = b; t < e; ++t) {
      const int64_t m0 = (t / P) * MC, m1 = std::min(M, m0 + MC), p = t % P;
      const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
      const W* panel = Bp + p * K * NR;
      const W* next = p + 1 < P ? panel + K * NR : nullptr;
      if constexpr (!std::is_same_v<W, float>) {
        if (m1 - m0 >= kWidenMinRows) {
          wide.resize(K * NR);
          widen_panel(panel, K, wide.data(), next);
          for (int64_t m = m0; m < m1; m += MR)
            tile_rows<float>(std::min(MR, m1 - m), A + m * K, K, wide.data(), K, C + m * N + n0, N,
                             bp ? bp + n0 : nullptr, ncols, nullptr, gelu);
          continue;
        }
      }
      for (int64_t m = m0; m < m1; m += MR)
        tile_rows<W>(std::min(MR, m1 - m), A + m * K, K, panel, K, C + m * N + n0, N, bp ? bp + n0 : nullptr,
                     ncols, m == m0 ? next : nullptr, gelu);
    }
  });
}
#endif

// out[M, N] = x[M, K] @ W^T (+ bias), then GELU when gelu; W packed by avx2_gemm_pack (float32, bfloat16 or
// float16 panels); x, out and bias float32; all contiguous.
static void gemm(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, bool gelu) {
#ifdef VLLITE_AVX2_GEMM
  using namespace avx2_gemm_impl;
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3 && packed.size(2) == NR
                  && x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && x.is_contiguous()
                  && out.is_contiguous() && packed.is_contiguous(),
              "avx2_gemm: float32 contiguous x [M, K], out [M, N], packed [P, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = packed.size(0);
  TORCH_CHECK(out.size(0) == M && packed.size(1) == K && P == (N + NR - 1) / NR, "avx2_gemm: shapes");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, "avx2_gemm: bias");
    bp = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const float* A = x.data_ptr<float>();
  float* C = out.data_ptr<float>();
  switch (packed.scalar_type()) {
    case at::kFloat: gemm_panels(A, packed.data_ptr<float>(), C, bp, M, K, N, P, gelu); break;
    case at::kBFloat16: gemm_panels(A, packed.data_ptr<c10::BFloat16>(), C, bp, M, K, N, P, gelu); break;
    case at::kHalf: gemm_panels(A, packed.data_ptr<c10::Half>(), C, bp, M, K, N, P, gelu); break;
    default: TORCH_CHECK(false, "avx2_gemm: packed panels must be float32, bfloat16 or float16");
  }
#else
  TORCH_CHECK(false, "avx2_gemm: built without AVX2/FMA/F16C");
#endif
}

#ifdef VLLITE_AVX2_GEMM
// C[M, N] = A[M, K] @ W^T from raw panels (avx2_gemm_pack's layout, of type wt), no bias, all contiguous: for a
// caller holding many weights' panels in one buffer (moe.cpp: an expert's slice of the stacked panels).
void avx2_gemm_rows(const float* A, const void* panels, at::ScalarType wt, float* C, int64_t M, int64_t K,
                    int64_t N) {
  using namespace avx2_gemm_impl;
  const int64_t P = (N + NR - 1) / NR;
  if (M == 0 || N == 0) return;
  switch (wt) {
    case at::kFloat: gemm_panels(A, static_cast<const float*>(panels), C, nullptr, M, K, N, P, false); break;
    case at::kBFloat16:
      gemm_panels(A, static_cast<const c10::BFloat16*>(panels), C, nullptr, M, K, N, P, false);
      break;
    case at::kHalf: gemm_panels(A, static_cast<const c10::Half*>(panels), C, nullptr, M, K, N, P, false); break;
    default: TORCH_CHECK(false, "avx2_gemm_rows: panels must be float32, bfloat16 or float16");
  }
}

// avx2_gemm_pack into a caller's buffer of ceil(N / 16) * K * 16 values of type wt (not zeroed: the columns past N
// are zeroed here), from a contiguous [N, K] weight of the same type.
void avx2_gemm_pack_into(const void* w, void* panels, at::ScalarType wt, int64_t N, int64_t K) {
  constexpr int64_t NR = 16;
  const int64_t tail = N % NR, last = N / NR;  // the last panel's live columns, and that panel
  switch (wt) {
    case at::kFloat: pack_panels(static_cast<const float*>(w), static_cast<float*>(panels), N, K); break;
    case at::kBFloat16:
      pack_panels(static_cast<const c10::BFloat16*>(w), static_cast<c10::BFloat16*>(panels), N, K);
      break;
    case at::kHalf: pack_panels(static_cast<const c10::Half*>(w), static_cast<c10::Half*>(panels), N, K); break;
    default: TORCH_CHECK(false, "avx2_gemm_pack_into: weight must be float32, bfloat16 or float16");
  }
  if (tail == 0) return;
  const int64_t size = c10::elementSize(wt);
  char* p = static_cast<char*>(panels) + last * K * NR * size;
  for (int64_t k = 0; k < K; ++k) std::memset(p + (k * NR + tail) * size, 0, (NR - tail) * size);
}
#endif

void avx2_gemm(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  gemm(out, x, packed, bias, false);
}

// gelu(x @ W^T + bias) (torch's exact GELU), the activation applied to each output tile as it is stored.
void avx2_gemm_gelu(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  gemm(out, x, packed, bias, true);
}

// ---- bfloat16 GEMM on AVX512-BF16 (vdpbf16ps) ------------------------------------------------------------------
// Why: on a CPU with native bf16 math (Zen 4, 2 threads, SmolLM2's 121 linear layers) oneDNN's packed bf16 kernel
// streamed the weights at 1-4 rows at half this kernel's speed (15.1 against 8.9 ms at one row) and ran 64 rows
// at 303 against 369 GFLOP/s, 2,048 at 348 against 399 (docs/benchmarks.md, 2026-12-04). One packed copy serves
// every row count.
//
// Layout: [ceil(N / 32)][K / 2][32][2]: per pair of k, 32 columns' (w[k], w[k + 1]), so one vdpbf16ps multiplies
// a broadcast pair of x with 16 columns' pairs and adds both products to 16 float32 sums. A 12-row x 32-column
// tile keeps its 24 sums in registers and walks K once; the panel (K x 64 bytes) is reused from L1/L2 by every
// row tile of a 120-row block. The sums (the instruction's float32, round to nearest even, denormals as zero)
// get the float32 bias and are rounded once to bfloat16. K must be even (checked); the caller routes others away.
namespace bf16_gemm_impl {
constexpr int64_t NB = 32;   // output columns per panel: two zmm of float32 sums
constexpr int64_t MR = 12;   // rows per micro-tile: 24 sums + 2 weight vectors + 1 broadcast of the 32 zmm
constexpr int64_t MC = 120;  // rows per task: a 120 x K block of x stays in L2 (K = 1536: 360 KB)
constexpr int64_t MR2 = 6;   // rows per two-panel tile (tile2, tile_silu): 24 sums + 4 weight vectors + 1 broadcast
constexpr int64_t kPairMinRows = 256;  // from here tile2's 6 x 64 tiles (prefill), below tile's 12 x 32

// x, out and the packed weight as the bf16 GEMMs take them (checked; `what` names the caller): bfloat16 and
// contiguous, x [M, K], out [M, *], packed [P, K / 2, 32, 2].
static inline void check_operands(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                                  const char* what) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 4 && packed.size(2) == NB && packed.size(3) == 2
                  && x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16
                  && packed.scalar_type() == at::kBFloat16 && x.is_contiguous() && out.is_contiguous()
                  && packed.is_contiguous(),
              what, ": bfloat16 contiguous x [M, K], out [M, N], packed [P, K / 2, 32, 2]");
}

#ifdef VLLITE_BF16_GEMM
// With PF, each k step also fetches the same two lines of the `next` panel into L2 (next_panel_tiles).
template <int R, bool PF = false>
static inline void tile(const uint16_t* __restrict A, int64_t lda, const uint16_t* __restrict B, int64_t Kp,
                        uint16_t* __restrict C, int64_t ldc, const float* bias, int64_t ncols,
                        const uint16_t* next = nullptr) {
  __m512 c0[R], c1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < Kp; ++kk) {
    if constexpr (PF) prefetch_l2_128(next + kk * 2 * NB);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + kk * 2 * NB);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B + kk * 2 * NB + NB);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * kk, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
    }
  }
  const TileEdge32 e = tile_edge32(ncols, bias);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm256_mask_storeu_epi16(C + r * ldc, e.m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c0[r], e.b0)));
    _mm256_mask_storeu_epi16(C + r * ldc + 16, e.m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c1[r], e.b1)));
  }
}


// R <= 6 rows x two panels (64 columns; the second's first ncols - 32 live): 4 R sums from 4 weight vectors and R
// broadcasts per k pair, against tile's 2 R from 2 and R. Each output's sum is the same chain of vdpbf16ps over k
// in order as in tile, so the same bits. Over SmolLM2's layers at 256-2,048 rows this shape ran 3.5-4.7% faster
// than tile's 12 x 32 (1 and 2 threads, up to 227 GFLOP/s on a core against the instruction's 231-235), neutral at
// 64-128 rows and 11% slower on the LM head at 64 (more weight reads per product where few rows share them).
// The 4 R float32 sums of R rows against two panels B0 and B1 (c[0], c[1]: B0's 32 columns; c[2], c[3]: B1's), k
// pairs in order as in tile: tile2's and tile_silu's loop. With PF, each k step also fetches the same two lines of
// next0 and of next1 into L2.
template <int R, bool PF>
__attribute__((always_inline)) static inline void sums_two_panels(const uint16_t* __restrict A, int64_t lda,
                                                                  const uint16_t* __restrict B0,
                                                                  const uint16_t* __restrict B1, int64_t Kp,
                                                                  __m512 (&c)[4][R], const uint16_t* next0,
                                                                  const uint16_t* next1) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) c[0][r] = c[1][r] = c[2][r] = c[3][r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < Kp; ++kk) {
    if constexpr (PF) {
      prefetch_l2_128(next0 + kk * 2 * NB);
      prefetch_l2_128(next1 + kk * 2 * NB);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B0 + kk * 2 * NB);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B0 + kk * 2 * NB + NB);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(B1 + kk * 2 * NB);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(B1 + kk * 2 * NB + NB);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * kk, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      c[0][r] = _mm512_dpbf16_ps(c[0][r], a, b0);
      c[1][r] = _mm512_dpbf16_ps(c[1][r], a, b1);
      c[2][r] = _mm512_dpbf16_ps(c[2][r], a, b2);
      c[3][r] = _mm512_dpbf16_ps(c[3][r], a, b3);
    }
  }
}

template <int R>
static inline void tile2(const uint16_t* __restrict A, int64_t lda, const uint16_t* __restrict B0,
                         const uint16_t* __restrict B1, int64_t Kp, uint16_t* __restrict C, int64_t ldc,
                         const float* bias, int64_t ncols) {
  __m512 c[4][R];
  sums_two_panels<R, false>(A, lda, B0, B1, Kp, c, nullptr, nullptr);
  const TileEdge32 e = tile_edge32(NB, bias), f = tile_edge32(ncols - NB, bias ? bias + NB : nullptr);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_mask_storeu_epi16(C + r * ldc, e.m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[0][r], e.b0)));
    _mm256_mask_storeu_epi16(C + r * ldc + 16, e.m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[1][r], e.b1)));
    _mm256_mask_storeu_epi16(C + r * ldc + 32, f.m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[2][r], f.b0)));
    _mm256_mask_storeu_epi16(C + r * ldc + 48, f.m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[3][r], f.b1)));
  }
}

// The gate_up projection and SiLU-and-mul in one tile: R rows x 32 columns of the gate (panel Bg) and the same 32
// columns of the up projection (panel Bu), 4 R sums from 4 weight vectors and R broadcasts per k pair (tile: 2 R
// sums from 2 and R; at 1,024 rows of SmolLM2's gate_up this shape ran 11% faster than 12 rows x (16 + 16)
// columns, with fewer broadcasts per product). Each sum gets its bias and is rounded to bfloat16 as tile rounds it, then
// silu(gate) * up is computed as silu_and_mul computes it (pointwise.cpp). With PF, each k step also fetches the
// next two panels' lines into L2.
template <int R, bool PF = false>
static inline void tile_silu(const uint16_t* __restrict A, int64_t lda, const uint16_t* __restrict Bg,
                             const uint16_t* __restrict Bu, int64_t Kp, c10::BFloat16* __restrict C, int64_t ldc,
                             const float* bias_g, const float* bias_u, const uint16_t* next_g = nullptr,
                             const uint16_t* next_u = nullptr) {
  __m512 c[4][R];  // gate: c[0], c[1]; up: c[2], c[3]
  sums_two_panels<R, PF>(A, lda, Bg, Bu, Kp, c, next_g, next_u);
  const TileEdge32 eg = tile_edge32(NB, bias_g), eu = tile_edge32(NB, bias_u);
  alignas(64) c10::BFloat16 gate[R][NB], up[R][NB];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(gate[r]), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[0][r], eg.b0)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(gate[r] + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[1][r], eg.b1)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(up[r]), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[2][r], eu.b0)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(up[r] + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[3][r], eu.b1)));
  }
  silu_mul_bf16_rows(gate[0], up[0], NB, C, ldc, R, NB);
}
#endif
}  // namespace bf16_gemm_impl

#ifdef VLLITE_BF16_GEMM
// Whether a bf16 GEMM of inner size K runs on AMX tiles (amx.h) instead of vdpbf16ps: K in steps of 32.
static inline bool use_amx(int64_t K) {
#ifdef VLLITE_AMX
  return K % 32 == 0 && amx_on();
#else
  return false;
#endif
}

#ifdef VLLITE_AMX
// The tiles sum K in blocks of this many columns, each block's float32 sums added to the block before's in order:
// the same numbers whatever the loop order, so bf16_gemm can run a task's blocks of K over all its panels while the
// rows' block of x stays in L2 (amx_k_blocked) and a tile alone (amx_tile) gets the same result. Llama-1B's
// down_proj (K = 8,192) at 2,048 rows on an AMX Xeon: 1,711-1,744 GFLOP/s panel by panel (64-row tasks), 2,207-2,239
// in blocks of 2,048 (1,741-1,832 in blocks of 4,096; oneDNN 2,055-2,203), benchmarks/gemm_shapes.py.
constexpr int64_t kAmxKBlock = 2048;

// Rows [0, rows) x one panel's 32 columns of A[:, kb:kb + kc] @ panel, added to acc ([rows][32] float32; `first`:
// stored instead, the first block's).
static inline void amx_block_sums(const uint16_t* A, int64_t K, int64_t rows, const uint16_t* panel, int64_t kb,
                                  int64_t kc, float* acc, bool first, bool stream) {
  alignas(64) float part[amx::MR][amx::NB];
  amx::sums(amx::Dot::bf16, reinterpret_cast<const uint8_t*>(A + kb), K * 2, rows,
            reinterpret_cast<const uint8_t*>(panel + kb * amx::NB), kc / 32, first ? acc : &part[0][0], stream);
  if (first) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < amx::NB; c += 16)
      _mm512_storeu_ps(acc + r * amx::NB + c,
                       _mm512_add_ps(_mm512_loadu_ps(acc + r * amx::NB + c), _mm512_load_ps(&part[r][c])));
}

// C[0:rows, 0:ncols] (bfloat16, ldc apart) = sums [rows][32] + bias, rounded once to bfloat16 (as tile's are).
static inline void amx_store(const float* sums, int64_t rows, uint16_t* C, int64_t ldc, const float* bias,
                             int64_t ncols) {
  const TileEdge32 e = tile_edge32(ncols, bias);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 c0 = _mm512_add_ps(_mm512_loadu_ps(sums + r * amx::NB), e.b0);
    const __m512 c1 = _mm512_add_ps(_mm512_loadu_ps(sums + r * amx::NB + 16), e.b1);
    _mm256_mask_storeu_epi16(C + r * ldc, e.m0, (__m256i)_mm512_cvtneps_pbh(c0));
    _mm256_mask_storeu_epi16(C + r * ldc + 16, e.m1, (__m256i)_mm512_cvtneps_pbh(c1));
  }
}

// C[0:rows, 0:ncols] (bfloat16, ldc apart) = A[0:rows, 0:K] @ one panel + bias through the tiles (configured for
// `rows`), K in blocks of kAmxKBlock.
static void amx_tile(const uint16_t* A, int64_t K, int64_t rows, const uint16_t* panel, uint16_t* C, int64_t ldc,
                     const float* bias, int64_t ncols, bool stream) {
  alignas(64) float sums[amx::MR][amx::NB];
  for (int64_t kb = 0; kb < K; kb += kAmxKBlock)
    amx_block_sums(A, K, rows, panel, kb, std::min(kAmxKBlock, K - kb), &sums[0][0], kb == 0, stream);
  amx_store(&sums[0][0], rows, C, ldc, bias, ncols);
}

// bf16_gemm's tasks (row block, panel) with K past one block: a thread takes its tasks a row block at a time, and
// for each block of K runs over the block's panels, the rows' sums kept per panel until the last block.
static void amx_k_blocked(const uint16_t* A, int64_t M, int64_t K, const uint16_t* B, uint16_t* C, int64_t N,
                          const float* bias) {
  const int64_t NB = amx::NB, panel_elems = K * NB;  // a panel: [K / 2][32][2]
  const PanelTasks tasks(M, N, NB, amx::MC);
  split_for(tasks.count, 1, [&](int64_t tb, int64_t te) {
    amx::Tiles tiles;
    std::vector<float> acc;
    for (int64_t t0 = tb; t0 < te;) {
      const int64_t t1 = std::min(te, (t0 / tasks.panels + 1) * tasks.panels);  // this row block's tasks
      const int64_t m0 = tasks.first_row(t0), nr = tasks.block_rows(t0), p0 = tasks.panel(t0), np = t1 - t0;
      acc.resize(np * nr * NB);
      for (int64_t kb = 0; kb < K; kb += kAmxKBlock)
        for (int64_t i = 0; i < np; ++i)
          for (int64_t m = 0; m < nr; m += amx::MR) {
            const int64_t rows = std::min(amx::MR, nr - m);
            tiles.configure(rows);
            amx_block_sums(A + (m0 + m) * K, K, rows, B + (p0 + i) * panel_elems, kb, std::min(kAmxKBlock, K - kb),
                           acc.data() + (i * nr + m) * NB, kb == 0, m == 0);
          }
      for (int64_t i = 0; i < np; ++i) {
        const int64_t n0 = (p0 + i) * NB;
        amx_store(acc.data() + i * nr * NB, nr, C + m0 * N + n0, N, bias ? bias + n0 : nullptr,
                  std::min(NB, N - n0));
      }
      t0 = t1;
    }
  });
}

// C[0:rows, 0:32] (bfloat16, ldc apart) = silu(A @ gate panel + bg) * (A @ up panel + bu), each product's sums and
// bias rounded to bfloat16 as amx_tile stores them and then combined as silu_and_mul does: bit for bit bf16_gemm into
// [rows, 2 I] then silu_and_mul, without writing that intermediate (64 MiB a layer at 2,048 rows of Llama-1B) and
// reading it back in a second pass.
static void amx_tile_silu(const uint16_t* A, int64_t K, int64_t rows, const uint16_t* gate_panel,
                          const uint16_t* up_panel, c10::BFloat16* C, int64_t ldc, const float* bg, const float* bu,
                          bool stream) {
  alignas(64) float sums[2][amx::MR][amx::NB];
  alignas(64) c10::BFloat16 rounded[2][amx::MR][amx::NB];
  const uint16_t* panels[2] = {gate_panel, up_panel};
  const float* biases[2] = {bg, bu};
  for (int h = 0; h < 2; ++h) {
    for (int64_t kb = 0; kb < K; kb += kAmxKBlock)
      amx_block_sums(A, K, rows, panels[h], kb, std::min(kAmxKBlock, K - kb), &sums[h][0][0], kb == 0, stream);
    amx_store(&sums[h][0][0], rows, reinterpret_cast<uint16_t*>(&rounded[h][0][0]), amx::NB, biases[h], amx::NB);
  }
  silu_mul_bf16_rows(&rounded[0][0][0], &rounded[1][0][0], amx::NB, C, ldc, rows, amx::NB);
}
#endif

// C[M, ncols] (bfloat16, ldc apart) = A[M, K] (bfloat16) @ one packed panel ([K / 2][32][2]) + bias, on this
// thread: the tiles bf16_gemm runs, for callers that make their panels on the fly (gguf.cpp's dequantised blocks).
void bf16_gemm_panel(const uint16_t* A, int64_t M, int64_t K, const uint16_t* panel, uint16_t* C, int64_t ldc,
                     const float* bias, int64_t ncols) {
  using namespace bf16_gemm_impl;
#ifdef VLLITE_AMX
  if (use_amx(K)) {
    amx::Tiles tiles;
    for (int64_t m = 0; m < M; m += amx::MR) {
      const int64_t rows = std::min(amx::MR, M - m);
      tiles.configure(rows);
      amx_tile(A + m * K, K, rows, panel, C + m * ldc, ldc, bias, ncols, false);
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; m += MR)
    with_height<MR>(std::min(MR, M - m), [&](auto r) {
      tile<decltype(r)::value>(A + m * K, K, panel, K / 2, C + m * ldc, ldc, bias, ncols);
    });
}
#endif

bool bf16_gemm_available() {
#ifdef VLLITE_BF16_GEMM
  return true;
#else
  return false;
#endif
}

// w [N, K] bfloat16, K even -> out [ceil(N / 32), K / 2, 32, 2] (bits copied; columns past N left as the caller
// made them: zeros). Plain C++: it runs (and is tested) in every variant. The caller allocates `out`: an at::zeros
// here was emitted out of line with AVX-512 moves and kept by the linker for every variant (the variant test's
// shared-code check).
void bf16_gemm_pack(at::Tensor out, at::Tensor w) {
  using namespace bf16_gemm_impl;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0 && w.is_contiguous(),
              "bf16_gemm_pack: contiguous bfloat16 weight [N, K] with K even");
  const int64_t N = w.size(0), K = w.size(1), Kp = K / 2, P = (N + NB - 1) / NB;
  TORCH_CHECK(out.dim() == 4 && out.size(0) == P && out.size(1) == Kp && out.size(2) == NB && out.size(3) == 2
                  && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
              "bf16_gemm_pack: out [ceil(N / 32), K / 2, 32, 2] bfloat16");
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < NB && p * NB + j < N; ++j) {
        const uint16_t* s = src + (p * NB + j) * K;
        uint16_t* d = dst + p * Kp * NB * 2 + j * 2;
        for (int64_t kk = 0; kk < Kp; ++kk) {
          d[kk * NB * 2] = s[2 * kk];
          d[kk * NB * 2 + 1] = s[2 * kk + 1];
        }
      }
  });
}

// out[M, N] (bfloat16) = x[M, K] (bfloat16) @ W^T + bias (float32), W packed by bf16_gemm_pack; all contiguous.
// Tasks are (row block, panel) pairs, split over the threads (or the decode step's team, team.h).
void bf16_gemm(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  using namespace bf16_gemm_impl;
  check_operands(out, x, packed, "bf16_gemm");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(out.size(0) == M && K == 2 * Kp && P == (N + NB - 1) / NB, "bf16_gemm: shapes");
  const float* bp = float_bias(bias, N, "bf16_gemm");
  if (M == 0 || N == 0) return;
#ifdef VLLITE_BF16_GEMM
  const auto* A = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* B = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* C = reinterpret_cast<uint16_t*>(out.data_ptr());
#ifdef VLLITE_AMX
  if (use_amx(K) && K > kAmxKBlock && M > amx::MR) {
    amx_k_blocked(A, M, K, B, C, N, bp);
    return;
  }
  if (use_amx(K)) {
    amx::for_tiles(M, N, [&](int64_t m, int64_t rows, int64_t p, int64_t n0, int64_t ncols, bool stream) {
      amx_tile(A + m * K, K, rows, B + p * Kp * NB * 2, C + m * N + n0, N, bp ? bp + n0 : nullptr, ncols, stream);
    });
    return;
  }
#endif
  if (M >= kPairMinRows) {  // tasks of (row block, two panels), tiles of MR2 rows or one fewer
    const int64_t ps = Kp * NB * 2;
    const PanelTasks tasks(M, N, 2 * NB, MC);
    split_for(tasks.count, 1, [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t)
        tasks.even_tiles(t, MR2, [&](int64_t m, int64_t rows, int64_t q, int64_t n0, int64_t ncols) {
          const uint16_t* p0 = B + 2 * q * ps;
          const float* b = bp ? bp + n0 : nullptr;
          with_height<MR2>(rows, [&](auto r) {
            constexpr int R = decltype(r)::value;
            if (ncols > NB)
              tile2<R>(A + m * K, K, p0, p0 + ps, Kp, C + m * N + n0, N, b, ncols);
            else
              tile<R>(A + m * K, K, p0, Kp, C + m * N + n0, N, b, ncols);
          });
        });
    });
    return;
  }
  const bool pf = next_panel_tiles(M, MR, MC);
  for_panel_tiles(M, N, NB, MC, MR, [&](int64_t m, int64_t rows, int64_t p, int64_t n0, int64_t ncols) {
    const uint16_t* panel = B + p * Kp * NB * 2;
    with_height<MR>(rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      const float* b = bp ? bp + n0 : nullptr;
      if (pf && m == 0 && p + 1 < P)
        tile<R, true>(A + m * K, K, panel, Kp, C + m * N + n0, N, b, ncols, panel + Kp * NB * 2);
      else
        tile<R>(A + m * K, K, panel, Kp, C + m * N + n0, N, b, ncols);
    });
  });
#else
  TORCH_CHECK(false, "bf16_gemm: built without AVX512-BF16");
#endif
}

// out[M, I] (bfloat16) = silu(x @ Wg^T + bg) * (x @ Wu^T + bu), W = [Wg; Wu] the gate_up weight [2 I, K] packed by
// bf16_gemm_pack (bias float32 [2 I] or none), I a multiple of 32: bf16_gemm into [M, 2 I] then silu_and_mul, bit for
// bit, without writing and reading back the [M, 2 I] intermediate (at 2,048 rows 12.6 MB a layer for SmolLM2) or a
// second pass over it.
// On AMX tiles (amx.h) each task's tiles take a gate panel and its up panel (amx_tile_silu); on vdpbf16ps, below
// kSiluMinRows rows the two steps run as they are.
void bf16_gemm_silu(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  using namespace bf16_gemm_impl;
  check_operands(out, x, packed, "bf16_gemm_silu");
  const int64_t M = x.size(0), K = x.size(1), I = out.size(1), P = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(out.size(0) == M && K == 2 * Kp && I % NB == 0 && P == 2 * I / NB, "bf16_gemm_silu: shapes");
  const float* bp = float_bias(bias, 2 * I, "bf16_gemm_silu");
  if (M == 0 || I == 0) return;
#ifdef VLLITE_BF16_GEMM
  const auto* A = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* B = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* C = out.data_ptr<c10::BFloat16>();
  const int64_t half = I / NB, ps = Kp * NB * 2;  // the up panels' offset, elements per panel
#ifdef VLLITE_AMX
  if (use_amx(K)) {  // tasks of (row block, gate panel p and up panel p + I / 32)
    amx::for_tiles(M, I, [&](int64_t m, int64_t rows, int64_t p, int64_t n0, int64_t, bool stream) {
      amx_tile_silu(A + m * K, K, rows, B + p * ps, B + (p + half) * ps, C + m * I + n0, I, bp ? bp + n0 : nullptr,
                    bp ? bp + I + n0 : nullptr, stream);
    }, amx::rows_per_task(K * 2));
    return;
  }
#endif
  // Below kSiluMinRows rows the two steps: each 6-row tile reads the weights twice as often as tile's 12 rows,
  // and where a thread has 16-32 rows (a decode step split by requests) that cost 3-11% of the pair's time.
  constexpr int64_t kSiluMinRows = 64;
  if (M < kSiluMinRows) {
    at::Tensor both = at::empty({M, 2 * I}, x.options());
    bf16_gemm(both, x, packed, bias);
    silu_and_mul(out, both);
    return;
  }
  const bool pf = next_panel_tiles(M, MR2, MC);
  const PanelTasks tasks(M, I, NB, MC);  // (row block, 32 output columns: gate panel p, up panel p + I / 32)
  split_for(tasks.count, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t)
      tasks.even_tiles(t, MR2, [&](int64_t m, int64_t rows, int64_t p, int64_t n0, int64_t) {
        const uint16_t *bg = B + p * ps, *bu = B + (p + half) * ps;
        const float *big = bp ? bp + n0 : nullptr, *biu = bp ? bp + I + n0 : nullptr;
        with_height<MR2>(rows, [&](auto r) {
          constexpr int R = decltype(r)::value;
          if (pf && m == 0 && p + 1 < half)
            tile_silu<R, true>(A + m * K, K, bg, bu, Kp, C + m * I + n0, I, big, biu, bg + ps, bu + ps);
          else
            tile_silu<R>(A + m * K, K, bg, bu, Kp, C + m * I + n0, I, big, biu);
        });
      });
  });
#else
  TORCH_CHECK(false, "bf16_gemm_silu: built without AVX512-BF16");
#endif
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
