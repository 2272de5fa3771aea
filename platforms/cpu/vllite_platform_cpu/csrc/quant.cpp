// int8 W8A8 with dynamic activations (quantization="int8"), compiled once per ISA variant: the two passes
// around torch's int8 GEMM (each input row quantized with its own scale; the int32 sums scaled back), and, on
// AVX512-VNNI, an int8 GEMM of our own that does all three in one call (int8_gemm, below).
//
// Why the passes: in torch these are ten small ops per linear layer (float, abs, amax, where, div, round, clamp,
// to; float, mul, mul, add, to) at 3,840 calls per 32 decode steps: 3.6 s of a 13 s run, more than the int8
// GEMMs saved. One pass each, parallel over rows only when a row block pays for the threads.
//
// Numerics are those of vllite_core.model_ops.quantize_rows_int8 and the CPU model ops' torch code:
// scale = max|x| / 127 (1 for an all-zero row), q = round-half-even(x / scale) clamped to +-127, and
// y = ((float(acc) * x_scale) * w_scale) + bias, rounded once to the output dtype; no FMA contraction.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
// after common.h
#include "amx.h"
#include "team.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VLLITE_QUANT_AVX512 1
#if defined(__AVX512VNNI__)
#define VLLITE_INT8_GEMM 1
#endif
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
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack16(v));
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

// One row of x quantized: returns its scale, writes q (int8) or, with `flip`, q + 128 as uint8 (the sign bit
// flipped: the unsigned operand of the int8 GEMM's vpdpbusd). The same rounding either way.
template <typename scalar_t>
static inline float quantize_row(const scalar_t* row, int64_t K, int8_t* out, bool flip) {
  float amax = 0.f;
  int64_t k0 = 0;
#ifdef VLLITE_QUANT_AVX512
  __m512 m = _mm512_setzero_ps();
  for (; k0 + 16 <= K; k0 += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(row + k0)));
  amax = _mm512_reduce_max_ps(m);
#endif
  for (int64_t k = k0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(row[k])));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  const int8_t mask = flip ? int8_t(-128) : int8_t(0);
  int64_t k1 = 0;
#ifdef VLLITE_QUANT_AVX512
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m128i mv = _mm_set1_epi8(mask);
  for (; k1 + 16 <= K; k1 += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(row + k1), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k1),
                     _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)), mv));
  }
#endif
  for (int64_t k = k1; k < K; ++k) {
    const float v = std::nearbyint(static_cast<float>(row[k]) / s);
    out[k] = static_cast<int8_t>(static_cast<int8_t>(std::min(127.f, std::max(-127.f, v))) ^ mask);
  }
  return s;
}

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
      for (int64_t r = b; r < e; ++r) sp[r] = quantize_row(xp + r * xs, K, qp + r * K, false);
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

