// The plan: the configured placement evaluated, the search over placements (the
// one that moves fewest bytes and fits), the config changes that reach it, and
// the notes on what the estimate assumes (make_plan).
#include "engine/plan/plan.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "core/str.h"
#include "engine/plan/plan_internal.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
using plan_detail::changes_for;
using plan_detail::evaluate;
using plan_detail::grid_fraction;
using plan_detail::Inputs;
using plan_detail::placement_wear;
using plan_detail::planned_homes;
using plan_detail::PlannedHomes;
using plan_detail::plan_wear;
using plan_detail::precision_label;
using plan_detail::quoted;
using plan_detail::resolve_model;
using plan_detail::tier_capacities;
using plan_detail::TierCapacities;
using plan_detail::validate_config;

// a better than b: fewer bytes per step, then fewer disk bytes.
bool moves_less(const PlacementPlan& a, const PlacementPlan& b) {
  if (a.traffic.total_bytes() != b.traffic.total_bytes()) {
    return a.traffic.total_bytes() < b.traffic.total_bytes();
  }
  return a.traffic.disk_bytes() < b.traffic.disk_bytes();
}

// offload_param.max_in_cpu for k whole homes, with room for the engine's
// padding of each parameter to 64 elements (the planner's groups have none):
// up to 4096 elements a group, less than one home in all, so that the
// planner keeps k too.
std::int64_t homes_value(const PlannedHomes& homes, std::int64_t k) {
  return k * homes.home + std::min<std::int64_t>(k * 4096, homes.home - 1);
}

// `config` with max_in_cpu at k whole homes (0 for none), "auto" cleared.
Config with_homes(const Config& config, const PlannedHomes& homes, std::int64_t k) {
  Config out = config;
  out.zero.offload_param.max_in_cpu_auto = false;
  out.zero.offload_param.max_in_cpu = k > 0 ? homes_value(homes, k) : 0;
  return out;
}

// The most whole homes (from `from` on, which fits) max_in_cpu can keep in
// pinned memory with placement `p` of `config` still fitting. Below every
// group each more one takes RAM (fits falls once, and stays false); keeping
// them all also drops the param staging and the optimizer's host view, so
// that case is tried on its own.
std::int64_t most_homes(const Config& config, const ModelSummary& model, const TierCapacities& capacities,
                        const PlanOptions& options, const Placement& p, const PlannedHomes& homes, std::int64_t from) {
  if (homes.home <= 0 || from >= homes.groups) return from;
  const auto fits = [&](std::int64_t k) {
    return evaluate(Inputs{with_homes(config, homes, k), model, capacities, options}, p).fits;
  };
  if (fits(homes.groups)) return homes.groups;
  std::int64_t lo = from, hi = homes.groups;  // fits at lo; not at hi
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

// offload_param.max_in_cpu "auto" resolved for placement `p` as
// Engine::finalize resolves it: the whole homes that fit in what
// strata.budgets.pinned leaves beside everything else with the disk
// pipeline's ring at its depth (planned_pinned_spare); none under
// strata.frozen_base "files" when the model has frozen parameters (the
// planner's groups hold them alike; the engine keeps only groups without).
// Any other config as it is, "auto" cleared.
Config resolve_max_in_cpu(const Config& config, const ModelSummary& model, const TierCapacities& capacities,
                          const PlanOptions& options, const Placement& p) {
  Config out = config;
  out.zero.offload_param.max_in_cpu_auto = false;
  if (!config.zero.offload_param.max_in_cpu_auto) return out;
  out.zero.offload_param.max_in_cpu = 0;
  if (p.param_device != OffloadDevice::kNvme) return out;
  if (config.strata.frozen_base == FrozenBase::kFiles && model.num_frozen_params > 0) return out;
  const Inputs in{out, model, capacities, options};
  const PlannedHomes homes = planned_homes(in, p);
  if (homes.home <= 0) return out;
  const std::uint64_t spare = planned_pinned_spare(in, p);
  const std::uint64_t home_bytes = static_cast<std::uint64_t>(homes.home) * static_cast<std::uint64_t>(config.compute_bytes());
  return with_homes(out, homes, std::min<std::int64_t>(homes.groups, static_cast<std::int64_t>(spare / home_bytes)));
}

}  // namespace

