// The Python module of the CPU kernels: one submodule per ISA variant compiled in (default, avx2, avx512,
// avx512_bf16), each with the same functions, and cpu_features() for kernels.py to choose among them.
//
// The build defines VLLITE_CPU_WITH_<namespace> for each variant it compiled (setup.py: all of them on
// x86-64, compiled with the baseline flags; the first-use build of kernels.py: one, with its flags).
// Nothing here runs a variant's code: kernels.py picks the one the CPU can run.
// <torch/python.h>, not <torch/extension.h>: the bindings need pybind11 and torch's tensor casters, not the
// whole C++ frontend (torch/all.h), which took 24 of this unit's 59 s of compile.
#include <torch/python.h>
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#endif

#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define VLLITE_CPU_X86_CPUID 1
#endif

#include "kernels.h"

namespace {

// The CPU's (and the OS's: the vector registers' state must be saved) features that the variants need,
// spelled as in /proc/cpuinfo.
std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
#ifdef VLLITE_CPU_X86_CPUID
  __builtin_cpu_init();
#define VLLITE_CPU_FEATURE(builtin, name) \
  if (__builtin_cpu_supports(builtin)) out.emplace_back(name);
  VLLITE_CPU_FEATURE("avx2", "avx2")
  VLLITE_CPU_FEATURE("fma", "fma")
  VLLITE_CPU_FEATURE("f16c", "f16c")
  VLLITE_CPU_FEATURE("bmi", "bmi1")
  VLLITE_CPU_FEATURE("bmi2", "bmi2")
  VLLITE_CPU_FEATURE("avx512f", "avx512f")
  VLLITE_CPU_FEATURE("avx512bw", "avx512bw")
  VLLITE_CPU_FEATURE("avx512vl", "avx512vl")
  VLLITE_CPU_FEATURE("avx512dq", "avx512dq")
#undef VLLITE_CPU_FEATURE
  // AVX512-BF16 straight from CPUID (leaf 7, subleaf 1, EAX bit 5): older compilers' __builtin_cpu_supports
  // does not know it. The OS check is the one avx512f passed (the same register state).
  unsigned int a = 0, b = 0, c = 0, d = 0;
  if (__builtin_cpu_supports("avx512f") && __get_cpuid_max(0, nullptr) >= 7 && __get_cpuid_count(7, 1, &a, &b, &c, &d)
      && (a & (1u << 5)))
    out.emplace_back("avx512_bf16");
  // AVX512-VNNI likewise (leaf 7, subleaf 0, ECX bit 11).
  if (__builtin_cpu_supports("avx512f") && __get_cpuid_max(0, nullptr) >= 7 && __get_cpuid_count(7, 0, &a, &b, &c, &d)
      && (c & (1u << 11)))
    out.emplace_back("avx512_vnni");
#endif
  return out;
}

// Where a tensor's values live and how often they were changed in place, as decoder_layer.py's packing keys
// read them (an inference tensor has no version counter: 0).
inline void append_identity(std::vector<int64_t>& keys, const at::Tensor& t) {
  keys.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  keys.push_back(t.is_inference() ? 0 : static_cast<int64_t>(t._version()));
}

// A variant's DecoderLayerSpec (kernels.h), made in Python once per layer for llama_decoder_stack, and
// layer_specs_current: whether every spec's sources are still what its packed weights were made from. Why:
// checking that in Python, tensor by tensor, was ~0.3 ms of a batch-64 int8 decode step (240 tensors).
template <typename Spec>
void bind_layer_spec(pybind11::module_& s) {
  // module_local: a process may load two builds of one variant (an installed module and a first-use build).
  pybind11::class_<Spec, std::shared_ptr<Spec>>(s, "DecoderLayerSpec", pybind11::module_local(),
                                                "One decoder layer's fixed arguments, for llama_decoder_stack")
      .def(pybind11::init([](at::Tensor input_norm, at::Tensor post_norm, double eps, std::vector<int64_t> kinds,
                             std::vector<at::Tensor> weights, std::vector<std::optional<at::Tensor>> biases,
                             std::vector<int64_t> out_features, std::vector<std::vector<at::Tensor>> quant,
                             std::vector<std::vector<double>> quant_args, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_size, double scale, int64_t window, std::vector<at::Tensor> sources) {
        std::vector<int64_t> keys;
        for (const at::Tensor& t : sources) append_identity(keys, t);
        return std::make_shared<Spec>(Spec{std::move(input_norm), std::move(post_norm), eps, std::move(kinds),
                                           std::move(weights), std::move(biases), std::move(out_features),
                                           std::move(quant), std::move(quant_args), num_heads, num_kv_heads,
                                           head_size, scale, window, std::move(sources), std::move(keys)});
      }));
  s.def("layer_specs_current", [](const std::vector<std::shared_ptr<Spec>>& specs) {
    std::vector<int64_t> now;
    for (const auto& spec : specs) {
      if (!spec) return false;
      now.clear();
      for (const at::Tensor& t : spec->sources) append_identity(now, t);
      if (now != spec->source_keys) return false;
    }
    return true;
  });
}

}  // namespace