// ---- int8 GEMM on AVX512-VNNI (vpdpbusd) ------------------------------------------------------------------------
// Why: through torch._int_mm (oneDNN) the W8A8 path ran no faster than this CPU's own bf16 GEMM (Zen 4: 500
// against 498 out tok/s on benchmarks/compare.py), the activations quantized and the int32 sums scaled back in
// two more passes over memory each. Here one call quantizes the rows, sums them against packed int8 panels and
// scales each output tile in registers as it is stored: the same numbers as quantize_rows_int8 + _int_mm +
// dequantize_int32, bit for bit (the int32 sums are exact either way; the epilogue is dequantize_int32's).
//
// vpdpbusd multiplies unsigned by signed bytes, so each quantized input byte q (-127..127) is stored as
// q + 128 (its sign bit flipped, quantize_row's `flip`) and each column's 128 * sum(w) is subtracted from its
// sum: sum((q + 128) w) - 128 sum(w) = sum(q w), exactly (|sum| <= 255 * 127 * K < 2^31 for K <= 65536, checked).
//
// Layout (int8_gemm_pack): [ceil(N / 32)] panels of K / 4 rows of 32 columns x 4 consecutive k (128 bytes, two
// zmm), then the panel's 32 int32 compensations and 32 float32 weight scales, so a tile reads one stream. A
// 12-row x 32-column tile keeps 24 int32 sums in registers, as the bf16 GEMM does; tasks are (row block, panel).
namespace int8_gemm_impl {
constexpr int64_t NB = 32;         // output columns per panel
constexpr int64_t MR = 12;         // rows per micro-tile
constexpr int64_t MC = 120;        // rows per task
constexpr int64_t TAIL = NB * 8;   // bytes after a panel's weights: NB int32 compensations, NB float32 scales

#ifdef VLLITE_INT8_GEMM
static inline void store_masked(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
static inline void store_masked(c10::BFloat16* p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, bf16_pack16(v)); }

// The tile's int32 sums into acc [R][32]. Not inlined: inlined beside the epilogue, GCC 12 copied and spilled the
// 24 accumulators on every k step (130 vector moves in the loop, half the kernel's speed).
// With PF, each k step also fetches the same two lines of the `next` panel into L2 (next_panel_tiles).
template <int R, bool PF = false>
__attribute__((noinline)) static void tile_sums(const uint8_t* __restrict A, int64_t lda, const int8_t* __restrict B,
                                                int64_t K4, int32_t* __restrict acc, const int8_t* next = nullptr) {
  __m512i c0[R], c1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_si512();
  for (int64_t kk = 0; kk < K4; ++kk) {
    if constexpr (PF) prefetch_l2_128(next + kk * 4 * NB);
    const __m512i b0 = _mm512_loadu_si512(B + kk * 4 * NB);
    const __m512i b1 = _mm512_loadu_si512(B + kk * 4 * NB + 64);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, A + r * lda + 4 * kk, sizeof(quad));
      const __m512i a = _mm512_set1_epi32(quad);
      c0[r] = _mm512_dpbusd_epi32(c0[r], a, b0);
      c1[r] = _mm512_dpbusd_epi32(c1[r], a, b1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_store_si512(acc + r * NB, c0[r]);
    _mm512_store_si512(acc + r * NB + 16, c1[r]);
  }
}

// A tile's rows of int32 sums (acc [rows][32]) scaled back and stored (the columns past ncols masked off); the
// panel's compensations and weight scales follow its K4 rows of weights.
template <typename out_t>
static inline void scale_back(const int32_t* acc, int64_t rows, const int8_t* B, int64_t K4, const float* xs, out_t* C,
                              int64_t ldc, const float* bias, int64_t ncols) {
  const int32_t* comp = reinterpret_cast<const int32_t*>(B + K4 * 4 * NB);
  const float* ws = reinterpret_cast<const float*>(comp + NB);
  const TileEdge32 e = tile_edge32(ncols, bias);
  const __m512i k0 = _mm512_loadu_si512(comp), k1 = _mm512_loadu_si512(comp + 16);
  const __m512 w0 = _mm512_loadu_ps(ws), w1 = _mm512_loadu_ps(ws + 16);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 xv = _mm512_set1_ps(xs[r]);
    const __m512i s0 = _mm512_load_si512(acc + r * NB), s1 = _mm512_load_si512(acc + r * NB + 16);
    __m512 v0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s0, k0)), xv), w0);
    __m512 v1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s1, k1)), xv), w1);
    if (bias) {  // no add without a bias: dequantize_int32's arithmetic
      v0 = _mm512_add_ps(v0, e.b0);
      v1 = _mm512_add_ps(v1, e.b1);
    }
    store_masked(C + r * ldc, e.m0, v0);
    store_masked(C + r * ldc + 16, e.m1, v1);
  }
}

// One R x 32 tile: its sums, then each row scaled back.
template <int R, typename out_t>
static inline void tile(const uint8_t* A, int64_t lda, const int8_t* B, int64_t K4, const float* xs, out_t* C,
                        int64_t ldc, const float* bias, int64_t ncols, const int8_t* next = nullptr) {
  alignas(64) int32_t acc[R * NB];
  if (next)
    tile_sums<R, true>(A, lda, B, K4, acc, next);
  else
    tile_sums<R>(A, lda, B, K4, acc);
  scale_back(acc, R, B, K4, xs, C, ldc, bias, ncols);
}

#endif

// x, out and the packed weight as the int8 GEMMs take them (checked; `what` names the caller): x [M, K] float32 or
// bfloat16 with contiguous rows, out [M, *] of x's dtype, packed int8 [P, K * 32 + 256] (int8_gemm_pack).
static inline void check_operands(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                                  const char* what) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 2 && x.stride(1) == 1 && out.is_contiguous()
                  && packed.is_contiguous() && packed.scalar_type() == at::kChar
                  && out.scalar_type() == x.scalar_type()
                  && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, ": x [M, K] float32 or bfloat16 (rows contiguous), out [M, N] of x's dtype, packed int8");
  TORCH_CHECK(x.size(1) <= 65536, what, ": K = ", x.size(1), " > 65536 could overflow the int32 sums");
}

