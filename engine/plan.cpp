// The planner's arithmetic: model resolution, tier capacities, one placement's
// bytes per tier and per step, and the search over placements.
#include "engine/plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "core/aligned_buffer.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/internal/plan_internal.h"
#include "engine/schedule/schedule.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;

// The planner's range: far beyond any model, small enough that every byte
// count below (at most ~40 B per parameter, times the accumulation steps,
// saturating) stays exact in 64 bits.
constexpr std::int64_t kMaxParams = 1'000'000'000'000'000;  // 1e15

std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}

std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}

std::uint64_t u64(std::int64_t v) { return v > 0 ? static_cast<std::uint64_t>(v) : 0; }

std::uint64_t floor_fraction(std::uint64_t bytes, double fraction) {
  return static_cast<std::uint64_t>(std::floor(static_cast<double>(bytes) * fraction));
}

// Elements of the tensors of one block, in the order of transformer_num_params.
std::array<std::int64_t, 12> block_tensor_elems(std::int64_t h) {
  return {3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h};
}

Status invalid(std::string message) { return Status::invalid_argument(std::move(message)); }

core::Result<ModelSummary> resolve_model(const Config& config, const ModelSpec& spec) {
  ModelSummary m;
  m.has_shape = spec.hidden_size != 0 || spec.vocab_size != 0;
  if (spec.num_layers == 0) {
    return invalid("num_layers (--layers) is required: the number of layers (fetch groups)");
  }
  if (spec.num_layers < 0) {
    return invalid(str_cat("num_layers (--layers) must be positive, got ", spec.num_layers));
  }
  m.num_layers = spec.num_layers;
  if (m.has_shape) {
    if (spec.num_params != 0) {
      return invalid(
          "give either num_params (--params) or a transformer shape (--hidden, --vocab), not both");
    }
    if (spec.hidden_size <= 0) {
      return invalid(
          str_cat("hidden_size (--hidden) must be positive with a transformer shape, got ",
                  spec.hidden_size));
    }
    if (spec.vocab_size <= 0) {
      return invalid(str_cat("vocab_size (--vocab) must be positive with a transformer shape, got ",
                             spec.vocab_size));
    }
    if (spec.num_heads < 0 || spec.num_heads > spec.hidden_size) {
      return invalid(str_cat("num_heads (--heads) must be in [1, hidden_size = ", spec.hidden_size,
                             "], got ", spec.num_heads));
    }
    m.hidden_size = spec.hidden_size;
    m.vocab_size = spec.vocab_size;
    m.num_heads =
        spec.num_heads != 0 ? spec.num_heads : std::max<std::int64_t>(1, spec.hidden_size / 128);
    STRATA_ASSIGN_OR_RETURN(m.num_params,
                            transformer_num_params(m.num_layers, m.hidden_size, m.vocab_size));
  } else {
    if (spec.num_heads != 0) {
      return invalid("num_heads (--heads) needs a transformer shape (--hidden, --vocab)");
    }
    if (spec.num_params == 0) {
      return invalid(
          "the model size is required: give num_params (--params) or a transformer shape "
          "(--hidden, --vocab)");
    }
    if (spec.num_params < 0) {
      return invalid(str_cat("num_params (--params) must be positive, got ", spec.num_params));
    }
    m.num_params = spec.num_params;
  }
  if (m.num_params > kMaxParams) {
    return invalid(str_cat("the model has ", m.num_params,
                           " parameters, beyond the planner's range (", kMaxParams, ")"));
  }
  if (m.num_layers > m.num_params) {
    return invalid(str_cat("num_layers (--layers) ", m.num_layers,
                           " exceeds num_params (--params) ", m.num_params,
                           ": a layer holds at least one parameter"));
  }
  if (!(spec.frozen_fraction >= 0.0 && spec.frozen_fraction <= 1.0)) {
    return invalid(str_cat("frozen_fraction (--frozen-fraction) must be in [0, 1], got ",
                           spec.frozen_fraction));
  }
  m.frozen_fraction = spec.frozen_fraction;
  m.num_frozen_params = share_of(m.num_params, spec.frozen_fraction);
  m.num_trainable_params = m.num_params - m.num_frozen_params;
  if (spec.seq_len <= 0) {
    return invalid(str_cat("seq_len (--seq) must be positive, got ", spec.seq_len));
  }
  m.seq_len = spec.seq_len;
  if (spec.micro_batch < 0) {
    return invalid(str_cat("micro_batch (--micro-batch) must be positive, got ", spec.micro_batch));
  }
  m.micro_batch = spec.micro_batch != 0 ? spec.micro_batch : config.train_micro_batch_size_per_gpu;
  if (m.micro_batch <= 0) {
    return invalid(str_cat("train_micro_batch_size_per_gpu must be positive, got ", m.micro_batch));
  }
  m.activation_checkpointing = spec.activation_checkpointing;

  const std::int64_t threshold = config.zero.stage3_param_persistence_threshold;
  if (m.has_shape) {
    const std::int64_t h = m.hidden_size;
    m.group_params = std::max(12 * h * h + 13 * h, m.vocab_size * h);
    std::int64_t per_block = 0;
    for (std::int64_t elems : block_tensor_elems(h)) {
      if (elems < threshold) per_block += elems;
    }
    m.persistent_params = m.num_layers * per_block;
    if (h < threshold) m.persistent_params += 2 * h;  // final layer norm
    if (m.vocab_size * h < threshold) m.persistent_params += m.vocab_size * h;
    STRATA_ASSIGN_OR_RETURN(
        ActivationEstimate act,
        estimate_activations(m.num_layers, h, m.num_heads, m.vocab_size, m.seq_len, m.micro_batch,
                             m.activation_checkpointing, config.compute_bytes()));
    m.activations = act;
  } else {
    m.group_params = (m.num_params + m.num_layers - 1) / m.num_layers;
  }
  return m;
}

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
  return Status();
}

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

