// The device-memory arena: offsets within [0, size) handed out first-fit
// from either end (gpu::ArenaEnd), neighbours coalesced on free. The CUDA device carves its one cudaMalloc
// with it; the host device can keep one beside its allocations
// (HostDeviceOptions::arena), so that a run on the host device meets the
// same fragmentation a CUDA run does (a budget the planner names must train
// on both).
#pragma once

#include <cstdint>
#include <map>
#include <optional>

#include "core/mutex.h"
#include "gpu/device.h"

namespace strata::gpu {

class Arena {
 public:
  // size_bytes: a multiple of the alignment (a high-end range's start stays aligned).
  Arena(std::uint64_t size_bytes, std::uint64_t alignment);

  // An offset, or none when no free range is large enough. kLow: the lowest
  // free range that fits, from its start; kHigh: the highest, from its end.
  std::optional<std::uint64_t> allocate(std::uint64_t size_bytes, ArenaEnd end = ArenaEnd::kLow);
  void free(std::uint64_t offset, std::uint64_t size_bytes);

  std::uint64_t largest_free() const;
  std::uint64_t size_bytes() const { return size_bytes_; }

 private:
  std::uint64_t round_up(std::uint64_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  const std::uint64_t size_bytes_;
  const std::uint64_t alignment_;
  mutable core::Mutex mu_;
  std::map<std::uint64_t, std::uint64_t> free_ STRATA_GUARDED_BY(mu_);  // offset -> size
};

}  // namespace strata::gpu
