// What every kernel translation unit (attention.cpp, gemm.cpp, pointwise.cpp) includes first.
//
// Each of them is compiled once per ISA variant (vllite_platform_cpu/isa.py lists the variants and their
// flags) into the one extension module: the build defines VLLITE_CPU_ISA, the variant's namespace
// (isa_default, isa_avx2, isa_avx512, isa_avx512_bf16), and CPU_CAPABILITY / CPU_CAPABILITY_AVX2 /
// CPU_CAPABILITY_AVX512, which pick ATen's at::vec::Vectorized implementation (itself in an inline
// namespace named after CPU_CAPABILITY). So no function of one variant can stand in for another's at
// link time. bindings.cpp (kernels.h) declares every variant's entry points.
#pragma once

#ifndef VLLITE_CPU_ISA
#error "VLLITE_CPU_ISA (the ISA variant's namespace, e.g. isa_avx2) must be defined by the build"
#endif

// ATen's core headers only, so the kernels name at::Tensor, at::zeros, at::kInt (the string build's
// torch::Tensor, torch::zeros, torch::kInt32 are the same entities): <torch/extension.h> or <torch/types.h>
// (pybind11, Python, the autograd API) doubled the time to compile a translation unit, and there are a
// dozen of them. bindings.cpp includes <torch/python.h>.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/zeros.h>

#include <optional>
#include <type_traits>

#include "kernels.h"

namespace vllite_cpu {
namespace VLLITE_CPU_ISA {

using AVec = at::vec::Vectorized<float>;
constexpr int64_t VL = AVec::size();  // 16 float lanes with AVX-512, 8 with AVX2

template <typename T>
static inline AVec avec_load(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return AVec::loadu(p);
  } else {
    AVec v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

// f(std::integral_constant<int, r>{}) for the runtime r = rows in [1, MAX]: a GEMM tile's (or a group's) height
// as a template argument, so that its accumulators are a fixed-size array the compiler keeps in registers.
template <int MAX, typename F>
static inline void with_height(int64_t rows, const F& f) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return with_height<MAX - 1>(rows, f);
  }
  f(std::integral_constant<int, MAX>{});
}

}  // namespace VLLITE_CPU_ISA
}  // namespace vllite_cpu