using TierCapacities = std::array<TierPlan, kNumTiers>;

core::Result<TierCapacities> tier_capacities(const Config& config, const MachineSpec& machine,
                                             const PlanMargins& margins,
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
  tiers[1] = tier_capacity(
      Tier::kPinned, machine.ram_bytes, machine.ram_source, b.pinned_bytes, "strata.budgets.pinned",
      sat_add(floor_fraction(machine.ram_bytes, margins.ram_fraction), margins.ram_reserve_bytes),
      notes);
  tiers[2] = tier_capacity(Tier::kNvme, machine.disk_bytes, machine.disk_source, b.disk_bytes,
                           "strata.budgets.disk",
                           floor_fraction(machine.disk_bytes, margins.disk_fraction), notes);
  return tiers;
}

std::string precision_label(const Config& config) {
  switch (config.precision) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp32: return "fp32";
  }
  return "?";
}

std::string count_times(std::int64_t n, std::uint64_t bytes, std::string_view what = {}) {
  std::string s = str_cat(group_digits(u64(n)), " x ", bytes, " B");
  if (!what.empty()) s += str_cat(" (", what, ")");
  return s;
}

struct Inputs {
  const Config& config;
  const ModelSummary& model;
  const TierCapacities& capacities;
  const PlanOptions& options;
};

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return b > 0 ? (a + b - 1) / b : 0; }
std::int64_t round_up_to(std::int64_t n, std::int64_t m) { return ceil_div(n, m) * m; }

// What the planner knows of the layout the engine builds (layout.cpp) for
// `groups` equal fetch groups: each group's trainable elements rounded up to
// whole norm blocks, cut into optimizer chunks that never cross a group, and
// the state split by the placement rule over that trainable space.
struct LayoutShape {
  std::int64_t group_trainable = 0;  // trainable elements of a group (norm-block aligned)
  std::int64_t chunk = 0;            // elements of the largest chunk
  std::int64_t nvme_chunks = 0;      // chunks whose state lives on NVMe, counted up to `count_limit`
};

LayoutShape layout_shape(std::int64_t trainable, std::int64_t groups, std::uint64_t chunk_bytes,
                         const Placement& pl, std::int64_t count_limit) {
  constexpr std::int64_t kBlock = core::numerics::kNormBlockElems;
  LayoutShape s;
  if (trainable == 0 || groups == 0) return s;
  s.group_trainable = round_up_to(ceil_div(trainable, groups), kBlock);
  const std::int64_t chunk_elems =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(chunk_bytes / 4) / kBlock) * kBlock;
  s.chunk = std::min(chunk_elems, s.group_trainable);
  // A chunk's state lives where the placement rule puts its first element:
  // count the chunk starts in [pinned, offloaded), walking group by group.
  const OptimizerSplit split = split_optimizer_state(s.group_trainable * groups, pl.optimizer_device,
                                                     pl.optimizer_ratio, pl.optimizer_cpu_fraction);
  const std::int64_t lo = split.pinned_elems, hi = split.offloaded_elems();
  std::int64_t at = lo;  // the first chunk start >= lo
  {
    const std::int64_t group_begin = lo / s.group_trainable * s.group_trainable;
    at = std::min(group_begin + round_up_to(lo - group_begin, chunk_elems), group_begin + s.group_trainable);
  }
  while (at < hi && s.nvme_chunks < count_limit) {
    ++s.nvme_chunks;
    const std::int64_t group_end = (at / s.group_trainable + 1) * s.group_trainable;
    at = std::min(at + chunk_elems, group_end);
  }
  return s;
}