namespace plan_detail {

std::string quoted(std::string_view s) { return str_cat('"', s, '"'); }

std::vector<ConfigChange> changes_for(const Config& config, const Placement& to) {
  std::vector<ConfigChange> changes;
  const int stage = config.zero.stage;
  int stage_needed = stage;
  if (to.param_device != OffloadDevice::kNone) {
    stage_needed = 3;
  } else if (to.optimizer_device != OffloadDevice::kNone && stage == 0) {
    stage_needed = 2;
  }
  if (stage_needed != stage) {
    changes.push_back(
        {"zero_optimization.stage", std::to_string(stage), std::to_string(stage_needed)});
  }
  if (to.param_device != config.zero.offload_param.device) {
    changes.push_back({"zero_optimization.offload_param.device",
                       quoted(offload_device_key(config.zero.offload_param.device)),
                       quoted(offload_device_key(to.param_device))});
  }
  if (to.optimizer_device != config.zero.offload_optimizer.device) {
    changes.push_back({"zero_optimization.offload_optimizer.device",
                       quoted(offload_device_key(config.zero.offload_optimizer.device)),
                       quoted(offload_device_key(to.optimizer_device))});
  }
  if (to.optimizer_device == OffloadDevice::kNvme &&
      to.optimizer_cpu_fraction != config.strata.optimizer_cpu_fraction) {
    changes.push_back({"strata.optimizer_cpu_fraction",
                       fraction_text(config.strata.optimizer_cpu_fraction),
                       fraction_text(to.optimizer_cpu_fraction)});
  }
  return changes;
}

// The grid of strata.optimizer_cpu_fraction the search tries: k x step, k < steps.
double grid_fraction(int k, double step) { return std::round(k * step * 1e9) / 1e9; }

}  // namespace plan_detail

std::vector<std::string> plan_swap_paths(const Config& config) {
  if (!config.strata.io.paths.empty()) return config.strata.io.paths;
  std::vector<std::string> paths{config.zero.offload_optimizer.nvme_path};
  if (config.zero.offload_param.nvme_path != paths.front()) {
    paths.push_back(config.zero.offload_param.nvme_path);
  }
  return paths;
}

