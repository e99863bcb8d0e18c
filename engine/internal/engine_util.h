// Small helpers the engine's files share: fp32 <-> compute dtype for
// initial values and inspection, and a stage timer for StepStats. Private to
// engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "core/clock.h"
#include "core/numerics.h"
#include "engine/config.h"

namespace strata::engine {

// Writes fp32 values as the compute dtype.
inline void to_compute(std::span<const float> src, std::byte* dst, int bytes, Precision p) {
  if (bytes == 4) {
    std::memcpy(dst, src.data(), src.size_bytes());
    return;
  }
  auto* h = reinterpret_cast<std::uint16_t*>(dst);
  for (std::size_t i = 0; i < src.size(); ++i) {
    h[i] = p == Precision::kFp16 ? core::numerics::fp32_to_fp16_bits(src[i]) : core::numerics::fp32_to_bf16_bits(src[i]);
  }
}
inline void from_compute(const std::byte* src, std::span<float> dst, int bytes, Precision p) {
  if (bytes == 4) {
    std::memcpy(dst.data(), src, dst.size_bytes());
    return;
  }
  const auto* h = reinterpret_cast<const std::uint16_t*>(src);
  for (std::size_t i = 0; i < dst.size(); ++i) {
    dst[i] = p == Precision::kFp16 ? core::numerics::fp16_bits_to_fp32(h[i]) : core::numerics::bf16_bits_to_fp32(h[i]);
  }
}

// Adds the seconds from construction to destruction to `total`.
class StageTimer {
 public:
  explicit StageTimer(double& total) : total_(total) {}
  ~StageTimer() { total_ += sw_.elapsed_s(); }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  double& total_;
  core::Stopwatch sw_;
};


}  // namespace strata::engine