PlacementPlan evaluate(const Inputs& in, const Placement& pl) {
  const Config& cfg = in.config;
  const Schedule& schedule = schedule_for(cfg.strata.overlap);
  const ModelSummary& m = in.model;
  PlacementPlan plan;
  plan.placement = pl;
  auto add = [&plan](std::string name, Tier tier, std::uint64_t bytes, std::string detail) {
    if (bytes == 0) return;
    plan.items.push_back(PlanItem{std::move(name), tier, bytes, std::move(detail)});
  };

  const std::int64_t P = m.num_params;
  const std::int64_t T = m.num_trainable_params;
  const std::int64_t L = m.num_layers;
  const std::uint64_t c = static_cast<std::uint64_t>(cfg.compute_bytes());
  const std::uint64_t accum = u64(cfg.gradient_accumulation_steps);
  const std::uint64_t g = accum == 1 ? c : 4;
  const std::uint64_t moments = optimizer_moment_bytes(cfg.optimizer.type);
  const std::uint64_t state = 4 + moments;
  const std::string prec = precision_label(cfg);
  const bool threaded = schedule.threaded();

  // The trainable parameters' optimizer state, by the layout's rule (tier.h).
  const OptimizerSplit split = split_optimizer_state(T, pl.optimizer_device, pl.optimizer_ratio,
                                                     pl.optimizer_cpu_fraction);
  const std::int64_t t_gpu = split.device_elems;
  const std::int64_t t_keep = split.pinned_elems;  // CPU-updated and resident in pinned memory
  const std::int64_t t_nvme = split.nvme_elems;

  const bool params_offloaded = pl.param_device != OffloadDevice::kNone;
  const Tier param_tier = tier_of(pl.param_device);
  // A fetch group (the largest), and the groups with something to train.
  const std::int64_t group = m.group_params;
  const std::uint64_t group_bytes = sat_mul(u64(group), c);
  const std::int64_t trainable_groups = T > 0 ? std::clamp<std::int64_t>(ceil_div(T, group), 1, L) : 0;
  // "3 fetch groups of 1,000,000"
  const auto groups_of = [group](std::int64_t n) {
    return str_cat(n, n == 1 ? " fetch group of " : " fetch groups of ", group_digits(u64(group)));
  };

  add("compute_copies", param_tier, sat_mul(u64(P), c), count_times(P, c, prec));
  // Device copies of offloaded compute copies (the threaded schedules: the
  // fetched, prefetched and resident ones, which share
  // stage3_max_live_parameters; groups of at most
  // stage3_param_persistence_threshold elements all stay), and how many of
  // the backward's fetches a copy kept since the forward serves. Both the
  // window and the gradient buffers below give way to a device budget
  // (fitted at the end).
  const bool persistent_groups = !m.has_shape && group <= cfg.zero.stage3_param_persistence_threshold;
  const std::int64_t live_groups = std::min<std::int64_t>(L, cfg.zero.stage3_max_live_parameters / group);
  std::int64_t window_groups = 0, resident_groups = 0;
  const auto window_detail = [&](std::int64_t n) {
    return str_cat(groups_of(n), " x ", c, " B (",
                   !threaded           ? "the fetched one: strata.overlap \"none\" keeps none"
                   : persistent_groups ? "all: each under stage3_param_persistence_threshold"
                                       : "fetched, prefetched and kept, within stage3_max_live_parameters",
                   n < window_groups ? " and the device budget" : "", ")");
  };
  if (params_offloaded) {
    window_groups = !threaded ? 1 : persistent_groups ? L : std::max<std::int64_t>(1, live_groups);
    resident_groups = !threaded ? 0 : persistent_groups ? L : live_groups;
    add("persistent_params", Tier::kDevice, sat_mul(u64(m.persistent_params), c),
        count_times(m.persistent_params, c,
                    str_cat("tensors under stage3_param_persistence_threshold = ",
                            group_digits(u64(cfg.zero.stage3_param_persistence_threshold)))));
    add("fetch_window", Tier::kDevice, sat_mul(group_bytes, u64(window_groups)), window_detail(window_groups));
  }
  if (pl.param_device == OffloadDevice::kNvme) {
    // A group read from nvme passes through a pinned staging copy on its way
    // to the device (ComputeHomes::load), one group at a time (the prefetch
    // thread's, or a fetch's). DeepSpeed's offload_param.buffer_count and
    // buffer_size have no effect on it.
    add("param_staging", Tier::kPinned, group_bytes,
        str_cat(groups_of(1), " x ", c, " B (staging copy of a group read from nvme)"));
  }
  std::int64_t grad_buffers = 0;
  const auto grads_detail = [&](std::int64_t n) {
    return str_cat(groups_of(n), " x ", c, " B (",
                   threaded ? "on their way down, within reduce_bucket_size" : "one at a time",
                   n < grad_buffers ? " and the device budget" : "", ")");
  };
  if (T > 0) {
    // Every trainable group's gradients come down to the host, whatever the
    // optimizer's tier: the gradient pass runs on the CPU.
    add("host_gradients", Tier::kPinned, sat_mul(u64(T), g),
        count_times(T, g, accum == 1 ? prec : "fp32 accumulation"));
    // The framework writes each group's gradients into a device buffer; the
    // threaded schedules hold those on their way down within
    // reduce_bucket_size elements (two groups at least).
    grad_buffers =
        !threaded ? 1
                  : std::min(trainable_groups, std::max<std::int64_t>(2, cfg.zero.reduce_bucket_size / group));
    add("device_gradient_buffers", Tier::kDevice, sat_mul(group_bytes, u64(grad_buffers)),
        grads_detail(grad_buffers));
    // The optimizer's host copy of the group it updates, unless the home is
    // pinned; when a certain step's early job updates groups whose home is
    // the GPU during the backward, it holds every trainable group's until
    // step_end (the framework may still read the home: Optimizer::run).
    const StepRules rules = StepRules::of(cfg);
    const bool views_held =
        pl.param_device == OffloadDevice::kNone && schedule.early_jobs(rules) && rules.certain();
    // A group's gradients in its pass, as copied down and packed into the
    // trainable layout, and the next group's as they come down; while the
    // views pile up, two groups are still to pass when a third staging is
    // in use, so the peak counts the last group's only.
    const std::int64_t staged = views_held ? 1 : 3;
    add("gradient_staging", Tier::kPinned, sat_mul(group_bytes, u64(staged)),
        str_cat(groups_of(staged), " x ", c, " B (",
                views_held ? "the last group's in its pass, when every view is held"
                           : "gradients in their pass, copied down and packed, and the next group's coming down",
                ")"));
    if (views_held) {
      add("optimizer_compute_view", Tier::kPinned, sat_mul(u64(T), c),
          count_times(T, c, "every trainable group's new compute copies, held until step_end"));
    } else if (pl.param_device != OffloadDevice::kCpu) {
      add("optimizer_compute_view", Tier::kPinned, group_bytes,
          str_cat(groups_of(1), " x ", c, " B (the optimizer's host copy of the group it updates)"));
    }
  }
  const LayoutShape shape = layout_shape(T, L, cfg.strata.chunk_bytes, pl, schedule.ring_depth());
  if (t_gpu > 0) {
    add("master_weights", Tier::kDevice, sat_mul(u64(t_gpu), 4), count_times(t_gpu, 4, "fp32"));
    add("optimizer_moments", Tier::kDevice, sat_mul(u64(t_gpu), moments),
        count_times(t_gpu, moments, optimizer_label(cfg.optimizer.type)));
    // A chunk updated on the device: its gradients go up, its new compute
    // copies come down through a pinned buffer.
    add("optimizer_device_buffers", Tier::kDevice, sat_mul(u64(shape.chunk), g + c),
        count_times(shape.chunk, g + c, "one chunk's gradients and new compute copies"));
    add("optimizer_device_copies", Tier::kPinned, sat_mul(u64(shape.chunk), c),
        count_times(shape.chunk, c, "one chunk's new compute copies on their way down"));
  }
  if (t_keep > 0) {
    add("master_weights", Tier::kPinned, sat_mul(u64(t_keep), 4), count_times(t_keep, 4, "fp32"));
    add("optimizer_moments", Tier::kPinned, sat_mul(u64(t_keep), moments),
        count_times(t_keep, moments, optimizer_label(cfg.optimizer.type)));
  }
  if (t_nvme > 0) {
    add("master_weights", Tier::kNvme, sat_mul(u64(t_nvme), 4), count_times(t_nvme, 4, "fp32"));
    add("optimizer_moments", Tier::kNvme, sat_mul(u64(t_nvme), moments),
        count_times(t_nvme, moments, optimizer_label(cfg.optimizer.type)));
    // The disk pipeline's ring (DiskPipeline::create): a slot holds the
    // largest nvme chunk's master and moments; strata.budgets.staging sets
    // the slots, else the schedule's depth, fewer when a pinned budget
    // leaves less than two slots' room per slot; never more than the chunks.
    const std::uint64_t states = 1 + moments / 4;
    const std::uint64_t slot =
        core::align_up(sat_mul(u64(std::max<std::int64_t>(shape.chunk, 1)), 4 * states), core::kDirectIoAlignment);
    const BudgetsConfig& b = cfg.strata.budgets;
    std::uint64_t slots = u64(schedule.ring_depth());
    if (b.staging_bytes > 0) {
      slots = std::max<std::uint64_t>(1, b.staging_bytes / slot);
    } else if (b.pinned_bytes > 0) {
      std::uint64_t held = sat_mul(u64(T), g);
      if (pl.param_device == OffloadDevice::kCpu) held = sat_add(held, sat_mul(u64(P), c));
      held = sat_add(held, sat_mul(u64(t_keep), state));
      const std::uint64_t left = b.pinned_bytes > held ? b.pinned_bytes - held : 0;
      slots = std::clamp<std::uint64_t>(left / (2 * slot), 1, slots);
    }
    slots = std::min(slots, u64(shape.nvme_chunks));
    add("optimizer_staging", Tier::kPinned, sat_mul(slot, slots),
        str_cat(slots, " slots of ", core::format_bytes(slot), " (the largest nvme chunk's ", states,
                " fp32 states)"));
  }
  // What the overlap schedule holds beyond the placement's state, as the
  // engine's finalize counts it (engine/schedule/).
  for (const ScheduleExtra& x : schedule.extra_memory()) {
    std::int64_t n = 0;          // elements
    std::uint64_t per = c;       // bytes each
    switch (x.basis) {
      case ExtraBasis::kNvmeState: n = t_nvme, per = state; break;
      case ExtraBasis::kNvmeGroupCompute: n = t_nvme; break;
      case ExtraBasis::kTrainableGroupCompute: n = T; break;
    }
    if (n > 0) add(std::string(x.item), x.tier, sat_mul(u64(n), per), count_times(n, per, std::string(x.why)));
  }
  if (m.activations) {
    const ActivationEstimate& a = *m.activations;
    add("activations", Tier::kDevice, a.layers_bytes,
        m.activation_checkpointing
            ? str_cat(m.num_layers, " layer inputs of ", core::format_bytes(a.kept_layer_bytes),
                      " + 1 layer recomputed (", core::format_bytes(a.full_layer_bytes), ")")
            : str_cat(m.num_layers, " layers x ", core::format_bytes(a.full_layer_bytes),
                      " (no checkpointing)"));
    add("logits", Tier::kDevice, a.logits_bytes,
        str_cat("4 B x seq ", m.seq_len, " x micro-batch ", m.micro_batch, " x vocab ",
                group_digits(u64(m.vocab_size))));
  }
  // The swap files: the engine reserves 1/16 + 64 MiB beyond its blocks
  // (finalize), or strata.budgets.disk when set.
  {
    std::uint64_t swap = 0;
    for (const PlanItem& item : plan.items) {
      if (item.tier == Tier::kNvme) swap = sat_add(swap, item.size_bytes);
    }
    const std::uint64_t budget = cfg.strata.budgets.disk_bytes;
    const std::uint64_t files =
        swap == 0 ? 0 : budget > 0 ? budget : core::align_up(swap + swap / 16 + (64ull << 20), 1ull << 20);
    add("swap_reserve", Tier::kNvme, files > swap ? files - swap : 0,
        budget > 0 ? "strata.budgets.disk beyond the blocks" : "1/16 + 64 MiB beyond the blocks, rounded to 1 MiB");
  }
  if (in.options.include_checkpoint) {
    add("checkpoint", Tier::kNvme, sat_add(sat_mul(u64(P), c), sat_mul(u64(T), state)),
        str_cat(group_digits(u64(P)), " x ", c, " B + ", group_digits(u64(T)), " x ", state,
                " B (compute copies, master, moments)"));
  }

  // A device budget (or the GPU) too small for the whole window and every
  // gradient buffer: the engine gives resident copies back first, then
  // waits for gradients to go down (Engine::allocate_working), down to one
  // group of each. What is left of the room is what it holds.
  {
    std::uint64_t device = 0;
    for (const PlanItem& item : plan.items) {
      if (item.tier == Tier::kDevice) device = sat_add(device, item.size_bytes);
    }
    const std::uint64_t room = in.capacities[static_cast<int>(Tier::kDevice)].available_bytes;
    std::int64_t window = window_groups, grads = grad_buffers;
    while (device > room && group_bytes > 0 && (window > 1 || grads > 1)) {
      if (window > 1) {
        --window;
      } else {
        --grads;
      }
      device -= group_bytes;
    }
    for (PlanItem& item : plan.items) {
      if (item.name == "fetch_window" && window < window_groups) {
        item.size_bytes = sat_mul(group_bytes, u64(window));
        item.detail = window_detail(window);
      } else if (item.name == "device_gradient_buffers" && grads < grad_buffers) {
        item.size_bytes = sat_mul(group_bytes, u64(grads));
        item.detail = grads_detail(grads);
      }
    }
    resident_groups = std::min(resident_groups, window);
  }

  plan.tiers = in.capacities;
  for (TierPlan& t : plan.tiers) t.needed_bytes = 0;
  for (const PlanItem& item : plan.items) {
    TierPlan& t = plan.tiers[static_cast<int>(item.tier)];
    t.needed_bytes = sat_add(t.needed_bytes, item.size_bytes);
  }
  plan.fits = true;
  for (TierPlan& t : plan.tiers) {
    t.fits = t.needed_bytes <= t.available_bytes;
    if (!t.fits) {
      plan.fits = false;
      plan.reasons.push_back(over_capacity_reason(plan, t));
    }
  }

  // Bytes per optimizer step (G micro-batches). Fetches of offloaded
  // compute copies: every group forward and backward, less those a kept
  // copy serves: the backward's first `resident_groups`, and as many of each
  // later micro-batch's forward (the backward kept its last groups, which
  // the forward wants first).
  StepTraffic& tr = plan.traffic;
  const std::uint64_t passes = 2 * accum;
  const std::uint64_t kept = u64(resident_groups) * (2 * accum - 1);
  const std::uint64_t fetch =
      params_offloaded ? sat_mul(c, sat_mul(u64(P), passes) - std::min(sat_mul(u64(P), passes), u64(P) / u64(L) * kept))
                       : 0;
  const std::uint64_t gradients_down = sat_mul(sat_mul(c, u64(T)), accum);
  // Once per step the optimizer opens each trainable group's compute copies
  // on the host (a copy of them unless their home is pinned), writes the
  // new ones there and sends them home; a chunk updated on the device takes
  // its gradients up and its new compute copies down.
  const std::uint64_t view = sat_mul(c, u64(T));
  const bool home_device = pl.param_device == OffloadDevice::kNone;
  const bool home_nvme = pl.param_device == OffloadDevice::kNvme;
  tr.host_to_device_bytes =
      sat_add(sat_add(fetch, home_device ? view : 0), sat_mul(g, u64(t_gpu)));
  tr.device_to_host_bytes =
      sat_add(sat_add(gradients_down, home_device ? view : 0), sat_mul(c, u64(t_gpu)));
  tr.disk_read_bytes = sat_mul(state, u64(t_nvme));
  tr.disk_write_bytes = sat_mul(state, u64(t_nvme));
  if (home_nvme) {
    tr.disk_read_bytes = sat_add(tr.disk_read_bytes, sat_add(fetch, view));
    tr.disk_write_bytes = sat_add(tr.disk_write_bytes, view);
  }
  return plan;
}

