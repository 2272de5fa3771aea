// The CPU fused-MoE op in one call per layer: the router's top-k choices in, every chosen expert's gate/up GEMM,
// SiLU-and-mul and down GEMM on the AVX2 GEMM's panels (gemm.cpp), and the routing-weighted sum out.
//
// Why: in Python the same op was a list of the chosen experts, then per expert two linears, a SiLU and a scaled
// add: ~15 torch calls per layer at a decode row, ~0.1-0.2 ms of dispatch per layer on a 2-vCPU host against
// ~0.1 ms of GEMM (two experts of 512 x 1024 at hidden 512). Here the dispatch is one call.
//
// Work: the (token, slot) choices are grouped by expert (a counting sort, tokens in order within an expert);
// experts in increasing id order, each once: its rows of x gathered into float32, the gate/up GEMM [n, 2I], SiLU
// of the gate times the up half (float32, as silu_and_mul's float32 path), the down GEMM [n, H], then each row
// scaled by its routing weight and added to its token's float32 sum; a 16-bit output is rounded once at the end.
// The GEMMs split their panels over threads as avx2_gemm does; the rest is light and stays on the caller.
//
// Panels: an expert's weights are packed into its slice of the stacked panel buffers the first time a token
// chooses it (ready[e] set then), so an expert no token chose is never read, not even to pack it.
#include <algorithm>
#include <cstring>
#include <vector>

#include <ATen/ops/empty.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // gemm.cpp's avx2_gemm_rows needs the same
#define VLLITE_MOE_AVX2 1
#endif

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

#ifdef VLLITE_MOE_AVX2
void avx2_gemm_rows(const float* A, const void* panels, at::ScalarType wt, float* C, int64_t M, int64_t K,
                    int64_t N);  // gemm.cpp
void avx2_gemm_pack_into(const void* w, void* panels, at::ScalarType wt, int64_t N, int64_t K);  // gemm.cpp

namespace moe_impl {

// Row r of a [*, n] matrix of T as float32.
template <typename T>
static inline void row_to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

// h[r, :I] = silu(g[r, :I]) * g[r, I:] for n rows of g [n, 2I], float32 (silu_and_mul's float32 arithmetic).
static inline void silu_mul_rows(const float* g, float* h, int64_t n, int64_t I) {
  const AVec one(1.f);
  for (int64_t r = 0; r < n; ++r) {
    const float* gr = g + r * 2 * I;
    const float* ur = gr + I;
    float* hr = h + r * I;
    int64_t d = 0;
    for (; d + VL <= I; d += VL) {
      const AVec gv = AVec::loadu(gr + d);
      ((gv / (one + gv.neg().exp())) * AVec::loadu(ur + d)).store(hr + d);
    }
    if (d < I) {
      const int64_t m = I - d;
      const AVec gv = AVec::loadu(gr + d, m);
      ((gv / (one + gv.neg().exp())) * AVec::loadu(ur + d, m)).store(hr + d, m);
    }
  }
}

template <typename T>
static void run(at::Tensor& out, const at::Tensor& x, const int64_t* ids, const float* wts, int64_t T_, int64_t k,
                const at::Tensor& w13, const at::Tensor& w2, at::Tensor& p13, at::Tensor& p2, uint8_t* ready) {
  const int64_t E = w13.size(0), I2 = w13.size(1), H = w13.size(2), I = I2 / 2;
  const at::ScalarType wt = w13.scalar_type();
  // Counting sort of the choices by expert: rows[offset[e] .. offset[e + 1]) are expert e's (token, weight).
  std::vector<int64_t> offset(E + 1, 0);
  for (int64_t c = 0; c < T_ * k; ++c) ++offset[ids[c] + 1];
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) {
    most = std::max(most, offset[e + 1]);
    offset[e + 1] += offset[e];
  }
  std::vector<int64_t> token(T_ * k);
  std::vector<float> weight(T_ * k);
  {
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t c = 0; c < T_ * k; ++c) {
      const int64_t at = fill[ids[c]]++;
      token[at] = c / k;
      weight[at] = wts[c];
    }
  }
  // Pack the chosen experts not packed yet (each pack splits its panels over threads).
  const int64_t p13_size = p13.stride(0), p2_size = p2.stride(0), esize = c10::elementSize(wt);
  char* p13p = static_cast<char*>(p13.data_ptr());
  char* p2p = static_cast<char*>(p2.data_ptr());
  const char* w13p = static_cast<const char*>(w13.data_ptr());
  const char* w2p = static_cast<const char*>(w2.data_ptr());
  for (int64_t e = 0; e < E; ++e) {
    if (offset[e + 1] == offset[e] || ready[e]) continue;
    avx2_gemm_pack_into(w13p + e * I2 * H * esize, p13p + e * p13_size * esize, wt, I2, H);
    avx2_gemm_pack_into(w2p + e * H * I * esize, p2p + e * p2_size * esize, wt, H, I);
    ready[e] = 1;
  }
  // The float32 sums: out itself when it is float32.
  const bool f32 = std::is_same_v<T, float>;
  std::vector<float> sums_buf(f32 ? 0 : T_ * H);
  float* sums = f32 ? reinterpret_cast<float*>(out.data_ptr()) : sums_buf.data();
  std::fill(sums, sums + T_ * H, 0.f);
  std::vector<float> a(most * H), g(most * I2), h(most * I), y(most * H);
  const T* xp = static_cast<const T*>(x.data_ptr());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = offset[e], n = offset[e + 1] - b;
    if (n == 0) continue;
    for (int64_t r = 0; r < n; ++r) row_to_float(xp + token[b + r] * H, a.data() + r * H, H);
    avx2_gemm_rows(a.data(), p13p + e * p13_size * esize, wt, g.data(), n, H, I2);
    silu_mul_rows(g.data(), h.data(), n, I);
    avx2_gemm_rows(h.data(), p2p + e * p2_size * esize, wt, y.data(), n, I, H);
    for (int64_t r = 0; r < n; ++r) {  // one row at a time: a token that chose e twice adds both
      float* s = sums + token[b + r] * H;
      const float* yr = y.data() + r * H;
      const AVec wv(weight[b + r]);
      int64_t d = 0;
      for (; d + VL <= H; d += VL) (AVec::loadu(s + d) + wv * AVec::loadu(yr + d)).store(s + d);
      for (; d < H; ++d) s[d] += weight[b + r] * yr[d];
    }
  }
  if constexpr (!std::is_same_v<T, float>) {
    T* op = static_cast<T*>(out.data_ptr());
    for (int64_t i = 0; i < T_ * H; ++i) op[i] = static_cast<T>(sums[i]);
  }
}

}  // namespace moe_impl
#endif

