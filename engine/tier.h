// Tier: the three places training state lives (device memory, pinned host
// memory, NVMe), and the one rule that says which tier each share of it goes
// to. plan_layout() places chunks with it, the planner (plan.h) counts bytes
// with it, so the plan describes the layout the engine builds.
// Pure functions and value types; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/config.h"

namespace strata::engine {

// The values index arrays of per-tier figures (the planner's TierPlan).
enum class Tier : int { kDevice = 0, kPinned = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
inline constexpr Tier kAllTiers[kNumTiers] = {Tier::kDevice, Tier::kPinned, Tier::kNvme};

std::string_view to_string(Tier tier);   // "device", "pinned", "nvme"
std::string_view tier_key(Tier tier);    // "gpu", "cpu", "nvme" (the planner's JSON keys)
std::string_view tier_label(Tier tier);  // "GPU", "CPU RAM", "NVMe/disk" (the planner's tables)

// The tier a placement device means (offload_param.device for the compute
// copies, offload_optimizer.device for the offloaded optimizer state):
// none -> kDevice, cpu -> kPinned, nvme -> kNvme.
Tier tier_of(OffloadDevice device);

// How the optimizer state (fp32 master and moments) of `elems` trainable
// elements, taken in order, is split between the tiers. The first
// offloaded_elems() are updated on the CPU: of them the first pinned_elems
// live in pinned memory and the rest on NVMe; the last device_elems stay on
// the device. The three counts add up to `elems`.
struct OptimizerSplit {
  std::int64_t pinned_elems = 0;
  std::int64_t nvme_elems = 0;
  std::int64_t device_elems = 0;

  std::int64_t offloaded_elems() const { return pinned_elems + nvme_elems; }
  // The tier of the element at `offset` (0-based, in the order above).
  Tier tier_at(std::int64_t offset) const;
};

// The placement rule, DeepSpeed's meaning plus strata's split:
//  - offload_optimizer.device none: everything on the device;
//  - cpu or nvme: round(elems x ratio) elements are offloaded (ratio is
//    offload_optimizer.ratio, in (0, 1]), the rest stay on the device;
//  - of the offloaded ones, cpu keeps all in pinned memory, nvme keeps
//    round(offloaded x cpu_fraction) there (strata.optimizer_cpu_fraction,
//    in [0, 1]) and puts the rest on NVMe.
// Rounding is to the nearest element, halves away from zero; shares are
// clamped to [0, elems]. `elems` >= 0.
OptimizerSplit split_optimizer_state(std::int64_t elems, OffloadDevice device, double ratio,
                                     double cpu_fraction);

// round(n x fraction), within [0, n]: the rounding split_optimizer_state uses.
std::int64_t share_of(std::int64_t n, double fraction);

}  // namespace strata::engine