// a better than b: fewer bytes per step, then fewer disk bytes.
bool moves_less(const PlacementPlan& a, const PlacementPlan& b) {
  if (a.traffic.total_bytes() != b.traffic.total_bytes()) {
    return a.traffic.total_bytes() < b.traffic.total_bytes();
  }
  return a.traffic.disk_bytes() < b.traffic.disk_bytes();
}

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

// --- SSD wear -------------------------------------------------------------------

// The swap paths a placement writes to, as the engine picks them
// (Config::swap_paths(), for this placement): strata.io.paths, else the
// nvme_paths of the devices on nvme. Empty when nothing is on nvme.
std::vector<std::string> placement_swap_paths(const Config& config, const Placement& p) {
  const bool optimizer_nvme = p.optimizer_device == OffloadDevice::kNvme;
  const bool param_nvme = p.param_device == OffloadDevice::kNvme;
  if (!optimizer_nvme && !param_nvme) return {};
  if (!config.strata.io.paths.empty()) return config.strata.io.paths;
  std::vector<std::string> out;
  if (optimizer_nvme) out.push_back(config.zero.offload_optimizer.nvme_path);
  if (param_nvme && std::find(out.begin(), out.end(), config.zero.offload_param.nvme_path) == out.end()) {
    out.push_back(config.zero.offload_param.nvme_path);
  }
  return out;
}

