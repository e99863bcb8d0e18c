// Adapters between the engine's 16-bit compute copies and gradients (raw
// bf16/fp16 bit patterns) and the fp32 views the example model computes on.
// The conversions are numerics.h's, so they match every kernel in strata.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "core/status.h"

namespace strata::examples {

// The element type of the engine's compute copies and gradients
// (strata_group_info.dtype).
enum class ComputeType { kF32, kBf16, kF16 };

std::string_view compute_type_name(ComputeType type);  // "fp32", "bf16", "fp16"
inline constexpr std::size_t compute_type_bytes(ComputeType type) {
  return type == ComputeType::kF32 ? 4 : 2;
}

// Element-wise, exact (every bf16/fp16 value is an fp32 value).
// INVALID_ARGUMENT when the sizes differ.
core::Status bf16_to_fp32(std::span<const std::uint16_t> in, std::span<float> out);
core::Status fp16_to_fp32(std::span<const std::uint16_t> in, std::span<float> out);

// Element-wise, round to nearest even (numerics::fp32_to_bf16_bits /
// fp32_to_fp16_bits: subnormals kept, NaN stays NaN). INVALID_ARGUMENT when
// the sizes differ.
core::Status fp32_to_bf16(std::span<const float> in, std::span<std::uint16_t> out);
core::Status fp32_to_fp16(std::span<const float> in, std::span<std::uint16_t> out);

}  // namespace strata::examples
