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

// h[i * r + j] = x_i . a_j for M rows and r rank rows of length n: JR rank rows at a time, each A vector
// loaded once for the M rows (M * JR accumulators), one horizontal sum per (row, rank row).
template <typename T, int M, int JR>
static inline void shrink_block(const T* const* xr, const T* a, int64_t n, int64_t r, int64_t j, float* h) {
  const T* aj[JR];
  for (int q = 0; q < JR; ++q) aj[q] = a + (j + q) * n;
  AVec c[M][JR];
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < JR; ++q) c[i][q] = AVec(0.f);
  int64_t k = 0;
  for (; k + VL <= n; k += VL) {
    AVec av[JR];
    for (int q = 0; q < JR; ++q) av[q] = avec_load(aj[q] + k);
    for (int i = 0; i < M; ++i) {
      const AVec xv = avec_load(xr[i] + k);
      for (int q = 0; q < JR; ++q) c[i][q] = at::vec::fmadd(xv, av[q], c[i][q]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < JR; ++q) {
      alignas(64) float t[VL];
      c[i][q].store(t);
      float sum = 0.f;
      for (int64_t l = 0; l < VL; ++l) sum += t[l];
      for (int64_t kk = k; kk < n; ++kk) sum += static_cast<float>(xr[i][kk]) * static_cast<float>(aj[q][kk]);
      h[i * r + j + q] = sum;
    }
}

template <typename T, int M>
static inline void shrink(const T* const* xr, const T* a, int64_t n, int64_t r, float* h) {
  int64_t j = 0;
  for (; j + 3 <= r; j += 3) shrink_block<T, M, 3>(xr, a, n, r, j, h);
  for (; j < r; ++j) shrink_block<T, M, 1>(xr, a, n, r, j, h);
}

// y_i[o : o + NC * VL] += sum_j h[i * r + j] * b_j[o : ...] for M rows: an M x NC tile of accumulators,
// each B vector loaded once for the M rows and each h value broadcast once for the NC vectors.
template <typename T, int M, int NC>
static inline void expand_block(T* const* yr, const T* b, int64_t n, int64_t r, const float* h, int64_t o) {
  AVec c[M][NC];
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < NC; ++q) c[i][q] = AVec(0.f);
  for (int64_t j = 0; j < r; ++j) {
    AVec bv[NC];
    for (int q = 0; q < NC; ++q) bv[q] = avec_load(b + j * n + o + q * VL);
    for (int i = 0; i < M; ++i) {
      const AVec hv(h[i * r + j]);
      for (int q = 0; q < NC; ++q) c[i][q] = at::vec::fmadd(hv, bv[q], c[i][q]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < NC; ++q) {
      T* yp = yr[i] + o + q * VL;
      if constexpr (std::is_same_v<T, float>) {
        (AVec::loadu(yp) + c[i][q]).store(yp);
      } else {
        alignas(64) float t[VL];
        c[i][q].store(t);
        for (int64_t l = 0; l < VL; ++l) yp[l] = static_cast<T>(static_cast<float>(yp[l]) + t[l]);
      }
    }
}

template <typename T, int M>
static inline void expand(T* const* yr, const T* b, int64_t n, int64_t r, const float* h) {
  // M x 3 vectors: 12 accumulators at M = 4 (with three B vectors and a broadcast: 16 AVX2 registers).
  int64_t o = 0;
  for (; o + 3 * VL <= n; o += 3 * VL) expand_block<T, M, 3>(yr, b, n, r, h, o);
  for (; o + VL <= n; o += VL) expand_block<T, M, 1>(yr, b, n, r, h, o);
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