// Whole steps until `rated` bytes are written at `bytes` per step (double
// arithmetic, as a reader checking the plan would do it).
std::uint64_t steps_until(double rated, std::uint64_t bytes) {
  const double steps = std::floor(rated / static_cast<double>(bytes));
  return steps >= 1.8e19 ? std::numeric_limits<std::uint64_t>::max() : static_cast<std::uint64_t>(steps);
}

std::optional<double> days_of(std::uint64_t steps, double step_seconds) {
  if (step_seconds <= 0.0) return std::nullopt;
  return static_cast<double>(steps) * step_seconds / 86400.0;
}

// A placement's writes per swap drive and how long the drives last. Each
// swap path takes an even share of the bytes written per step (the swap store
// stripes blocks over the paths; the remainder goes to the first paths);
// paths on one file system (the probe's device ids) are one drive.
PlacementWear placement_wear(const Config& config, const MachineSpec& machine, const PlacementPlan& pp,
                             double rated, double step_seconds) {
  PlacementWear w;
  w.placement = pp.placement;
  w.changes = changes_for(config, pp.placement);
  w.fits = pp.fits;
  w.reasons = pp.reasons;
  w.write_bytes_per_step = pp.traffic.disk_write_bytes;
  const std::vector<std::string> paths = placement_swap_paths(config, pp.placement);
  if (paths.empty()) return w;
  // Per drive: the file system's device id, as probed (nullopt: not probed, a drive of its own).
  std::vector<std::optional<std::uint64_t>> drive_ids;
  const std::uint64_t n = paths.size();
  for (std::size_t i = 0; i < paths.size(); ++i) {
    std::optional<std::uint64_t> id;
    for (const DiskSpace& d : machine.disks) {
      if (d.path == paths[i]) id = d.device_id;
    }
    std::size_t drive = w.drives.size();
    for (std::size_t k = 0; id && k < drive_ids.size(); ++k) {
      if (drive_ids[k] == id) drive = k;
    }
    if (drive == w.drives.size()) {
      w.drives.emplace_back();
      drive_ids.push_back(id);
    }
    const std::uint64_t total = w.write_bytes_per_step;
    w.drives[drive].paths.push_back(paths[i]);
    w.drives[drive].write_bytes_per_step += total / n + (i < total % n ? 1 : 0);
  }
  for (DriveWear& d : w.drives) {
    if (d.write_bytes_per_step == 0) continue;
    d.steps = steps_until(rated, d.write_bytes_per_step);
    d.days = days_of(*d.steps, step_seconds);
    if (!w.steps || *d.steps < *w.steps) {
      w.steps = d.steps;
      w.days = d.days;
    }
  }
  return w;
}