#define VLLITE_CPU_BIND(m, variants, name, ns)                                           \
  do {                                                                                   \
    auto s = m.def_submodule(name, "CPU kernels compiled for the " name " ISA variant"); \
    s.def("paged_attention", &vllite_cpu::ns::paged_attention);                          \
    s.def("paged_attention_store", &vllite_cpu::ns::paged_attention_store);              \
    s.def("avx2_gemm_available", &vllite_cpu::ns::avx2_gemm_available);                  \
    s.def("avx2_gemm_dtypes", &vllite_cpu::ns::avx2_gemm_dtypes);                        \
    s.def("avx2_gemm_pack", &vllite_cpu::ns::avx2_gemm_pack);                            \
    s.def("avx2_gemm", &vllite_cpu::ns::avx2_gemm);                                      \
    s.def("avx2_gemm_gelu", &vllite_cpu::ns::avx2_gemm_gelu);                            \
    s.def("bf16_gemm_available", &vllite_cpu::ns::bf16_gemm_available);                  \
    s.def("bf16_gemm_pack", &vllite_cpu::ns::bf16_gemm_pack);                            \
    s.def("bf16_gemm", &vllite_cpu::ns::bf16_gemm);                                      \
    s.def("bf16_gemm_silu", &vllite_cpu::ns::bf16_gemm_silu);                            \
    s.def("amx_available", &vllite_cpu::ns::amx_available);                              \
    s.def("set_amx", &vllite_cpu::ns::set_amx);                                          \
    s.def("encoder_attention", &vllite_cpu::ns::encoder_attention);                      \
    s.def("add_layer_norm", &vllite_cpu::ns::add_layer_norm);                            \
    s.def("small_linear", &vllite_cpu::ns::small_linear);                                \
    s.def("rms_norm", &vllite_cpu::ns::rms_norm);                                        \
    s.def("add_rms_norm", &vllite_cpu::ns::add_rms_norm);                                \
    s.def("silu_and_mul", &vllite_cpu::ns::silu_and_mul);                                \
    s.def("argmax_rows", &vllite_cpu::ns::argmax_rows);                                  \
    s.def("rotary", &vllite_cpu::ns::rotary);                                            \
    s.def("quantize_rows_int8", &vllite_cpu::ns::quantize_rows_int8);                    \
    s.def("int8_gemm_available", &vllite_cpu::ns::int8_gemm_available);                  \
    s.def("int8_gemm_pack", &vllite_cpu::ns::int8_gemm_pack);                            \
    s.def("int8_gemm", &vllite_cpu::ns::int8_gemm);                                      \
    s.def("int8_gemm_silu", &vllite_cpu::ns::int8_gemm_silu);                            \
    s.def("dequantize_int32", &vllite_cpu::ns::dequantize_int32);                        \
    s.def("gguf_linear_x8", &vllite_cpu::ns::gguf_linear_x8);                            \
    s.def("gguf_rows", &vllite_cpu::ns::gguf_rows);                                      \
    s.def("gguf_repack_kquant", &vllite_cpu::ns::gguf_repack_kquant);                    \
    s.def("int4_linear", &vllite_cpu::ns::int4_linear);                                  \
    s.def("int4_linear_q8", &vllite_cpu::ns::int4_linear_q8);                            \
    s.def("fp8_linear", &vllite_cpu::ns::fp8_linear);                                    \
    s.def("fp8_linear_act", &vllite_cpu::ns::fp8_linear_act);                            \
    s.def("lora_add", &vllite_cpu::ns::lora_add);                                        \
    s.def("moe_experts", &vllite_cpu::ns::moe_experts);                                  \
    s.def("llama_decoder_layer", &vllite_cpu::ns::llama_decoder_layer);                  \
    s.def("llama_decoder_stack", &vllite_cpu::ns::llama_decoder_stack);                  \
    s.def("decoder_split_step", &vllite_cpu::ns::decoder_split_step);                    \
    bind_layer_spec<vllite_cpu::ns::DecoderLayerSpec>(s);                                \
    s.attr("name") = name;                                                               \
    variants.append(name);                                                               \
  } while (0)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::list variants;  // lowest first
#ifdef VLLITE_CPU_WITH_isa_default
  VLLITE_CPU_BIND(m, variants, "default", isa_default);
#endif
#ifdef VLLITE_CPU_WITH_isa_avx2
  VLLITE_CPU_BIND(m, variants, "avx2", isa_avx2);
#endif
#ifdef VLLITE_CPU_WITH_isa_avx512
  VLLITE_CPU_BIND(m, variants, "avx512", isa_avx512);
#endif
#ifdef VLLITE_CPU_WITH_isa_avx512_bf16
  VLLITE_CPU_BIND(m, variants, "avx512_bf16", isa_avx512_bf16);
#endif
  m.attr("variants") = pybind11::tuple(variants);
#ifdef TORCH_VERSION_MAJOR
  // The torch this was compiled against (kernels.py builds its own instead when another one runs).
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "."
                            + std::to_string(TORCH_VERSION_PATCH);
#endif
#ifdef VLLITE_CPU_SOURCES_DIGEST
  // The sources it was built from (isa.sources_digest, passed by setup.py): kernels.py uses it only if they match.
#define VLLITE_CPU_STR(x) #x
#define VLLITE_CPU_XSTR(x) VLLITE_CPU_STR(x)
  m.attr("sources_digest") = VLLITE_CPU_XSTR(VLLITE_CPU_SOURCES_DIGEST);
#endif
  m.def("cpu_features", &cpu_features, "The CPU features the ISA variants need that this CPU and OS support");
}
