// The entry points of every ISA variant of the kernels, as bindings.cpp registers them.
//
// attention.cpp, gemm.cpp, pointwise.cpp, quant.cpp, gguf.cpp, wna16.cpp, encoder.cpp, lora.cpp, moe.cpp and decoder.cpp
// define them
// inside vllite_cpu::VLLITE_CPU_ISA; the build compiles those files once per variant (vllite_platform_cpu/isa.py),
// each into its own namespace.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// One variant's functions, declared in the enclosing namespace; and DecoderLayerSpec, one Llama-style decoder
// layer's fixed arguments to llama_decoder_layer (norms, the four linears as (kind, weight, bias, output
// features, a pre-quantized weight's scales, zero points and arguments), heads, scale, window), made once per
// layer in Python (decoder_layer.py) so that llama_decoder_stack takes a step's layers as one list instead of
// converting ~20 arguments per layer; `sources` are the tensors its packed weights were made from, with their
// data pointers and versions then (layer_specs_current). Each variant has its own (its inline members compiled
// with that variant's flags, like everything else of it).
#define VLLITE_CPU_DECLARE_KERNELS                                                                                  \
  struct DecoderLayerSpec {                                                                                         \
    at::Tensor input_norm, post_norm;                                                                               \
    double eps;                                                                                                     \
    std::vector<int64_t> kinds;                                                                                     \
    std::vector<at::Tensor> weights;                                                                                \
    std::vector<std::optional<at::Tensor>> biases;                                                                  \
    std::vector<int64_t> out_features;                                                                              \
    std::vector<std::vector<at::Tensor>> quant;   /* per linear: a pre-quantized weight's scales, zero points */   \
    std::vector<std::vector<double>> quant_args;  /* per linear: group, zero, act mode, act group, act scale */    \
    int64_t num_heads, num_kv_heads, head_size;                                                                     \
    double scale;                                                                                                   \
    int64_t window;                                                                                                 \
    std::vector<at::Tensor> sources;        /* what the packed weights were made from */                          \
    std::vector<int64_t> source_keys;       /* each source's data pointer and version when made */                \
  };                                                                                                                \
  void paged_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,              \
                       at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor req_ids, \
                       double scale, int64_t window, double k_scale, double v_scale, double soft_cap);              \
  void paged_attention_store(at::Tensor out, at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor kv_cache, \
                             at::Tensor slots, at::Tensor block_table, at::Tensor seq_lens,                         \
                             at::Tensor query_start_loc, at::Tensor req_ids, double scale, int64_t window,          \
                             double soft_cap);                                                                      \
  bool avx2_gemm_available();                                                                                       \
  std::vector<std::string> avx2_gemm_dtypes();                                                                      \
  at::Tensor avx2_gemm_pack(at::Tensor w);                                                                          \
  void avx2_gemm(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);                  \
  void avx2_gemm_gelu(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);             \
  bool bf16_gemm_available();                                                                                       \
  void bf16_gemm_pack(at::Tensor out, at::Tensor w);                                                                \
  void bf16_gemm(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);                  \
  void bf16_gemm_silu(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);             \
  bool amx_available();                                                                                             \
  bool amx_on();                                                                                                    \
  bool set_amx(bool on);                                                                                            \
  void encoder_attention(at::Tensor out, at::Tensor qkv, at::Tensor cu_seqlens, double scale);                      \
  void add_layer_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, at::Tensor bias, double eps);           \
  void small_linear(at::Tensor out, at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias);                    \
  void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);                                       \
  void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);                              \
  void silu_and_mul(at::Tensor out, at::Tensor x);                                                                  \
  void argmax_rows(at::Tensor out, at::Tensor x);                                                                   \
  void rotary(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);                                          \
  void quantize_rows_int8(at::Tensor q, at::Tensor scale, at::Tensor x);                                            \
  void dequantize_int32(at::Tensor out, at::Tensor acc, at::Tensor x_scale, at::Tensor w_scale,                     \
                        std::optional<at::Tensor> bias);                                                            \
  bool int8_gemm_available();                                                                                       \
  void int8_gemm_pack(at::Tensor out, at::Tensor q, at::Tensor scale);                                              \
  void int8_gemm(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);                  \
  void int8_gemm_silu(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);             \
  void gguf_linear_x8(at::Tensor out, at::Tensor x, int64_t type, at::Tensor blocks, std::optional<at::Tensor> bias, \
                      int64_t gemm_min_rows, int64_t grain_bytes);                                                  \
  void gguf_rows(at::Tensor out, at::Tensor ids, int64_t type, at::Tensor blocks);                                  \
  void gguf_repack_kquant(at::Tensor out, at::Tensor raw, int64_t type);                                            \
  void int4_linear(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales,                              \
                   std::optional<at::Tensor> zeros, int64_t zero, int64_t group);                                   \
  void int4_linear_q8(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales,                           \
                      std::optional<at::Tensor> zeros, int64_t zero, int64_t group);                                \
  void fp8_linear(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t group);              \
  void fp8_linear_act(at::Tensor out, at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t group,           \
                      int64_t act_mode, int64_t act_group, double act_scale);                                       \
  void moe_experts(at::Tensor out, at::Tensor x, at::Tensor topk_ids, at::Tensor topk_weights, at::Tensor w13,        \
                   at::Tensor w2, at::Tensor p13, at::Tensor p2, at::Tensor ready);                                \
  void lora_add(at::Tensor y, at::Tensor x, at::Tensor lora_a, at::Tensor lora_b, at::Tensor order,                 \
                std::vector<int64_t> seg_slots, std::vector<int64_t> seg_starts, std::vector<int64_t> ranks);       \
  std::tuple<at::Tensor, at::Tensor> llama_decoder_layer(                                                           \
      at::Tensor x, std::optional<at::Tensor> residual, at::Tensor input_norm, at::Tensor post_norm, double eps,    \
      std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<std::optional<at::Tensor>> biases,   \
      std::vector<int64_t> out_features, std::vector<std::vector<at::Tensor>> quant,                                \
      std::vector<std::vector<double>> quant_args, at::Tensor cos, at::Tensor sin, int64_t num_heads,               \
      int64_t num_kv_heads, int64_t head_size, at::Tensor kv_cache, at::Tensor slots, at::Tensor block_table,        \
      at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor req_ids, int64_t num_tokens, double scale,        \
      int64_t window, int64_t gguf_min_rows, int64_t gguf_grain);                                                   \
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> decoder_split_step(                                   \
      at::Tensor query_start_loc, at::Tensor seq_lens, int64_t rows, int64_t num_tokens, int64_t parts);             \
  std::tuple<at::Tensor, at::Tensor> llama_decoder_stack(                                                           \
      at::Tensor x, std::vector<std::shared_ptr<DecoderLayerSpec>> layers, at::Tensor cos,                         \
      at::Tensor sin, std::vector<at::Tensor> kv_caches, std::vector<at::Tensor> plans,                             \
      std::vector<int64_t> plan_of_layer, int64_t num_tokens, int64_t team_max_rows, int64_t split_min_rows,  \
      int64_t gguf_min_rows, int64_t gguf_grain);

namespace vllite_cpu {
namespace isa_default {
VLLITE_CPU_DECLARE_KERNELS
}  // namespace isa_default
namespace isa_avx2 {
VLLITE_CPU_DECLARE_KERNELS
}  // namespace isa_avx2
namespace isa_avx512 {
VLLITE_CPU_DECLARE_KERNELS
}  // namespace isa_avx512
namespace isa_avx512_bf16 {
VLLITE_CPU_DECLARE_KERNELS
}  // namespace isa_avx512_bf16
}  // namespace vllite_cpu
