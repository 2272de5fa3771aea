// Multi-LoRA on the CPU: y[t] += (x[t] A_s^T) B_s for every adapted row t of a step, all slots in one call
// (the "shrink" to rank r and the "expand" back, per segment of rows that share a slot).
//
// Why: the torch path is a gather, two small matmuls per active slot and a scatter-add per adapted layer,
// about ten ops per layer and a thousand per decode step of a 30-layer model; on a 2-core host each pays
// for its dispatch and thread wake-up, which cost more than the arithmetic (5% of the base model's
// multiply-adds at rank 16). Here one parallel region per layer does the whole update.
//
// Work: tasks of up to MT rows of one segment (rows listed by `order`, grouped by slot). A task computes
// h = x A_s^T for its rows (dot products over `in`, two rank rows at a time, each A row read once for the
// MT rows) and then y += h B_s with B stored transposed [R, out] (one axpy per rank row, each B row read
// once for the MT rows). A slot's A and B stay in L2 across its tasks. float32 accumulation for every
// dtype; a 16-bit y is rounded once.
#include <algorithm>
#include <vector>

#include "common.h"

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

namespace lora_impl {

constexpr int64_t MT = 4;  // rows per task

// h[i * r + j] = x_i . a_j for M rows and r rank rows of length n.
template <typename T, int M>
static inline void shrink(const T* const* xr, const T* a, int64_t n, int64_t r, float* h) {
  int64_t j = 0;
  for (; j + 2 <= r; j += 2) {
    const T* a0 = a + j * n;
    const T* a1 = a0 + n;
    AVec c0[M], c1[M];
    for (int i = 0; i < M; ++i) c0[i] = c1[i] = AVec(0.f);
    int64_t k = 0;
    for (; k + VL <= n; k += VL) {
      const AVec v0 = avec_load(a0 + k), v1 = avec_load(a1 + k);
      for (int i = 0; i < M; ++i) {
        const AVec xv = avec_load(xr[i] + k);
        c0[i] = at::vec::fmadd(xv, v0, c0[i]);
        c1[i] = at::vec::fmadd(xv, v1, c1[i]);
      }
    }
    for (int i = 0; i < M; ++i) {
      alignas(64) float t0[VL], t1[VL];
      c0[i].store(t0);
      c1[i].store(t1);
      float s0 = 0.f, s1 = 0.f;
      for (int64_t l = 0; l < VL; ++l) {
        s0 += t0[l];
        s1 += t1[l];
      }
      for (int64_t kk = k; kk < n; ++kk) {
        const float xv = static_cast<float>(xr[i][kk]);
        s0 += xv * static_cast<float>(a0[kk]);
        s1 += xv * static_cast<float>(a1[kk]);
      }
      h[i * r + j] = s0;
      h[i * r + j + 1] = s1;
    }
  }
  for (; j < r; ++j) {
    const T* a0 = a + j * n;
    for (int i = 0; i < M; ++i) {
      float s = 0.f;
      for (int64_t kk = 0; kk < n; ++kk) s += static_cast<float>(xr[i][kk]) * static_cast<float>(a0[kk]);
      h[i * r + j] = s;
    }
  }
}

// y_i += sum_j h[i * r + j] * b_j for M rows; b rows of length n (the layer's outputs).
template <typename T, int M>
static inline void expand(T* const* yr, const T* b, int64_t n, int64_t r, const float* h) {
  int64_t o = 0;
  for (; o + VL <= n; o += VL) {
    AVec c[M];
    for (int i = 0; i < M; ++i) c[i] = AVec(0.f);
    for (int64_t j = 0; j < r; ++j) {
      const AVec bv = avec_load(b + j * n + o);
      for (int i = 0; i < M; ++i) c[i] = at::vec::fmadd(AVec(h[i * r + j]), bv, c[i]);
    }
    for (int i = 0; i < M; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        (AVec::loadu(yr[i] + o) + c[i]).store(yr[i] + o);
      } else {
        alignas(64) float t[VL];
        c[i].store(t);
        for (int64_t l = 0; l < VL; ++l) yr[i][o + l] = static_cast<T>(static_cast<float>(yr[i][o + l]) + t[l]);
      }
    }
  }
  for (; o < n; ++o)
    for (int i = 0; i < M; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < r; ++j) s += h[i * r + j] * static_cast<float>(b[j * n + o]);
      yr[i][o] = static_cast<T>(static_cast<float>(yr[i][o]) + s);
    }
}

template <typename T, int M>
static inline void task(T* y, int64_t ldy, const T* x, int64_t ldx, const T* a, const T* b, const int64_t* rows,
                        int64_t in, int64_t out, int64_t r, float* h) {
  const T* xr[M];
  T* yr[M];
  for (int i = 0; i < M; ++i) {
    xr[i] = x + rows[i] * ldx;
    yr[i] = y + rows[i] * ldy;
  }
  shrink<T, M>(xr, a, in, r, h);
  expand<T, M>(yr, b, out, r, h);
}

