// Helpers shared by the planner's arithmetic (plan.cpp) and its output
// (plan_format.cpp): names, labels and digit grouping. Private to engine/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "engine/config.h"
#include "engine/plan.h"

namespace strata::engine {

// 0.5 -> "0.5": a fraction as the config writes it.
std::string fraction_text(double f);
// 600 -> "600", 3.84 -> "3.84", 7008.0001 -> "7008": six significant digits.
std::string number_text(double v);
// 40000000000 -> "40,000,000,000".
std::string group_digits(std::uint64_t v);
// "none", "cpu", "nvme": the config's spelling (config.cpp has its own
// to_string; the planner does not link the parser).
std::string_view offload_device_key(OffloadDevice d);
// "Adam", "AdamW", "Adagrad", "Lion".
std::string_view optimizer_name(OptimizerType t);
// "AdamW moments", "Lion momentum", ...
std::string_view optimizer_label(OptimizerType t);
// Bytes of optimizer moments per trainable parameter: Adam/AdamW 8, Adagrad 4, Lion 4.
std::uint64_t optimizer_moment_bytes(OptimizerType t);
// The tier a placement device means: none -> GPU.
Tier tier_of(OffloadDevice d);
// "compute_copies" -> "compute copies".
std::string_view item_label(std::string_view name);
// "params nvme, optimizer nvme (cpu fraction 0.05)".
std::string describe_placement(const Placement& p);
// "CPU RAM needs X (host gradients A, ...) > Y available (Z less a M margin)".
std::string over_capacity_reason(const PlacementPlan& plan, const TierPlan& tier);

}  // namespace strata::engine
