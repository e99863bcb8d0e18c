// What the planner's files share, private to engine/plan/: the names, labels and
// digit grouping of the arithmetic and the output (labels.cpp), and the
// arithmetic's own pieces (plan_detail: model.cpp, capacity.cpp, placement.cpp,
// search.cpp, wear.cpp).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "core/status.h"
#include "engine/config.h"
#include "engine/plan/plan.h"

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
// Bytes of optimizer moments per trainable parameter under the config's
// optimizer and strata.optimizer_state: Adam/AdamW 8 (bf16: 4; int8_blockwise:
// 2 and 8 B of scales per 256, 2.03125), Adagrad 4, Lion 4.
double optimizer_moment_bytes(const Config& config);
// "fp32", "bf16", "int8_blockwise" (the config's spelling; the planner links without the config writer).
std::string_view state_format_name(StateFormat f);
// The tier a placement device means: none -> GPU.
Tier tier_of(OffloadDevice d);
// "compute_copies" -> "compute copies".
std::string_view item_label(std::string_view name);
// "params nvme, optimizer nvme (cpu fraction 0.05)".
std::string describe_placement(const Placement& p);
// "CPU RAM needs X (host gradients A, ...) > Y available (Z less a M margin)".
std::string over_capacity_reason(const PlacementPlan& plan, const TierPlan& tier);


// --- the arithmetic's shared pieces ---------------------------------------------
namespace plan_detail {

// The planner's range: far beyond any model, small enough that every byte
// count (at most ~40 B per parameter, times the accumulation steps,
// saturating) stays exact in 64 bits.
inline constexpr std::int64_t kMaxParams = 1'000'000'000'000'000;  // 1e15

inline std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}
inline std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}
inline std::uint64_t u64(std::int64_t v) { return v > 0 ? static_cast<std::uint64_t>(v) : 0; }
inline std::uint64_t floor_fraction(std::uint64_t bytes, double fraction) {
  return static_cast<std::uint64_t>(std::floor(static_cast<double>(bytes) * fraction));
}
inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return b > 0 ? (a + b - 1) / b : 0; }
inline std::int64_t round_up_to(std::int64_t n, std::int64_t m) { return ceil_div(n, m) * m; }
inline core::Status invalid(std::string message) { return core::Status::invalid_argument(std::move(message)); }

using TierCapacities = std::array<TierPlan, kNumTiers>;

// What evaluate() reads: the config, the resolved model, the tiers' capacities.
struct Inputs {
  const Config& config;
  const ModelSummary& model;
  const TierCapacities& capacities;
  const PlanOptions& options;
};

// model.cpp: the model's counts from a parameter count or a transformer shape.
core::Result<ModelSummary> resolve_model(const Config& config, const ModelSpec& spec);
// capacity.cpp: the config's values the planner relies on, and each tier's capacity.
core::Status validate_config(const Config& config, const PlanOptions& options);
// With `ranks_per_node` > 1, RAM and disk (and their margins) are shared by
// that many ranks: each rank's capacity is its share.
core::Result<TierCapacities> tier_capacities(const Config& config, const MachineSpec& machine,
                                             const PlanMargins& margins, int ranks_per_node,
                                             std::vector<std::string>* notes);
// placement.cpp: "bf16", "fp16", "fp32"; one placement's bytes per tier and per step.
std::string precision_label(const Config& config);
PlacementPlan evaluate(const Inputs& in, const Placement& pl);
// The elements of one group's compute home as evaluate() counts them (the
// rank's shard at stage 3 over ranks), and how many groups there are: the
// unit offload_param.max_in_cpu keeps in pinned memory.
struct PlannedHomes {
  std::int64_t home = 0;
  std::int64_t groups = 0;
};
PlannedHomes planned_homes(const Inputs& in, const Placement& pl);
// What strata.budgets.pinned leaves beyond the placement's pinned state, the
// step's working memory and the disk pipeline's ring at its depth, as
// Engine::finalize's Needs::pinned_spare (0 without a pinned budget): the
// room offload_param.max_in_cpu "auto" fills.
std::uint64_t planned_pinned_spare(const Inputs& in, const Placement& pl);
// search.cpp: `"s"`; the config changes that reach `to`; the search's grid of
// strata.optimizer_cpu_fraction (k x step, exact where the step is).
std::string quoted(std::string_view s);
std::vector<ConfigChange> changes_for(const Config& config, const Placement& to);
double grid_fraction(int k, double step);
// wear.cpp: the drives' wear under the configured placement and the changes that
// write less; `fitting` is every placement of the search that fits.
core::Result<WearPlan> plan_wear(const Inputs& in, const Plan& plan, const DriveEndurance& drive, int steps,
                                 const std::vector<PlacementPlan>& fitting);

// wear.cpp: a placement's writes per swap drive and the steps (and days, with
// step_seconds > 0) until `rated` bytes are written to the first drive.
PlacementWear placement_wear(const Config& config, const MachineSpec& machine, const PlacementPlan& pp,
                             double rated, double step_seconds);

}  // namespace plan_detail
}  // namespace strata::engine
