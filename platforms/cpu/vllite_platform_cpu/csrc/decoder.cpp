// One Llama-style decoder layer (norm, qkv, rotary, paged attention, o_proj, norm, gate_up, SiLU-and-mul,
// down) in one call, composing this variant's own kernels in the order and with the dtype casts of the
// Python path (model_registry/models/llama.py through vllite_platform_cpu.model_ops.CpuModelOps).
//
// Why: a batch-1 decode step of a small model spends about a third of its time in the ~9 Python-level op
// calls per layer between the kernels (argument checks, tensor allocations through Python, dispatch);
// here they are C++ calls, allocations through at::empty. Numerics are the Python path's bit for bit: the
// same kernel functions, on the same inputs, in the same order.
//
// Each linear is (kind, weight, bias): KIND_PANELS the AVX2 GEMM's packed panels (float32, bfloat16 or
// float16) with a float32 bias; KIND_PLAIN a plain [N, K] weight for small_linear, bias in the model dtype;
// KIND_BF16 the bf16 GEMM's panels, KIND_INT8 the int8 GEMM's (W8A8), each with a float32 bias; KIND_GGUF + ggml
// type the GGUF blocks for gguf_linear_x8, bias in the model dtype; KIND_INT4 / KIND_INT4_Q8 / KIND_FP8 a
// pre-quantized weight's codes for int4_linear / int4_linear_q8 / fp8_linear_act (wna16.cpp, fp8_linear.cpp), its
// scales and zero points in the spec's `quant`, its group, zero, activation quantization in `quant_args`, bias in
// the model dtype (as CpuModelOps.quant_linear). The caller (decoder_layer.py) chose each kind as
// CpuModelOps.linear / gguf_linear / quant_linear would for this many rows.
//
// Why the pre-quantized kinds: a W4A16 or FP8 decode step of a 1B Llama ran its 64 linears through Python, each
// with ~4 torch ops around the kernel, and each kernel's own fork/join; in the stack's call they split over its team.
//
// llama_decoder_stack runs all of a model's layers in one call (their fixed arguments made once as
// DecoderLayerSpec): at batch 1 the per-layer Python and argument conversion around 30 layer calls was ~5% of
// a decode step, and in one call the threads can be held as a team for the whole step (team.h), so that
// every linear is split over them instead of the small ones staying on one thread.
#include <ATen/ops/empty.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <tuple>
#include <vector>

#include <omp.h>

#include "common.h"
#include "team.h"

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