#ifdef VLLITE_INT8_GEMM
// int8_gemm_silu's tasks: (row block, 32 output columns p); per task the GEMM's tiles of gate panel p over the block
// into bfloat16 rows in L1, then those of up panel p + I / 32, then silu(gate) * up as silu_and_mul computes it. Each
// panel is reused from L1 by the block's tiles as in int8_gemm (a tile of a gate and an up panel at once, 37 KB with
// K = 576, fell out of Zen 4's 32 KB L1: 1-4% slower at 256 rows). tile(m, rows, p, up, dst, first) runs the GEMM's
// tile of `rows` rows from row m against gate (up false) or up panel p into dst (32 values a row); `first`: the
// block's first tile, the one that fetches the panel used next.
template <typename Tile>
static void gate_up_silu_blocks(int64_t M, int64_t I, c10::BFloat16* C, const Tile& tile) {
  const PanelTasks tasks(M, I, NB, MC);
  split_for(tasks.count, 1, [&](int64_t tb, int64_t te) {
    alignas(64) c10::BFloat16 gate[MC][NB], up[MC][NB];
    for (int64_t t = tb; t < te; ++t) {
      const int64_t m0 = tasks.first_row(t), p = tasks.panel(t);
      for (const bool is_up : {false, true})
        tasks.tiles(t, MR, [&](int64_t m, int64_t r, int64_t, int64_t, int64_t) {
          tile(m, r, p, is_up, (is_up ? up : gate)[m - m0], m == m0);
        });
      silu_mul_bf16_rows(gate[0], up[0], NB, C + m0 * I + p * NB, I, tasks.block_rows(t), NB);
    }
  });
}

// x's rows quantized for the tiles (quantize_row with the sign bit flipped): the [M, K] bytes and their scales.
static std::pair<at::Tensor, at::Tensor> quantize_for_tiles(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor xsc = at::empty({M}, x.options().dtype(at::kFloat));
  int8_t* qp = xq.data_ptr<int8_t>();
  float* xs = xsc.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "int8_gemm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, quant_grain(K), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) xs[r] = quantize_row(xp + r * ld, K, qp + r * K, true);
    });
  });
  return {xq, xsc};
}
#endif
}  // namespace int8_gemm_impl

bool int8_gemm_available() {
#ifdef VLLITE_INT8_GEMM
  return true;
#else
  return false;
#endif
}

// q [N, K] int8 (K a multiple of 4) and its float32 scale per row -> out [ceil(N / 32), K * 32 + 256] int8 (the
// layout above; columns past N, weights, compensations and scales, left as the caller made them: zeros). Plain
// C++: it runs (and is tested) in every variant; the caller allocates `out` (see bf16_gemm_pack).
void int8_gemm_pack(at::Tensor out, at::Tensor q, at::Tensor scale) {
  using namespace int8_gemm_impl;
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % 4 == 0 && q.is_contiguous()
                  && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == q.size(0),
              "int8_gemm_pack: contiguous int8 weight [N, K] with K a multiple of 4, float32 scale [N]");
  const int64_t N = q.size(0), K = q.size(1), K4 = K / 4, P = (N + NB - 1) / NB;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == P && out.size(1) == K * NB + TAIL && out.scalar_type() == at::kChar
                  && out.is_contiguous(),
              "int8_gemm_pack: out [ceil(N / 32), K * 32 + 256] int8");
  const int8_t* src = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      int8_t* panel = dst + p * (K * NB + TAIL);
      for (int64_t j = 0; j < NB && p * NB + j < N; ++j) {
        const int8_t* row = src + (p * NB + j) * K;
        int32_t sum = 0;
        for (int64_t kk = 0; kk < K4; ++kk)
          for (int64_t i = 0; i < 4; ++i) {
            panel[kk * 4 * NB + j * 4 + i] = row[4 * kk + i];
            sum += row[4 * kk + i];
          }
        const int32_t comp = 128 * sum;
        std::memcpy(panel + K * NB + 4 * j, &comp, 4);
        std::memcpy(panel + K * NB + 4 * NB + 4 * j, sp + p * NB + j, 4);
      }
    }
  });
}