template <typename T>
static void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const int64_t* order, const std::vector<int64_t>& seg_slots, const std::vector<int64_t>& seg_starts,
                const std::vector<int64_t>& ranks) {
  const int64_t in = x.size(1), out = y.size(1), cap = lora_a.size(1);
  // Tasks: (segment, first row in `order`, rows), MT rows at most, skipping slots this layer does not adapt.
  std::vector<int64_t> t_seg, t_row, t_len;
  for (size_t s = 0; s < seg_slots.size(); ++s) {
    if (ranks[seg_slots[s]] == 0) continue;
    for (int64_t p = seg_starts[s]; p < seg_starts[s + 1]; p += MT) {
      t_seg.push_back(static_cast<int64_t>(s));
      t_row.push_back(p);
      t_len.push_back(std::min(MT, seg_starts[s + 1] - p));
    }
  }
  const int64_t ntasks = static_cast<int64_t>(t_seg.size());
  if (ntasks == 0) return;
  T* yp = y.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* ap = lora_a.data_ptr<T>();
  const T* bp = lora_b.data_ptr<T>();
  const int64_t ldy = y.stride(0), ldx = x.stride(0);
  // One task per thread chunk is enough work (rank x (in + out) x MT multiply-adds, tens of thousands).
  at::parallel_for(0, ntasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(MT * cap);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = seg_slots[t_seg[t]], r = ranks[slot];
      const T* a = ap + slot * lora_a.stride(0);
      const T* b = bp + slot * lora_b.stride(0);
      const int64_t* rows = order + t_row[t];
      switch (t_len[t]) {
        case 4: task<T, 4>(yp, ldy, xp, ldx, a, b, rows, in, out, r, h.data()); break;
        case 3: task<T, 3>(yp, ldy, xp, ldx, a, b, rows, in, out, r, h.data()); break;
        case 2: task<T, 2>(yp, ldy, xp, ldx, a, b, rows, in, out, r, h.data()); break;
        default: task<T, 1>(yp, ldy, xp, ldx, a, b, rows, in, out, r, h.data()); break;
      }
    }
  });
}

}  // namespace lora_impl

void lora_add(at::Tensor y, at::Tensor x, at::Tensor lora_a, at::Tensor lora_b, at::Tensor order,
              std::vector<int64_t> seg_slots, std::vector<int64_t> seg_starts, std::vector<int64_t> ranks) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && x.size(0) == y.size(0) && y.stride(1) == 1 && x.stride(1) == 1,
              "lora_add: y [T, out] and x [T, in] with contiguous rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() && lora_b.is_contiguous()
                  && lora_a.size(0) == lora_b.size(0) && lora_a.size(1) == lora_b.size(1)
                  && lora_a.size(2) == x.size(1) && lora_b.size(2) == y.size(1),
              "lora_add: lora_a [slots, R, in] and lora_b [slots, R, out], contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && lora_a.scalar_type() == y.scalar_type()
                  && lora_b.scalar_type() == y.scalar_type(),
              "lora_add: x, y, lora_a and lora_b must share one dtype");
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1 && order.is_contiguous(),
              "lora_add: order must be a contiguous int64 vector");
  TORCH_CHECK(seg_starts.size() == seg_slots.size() + 1 && static_cast<int64_t>(ranks.size()) == lora_a.size(0),
              "lora_add: seg_starts needs one more entry than seg_slots, ranks one per slot");
  const int64_t n = order.size(0), slots = lora_a.size(0), cap = lora_a.size(1);
  TORCH_CHECK(seg_starts.front() >= 0 && seg_starts.back() <= n, "lora_add: segments outside order");
  for (size_t s = 0; s < seg_slots.size(); ++s)
    TORCH_CHECK(seg_slots[s] >= 0 && seg_slots[s] < slots && seg_starts[s] <= seg_starts[s + 1]
                    && ranks[seg_slots[s]] >= 0 && ranks[seg_slots[s]] <= cap,
                "lora_add: bad segment, slot or rank");
  const int64_t* op = order.data_ptr<int64_t>();
  for (int64_t i = seg_starts.front(); i < seg_starts.back(); ++i)
    TORCH_CHECK(op[i] >= 0 && op[i] < y.size(0), "lora_add: row index out of range");
  switch (y.scalar_type()) {
    case at::kFloat: lora_impl::run<float>(y, x, lora_a, lora_b, op, seg_slots, seg_starts, ranks); break;
    case at::kBFloat16: lora_impl::run<at::BFloat16>(y, x, lora_a, lora_b, op, seg_slots, seg_starts, ranks); break;
    case at::kHalf: lora_impl::run<at::Half>(y, x, lora_a, lora_b, op, seg_slots, seg_starts, ranks); break;
    default: TORCH_CHECK(false, "lora_add: float32, bfloat16 or float16 only");
  }
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