namespace {

constexpr int64_t KIND_PANELS = 0, KIND_PLAIN = 1, KIND_BF16 = 2, KIND_INT8 = 3, KIND_GGUF = 16;  // + ggml type id
constexpr int64_t KIND_INT4 = 4, KIND_INT4_Q8 = 5, KIND_FP8 = 6;  // pre-quantized weights (CpuModelOps.quant_linear)

// x @ W^T + bias for a pre-quantized weight, as CpuModelOps.quant_linear: x widened to float32 (contiguous), the
// kernel's float32 output, bias added in float32, then `.to(dt)`. q: scales and zero points (an empty tensor for
// none); a: group, zero, activation mode (fp8: 0 none, 1 per token, 2 per token and group, 3 static), its group,
// its static scale.
at::Tensor quant_linear(const at::Tensor& x, int64_t kind, const at::Tensor& codes,
                        const std::optional<at::Tensor>& bias, int64_t n, const std::vector<at::Tensor>& q,
                        const std::vector<double>& a) {
  TORCH_CHECK(q.size() == 2 && a.size() == 5, "llama_decoder_layer: a pre-quantized linear takes (scales, zeros) and "
              "(group, zero, act mode, act group, act scale)");
  const auto dt = x.scalar_type();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  const auto group = static_cast<int64_t>(a[0]), zero = static_cast<int64_t>(a[1]);
  std::optional<at::Tensor> zeros;
  if (q[1].numel()) zeros = q[1];
  if (kind == KIND_FP8)
    fp8_linear_act(out, xf, codes, q[0], group, static_cast<int64_t>(a[2]), static_cast<int64_t>(a[3]), a[4]);
  else if (kind == KIND_INT4_Q8)
    int4_linear_q8(out, xf, codes, q[0], zeros, zero, group);
  else
    int4_linear(out, xf, codes, q[0], zeros, zero, group);
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return dt == at::kFloat ? out : out.to(dt);
}

// x [M, K] (model dtype) @ W^T + b -> [M, N] float32 rounded to the model dtype, as CpuModelOps does:
// the input widened to float32 (contiguous), the kernel's float32 output, then `.to(dt)` (the bf16 and int8
// GEMMs, and GGUF blocks under a bfloat16 model, take and give the model dtype themselves).
at::Tensor linear(const at::Tensor& x, int64_t kind, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  int64_t n, int64_t gguf_min_rows, int64_t gguf_grain) {
  const auto dt = x.scalar_type();
  if (kind == KIND_BF16 || kind == KIND_INT8) {  // x's dtype in and out, as CpuModelOps.linear / int8_linear
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    if (kind == KIND_BF16)
      bf16_gemm(out, x.contiguous(), w, bias);
    else
      int8_gemm(out, x.contiguous(), w, bias);
    return out;
  }
  std::optional<at::Tensor> bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat);
  if (kind >= KIND_GGUF && dt == at::kBFloat16) {  // bf16 in and out, as CpuModelOps.gguf_linear
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    gguf_linear_x8(out, x.contiguous(), kind - KIND_GGUF, w, bf, gguf_min_rows, gguf_grain);
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (kind == KIND_PANELS)
    avx2_gemm(out, xf, w, bf);
  else if (kind == KIND_PLAIN)
    small_linear(out, xf, w, bf);
  else
    gguf_linear_x8(out, xf, kind - KIND_GGUF, w, bf, gguf_min_rows, gguf_grain);
  return dt == at::kFloat ? out : out.to(dt);
}

}  // namespace

