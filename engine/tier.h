// Tier: where a piece of state lives. Shared by the layout (engine/layout.h),
// the schedules' memory (engine/schedule/schedule.h) and the planner.
#pragma once

#include <string_view>

namespace strata::engine {

enum class Tier { kDevice, kPinned, kNvme };
std::string_view to_string(Tier t);  // "device", "pinned", "nvme"

}  // namespace strata::engine
