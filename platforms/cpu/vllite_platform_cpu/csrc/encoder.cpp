// The pieces of an encoder layer (BERT) that are not GEMMs, compiled once per ISA variant: bidirectional
// attention over a step's packed prompts and residual add + LayerNorm (GELU is the AVX2 GEMM's epilogue).
//
// Why: an encoder step is a few thousand prompt tokens of many short prompts. torch's path pads the
// prompts into buckets (a gather and a scatter of q/k/v per layer), runs SDPA's flash kernel (built for
// long sequences: most of its time at 50-token prompts is overhead), and makes separate passes for the
// residual add and the LayerNorm; on a shared 2-core host those memory passes cost as much as the
// attention math (docs/benchmarks.md, embeddings). Here each (prompt, head) reads its rows of the fused
// qkv projection where they lie and writes its output rows, and add + LayerNorm is one pass per row.
//
// Numerics: float32 throughout; exp and erf are ATen's vectorised ones (what torch's softmax and GELU use).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

namespace encoder_impl {
constexpr int64_t QR = 4;  // query rows that share one pass over the keys (scores) and the values (output)

// scores[r][0:lp] = q_r . k_j for QR query rows, keys transposed: kt[d][j], row stride lp (a multiple of
// VL; the columns past L are zero keys). Two key vectors by four rows: eight independent accumulators.
static inline void qk_rows(const float* q, int64_t D, const float* kt, int64_t lp, float* scores) {
  int64_t j = 0;
  for (; j + 2 * VL <= lp; j += 2 * VL) {
    AVec a00(0.f), a01(0.f), a10(0.f), a11(0.f), a20(0.f), a21(0.f), a30(0.f), a31(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const AVec k0 = AVec::loadu(kt + d * lp + j), k1 = AVec::loadu(kt + d * lp + j + VL);
      const AVec q0(q[d]), q1(q[D + d]), q2(q[2 * D + d]), q3(q[3 * D + d]);
      a00 = at::vec::fmadd(q0, k0, a00);
      a01 = at::vec::fmadd(q0, k1, a01);
      a10 = at::vec::fmadd(q1, k0, a10);
      a11 = at::vec::fmadd(q1, k1, a11);
      a20 = at::vec::fmadd(q2, k0, a20);
      a21 = at::vec::fmadd(q2, k1, a21);
      a30 = at::vec::fmadd(q3, k0, a30);
      a31 = at::vec::fmadd(q3, k1, a31);
    }
    a00.store(scores + j), a01.store(scores + j + VL);
    a10.store(scores + lp + j), a11.store(scores + lp + j + VL);
    a20.store(scores + 2 * lp + j), a21.store(scores + 2 * lp + j + VL);
    a30.store(scores + 3 * lp + j), a31.store(scores + 3 * lp + j + VL);
  }
  for (; j < lp; j += VL) {
    AVec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const AVec k0 = AVec::loadu(kt + d * lp + j);
      a0 = at::vec::fmadd(AVec(q[d]), k0, a0);
      a1 = at::vec::fmadd(AVec(q[D + d]), k0, a1);
      a2 = at::vec::fmadd(AVec(q[2 * D + d]), k0, a2);
      a3 = at::vec::fmadd(AVec(q[3 * D + d]), k0, a3);
    }
    a0.store(scores + j), a1.store(scores + lp + j), a2.store(scores + 2 * lp + j), a3.store(scores + 3 * lp + j);
  }
}