bool same_placement(const Placement& a, const Placement& b) {
  return a.param_device == b.param_device && a.optimizer_device == b.optimizer_device &&
         a.optimizer_ratio == b.optimizer_ratio &&
         (a.optimizer_device != OffloadDevice::kNvme || a.optimizer_cpu_fraction == b.optimizer_cpu_fraction);
}

// The grid of strata.optimizer_cpu_fraction the search tries: k x step, k < steps.
double grid_fraction(int k, double step) { return std::round(k * step * 1e9) / 1e9; }

// With the optimizer on nvme: the largest cpu fraction on the search's grid
// above `from` under which `p` fits; else the next one above `from` (which
// does not fit: its reasons say why); nullopt when none is above.
std::optional<Placement> raised_fraction(const Inputs& in, Placement p, double from, int steps, double step) {
  std::optional<Placement> next;
  for (int k = steps - 1; k >= 0; --k) {
    const double f = grid_fraction(k, step);
    if (f <= from) break;
    p.optimizer_cpu_fraction = f;
    if (evaluate(in, p).fits) return p;
    next = p;
  }
  return next;
}

// `fitting`: every placement of the search that fits (Plan's search below).
core::Result<WearPlan> plan_wear(const Inputs& in, const Plan& plan, const DriveEndurance& drive, int steps,
                                 const std::vector<PlacementPlan>& fitting) {
  const Config& config = in.config;
  auto positive = [](double v) { return std::isfinite(v) && v > 0.0; };
  if (drive.tbw != 0.0 && drive.dwpd != 0.0) {
    return invalid("give the drives' rated endurance either as TBW (--drive-tbw) or as DWPD (--drive-dwpd with "
                   "--drive-capacity), not both");
  }
  WearPlan w;
  w.drive = drive;
  if (drive.tbw != 0.0) {
    if (!positive(drive.tbw)) return invalid(str_cat("--drive-tbw must be a positive number of TB, got ", drive.tbw));
    w.rated_bytes_per_drive = drive.tbw * 1e12;
    w.rating = str_cat(number_text(drive.tbw), " TBW per drive");
  } else {
    if (!positive(drive.dwpd)) return invalid(str_cat("--drive-dwpd must be a positive number, got ", drive.dwpd));
    if (drive.capacity_bytes == 0) return invalid("--drive-dwpd needs the drive's capacity (--drive-capacity SIZE)");
    if (!positive(drive.warranty_years)) {
      return invalid(str_cat("--warranty-years must be a positive number, got ", drive.warranty_years));
    }
    w.rated_bytes_per_drive = drive.dwpd * static_cast<double>(drive.capacity_bytes) * 365.0 * drive.warranty_years;
    w.rating = str_cat(number_text(drive.dwpd), " DWPD x ", number_text(static_cast<double>(drive.capacity_bytes) / 1e12),
                       " TB x 365 days x ", number_text(drive.warranty_years), " years = ",
                       number_text(w.rated_bytes_per_drive / 1e12), " TBW per drive");
  }
  if (drive.step_seconds != 0.0 && !positive(drive.step_seconds)) {
    return invalid(str_cat("--step-seconds must be a positive number, got ", drive.step_seconds));
  }
  const double rated = w.rated_bytes_per_drive;
  w.configured = placement_wear(config, plan.machine, plan.configured, rated, drive.step_seconds);

  // The placement changes, each evaluated here (never guessed).
  const Placement& c = plan.configured.placement;
  const double step = in.options.cpu_fraction_step;
  std::vector<Placement> tries;
  if (c.optimizer_device == OffloadDevice::kNvme) {
    if (auto p = raised_fraction(in, c, c.optimizer_cpu_fraction, steps, step)) tries.push_back(*p);
    Placement cpu = c;
    cpu.optimizer_device = OffloadDevice::kCpu;
    cpu.optimizer_cpu_fraction = 0.0;
    tries.push_back(cpu);
  }
  if (c.param_device == OffloadDevice::kNvme) {
    Placement p = c;
    p.param_device = OffloadDevice::kCpu;
    if (c.optimizer_device == OffloadDevice::kNvme) {
      if (auto raised = raised_fraction(in, p, c.optimizer_cpu_fraction, steps, step); raised && evaluate(in, *raised).fits) {
        p = *raised;
      }
    }
    tries.push_back(p);
  }
  // The search's placement that writes least while fitting (ties: fewer bytes
  // moved, then search order).
  const PlacementPlan* least = nullptr;
  for (const PlacementPlan& e : fitting) {
    const StepTraffic& t = e.traffic;
    if (least == nullptr || t.disk_write_bytes < least->traffic.disk_write_bytes ||
        (t.disk_write_bytes == least->traffic.disk_write_bytes && t.total_bytes() < least->traffic.total_bytes())) {
      least = &e;
    }
  }
  if (least) tries.push_back(least->placement);
  for (const Placement& p : tries) {
    if (same_placement(p, c)) continue;
    bool seen = false;
    for (const PlacementWear& a : w.alternatives) seen = seen || same_placement(a.placement, p);
    if (seen) continue;
    const PlacementPlan e = evaluate(in, p);
    if (e.traffic.disk_write_bytes >= plan.configured.traffic.disk_write_bytes) continue;
    w.alternatives.push_back(placement_wear(config, plan.machine, e, rated, drive.step_seconds));
  }
  std::stable_sort(w.alternatives.begin(), w.alternatives.end(), [](const PlacementWear& a, const PlacementWear& b) {
    if (a.fits != b.fits) return a.fits;
    return a.write_bytes_per_step < b.write_bytes_per_step;
  });
  return w;
}

}  // namespace