namespace {

// One step's attention arguments of a layer (paged_attention_store's, after the query, key, value and cache).
struct StepAttention {
  const at::Tensor &slots, &block_table, &seq_lens, &query_start_loc, &req_ids;
  int64_t num_tokens;
};

// The layer on (x, residual) as LlamaDecoderLayer.forward: returns (layer output, residual stream).
std::tuple<at::Tensor, at::Tensor> layer_forward(at::Tensor x, const std::optional<at::Tensor>& residual,
                                                 const DecoderLayerSpec& s, const at::Tensor& cos,
                                                 const at::Tensor& sin, const at::Tensor& kv_cache,
                                                 const StepAttention& step, int64_t gguf_min_rows,
                                                 int64_t gguf_grain) {
  TORCH_CHECK(s.kinds.size() == 4 && s.weights.size() == 4 && s.biases.size() == 4 && s.out_features.size() == 4
                  && s.quant.size() == 4 && s.quant_args.size() == 4,
              "llama_decoder_layer: four linears (qkv, o, gate_up, down)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "llama_decoder_layer: x [T, hidden] with contiguous rows");
  auto lin = [&](const at::Tensor& in, int i) {
    if (s.kinds[i] >= KIND_INT4 && s.kinds[i] <= KIND_FP8)
      return quant_linear(in, s.kinds[i], s.weights[i], s.biases[i], s.out_features[i], s.quant[i], s.quant_args[i]);
    return linear(in, s.kinds[i], s.weights[i], s.biases[i], s.out_features[i], gguf_min_rows, gguf_grain);
  };
  const int64_t t = x.size(0), head_size = s.head_size;
  at::Tensor h, res;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    add_rms_norm(x, res, s.input_norm, s.eps);
    h = x;
  } else {
    res = x;
    h = at::empty_like(x);
    rms_norm(h, x, s.input_norm, s.eps);
  }
  // Each intermediate is released once used (a long prefill's qkv and gate_up are the widest tensors).
  at::Tensor attn;
  {
    const at::Tensor qkv = lin(h, 0).view({t, -1, head_size});
    const auto parts = qkv.split_with_sizes({s.num_heads, s.num_kv_heads, s.num_kv_heads}, 1);
    rotary(parts[0], parts[1], cos, sin);
    attn = step.num_tokens < t ? at::zeros({t, s.num_heads, head_size}, qkv.options())
                               : at::empty({t, s.num_heads, head_size}, qkv.options());
    paged_attention_store(attn, parts[0], parts[1], parts[2], kv_cache, step.slots, step.block_table, step.seq_lens,
                          step.query_start_loc, step.req_ids, s.scale, s.window, 0.0);
  }
  h = lin(attn.view({t, s.num_heads * head_size}), 1);
  attn.reset();
  add_rms_norm(h, res, s.post_norm, s.eps);
  at::Tensor act;
  const int64_t inter = s.out_features[2] / 2;
  const bool bf16 = h.scalar_type() == at::kBFloat16;
  if ((s.kinds[2] == KIND_BF16 || (s.kinds[2] == KIND_INT8 && bf16)) && inter % 32 == 0) {
    act = at::empty({t, inter}, h.options());  // the two in one pass, bit for bit (bf16_gemm_silu, int8_gemm_silu)
    if (s.kinds[2] == KIND_BF16)
      bf16_gemm_silu(act, h.contiguous(), s.weights[2], s.biases[2]);
    else
      int8_gemm_silu(act, h.contiguous(), s.weights[2], s.biases[2]);
    h.reset();
  } else {
    const at::Tensor gate_up = lin(h, 2);
    h.reset();
    act = at::empty({t, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(act, gate_up);
  }
  return {lin(act, 3), res};
}

}  // namespace

// Returns (layer output, residual stream) as LlamaDecoderLayer.forward does. Without `residual` (the first
// layer) x is the residual; with it, residual += x and x = norm(residual) in place, as add_rms_norm does.
// linears: qkv, o, gate_up, down (kinds, weights, biases, output features); attention as
// paged_attention_store, its output rows past num_tokens (padding) zero.
std::tuple<at::Tensor, at::Tensor> llama_decoder_layer(
    at::Tensor x, std::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,
    std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<std::optional<at::Tensor>> biases,
    std::vector<int64_t> out_features, std::vector<std::vector<at::Tensor>> quant,
    std::vector<std::vector<double>> quant_args, at::Tensor cos, at::Tensor sin, int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_size, at::Tensor kv_cache, at::Tensor slots, at::Tensor block_table, at::Tensor seq_lens,
    at::Tensor query_start_loc, at::Tensor req_ids, int64_t num_tokens, double scale, int64_t window,
    int64_t gguf_min_rows, int64_t gguf_grain) {
  const DecoderLayerSpec spec{input_norm,         post_norm,          eps,
                              std::move(kinds),   std::move(weights), std::move(biases),
                              std::move(out_features), std::move(quant), std::move(quant_args),
                              num_heads,          num_kv_heads,       head_size,
                              scale,              window};
  return layer_forward(x, residual, spec, cos, sin, kv_cache,
                       {slots, block_table, seq_lens, query_start_loc, req_ids, num_tokens}, gguf_min_rows,
                       gguf_grain);
}

namespace {

// Linear work of one token against attention work of one (query row, context position) pair, in the units
// split_step balances: SmolLM2-135M's ~106M weights per token against 30 layers x 768 bytes of bfloat16 K/V per
// position measured ~350 (int8) to ~700 (bfloat16) positions per token on a Zen 4 core.
constexpr int64_t kTokenCost = 512;

// One thread's share of a step: rows [row0, row1) of x, requests [req0, req1) of the attention plans.
struct StepPart {
  int64_t row0, row1, req0, req1;
};

// The step cut at request boundaries into `parts` shares of about equal work (each request's query rows x
// kTokenCost plus the context positions its rows attend to), padding rows (past num_tokens) in the last; empty
// when some share would be empty or over 5/4 of an equal one (the step then runs whole, every kernel split).
std::vector<StepPart> split_step(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t rows,
                                 int64_t num_tokens, int parts) {
  const int64_t R = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  if (R < parts || qsl[0] != 0 || qsl[R] != num_tokens) return {};
  std::vector<int64_t> cum(R + 1, 0);  // work of requests [0, r)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q = qsl[r + 1] - qsl[r], L = sl[r];
    cum[r + 1] = cum[r] + q * kTokenCost + q * L - q * (q - 1) / 2;
  }
  const int64_t total = cum[R];
  std::vector<StepPart> out;
  int64_t req = 0;
  for (int k = 1; k <= parts; ++k) {
    int64_t end = R;
    if (k < parts) {  // the boundary whose work before it is nearest k / parts of the total
      const int64_t target = total * k / parts;
      end = std::lower_bound(cum.begin() + req + 1, cum.end(), target) - cum.begin();
      if (end > req + 1 && target - cum[end - 1] < cum[end] - target) --end;
    }
    if (end <= req || 4 * parts * (cum[end] - cum[req]) > 5 * total) return {};
    out.push_back({qsl[req], k < parts ? qsl[end] : rows, req, end});
    req = end;
  }
  for (const auto& p : out)
    if (p.row1 <= p.row0 || p.row0 >= num_tokens) return {};
  return out;
}

// One attention plan (slots, block_table, seq_lens, query_start_loc, req_ids) narrowed to a part: its rows'
// slots, its requests' tables and lengths, query starts from the part's first row, its requests among req_ids.
std::vector<at::Tensor> plan_part(const at::Tensor* plan, const StepPart& part) {
  const at::Tensor &slots = plan[0], &qsl = plan[3], &rid = plan[4];
  const int64_t n = slots.size(0);
  at::Tensor starts = at::empty({part.req1 - part.req0 + 1}, qsl.options());
  const int32_t* src = qsl.data_ptr<int32_t>() + part.req0;
  int32_t* dst = starts.data_ptr<int32_t>();
  for (int64_t i = 0; i <= part.req1 - part.req0; ++i) dst[i] = src[i] - static_cast<int32_t>(part.row0);
  std::vector<int32_t> mine;
  const int32_t* ids = rid.data_ptr<int32_t>();
  for (int64_t j = 0; j < rid.size(0); ++j)
    if (ids[j] >= part.req0 && ids[j] < part.req1) mine.push_back(ids[j] - static_cast<int32_t>(part.req0));
  at::Tensor req_ids = at::empty({static_cast<int64_t>(mine.size())}, rid.options());
  std::copy(mine.begin(), mine.end(), req_ids.data_ptr<int32_t>());
  return {slots.slice(0, std::min(part.row0, n), std::min(part.row1, n)), plan[1].slice(0, part.req0, part.req1),
          plan[2].slice(0, part.req0, part.req1), starts, req_ids};
}

}  // namespace

// split_step's shares as (first row, end row, first request, end request), for tests: checked arguments.
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> decoder_split_step(at::Tensor query_start_loc,
                                                                               at::Tensor seq_lens, int64_t rows,
                                                                               int64_t num_tokens, int64_t parts) {
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt
                  && query_start_loc.is_contiguous() && seq_lens.is_contiguous()
                  && query_start_loc.numel() == seq_lens.numel() + 1 && parts > 0 && num_tokens <= rows,
              "decoder_split_step: int32 query_start_loc [R + 1] and seq_lens [R], parts > 0, num_tokens <= rows");
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
  for (const auto& p : split_step(query_start_loc, seq_lens, rows, num_tokens, static_cast<int>(parts)))
    out.emplace_back(p.row0, p.row1, p.req0, p.req1);
  return out;
}

