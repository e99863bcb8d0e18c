// What the cpu_adam tests share: a gradient in every type the kernels take
// (fp32 values, and their bf16 or fp16 form), and its value as a kernel
// reads it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/numerics.h"
#include "cpu_adam/cpu_adam.h"

namespace strata::adam::test {

struct TestGradients {
  std::vector<float> g32;
  std::vector<std::uint16_t> g16;
  ElemType grad_type = ElemType::kF32;

  ConstTypedSpan grad() const {
    const auto n = static_cast<std::int64_t>(g32.size());
    if (grad_type == ElemType::kF32) return {g32.data(), ElemType::kF32, n};
    return {g16.data(), grad_type, n};
  }
  // The gradient as the kernels see it: the fp32 value of what is stored.
  float grad_f32(std::int64_t i) const {
    switch (grad_type) {
      case ElemType::kF32: return g32[static_cast<std::size_t>(i)];
      case ElemType::kBf16: return core::numerics::bf16_bits_to_fp32(g16[static_cast<std::size_t>(i)]);
      case ElemType::kF16: return core::numerics::fp16_bits_to_fp32(g16[static_cast<std::size_t>(i)]);
    }
    return 0.0f;
  }
  // Stores g32 in type t (bf16 or fp16 round to nearest even).
  void set_grad_type(ElemType t) {
    grad_type = t;
    g16.resize(g32.size());
    for (std::size_t i = 0; i < g32.size(); ++i) {
      if (t == ElemType::kBf16) g16[i] = core::numerics::fp32_to_bf16_bits(g32[i]);
      if (t == ElemType::kF16) g16[i] = core::numerics::fp32_to_fp16_bits(g32[i]);
    }
  }
};

}  // namespace strata::adam::test
