// Each tier's capacity for the plan: the machine's (less the margins) or the
// config's budgets, and the plan's inputs checked (validate_config).
#include "engine/plan/plan.h"

#include <algorithm>
#include <string>

#include "core/str.h"
#include "engine/plan/plan_internal.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
using plan_detail::floor_fraction;
using plan_detail::sat_add;

// Capacity of one tier: the machine's, less its margin, or a budget.
TierPlan tier_capacity(Tier tier, std::optional<std::uint64_t> physical, const std::string& source,
                       std::uint64_t budget, std::string_view budget_key,
                       std::uint64_t margin_bytes, std::vector<std::string>* notes) {
  TierPlan t;
  t.tier = tier;
  if (budget > 0 && (!physical || budget <= *physical)) {
    t.capacity_bytes = budget;
    t.margin_bytes = 0;
    t.capacity_source = str_cat(budget_key, " (budget)");
    if (physical && budget < *physical && source.starts_with("given")) {
      notes->push_back(str_cat(budget_key, " = ", core::format_bytes(budget), " caps this tier below the ",
                               core::format_bytes(*physical), " ", source,
                               ": the plan uses the budget (drop it from the config to plan for the whole ",
                               tier_label(tier), ")"));
    } else if (physical && *physical - budget < margin_bytes) {
      notes->push_back(str_cat(budget_key, " = ", core::format_bytes(budget),
                               " leaves less than the ", core::format_bytes(margin_bytes),
                               " margin the planner keeps on this ", core::format_bytes(*physical),
                               " ", tier_label(tier)));
    }
  } else {
    t.capacity_bytes = *physical;
    t.margin_bytes = margin_bytes;
    t.capacity_source = source;
    if (budget > 0) {
      notes->push_back(str_cat(budget_key, " = ", core::format_bytes(budget), " exceeds the ",
                               core::format_bytes(*physical), " of ", tier_label(tier),
                               " on this machine: the machine's capacity applies"));
    }
  }
  t.available_bytes = t.capacity_bytes > t.margin_bytes ? t.capacity_bytes - t.margin_bytes : 0;
  return t;
}

}  // namespace

namespace plan_detail {

Status validate_config(const Config& config, const PlanOptions& options) {
  if (config.gradient_accumulation_steps <= 0) {
    return invalid(str_cat("gradient_accumulation_steps must be positive, got ",
                           config.gradient_accumulation_steps));
  }
  const double ratio = config.zero.offload_optimizer.ratio;
  if (!(ratio > 0.0 && ratio <= 1.0)) {
    return invalid(
        str_cat("zero_optimization.offload_optimizer.ratio must be in (0, 1], got ", ratio));
  }
  const double fraction = config.strata.optimizer_cpu_fraction;
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    return invalid(str_cat("strata.optimizer_cpu_fraction must be in [0, 1], got ", fraction));
  }
  if (config.strata.chunk_bytes == 0) return invalid("strata.chunk_bytes must be positive, got 0");
  const OffloadParamConfig& op = config.zero.offload_param;
  if (op.buffer_count < 0) {
    return invalid(
        str_cat("zero_optimization.offload_param.buffer_count must not be negative, got ",
                op.buffer_count));
  }
  if (op.buffer_size < 0) {
    return invalid(str_cat("zero_optimization.offload_param.buffer_size must not be negative, got ",
                           op.buffer_size));
  }
  const ZeroConfig& z = config.zero;
  if (z.stage3_prefetch_bucket_size < 0 || z.stage3_max_live_parameters < 0 ||
      z.stage3_param_persistence_threshold < 0) {
    return invalid(
        "zero_optimization.stage3_prefetch_bucket_size, stage3_max_live_parameters and "
        "stage3_param_persistence_threshold must not be negative");
  }
  const PlanMargins& mg = options.margins;
  for (double f : {mg.gpu_fraction, mg.ram_fraction, mg.disk_fraction}) {
    if (!(f >= 0.0 && f < 1.0))
      return invalid(str_cat("plan margin fraction must be in [0, 1), got ", f));
  }
  if (!(options.cpu_fraction_step > 0.0 && options.cpu_fraction_step <= 1.0)) {
    return invalid(str_cat("cpu_fraction_step must be in (0, 1], got ", options.cpu_fraction_step));
  }
  if (options.ranks < 1) return invalid(str_cat("--ranks must be at least 1, got ", options.ranks));
  if (options.nodes < 1 || options.nodes > options.ranks || options.ranks % options.nodes != 0) {
    return invalid(str_cat("--nodes must divide --ranks (the same number of ranks on each machine), got ",
                           options.nodes, " nodes for ", options.ranks, " ranks"));
  }
  if (options.ranks > 1 && config.strata.overlap == OverlapMode::kSpeculative) {
    return invalid("strata.overlap \"speculative\" with several ranks is not built yet (the engine refuses it): "
                   "plan with \"delayed\" or \"exact\"");
  }
  return Status();
}

core::Result<TierCapacities> tier_capacities(const Config& config, const MachineSpec& machine,
                                             const PlanMargins& margins, int ranks_per_node,
                                             std::vector<std::string>* notes) {
  const BudgetsConfig& b = config.strata.budgets;
  if (!machine.gpu_bytes && b.device_bytes == 0) {
    return Status::failed_precondition(
        str_cat("GPU memory is unknown (", machine.gpu_probe,
                "): give it with `strata plan --gpu-memory SIZE` or set strata.budgets.device"));
  }
  TierCapacities tiers;
  const std::uint64_t gpu_margin =
      machine.gpu_bytes ? floor_fraction(*machine.gpu_bytes, margins.gpu_fraction) : 0;
  tiers[0] = tier_capacity(Tier::kDevice, machine.gpu_bytes, machine.gpu_source, b.device_bytes,
                           "strata.budgets.device", gpu_margin, notes);
  // A machine's RAM and disk are shared by its ranks: each plans with its share.
  const auto share = static_cast<std::uint64_t>(std::max(1, ranks_per_node));
  const std::string each = share > 1 ? str_cat(" / ", share, " ranks on the machine") : std::string();
  tiers[1] = tier_capacity(
      Tier::kPinned, machine.ram_bytes / share, machine.ram_source + each, b.pinned_bytes, "strata.budgets.pinned",
      sat_add(floor_fraction(machine.ram_bytes, margins.ram_fraction), margins.ram_reserve_bytes) / share,
      notes);
  tiers[2] = tier_capacity(Tier::kNvme, machine.disk_bytes / share, machine.disk_source + each, b.disk_bytes,
                           "strata.budgets.disk",
                           floor_fraction(machine.disk_bytes, margins.disk_fraction) / share, notes);
  return tiers;
}

}  // namespace plan_detail
}  // namespace strata::engine
