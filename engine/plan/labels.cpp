// The planner's names and labels, shared by its arithmetic (model.cpp ... wear.cpp) and
// its output (format.cpp): digit grouping, the config's spellings, item
// labels, placements described, and why a tier is over capacity.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/str.h"
#include "engine/optimizer_spec.h"
#include "engine/plan/plan_internal.h"

namespace strata::engine {

using core::str_cat;

std::string fraction_text(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", f);
  return buf;
}

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string group_digits(std::uint64_t v) {
  std::string digits = std::to_string(v);
  std::string out;
  const int n = static_cast<int>(digits.size());
  for (int i = 0; i < n; ++i) {
    if (i > 0 && (n - i) % 3 == 0) out += ',';
    out += digits[static_cast<std::size_t>(i)];
  }
  return out;
}

std::string_view offload_device_key(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}

std::string_view optimizer_name(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam: return "Adam";
    case OptimizerType::kAdamW: return "AdamW";
    case OptimizerType::kAdagrad: return "Adagrad";
    case OptimizerType::kLion: return "Lion";
  }
  return "?";
}

std::string_view optimizer_label(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam: return "Adam moments";
    case OptimizerType::kAdamW: return "AdamW moments";
    case OptimizerType::kAdagrad: return "Adagrad sum of squares";
    case OptimizerType::kLion: return "Lion momentum";
  }
  return "?";
}

double optimizer_moment_bytes(const Config& config) {
  // The engine's arrays less the master, per element of a whole number of blocks.
  constexpr std::int64_t kElems = std::int64_t{1} << 20;
  return static_cast<double>(optimizer_spec(config.optimizer.type, config.strata.optimizer_state.format)
                                 .moment_bytes(kElems)) / static_cast<double>(kElems);
}

std::string_view state_format_name(StateFormat f) {
  switch (f) {
    case StateFormat::kFp32: return "fp32";
    case StateFormat::kBf16: return "bf16";
    case StateFormat::kInt8Blockwise: return "int8_blockwise";
  }
  return "?";
}

std::string over_capacity_reason(const PlacementPlan& plan, const TierPlan& tier) {
  std::vector<const PlanItem*> items;
  for (const PlanItem& item : plan.items) {
    if (item.tier == tier.tier) items.push_back(&item);
  }
  std::stable_sort(items.begin(), items.end(), [](const PlanItem* a, const PlanItem* b) {
    return a->size_bytes > b->size_bytes;
  });
  std::string parts;
  constexpr std::size_t kShown = 4;
  for (std::size_t i = 0; i < items.size() && i < kShown; ++i) {
    if (i > 0) parts += ", ";
    parts += str_cat(item_label(items[i]->name), " ", core::format_bytes(items[i]->size_bytes));
  }
  if (items.size() > kShown) parts += str_cat(", ", items.size() - kShown, " more");
  std::string limit = tier.margin_bytes > 0
                          ? str_cat(core::format_bytes(tier.capacity_bytes), " less the ",
                                    core::format_bytes(tier.margin_bytes), " margin")
                          : tier.capacity_source;
  return str_cat(tier_label(tier.tier), " needs ", core::format_bytes(tier.needed_bytes), " (",
                 parts, ") > ", core::format_bytes(tier.available_bytes), " available (", limit,
                 ")");
}

std::string_view item_label(std::string_view name) {
  if (name == "compute_copies") return "compute copies";
  if (name == "compute_copies_in_cpu") return "compute copies kept in CPU memory";
  if (name == "persistent_params") return "persistent params";
  if (name == "fetch_window") return "fetch window";
  if (name == "device_gradient_buffers") return "device gradient buffers";
  if (name == "host_gradients") return "host gradients";
  if (name == "master_weights") return "fp32 master";
  if (name == "optimizer_moments") return "optimizer moments";
  if (name == "optimizer_staging") return "optimizer staging";
  if (name == "param_staging") return "param staging";
  if (name == "gradient_staging") return "gradient staging";
  if (name == "optimizer_compute_view") return "optimizer's compute copies";
  if (name == "optimizer_device_buffers") return "device optimizer buffers";
  if (name == "optimizer_device_copies") return "device optimizer copies";
  if (name == "swap_reserve") return "swap reserve";
  if (name == "speculative_state") return "speculative state";
  if (name == "speculative_compute_copies") return "speculative compute copies";
  if (name == "delayed_compute_copies") return "delayed compute copies";
  if (name == "activations") return "activations";
  if (name == "logits") return "logits";
  if (name == "checkpoint") return "checkpoint";
  if (name == "rank_gradient_sums") return "gradient sums over ranks";
  if (name == "device_gradient_sums") return "device gradient sums";
  if (name == "device_fetch_gather") return "device fetch gather";
  if (name == "rank_read_gather") return "read gather";
  if (name == "rank_compute_gather") return "compute copies gathered";
  return name;
}

std::string describe_placement(const Placement& p) {
  std::string s =
      str_cat("params ",
              p.param_device == OffloadDevice::kNone ? std::string_view("gpu")
                                                     : offload_device_key(p.param_device),
              ", optimizer ",
              p.optimizer_device == OffloadDevice::kNone ? std::string_view("gpu")
                                                         : offload_device_key(p.optimizer_device));
  if (p.optimizer_device != OffloadDevice::kNone && p.optimizer_ratio < 1.0) {
    s += str_cat(" (ratio ", fraction_text(p.optimizer_ratio), ": the rest on gpu)");
  }
  if (p.optimizer_device == OffloadDevice::kNvme) {
    s += str_cat(" (cpu fraction ", fraction_text(p.optimizer_cpu_fraction), ")");
  }
  return s;
}

}  // namespace strata::engine