// out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])), e = topk_ids[t, j].
// x, out [T, H], w13 [E, 2I, H], w2 [E, H, I]: one dtype (float32, bfloat16, float16), contiguous. p13 [E,
// ceil(2I / 16), H, 16] and p2 [E, ceil(H / 16), I, 16] (that dtype, contiguous) hold the experts' panels once
// ready[e] (uint8 [E]) is set; an expert chosen here and not ready is packed first.
void moe_experts(at::Tensor out, at::Tensor x, at::Tensor topk_ids, at::Tensor topk_weights, at::Tensor w13,
                 at::Tensor w2, at::Tensor p13, at::Tensor p2, at::Tensor ready) {
#ifdef VLLITE_MOE_AVX2
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "moe_experts: x must be float32, bfloat16 or float16");
  TORCH_CHECK(out.scalar_type() == dt && w13.scalar_type() == dt && w2.scalar_type() == dt
                  && p13.scalar_type() == dt && p2.scalar_type() == dt,
              "moe_experts: x, out, w13, w2 and the panels must share one dtype");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && p13.dim() == 4 && p2.dim() == 4,
              "moe_experts: x, out [T, H], w13 [E, 2I, H], w2 [E, H, I], panels [E, P, K, 16]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && w13.is_contiguous() && w2.is_contiguous()
                  && p13.is_contiguous() && p2.is_contiguous() && ready.is_contiguous(),
              "moe_experts: every tensor must be contiguous");
  const int64_t T_ = x.size(0), H = x.size(1), E = w13.size(0), I2 = w13.size(1), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0 && w13.size(2) == H && out.size(0) == T_ && out.size(1) == H && w2.size(0) == E
                  && w2.size(1) == H && w2.size(2) == I,
              "moe_experts: shapes of x, out, w13, w2 disagree");
  TORCH_CHECK(p13.size(0) == E && p13.size(1) == (I2 + 15) / 16 && p13.size(2) == H && p13.size(3) == 16
                  && p2.size(0) == E && p2.size(1) == (H + 15) / 16 && p2.size(2) == I && p2.size(3) == 16,
              "moe_experts: panel buffers must be [E, ceil(2I / 16), H, 16] and [E, ceil(H / 16), I, 16]");
  TORCH_CHECK(ready.scalar_type() == at::kByte && ready.numel() == E, "moe_experts: ready must be uint8 [E]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T_ && topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_ids and topk_weights must be [T, k]");
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const int64_t k = ids.size(1);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t c = 0; c < T_ * k; ++c)
    TORCH_CHECK(idp[c] >= 0 && idp[c] < E, "moe_experts: expert id ", idp[c], " outside [0, ", E, ")");
  if (T_ == 0) return;
  uint8_t* rp = ready.data_ptr<uint8_t>();
  switch (dt) {
    case at::kFloat: moe_impl::run<float>(out, x, idp, wts.data_ptr<float>(), T_, k, w13, w2, p13, p2, rp); break;
    case at::kBFloat16:
      moe_impl::run<c10::BFloat16>(out, x, idp, wts.data_ptr<float>(), T_, k, w13, w2, p13, p2, rp);
      break;
    default: moe_impl::run<c10::Half>(out, x, idp, wts.data_ptr<float>(), T_, k, w13, w2, p13, p2, rp); break;
  }
#else
  TORCH_CHECK(false, "moe_experts: built without AVX2/FMA/F16C");
#endif
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