double DriveEndurance::rated_bytes() const {
  return tbw != 0.0 ? tbw * 1e12 : dwpd * static_cast<double>(capacity_bytes) * 365.0 * warranty_years;
}

std::uint64_t PlacementPlan::item_bytes(Tier t, std::string_view name) const {
  std::uint64_t total = 0;
  for (const PlanItem& item : items) {
    if (item.tier == t && item.name == name) total += item.size_bytes;
  }
  return total;
}

core::Result<ActivationEstimate> estimate_activations(
    std::int64_t num_layers, std::int64_t hidden_size, std::int64_t num_heads,
    std::int64_t vocab_size, std::int64_t seq_len, std::int64_t micro_batch,
    bool activation_checkpointing, int compute_bytes) {
  if (num_layers <= 0 || hidden_size <= 0 || num_heads <= 0 || vocab_size <= 0 || seq_len <= 0 ||
      micro_batch <= 0 || (compute_bytes != 2 && compute_bytes != 4)) {
    return invalid(str_cat("activation estimate: layers ", num_layers, ", hidden ", hidden_size,
                           ", heads ", num_heads, ", vocab ", vocab_size, ", seq ", seq_len,
                           ", micro-batch ", micro_batch, " must all be positive"));
  }
  // Checked 64-bit arithmetic: any overflow makes the estimate an error.
  bool overflow = false;
  auto mul = [&overflow](std::uint64_t x, std::uint64_t y) {
    std::uint64_t r = 0;
    overflow = overflow || __builtin_mul_overflow(x, y, &r);
    return r;
  };
  auto add = [&overflow](std::uint64_t x, std::uint64_t y) {
    std::uint64_t r = 0;
    overflow = overflow || __builtin_add_overflow(x, y, &r);
    return r;
  };
  const std::uint64_t s = u64(seq_len), b = u64(micro_batch), h = u64(hidden_size);
  const std::uint64_t a = u64(num_heads), L = u64(num_layers), V = u64(vocab_size);
  const std::uint64_t scale = u64(compute_bytes);  // over 2: 16-bit is the paper's unit
  const std::uint64_t sb = mul(s, b);
  const std::uint64_t full = mul(mul(sb, add(mul(34, h), mul(mul(5, a), s))), scale) / 2;
  const std::uint64_t kept_ckpt = mul(mul(2, mul(sb, h)), scale) / 2;
  const std::uint64_t kept = activation_checkpointing ? kept_ckpt : full;
  const std::uint64_t layers =
      activation_checkpointing ? add(mul(L, kept_ckpt), full) : mul(L, full);
  const std::uint64_t logits = mul(mul(4, sb), V);
  const std::uint64_t total = add(layers, logits);
  if (overflow) {
    return invalid("activation estimate overflows 64 bits: check --seq, --hidden, --micro-batch");
  }
  ActivationEstimate e;
  e.full_layer_bytes = full;
  e.kept_layer_bytes = kept;
  e.layers_bytes = layers;
  e.logits_bytes = logits;
  e.total_bytes = total;
  return e;
}