// p = exp(s - max(s)) over s[0:L] in place; returns the sum.
static inline float softmax_numerators(float* s, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) m = std::max(m, s[j]);
  const AVec mv(m);
  AVec sv(0.f);
  int64_t j = 0;
  for (; j + VL <= L; j += VL) {
    const AVec e = (AVec::loadu(s + j) - mv).exp();
    e.store(s + j);
    sv = sv + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](AVec& a, AVec& b) { return a + b; }, sv);
  for (; j < L; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// o_r[0:NV * VL] = sum_j p_r[j] v_j for QR rows: each value row loaded once for the four, NV vectors wide.
template <int NV>
static inline void pv_rows(const float* p, int64_t lp, const float* v, int64_t vstride, int64_t L, float* o) {
  static_assert(NV >= 1 && NV <= 2, "two value vectors at most: 4 x NV accumulators stay in registers");
  AVec acc[QR][NV];
  for (int r = 0; r < QR; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = AVec(0.f);
  for (int64_t j = 0; j < L; ++j) {
    AVec vv[NV];
    for (int n = 0; n < NV; ++n) vv[n] = AVec::loadu(v + j * vstride + n * VL);
    for (int r = 0; r < QR; ++r) {
      const AVec pr(p[r * lp + j]);
      for (int n = 0; n < NV; ++n) acc[r][n] = at::vec::fmadd(pr, vv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < QR; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n].store(o + r * NV * VL + n * VL);
}

// One (prompt, head): out rows [a, a + L) of this head from qkv rows [a, a + L).
static void attend_head(const float* qkv, float* out, int64_t a, int64_t L, int64_t h, int64_t H, int64_t D,
                        float scale, std::vector<float>& buf) {
  const int64_t row = 3 * H * D, lp = (L + VL - 1) / VL * VL, dp = (D + 2 * VL - 1) / (2 * VL) * (2 * VL);
  buf.assign(D * lp + QR * lp + QR * D + QR * dp, 0.f);
  float* kt = buf.data();        // [D][lp] keys, transposed
  float* sc = kt + D * lp;       // [QR][lp] scores, then probabilities
  float* qs = sc + QR * lp;      // [QR][D] scaled queries
  float* os = qs + QR * D;       // [QR][dp] output sums
  for (int64_t j = 0; j < L; ++j) {
    const float* k = qkv + (a + j) * row + (H + h) * D;
    for (int64_t d = 0; d < D; ++d) kt[d * lp + j] = k[d];
  }
  const float* v0 = qkv + a * row + (2 * H + h) * D;
  for (int64_t i = 0; i < L; i += QR) {
    const int64_t rows = std::min(QR, L - i);
    for (int64_t r = 0; r < QR; ++r) {  // rows past the prompt repeat its last query (computed, not stored)
      const float* src = qkv + (a + i + std::min(r, rows - 1)) * row + h * D;
      for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * scale;
    }
    qk_rows(qs, D, kt, lp, sc);
    float inv[QR];
    for (int64_t r = 0; r < QR; ++r) inv[r] = 1.f / softmax_numerators(sc + r * lp, L);
    // The output in chunks of up to two vectors per row (D = 32 on AVX2: two chunks).
    for (int64_t d0 = 0; d0 < dp; d0 += 2 * VL) {
      const int64_t w = std::min<int64_t>(2 * VL, D - d0);
      float chunk[QR * 2 * VL];
      if (w == 2 * VL) {
        pv_rows<2>(sc, lp, v0 + d0, row, L, chunk);
      } else if (w == VL) {
        pv_rows<1>(sc, lp, v0 + d0, row, L, chunk);
      } else {  // a head size that is not a multiple of the vector width: plain sums
        for (int64_t r = 0; r < QR; ++r)
          for (int64_t c = 0; c < w; ++c) {
            float acc = 0.f;
            for (int64_t j = 0; j < L; ++j) acc += sc[r * lp + j] * v0[j * row + d0 + c];
            chunk[r * w + c] = acc;
          }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out + (a + i + r) * H * D + h * D + d0;
        for (int64_t c = 0; c < w; ++c) o[c] = chunk[r * w + c] * inv[r];
      }
    }
  }
}
}  // namespace encoder_impl

// out[T, H, D] = softmax(q k^T * scale) v within each prompt; qkv [T, 3, H, D] float32 contiguous (the fused
// projection's output), cu_seqlens [B + 1] int64 on the host: prompt b is rows [cu[b], cu[b + 1]).
void encoder_attention(at::Tensor out, at::Tensor qkv, at::Tensor cu_seqlens, double scale) {
  using namespace encoder_impl;
  TORCH_CHECK(qkv.dim() == 4 && qkv.size(1) == 3 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat,
              "encoder_attention: qkv float32 contiguous [T, 3, H, D]");
  const int64_t T = qkv.size(0), H = qkv.size(2), D = qkv.size(3);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == T
                  && out.size(1) == H && out.size(2) == D,
              "encoder_attention: out float32 contiguous [T, H, D]");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous()
                  && cu_seqlens.numel() >= 1,
              "encoder_attention: cu_seqlens int64 [B + 1]");
  const int64_t B = cu_seqlens.numel() - 1;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, "encoder_attention: cu_seqlens must run from 0 to T");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cu[b + 1] >= cu[b], "encoder_attention: cu_seqlens must not decrease");
  const float* qp = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / H, h = t % H, a = cu[b], L = cu[b + 1] - a;
      if (L > 0) attend_head(qp, op, a, L, h, H, D, sc, buf);
    }
  });
}

// x = layer_norm(x + residual) * weight + bias, row by row, in place in x (float32 rows, unit stride).
void add_layer_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, at::Tensor bias, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && x.stride(1) == 1 && residual.stride(1) == 1
                  && x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat
                  && weight.is_contiguous() && bias.is_contiguous() && weight.numel() == x.size(1)
                  && bias.numel() == x.size(1) && weight.scalar_type() == at::kFloat
                  && bias.scalar_type() == at::kFloat,
              "add_layer_norm: float32 x, residual [T, n], weight and bias [n]");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const float fe = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* xr = xp + r * xs;
      const float* rr = rp + r * rs;
      AVec sv(0.f);
      int64_t d = 0;
      for (; d + VL <= n; d += VL) {
        const AVec v = AVec::loadu(xr + d) + AVec::loadu(rr + d);
        v.store(xr + d);
        sv = sv + v;
      }
      float sum = at::vec::vec_reduce_all<float>([](AVec& p, AVec& q) { return p + q; }, sv);
      for (; d < n; ++d) {
        xr[d] += rr[d];
        sum += xr[d];
      }
      const float mean = sum / static_cast<float>(n);
      const AVec mv(mean);
      AVec qv(0.f);
      d = 0;
      for (; d + VL <= n; d += VL) {
        const AVec c = AVec::loadu(xr + d) - mv;
        qv = at::vec::fmadd(c, c, qv);
      }
      float sq = at::vec::vec_reduce_all<float>([](AVec& p, AVec& q) { return p + q; }, qv);
      for (; d < n; ++d) sq += (xr[d] - mean) * (xr[d] - mean);
      const float rstd = 1.f / std::sqrt(sq / static_cast<float>(n) + fe);
      const AVec rv(rstd), shift(-rstd * mean);
      d = 0;
      for (; d + VL <= n; d += VL)
        at::vec::fmadd(at::vec::fmadd(AVec::loadu(xr + d), rv, shift), AVec::loadu(wp + d), AVec::loadu(bp + d))
            .store(xr + d);
      for (; d < n; ++d) xr[d] = (xr[d] * rstd - rstd * mean) * wp[d] + bp[d];
    }
  });
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
