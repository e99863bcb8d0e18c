// Tier names and the placement rule shared by the layout and the planner.
#include "engine/tier.h"

#include <algorithm>
#include <cmath>

namespace strata::engine {

std::string_view to_string(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kPinned:
      return "pinned";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

std::string_view tier_key(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "gpu";
    case Tier::kPinned:
      return "cpu";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

std::string_view tier_label(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "GPU";
    case Tier::kPinned:
      return "CPU RAM";
    case Tier::kNvme:
      return "NVMe/disk";
  }
  return "?";
}

Tier tier_of(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return Tier::kDevice;
    case OffloadDevice::kCpu:
      return Tier::kPinned;
    case OffloadDevice::kNvme:
      return Tier::kNvme;
  }
  return Tier::kDevice;
}

Tier OptimizerSplit::tier_at(std::int64_t offset) const {
  if (offset < pinned_elems) return Tier::kPinned;
  if (offset < offloaded_elems()) return Tier::kNvme;
  return Tier::kDevice;
}

std::int64_t share_of(std::int64_t n, double fraction) {
  const long long v = std::llround(static_cast<long double>(n) * fraction);
  return std::clamp(static_cast<std::int64_t>(v), std::int64_t{0}, n);
}

OptimizerSplit split_optimizer_state(std::int64_t elems, OffloadDevice device, double ratio,
                                     double cpu_fraction) {
  OptimizerSplit s;
  const std::int64_t offloaded = device == OffloadDevice::kNone ? 0 : share_of(elems, ratio);
  s.pinned_elems = device == OffloadDevice::kCpu    ? offloaded
                   : device == OffloadDevice::kNvme ? share_of(offloaded, cpu_fraction)
                                                    : 0;
  s.nvme_elems = offloaded - s.pinned_elems;
  s.device_elems = elems - offloaded;
  return s;
}

}  // namespace strata::engine
