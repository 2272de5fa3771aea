// float8 e4m3 weight linear for pre-quantized fp8 checkpoints (``fp8``, compressed-tensors FP8: repacked at load into
// model_registry.layers.quantization.quant_weight.QuantWeight): out [M, N] = x [M, K] @ W^T in float32, with
//   W[n, k] = e4m3(code[n, k]) * scale[n, k / group],
// codes one byte each [N, K] (float8_e4m3fn as stored in the checkpoint), float32 scales [N, ceil(K / group)]:
// per tensor and per channel are one group of K columns, a 128x128 block one scale per row and 128 columns.
//
// Why: a decode step streams every weight once, and an fp8 weight is half of bf16's bytes, so the widening must
// cost little beside the bytes saved: no dequantised copy, each code widened in registers on the way to its FMA.
// AVX2 has no fp8 conversion. 32 codes are one load (64 with AVX-512, groups permitting); in each int32 lane (codes
// 4i .. 4i + 3) each code in turn is shifted to the top byte, then an arithmetic shift right by 4 and an AND with
// 0x87F00000 leave the sign at bit 31 and the 4 exponent and 3 mantissa bits at the top of the float's exponent and
// mantissa: the float whose value is e4m3 * 2^-120 exactly, subnormals included (exponent 0 becomes a float
// subnormal of the same mantissa). So 8 (16) weights cost 3 integer ops (2 for one of the four) and one FMA. To
// keep those tiny products normal floats, each activation row is copied once per call scaled by a power of two that
// puts its largest value near 2^60 (and its columns in the order the lanes produce: per block of 32 (64) columns,
// column 4i + j at 8j + i (16j + i)); the result is scaled back by 2^(120 - that power) in double: exact
// power-of-two scalings, the sums are those of the plain values.
// Scales are applied once per group to a float accumulator of that group's products. Activation rows are taken
// four at a time (each group of codes widened once for the four; one row: four FMA chains), output columns in
// chunks of 16 so a tile's activations stay in cache; N is split over threads (split_for), each computing
// whole columns: the same arithmetic whoever computes them. Groups that do not start on 32-column blocks (a group
// size not a multiple of 32) and the default variant take the plain loop over a 256-entry table of the values.
//
// fp8_linear_act also quantizes the activations first as the checkpoint's producer does (``quant_weight.fake_quant``:
// fp8 per token, per token and group of columns, or one static scale): scale = max(amax / 448, FLT_MIN), x / scale
// clamped to +-448, rounded to e4m3 (c10's conversion, torch's own), times the scale. In torch that was ~10% of an
// FP8 decode step (five ops and their temporaries per linear); here it is one pass over the row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <vector>

#include "common.h"
#include "team.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLLITE_FP8W_AVX2 1
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

namespace {

constexpr int64_t FP8_MT = 4;   // activation rows per tile
constexpr int64_t FP8_NC = 16;  // output columns per chunk (one tile of rows runs over them before the next)
// Bytes of codes fetched ahead of the tiles' loads: one thread's stream of weight rows runs at the hardware
// prefetcher's pace otherwise (1B FP8-block decode on an AMX Xeon: 91 ms a token without, 81 at 1 KiB, 75 at 2 KiB,
// 72 at 4 and 8 KiB).
constexpr int64_t FP8_AHEAD = 4096;

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
// The SIMD width the tiles run at: 8 float lanes (AVX2: a block of 32 codes per load) or 16 (AVX-512: 64 codes,
// half the instructions per weight). In each int32 lane (codes 4i .. 4i + 3) each code in turn is shifted to the
// top byte; widen() then leaves the float whose value is e4m3 * 2^-120 (see the top).
struct Lanes8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int64_t B = 32;  // codes per load
  static F zero() { return _mm256_setzero_ps(); }
  static I codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  template <int S>
  static F widen(I v) {
    const I t = S ? _mm256_slli_epi32(v, S) : v;
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(t, 4), _mm256_set1_epi32(0x87F00000)));
  }
  static float sum(F v) { return hsum8(v); }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int64_t B = 64;
  static F zero() { return _mm512_setzero_ps(); }
  static I codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  template <int S>
  static F widen(I v) {
    const I t = S ? _mm512_slli_epi32(v, S) : v;
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32(t, 4), _mm512_set1_epi32(0x87F00000)));
  }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
#endif

