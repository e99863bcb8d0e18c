// The bf16/fp16 adapters agree with numerics.h element by element.
#include "examples/model/precision.h"

#include <cstdint>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "core/numerics.h"

namespace strata::examples {
namespace {

namespace nx = core::numerics;

std::vector<float> sample_values() {
  return {0.0f, -0.0f, 1.0f, -1.5f, 3.14159265f, 1.00390625f /* bf16 tie */, 1e-40f,
          -3e-39f, 65504.0f, 1e30f, std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::denorm_min(), 0.1f, -7.3e-5f};
}

TEST(Precision, Bf16AdaptersMatchNumerics) {
  const std::vector<float> in = sample_values();
  std::vector<std::uint16_t> bits(in.size());
  ASSERT_TRUE(fp32_to_bf16(in, bits).ok());
  std::vector<float> back(in.size());
  ASSERT_TRUE(bf16_to_fp32(bits, back).ok());
  for (std::size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(bits[i], nx::fp32_to_bf16_bits(in[i])) << in[i];
    EXPECT_EQ(nx::float_bits(back[i]), nx::float_bits(nx::bf16_bits_to_fp32(bits[i]))) << in[i];
  }
}

TEST(Precision, Fp16AdaptersMatchNumerics) {
  const std::vector<float> in = sample_values();
  std::vector<std::uint16_t> bits(in.size());
  ASSERT_TRUE(fp32_to_fp16(in, bits).ok());
  std::vector<float> back(in.size());
  ASSERT_TRUE(fp16_to_fp32(bits, back).ok());
  for (std::size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(bits[i], nx::fp32_to_fp16_bits(in[i])) << in[i];
    EXPECT_EQ(nx::float_bits(back[i]), nx::float_bits(nx::fp16_bits_to_fp32(bits[i]))) << in[i];
  }
}

TEST(Precision, SizeMismatchIsInvalidArgument) {
  std::vector<float> f(4);
  std::vector<std::uint16_t> h(3);
  EXPECT_EQ(fp32_to_bf16(f, h).code(), core::StatusCode::kInvalidArgument);
  EXPECT_EQ(bf16_to_fp32(h, f).code(), core::StatusCode::kInvalidArgument);
  EXPECT_EQ(fp32_to_fp16(f, h).code(), core::StatusCode::kInvalidArgument);
  EXPECT_EQ(fp16_to_fp32(h, f).code(), core::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::examples
