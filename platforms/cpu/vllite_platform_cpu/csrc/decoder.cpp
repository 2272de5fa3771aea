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
// KIND_GGUF + ggml type the GGUF blocks for gguf_linear_x8, bias in the model dtype. The caller
// (decoder_layer.py) chose each kind as CpuModelOps.linear / gguf_linear would for this many rows.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <tuple>
#include <vector>

#include "common.h"

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

namespace {

constexpr int64_t KIND_PANELS = 0, KIND_PLAIN = 1, KIND_GGUF = 16;  // KIND_GGUF + ggml type id

// x [M, K] (model dtype) @ W^T + b -> [M, N] float32 rounded to the model dtype, as CpuModelOps does:
// the input widened to float32 (contiguous), the kernel's float32 output, then `.to(dt)`.
at::Tensor linear(const at::Tensor& x, int64_t kind, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  int64_t n, int64_t gguf_min_rows, int64_t gguf_grain) {
  const auto dt = x.scalar_type();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  std::optional<at::Tensor> bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat);
  if (kind == KIND_PANELS)
    avx2_gemm(out, xf, w, bf);
  else if (kind == KIND_PLAIN)
    small_linear(out, xf, w, bf);
  else
    gguf_linear_x8(out, xf, kind - KIND_GGUF, w, bf, gguf_min_rows, gguf_grain);
  return dt == at::kFloat ? out : out.to(dt);
}

}  // namespace

// Returns (layer output, residual stream) as LlamaDecoderLayer.forward does. Without `residual` (the first
// layer) x is the residual; with it, residual += x and x = norm(residual) in place, as add_rms_norm does.
// linears: qkv, o, gate_up, down (kinds, weights, biases, output features); attention as
// paged_attention_store, its output rows past num_tokens (padding) zero.
std::tuple<at::Tensor, at::Tensor> llama_decoder_layer(
    at::Tensor x, std::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,
    std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<std::optional<at::Tensor>> biases,
    std::vector<int64_t> out_features, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_size, at::Tensor kv_cache, at::Tensor slots, at::Tensor block_table, at::Tensor seq_lens,
    at::Tensor query_start_loc, at::Tensor req_ids, int64_t num_tokens, double scale, int64_t window,
    int64_t gguf_min_rows, int64_t gguf_grain) {
  TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && biases.size() == 4 && out_features.size() == 4,
              "llama_decoder_layer: four linears (qkv, o, gate_up, down)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "llama_decoder_layer: x [T, hidden] with contiguous rows");
  auto lin = [&](const at::Tensor& in, int i) {
    return linear(in, kinds[i], weights[i], biases[i], out_features[i], gguf_min_rows, gguf_grain);
  };
  const int64_t t = x.size(0);
  at::Tensor h, res;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    add_rms_norm(x, res, input_norm, eps);
    h = x;
  } else {
    res = x;
    h = at::empty_like(x);
    rms_norm(h, x, input_norm, eps);
  }
  // Each intermediate is released once used (a long prefill's qkv and gate_up are the widest tensors).
  at::Tensor attn;
  {
    const at::Tensor qkv = lin(h, 0).view({t, -1, head_size});
    const auto parts = qkv.split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
    rotary(parts[0], parts[1], cos, sin);
    attn = num_tokens < t ? at::zeros({t, num_heads, head_size}, qkv.options())
                          : at::empty({t, num_heads, head_size}, qkv.options());
    paged_attention_store(attn, parts[0], parts[1], parts[2], kv_cache, slots, block_table, seq_lens,
                          query_start_loc, req_ids, scale, window);
  }
  h = lin(attn.view({t, num_heads * head_size}), 1);
  attn.reset();
  add_rms_norm(h, res, post_norm, eps);
  at::Tensor act;
  {
    const at::Tensor gate_up = lin(h, 2);
    h.reset();
    act = at::empty({t, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(act, gate_up);
  }
  return {lin(act, 3), res};
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