// A model's decoder layers in order, from the embedding (no residual yet): what llama_decoder_layer called
// layer by layer returns, bit for bit, without a Python call per layer. plans: 5 tensors per attention plan
// (slots, block_table, seq_lens, query_start_loc, req_ids; the layers of one cache group share one), layer i
// using plan plan_of_layer[i]. With more than one thread:
// - at most team_max_rows rows (a decode step at batch 1-4): the threads are held as a Team for the whole call
//   and every linear is split over them (team.h);
// - at least split_min_rows rows per thread (0: never), cut at request boundaries into one share per thread
//   (split_step): each thread runs every layer on its own rows alone, each kernel on one thread. The threads
//   then never wait for each other inside the step (~10 fork/joins per layer, each waiting for the slower
//   half), no activation crosses cores, and one thread's attention (bound by memory) can run beside the other's
//   GEMMs (bound by compute). Each thread reads every weight, so this pays only where a thread's rows keep the GEMMs
//   busy enough (the caller's threshold). Every kernel's result for a row depends on that row (and its
//   request's cache) alone, so the results are those of the whole step.
std::tuple<at::Tensor, at::Tensor> llama_decoder_stack(at::Tensor x, std::vector<std::shared_ptr<DecoderLayerSpec>> layers,
                                                       at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv_caches,
                                                       std::vector<at::Tensor> plans, std::vector<int64_t> plan_of_layer,
                                                       int64_t num_tokens, int64_t team_max_rows, int64_t split_min_rows,
                                                       int64_t gguf_min_rows, int64_t gguf_grain) {
  const size_t n = layers.size();
  TORCH_CHECK(n > 0 && kv_caches.size() == n && plan_of_layer.size() == n && plans.size() % 5 == 0,
              "llama_decoder_stack: one cache and one plan index per layer, 5 tensors per plan");
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(layers[i] && plan_of_layer[i] >= 0 && 5 * static_cast<size_t>(plan_of_layer[i]) < plans.size(),
                "llama_decoder_stack: layer ", i, ": no spec or no such plan");
  // Every layer on h (rows of x; cos, sin, plans ps and real tokens to match): (output, residual stream).
  auto run = [&](at::Tensor h, const at::Tensor& c, const at::Tensor& s, const std::vector<at::Tensor>& ps,
                 int64_t tokens) {
    std::optional<at::Tensor> residual;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor* p = ps.data() + 5 * plan_of_layer[i];
      auto out = layer_forward(h, residual, *layers[i], c, s, kv_caches[i], {p[0], p[1], p[2], p[3], p[4], tokens},
                               gguf_min_rows, gguf_grain);
      h = std::move(std::get<0>(out));
      residual = std::move(std::get<1>(out));
    }
    return std::make_tuple(h, *residual);
  };
  const int threads = at::get_num_threads();
  const int64_t rows = x.size(0);
  const bool whole = rows > team_max_rows && (split_min_rows <= 0 || rows < split_min_rows * threads);
  if (threads <= 1 || at::in_parallel_region() || whole) return run(x, cos, sin, plans, num_tokens);
  if (rows > team_max_rows) {
    const std::vector<StepPart> parts = split_step(plans[3], plans[2], rows, num_tokens, threads);
    bool one_layout = true;  // every plan's requests start at the same rows (they are one step's)
    for (size_t j = 5; one_layout && j < plans.size(); j += 5) one_layout = plans[j + 3].equal(plans[3]);
    if (parts.empty() || !one_layout) return run(x, cos, sin, plans, num_tokens);
    const int count = static_cast<int>(parts.size());
    std::vector<at::Tensor> outs(count), residuals(count);
    std::vector<std::exception_ptr> errors(count);
    const at::ThreadLocalState state;  // the caller's inference mode and dispatch state, in every thread
#pragma omp parallel num_threads(count)
    for (int k = omp_get_thread_num(); k < count; k += omp_get_num_threads()) {
      try {
        const at::ThreadLocalStateGuard guard(state);
        const StepPart& part = parts[k];
        std::vector<at::Tensor> ps;
        for (size_t j = 0; j < plans.size(); j += 5)
          for (auto& t : plan_part(plans.data() + j, part)) ps.push_back(std::move(t));
        const int64_t tokens = std::min(num_tokens, part.row1) - part.row0;
        std::tie(outs[k], residuals[k]) = run(x.slice(0, part.row0, part.row1), cos.slice(0, part.row0, part.row1),
                                              sin.slice(0, part.row0, part.row1), ps, tokens);
      } catch (...) {
        errors[k] = std::current_exception();  // rethrown outside the parallel region
      }
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    return {at::cat(outs), at::cat(residuals)};
  }
  Team team;
  at::Tensor out, residual;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      team.set_size(omp_get_num_threads());
      current_team = &team;
      try {
        std::tie(out, residual) = run(x, cos, sin, plans, num_tokens);
      } catch (...) {
        error = std::current_exception();  // rethrown outside the parallel region
      }
      current_team = nullptr;
      team.stop();
    } else {
      team.serve(omp_get_thread_num());
    }
  }
  if (error) std::rethrow_exception(error);
  return {out, residual};
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
