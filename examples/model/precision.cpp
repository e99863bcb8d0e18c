// bf16/fp16 <-> fp32 adapters for the example model.
#include "examples/model/precision.h"

#include "core/numerics.h"
#include "core/result.h"
#include "core/str.h"

namespace strata::examples {
namespace {

core::Status check_sizes(const char* what, std::size_t in, std::size_t out) {
  if (in == out) return core::Status();
  return core::Status::invalid_argument(
      core::str_cat(what, ": input has ", in, " elements, output ", out));
}

template <typename In, typename Out, typename Convert>
core::Status convert(const char* what, std::span<const In> in, std::span<Out> out,
                     Convert convert_one) {
  STRATA_RETURN_IF_ERROR(check_sizes(what, in.size(), out.size()));
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = convert_one(in[i]);
  return core::Status();
}

}  // namespace

std::string_view compute_type_name(ComputeType type) {
  switch (type) {
    case ComputeType::kF32: return "fp32";
    case ComputeType::kBf16: return "bf16";
    case ComputeType::kF16: return "fp16";
  }
  return "unknown";
}

core::Status bf16_to_fp32(std::span<const std::uint16_t> in, std::span<float> out) {
  return convert("bf16_to_fp32", in, out, core::numerics::bf16_bits_to_fp32);
}

core::Status fp16_to_fp32(std::span<const std::uint16_t> in, std::span<float> out) {
  return convert("fp16_to_fp32", in, out, core::numerics::fp16_bits_to_fp32);
}

core::Status fp32_to_bf16(std::span<const float> in, std::span<std::uint16_t> out) {
  return convert("fp32_to_bf16", in, out, core::numerics::fp32_to_bf16_bits);
}

core::Status fp32_to_fp16(std::span<const float> in, std::span<std::uint16_t> out) {
  return convert("fp32_to_fp16", in, out, core::numerics::fp32_to_fp16_bits);
}

}  // namespace strata::examples