// One output column (weight row w, scales s) for R activation rows: xq their prepared copies (stride K), x the
// rows as given (a group's last columns short of a block), back[r] the factor that undoes row r's scaling; A chains
// of FMAs per row (more independent sums where there are fewer rows). (Tiles of 4 columns at one row, 2 chains each,
// each column's codes prefetched, measured 7-20% slower on the Zen 3 host than this one column at a time.)
template <typename V, int R, int A>
inline void column_tile(const uint8_t* w, const float* s, const float* xq, const float* x, int64_t K, int64_t group,
                        const float* tab, const double* back, float* res) {
  using F = typename V::F;
  constexpr int64_t L = V::B / 4;  // lanes
  F tot[R];
  float tail[R];
  for (int r = 0; r < R; ++r) {
    tot[r] = V::zero();
    tail[r] = 0.f;
  }
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t k1 = std::min(K, k0 + group);
    F acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = V::zero();
    int64_t k = k0;
    for (; k + V::B <= k1; k += V::B) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + FP8_AHEAD, _MM_HINT_T0);
      const auto v = V::codes(w + k);
      const F f0 = V::template widen<24>(v), f1 = V::template widen<16>(v);
      const F f2 = V::template widen<8>(v), f3 = V::template widen<0>(v);
      for (int r = 0; r < R; ++r) {
        const float* xr = xq + r * K + k;
        acc[r][0] = V::fma(V::load(xr), f0, acc[r][0]);
        acc[r][1 % A] = V::fma(V::load(xr + L), f1, acc[r][1 % A]);
        acc[r][2 % A] = V::fma(V::load(xr + 2 * L), f2, acc[r][2 % A]);
        acc[r][3 % A] = V::fma(V::load(xr + 3 * L), f3, acc[r][3 % A]);
      }
    }
    const F sg = V::set1(s[g]);
    for (int r = 0; r < R; ++r) {
      F a = acc[r][0];
      for (int i = 1; i < A; ++i) a = V::add(a, acc[r][i]);
      tot[r] = V::fma(a, sg, tot[r]);
    }
    if (k < k1) {  // a group's last columns short of a block
      float part[R];
      dot_plain<R>(w, x, K, k, k1, tab, part);
      for (int r = 0; r < R; ++r) tail[r] += part[r] * s[g];
    }
  }
  for (int r = 0; r < R; ++r) res[r] = static_cast<float>(static_cast<double>(V::sum(tot[r])) * back[r]) + tail[r];
}

// R rows (m0 ..) of output column n on the tiles of V: the tile for R (fewer rows, more chains).
template <typename V>
inline void column_tiles(int64_t R, const uint8_t* w, const float* s, const float* xq, const float* x, int64_t K,
                         int64_t group, const float* tab, const double* back, float* res) {
  switch (R) {
    case 4: column_tile<V, 4, 1>(w, s, xq, x, K, group, tab, back, res); break;
    case 3: column_tile<V, 3, 1>(w, s, xq, x, K, group, tab, back, res); break;
    case 2: column_tile<V, 2, 2>(w, s, xq, x, K, group, tab, back, res); break;
    default: column_tile<V, 1, 4>(w, s, xq, x, K, group, tab, back, res); break;
  }
}

// Each row's copy for the SIMD tiles: per block of B columns, column 4i + j at (B / 4) j + i (the order in which a
// block's codes come out of widen: lane i holds codes 4i .. 4i + 3), times 2^p with p chosen so that the row's
// largest value is near 2^60: the products with weights of value e4m3 * 2^-120 stay normal floats. back[m]
// = 2^(120 - p) undoes both. An exact power-of-two scaling: the sums are those of the unscaled values.
void prepare_rows(const float* x, int64_t M, int64_t K, int64_t B, float* xq, double* back) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const int p = amax > 0.f && std::isfinite(amax) ? 60 - std::ilogb(amax) : 0;  // up to 209: a double's
    const double f = std::ldexp(1.0, p);
    back[m] = std::ldexp(1.0, 120 - p);
    for (int64_t b = 0; b + B <= K; b += B)
      for (int64_t i = 0; i < B / 4; ++i)
        for (int64_t j = 0; j < 4; ++j) xq[m * K + b + (B / 4) * j + i] = static_cast<float>(xr[b + 4 * i + j] * f);
  }
}
#endif

// The whole product plainly (the default variant; groups that do not start on 32-column blocks).
template <int R>
inline void plain_tile(const uint8_t* w, const float* s, const float* x, int64_t K, int64_t group, const float* tab,
                        float* res) {
  for (int r = 0; r < R; ++r) res[r] = 0.f;
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    float part[R];
    dot_plain<R>(w, x, K, k0, std::min(K, k0 + group), tab, part);
    for (int r = 0; r < R; ++r) res[r] += part[r] * s[g];
  }
}