core::Result<Plan> make_plan(const Config& config, const ModelSpec& model,
                             const MachineSpec& machine, const PlanOptions& options) {
  STRATA_RETURN_IF_ERROR(validate_config(config, options));
  Plan plan;
  plan.ranks = options.ranks;
  plan.nodes = options.nodes;
  STRATA_ASSIGN_OR_RETURN(plan.model, resolve_model(config, model));
  // strata.frozen_base "files" is refused by finalize where the frozen
  // parameters' home is not nvme or stage 3 shards the compute copies.
  if (config.strata.frozen_base == FrozenBase::kFiles && plan.model.num_frozen_params > 0 &&
      (config.zero.offload_param.device != OffloadDevice::kNvme || (options.ranks > 1 && config.zero.stage == 3))) {
    return Status::invalid_argument(str_cat(
        "strata.frozen_base \"files\" reads the frozen parameters from their files only where their compute copies "
        "live on nvme (zero_optimization.offload_param.device \"nvme\") and are not sharded over ranks (stage 3); "
        "the engine refuses this config (\"auto\" keeps them in their tier)"));
  }
  plan.state.precision = precision_label(config);
  plan.state.optimizer = std::string(optimizer_name(config.optimizer.type));
  plan.state.compute_bytes = static_cast<std::uint64_t>(config.compute_bytes());
  plan.state.gradient_accumulation_steps = config.gradient_accumulation_steps;
  plan.state.gradient_bytes =
      config.gradient_accumulation_steps == 1 && options.ranks == 1 ? plan.state.compute_bytes : 4;
  plan.state.moment_bytes = optimizer_moment_bytes(config);
  plan.state.moment_format = std::string(state_format_name(config.strata.optimizer_state.format));
  plan.machine = machine;
  STRATA_ASSIGN_OR_RETURN(TierCapacities capacities,
                          tier_capacities(config, machine, options.margins, options.ranks / options.nodes,
                                          &plan.notes));
  Placement configured;
  configured.param_device = config.zero.offload_param.device;
  configured.optimizer_device = config.zero.offload_optimizer.device;
  configured.optimizer_ratio = config.zero.offload_optimizer.ratio;
  configured.optimizer_cpu_fraction = config.strata.optimizer_cpu_fraction;
  // offload_param.max_in_cpu "auto" resolved as finalize resolves it (for
  // the configured placement here, for each one the search tries there).
  const bool max_in_cpu_auto = config.zero.offload_param.max_in_cpu_auto;
  const Config resolved = resolve_max_in_cpu(config, plan.model, capacities, options, configured);
  const Inputs in{resolved, plan.model, capacities, options};
  if (max_in_cpu_auto && configured.param_device == OffloadDevice::kNvme) {
    const PlannedHomes homes = planned_homes(in, configured);
    const std::int64_t k = homes.home > 0 ? resolved.zero.offload_param.max_in_cpu / homes.home : 0;
    plan.notes.push_back(str_cat("zero_optimization.offload_param.max_in_cpu \"auto\": the compute copies of ", k,
                                 " of ", homes.groups, " groups fit in what strata.budgets.pinned leaves beside the "
                                 "rest and the disk pipeline's ring (",
                                 group_digits(static_cast<std::uint64_t>(resolved.zero.offload_param.max_in_cpu)),
                                 " elements)"));
  }
  plan.configured = evaluate(in, configured);
  // ... nor for a group offload_param.max_in_cpu keeps in pinned memory.
  if (config.strata.frozen_base == FrozenBase::kFiles && plan.model.num_frozen_params > 0 &&
      plan.configured.item_bytes(Tier::kPinned, "compute_copies_in_cpu") > 0) {
    return Status::invalid_argument(str_cat(
        "strata.frozen_base \"files\" reads the frozen parameters from their files only where their compute copies "
        "live on nvme, and zero_optimization.offload_param.max_in_cpu = ", resolved.zero.offload_param.max_in_cpu,
        " keeps groups with frozen parameters in CPU memory: the engine refuses this config (\"auto\" keeps such "
        "groups' in memory)"));
  }

  // The search. Fractions are k x step, computed from k so that they are exact
  // decimals where the step is (0.05 x 3 == 0.15).
  const int steps = std::max(1, static_cast<int>(std::lround(1.0 / options.cpu_fraction_step)));
  const PlacementPlan* best = nullptr;
  std::vector<PlacementPlan> fitting;
  fitting.reserve(static_cast<std::size_t>(9 * steps));
  constexpr OffloadDevice kDevices[] = {OffloadDevice::kNone, OffloadDevice::kCpu,
                                        OffloadDevice::kNvme};
  for (OffloadDevice pd : kDevices) {
    for (OffloadDevice od : kDevices) {
      Placement p = configured;
      p.param_device = pd;
      p.optimizer_device = od;
      p.optimizer_cpu_fraction = 0.0;
      std::optional<PlacementPlan> shown;
      const int tries = od == OffloadDevice::kNvme ? steps : 1;
      for (int k = 0; k < tries; ++k) {
        if (od == OffloadDevice::kNvme) {
          p.optimizer_cpu_fraction = grid_fraction(k, options.cpu_fraction_step);
        }
        PlacementPlan candidate =
            max_in_cpu_auto ? evaluate(Inputs{resolve_max_in_cpu(config, plan.model, capacities, options, p),
                                              plan.model, capacities, options},
                                       p)
                            : evaluate(in, p);
        if (!shown || (candidate.fits && (!shown->fits || moves_less(candidate, *shown)))) {
          shown = candidate;
        }
        if (candidate.fits) fitting.push_back(std::move(candidate));
      }
      plan.candidates.push_back(std::move(*shown));
    }
  }
  for (const PlacementPlan& c : fitting) {
    if (best == nullptr || moves_less(c, *best)) best = &c;
  }
  if (best != nullptr && (!plan.configured.fits || moves_less(*best, plan.configured))) {
    plan.recommended = *best;
    plan.changes = changes_for(config, best->placement);
  }

  if (options.drive) {
    STRATA_ASSIGN_OR_RETURN(plan.wear, plan_wear(in, plan, *options.drive, steps, fitting));
  }
  // The configured placement under each state format the optimizer takes.
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kInt8Blockwise}) {
    if (f != StateFormat::kFp32 && config.optimizer.type != OptimizerType::kAdam &&
        config.optimizer.type != OptimizerType::kAdamW) {
      continue;
    }
    Config fc = resolved;  // (max_in_cpu "auto" resolved)
    fc.strata.optimizer_state.format = f;
    if (f == StateFormat::kFp32) fc.strata.optimizer_state.rounding = StateRounding::kNearestEven;
    const Inputs fin{fc, plan.model, capacities, options};
    FormatPlan row;
    row.format = std::string(state_format_name(f));
    row.state_bytes = 4 + optimizer_moment_bytes(fc);
    row.plan = evaluate(fin, configured);
    if (plan.wear) {
      row.wear = placement_wear(fc, plan.machine, row.plan, plan.wear->rated_bytes_per_drive,
                                options.drive->step_seconds);
    }
    plan.formats.push_back(std::move(row));
  }

  // Compute copies on nvme with RAM to spare: the most whole homes
  // offload_param.max_in_cpu can keep in pinned memory with the configured
  // placement still fitting, said as a note ("auto" took them already).
  if (configured.param_device == OffloadDevice::kNvme && plan.configured.fits &&
      !config.zero.offload_param.max_in_cpu_auto) {
    const PlannedHomes homes = planned_homes(in, configured);
    const std::int64_t now = homes.home > 0 ? config.zero.offload_param.max_in_cpu / homes.home : 0;
    const std::int64_t best = most_homes(resolved, plan.model, capacities, options, configured, homes, now);
    if (best > now) {
      const PlacementPlan more =
          evaluate(Inputs{with_homes(resolved, homes, best), plan.model, capacities, options}, configured);
      const StepTraffic& was = plan.configured.traffic;
      plan.notes.push_back(str_cat(
          "RAM has room for more compute copies: zero_optimization.offload_param.max_in_cpu = ",
          group_digits(static_cast<std::uint64_t>(homes_value(homes, best))), " (now ",
          group_digits(static_cast<std::uint64_t>(config.zero.offload_param.max_in_cpu)),
          ") keeps the compute copies of ", best, " of ", homes.groups, " groups (",
          core::format_bytes(more.item_bytes(Tier::kPinned, "compute_copies_in_cpu")),
          ") in CPU memory; the drive would read ", core::format_bytes(was.disk_read_bytes - more.traffic.disk_read_bytes),
          " and write ", core::format_bytes(was.disk_write_bytes - more.traffic.disk_write_bytes), " less per step"));
    }
  }

  // Notes: what the estimate leaves out or assumes.
  if (!plan.model.has_shape) {
    plan.notes.push_back(
        "no transformer shape (--hidden, --vocab): activations and persistent parameters are not "
        "estimated; the GPU needs room for them on top of the GPU total");
  }
  if (configured.param_device != OffloadDevice::kNone && config.zero.stage != 3) {
    plan.notes.push_back(
        str_cat("offload_param is used only with zero_optimization.stage 3 (stage is ",
                config.zero.stage, ")"));
  }
  if (options.ranks > 1) {
    plan.notes.push_back(str_cat(
        "one rank of ", options.ranks, " (", options.ranks / options.nodes, " on each of ", options.nodes,
        options.nodes == 1 ? " machine" : " machines",
        "): its shard of the optimizer state and fp32 host gradients, whole compute copies",
        config.zero.stage == 3 ? " (stage 3 does not shard them yet)" : "",
        "; each machine's RAM and disk are shared by its ranks"));
  }
  if (config.gradient_accumulation_steps > 1) {
    plan.notes.push_back(
        str_cat("gradient_accumulation_steps = ", config.gradient_accumulation_steps,
                ": host gradients accumulate in fp32 (4 B) and the bytes per step "
                "count every micro-batch's fetches and gradients"));
  }
  const std::uint64_t staging = plan.configured.item_bytes(Tier::kPinned, "optimizer_staging");
  if (config.strata.budgets.staging_bytes > 0 && staging > config.strata.budgets.staging_bytes) {
    plan.notes.push_back(
        str_cat("the disk pipeline needs one chunk's optimizer state in staging memory, ", core::format_bytes(staging),
                " > strata.budgets.staging = ", core::format_bytes(config.strata.budgets.staging_bytes),
                ": raise it, or lower strata.chunk_bytes"));
  }
  if (plan.recommended && config.strata.io.paths.empty()) {
    const Placement& r = plan.recommended->placement;
    if (r.param_device == OffloadDevice::kNvme && configured.param_device != OffloadDevice::kNvme) {
      plan.notes.push_back(
          str_cat("parameter swap files go to zero_optimization.offload_param.nvme_path = ",
                  quoted(config.zero.offload_param.nvme_path),
                  " unless strata.io.paths is set: point it at an NVMe drive"));
    }
    if (r.optimizer_device == OffloadDevice::kNvme &&
        configured.optimizer_device != OffloadDevice::kNvme) {
      plan.notes.push_back(
          str_cat("optimizer swap files go to zero_optimization.offload_optimizer.nvme_path = ",
                  quoted(config.zero.offload_optimizer.nvme_path),
                  " unless strata.io.paths is set: point it at an NVMe drive"));
    }
  }
  return plan;
}

}  // namespace strata::engine