core::Result<std::int64_t> transformer_num_params(std::int64_t num_layers, std::int64_t hidden_size,
                                                  std::int64_t vocab_size) {
  if (num_layers <= 0 || hidden_size <= 0 || vocab_size <= 0) {
    return invalid(str_cat("transformer shape: layers ", num_layers, ", hidden ", hidden_size,
                           ", vocab ", vocab_size, " must all be positive"));
  }
  // L (12 h^2 + 13 h) + V h + 2 h, checked.
  std::int64_t params = 0;
  std::int64_t hh = 0, block = 0, blocks = 0, embed = 0;
  const bool overflow = __builtin_mul_overflow(hidden_size, hidden_size, &hh) ||
                        __builtin_mul_overflow(hh, std::int64_t{12}, &block) ||
                        __builtin_add_overflow(block, 13 * hidden_size, &block) ||
                        __builtin_mul_overflow(num_layers, block, &blocks) ||
                        __builtin_mul_overflow(vocab_size, hidden_size, &embed) ||
                        __builtin_add_overflow(blocks, embed, &params) ||
                        __builtin_add_overflow(params, 2 * hidden_size, &params) ||
                        hidden_size > (std::int64_t{1} << 40);
  if (overflow) {
    return invalid(str_cat("transformer shape: layers ", num_layers, " x hidden ", hidden_size,
                           " x vocab ", vocab_size, " overflows 64 bits"));
  }
  return params;
}

bool parse_count(std::string_view text, std::int64_t* out) {
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start]))) ++start;
  s.erase(0, start);
  if (s.empty()) return false;
  const bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.')) return false;
  if (s.find_first_of("xXpP") != std::string::npos) return false;  // strtold's hex floats
  char* end = nullptr;
  const long double number = std::strtold(s.c_str(), &end);
  if (end == s.c_str() || !std::isfinite(number)) return false;
  std::string suffix(end);
  long double mult = 0;
  if (suffix.empty()) mult = 1;
  if (suffix == "k" || suffix == "K") mult = 1e3L;
  if (suffix == "m" || suffix == "M") mult = 1e6L;
  if (suffix == "b" || suffix == "B" || suffix == "g" || suffix == "G") mult = 1e9L;
  if (suffix == "t" || suffix == "T") mult = 1e12L;
  if (mult == 0) return false;
  const long double value = number * mult;
  const long double rounded = std::round(value);
  if (rounded >= 9.2e18L) return false;
  if (std::fabs(value - rounded) > 1e-9L * std::max(1.0L, rounded)) return false;
  const auto v = static_cast<std::int64_t>(rounded);
  *out = negative ? -v : v;
  return true;
}

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
  STRATA_ASSIGN_OR_RETURN(plan.model, resolve_model(config, model));
  plan.state.precision = precision_label(config);
  plan.state.optimizer = std::string(optimizer_name(config.optimizer.type));
  plan.state.compute_bytes = static_cast<std::uint64_t>(config.compute_bytes());
  plan.state.gradient_accumulation_steps = config.gradient_accumulation_steps;
  plan.state.gradient_bytes =
      config.gradient_accumulation_steps == 1 ? plan.state.compute_bytes : 4;
  plan.state.moment_bytes = optimizer_moment_bytes(config.optimizer.type);
  plan.machine = machine;
  STRATA_ASSIGN_OR_RETURN(TierCapacities capacities,
                          tier_capacities(config, machine, options.margins, &plan.notes));
  const Inputs in{config, plan.model, capacities, options};

  Placement configured;
  configured.param_device = config.zero.offload_param.device;
  configured.optimizer_device = config.zero.offload_optimizer.device;
  configured.optimizer_ratio = config.zero.offload_optimizer.ratio;
  configured.optimizer_cpu_fraction = config.strata.optimizer_cpu_fraction;
  plan.configured = evaluate(in, configured);

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
        PlacementPlan candidate = evaluate(in, p);
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