// Activations quantized in place as ``fake_quant`` does for fp8 (see the top): mode 1 per row, 2 per row and
// `agroup` columns, 3 one static scale.
void fake_quant_fp8(float* x, int64_t M, int64_t K, int64_t mode, int64_t agroup, float static_scale) {
  const int64_t seg = mode == 2 ? agroup : K;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += seg) {
      float* v = x + m * K + k0;
      const int64_t n = std::min(seg, K - k0);
      float scale = static_scale;
      if (mode != 3) {
        float amax = 0.f;
        for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(v[k]));
        scale = std::max(amax / 448.f, FLT_MIN);
      }
      for (int64_t k = 0; k < n; ++k) {
        const float q = std::min(std::max(v[k] / scale, -448.f), 448.f);
        v[k] = static_cast<float>(c10::Float8_e4m3fn(q)) * scale;
      }
    }
}

}  // namespace

void fp8_linear_act(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t group,
                    int64_t act_mode, int64_t act_group, double act_scale) {
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
  TORCH_CHECK(act_mode >= 0 && act_mode <= 3 && (act_mode != 2 || (act_group > 0 && K % act_group == 0))
                  && (act_mode != 3 || act_scale > 0),
              "fp8_linear: activation quantization 0 (none), 1 (per token), 2 (per token and group: a group "
              "dividing K) or 3 (static: a positive scale)");
  if (M == 0 || N == 0) return;
  const int64_t G = scales.size(1);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  std::vector<float> xa;  // the quantized activations
  if (act_mode) {
    xa.assign(xp, xp + M * K);
    fake_quant_fp8(xa.data(), M, K, act_mode, act_group, static_cast<float>(act_scale));
    xp = xa.data();
  }
  float* op = out.data_ptr<float>();
  const float* tab = e4m3_values().data();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1));  // >= 64 KiB of codes
#ifdef VLLITE_FP8W_AVX2
  // The SIMD tiles need every group to start on a block: groups of a multiple of the block, or one group; the
  // 64-column blocks of AVX-512 where they do, else the 32-column ones.
  const bool simd = G == 1 || group % 32 == 0;
#if defined(__AVX512F__)
  const bool wide = G == 1 || group % 64 == 0;
#else
  constexpr bool wide = false;
#endif
  std::vector<float> xq(simd ? M * K : 0);
  std::vector<double> back(simd ? M : 0);
  if (simd) prepare_rows(xp, M, K, wide ? 64 : 32, xq.data(), back.data());
#endif
  split_for(N, grain, [&](int64_t begin, int64_t end) {
    float res[FP8_MT];
    for (int64_t n0 = begin; n0 < end; n0 += FP8_NC) {
      const int64_t n1 = std::min(end, n0 + FP8_NC);
      for (int64_t m0 = 0; m0 < M; m0 += FP8_MT) {
        const int64_t R = std::min(FP8_MT, M - m0);
        const float* xm = xp + m0 * K;
        for (int64_t n = n0; n < n1; ++n) {
          const uint8_t* wn = cp + n * K;
          const float* sn = sp + n * G;
#ifdef VLLITE_FP8W_AVX2
          if (simd) {
            const float* qm = xq.data() + m0 * K;
            const double* bm = back.data() + m0;
#if defined(__AVX512F__)
            if (wide)
              column_tiles<Lanes16>(R, wn, sn, qm, xm, K, group, tab, bm, res);
            else
#endif
              column_tiles<Lanes8>(R, wn, sn, qm, xm, K, group, tab, bm, res);
            for (int64_t r = 0; r < R; ++r) op[(m0 + r) * N + n] = res[r];
            continue;
          }
#endif
          switch (R) {
            case 4: plain_tile<4>(wn, sn, xm, K, group, tab, res); break;
            case 3: plain_tile<3>(wn, sn, xm, K, group, tab, res); break;
            case 2: plain_tile<2>(wn, sn, xm, K, group, tab, res); break;
            default: plain_tile<1>(wn, sn, xm, K, group, tab, res); break;
          }
          for (int64_t r = 0; r < R; ++r) op[(m0 + r) * N + n] = res[r];
        }
      }
    }
  });
}

void fp8_linear(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t group) {
  fp8_linear_act(std::move(out), std::move(x), std::move(codes), std::move(scales), group, 0, 0, 0.0);
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
