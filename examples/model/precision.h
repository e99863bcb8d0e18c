// Adapters between the engine's 16-bit compute copies and gradients (raw
// bf16/fp16 bit patterns) and the fp32 views the example model computes on.
// The conversions are numerics.h's, so they match every kernel in strata.
#pragma once

#include <cstdint>
#include <span>

#include "engine/core/status.h"

namespace strata::examples {

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