// out[M, N] = int8 W8A8 linear of x[M, K] (float32 or bfloat16, rows contiguous) with W packed by int8_gemm_pack:
// x quantized per row (quantize_rows_int8's rounding), exact int32 sums, then (float(sum) * x_scale) * w_scale
// + bias (float32), rounded once to out's dtype (x's). Tasks are (row block, panel) pairs, split over the threads
// (or the decode step's team, team.h).
void int8_gemm(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  using namespace int8_gemm_impl;
  check_operands(out, x, packed, "int8_gemm");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = packed.size(0);
  TORCH_CHECK(out.size(0) == M && K % 4 == 0 && P == (N + NB - 1) / NB && packed.size(1) == K * NB + TAIL,
              "int8_gemm: shapes");
  const float* bp = float_bias(bias, N, "int8_gemm");
  if (M == 0 || N == 0) return;
#ifdef VLLITE_INT8_GEMM
  const auto [xq, xsc] = quantize_for_tiles(x);
  const auto* A = reinterpret_cast<const uint8_t*>(xq.data_ptr<int8_t>());
  const float* xs = xsc.data_ptr<float>();
  const int8_t* B = packed.data_ptr<int8_t>();
  const int64_t K4 = K / 4;
  auto run = [&](auto* C) {
#ifdef VLLITE_AMX
    if (K % 64 == 0 && amx_on()) {  // the same int32 sums on AMX tiles (amx.h), 64 k per step
      amx::for_tiles(M, N, [&](int64_t m, int64_t rows, int64_t p, int64_t n0, int64_t ncols, bool stream) {
        alignas(64) int32_t acc[amx::MR * NB];
        const int8_t* panel = B + p * (K * NB + TAIL);
        amx::sums(amx::Dot::int8, A + m * K, K, rows, reinterpret_cast<const uint8_t*>(panel), K / 64, acc, stream);
        scale_back(acc, rows, panel, K4, xs + m, C + m * N + n0, N, bp ? bp + n0 : nullptr, ncols);
      }, amx::rows_per_task(K));
      return;
    }
#endif
    const bool pf = next_panel_tiles(M, MR, MC);
    for_panel_tiles(M, N, NB, MC, MR, [&](int64_t m, int64_t rows, int64_t p, int64_t n0, int64_t ncols) {
      const int8_t* next = pf && m == 0 && p + 1 < P ? B + (p + 1) * (K * NB + TAIL) : nullptr;
      with_height<MR>(rows, [&](auto r) {
        tile<decltype(r)::value>(A + m * K, K, B + p * (K * NB + TAIL), K4, xs + m, C + m * N + n0, N,
                                 bp ? bp + n0 : nullptr, ncols, next);
      });
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "int8_gemm: built without AVX512-VNNI");
#endif
}

// out[M, I] (bfloat16) = silu(g) * u for [g, u] = int8_gemm(x, W) (x bfloat16), W = [Wg; Wu] the gate_up weight
// [2 I, K] packed by int8_gemm_pack (bias float32 [2 I] or none), I a multiple of 32: int8_gemm into [M, 2 I] then
// silu_and_mul, bit for bit, without writing and reading back the [M, 2 I] intermediate or a second pass over it.
// On AMX tiles (amx.h) the two steps run as they are.
void int8_gemm_silu(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  using namespace int8_gemm_impl;
  check_operands(out, x, packed, "int8_gemm_silu");
  const int64_t M = x.size(0), K = x.size(1), I = out.size(1), P = packed.size(0);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int8_gemm_silu: bfloat16 x and out");
  TORCH_CHECK(out.size(0) == M && K % 4 == 0 && I % NB == 0 && P == 2 * I / NB && packed.size(1) == K * NB + TAIL,
              "int8_gemm_silu: shapes");
  const float* bp = float_bias(bias, 2 * I, "int8_gemm_silu");
  if (M == 0 || I == 0) return;
#ifdef VLLITE_INT8_GEMM
#ifdef VLLITE_AMX
  if (K % 64 == 0 && amx_on()) {
    at::Tensor both = at::empty({M, 2 * I}, x.options());
    int8_gemm(both, x, packed, bias);
    silu_and_mul(out, both);
    return;
  }
#endif
  const auto [xq, xsc] = quantize_for_tiles(x);
  const auto* A = reinterpret_cast<const uint8_t*>(xq.data_ptr<int8_t>());
  const float* xs = xsc.data_ptr<float>();
  const int8_t* B = packed.data_ptr<int8_t>();
  auto* C = out.data_ptr<c10::BFloat16>();
  const int64_t K4 = K / 4, half = I / NB, ps = K * NB + TAIL;  // the up panels' offset, bytes per panel
  // Up to MC rows (one block) each panel's first tile fetches the panel used next (the up panel, then the next
  // gate panel), from one row: at 6 rows a thread, left to the hardware's prefetcher, the jumps between gate and up
  // panels cost 13-39% against int8_gemm's one stream of panels.
  const bool pf = M <= MC;
  gate_up_silu_blocks(M, I, C, [&](int64_t m, int64_t rows, int64_t p, bool up, c10::BFloat16* dst, bool first) {
    const int64_t next_panel = up ? p + 1 : p + half;  // used after this one: the up panel, then the next gate's
    const int8_t* next = pf && first && (!up || p + 1 < half) ? B + next_panel * ps : nullptr;
    const float* b = bp ? bp + (up ? I : 0) + p * NB : nullptr;
    with_height<MR>(rows, [&](auto h) {
      tile<decltype(h)::value>(A + m * K, K, B + (up ? p + half : p) * ps, K4, xs + m, dst, NB, b, NB, next);
    });
  });
#else
  TORCH_CHECK(false, "int8_gemm_silu: built without AVX512-VNNI");
#endif
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
