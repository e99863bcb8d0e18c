// One placement's bytes: what each tier holds and each link moves per step for
// a placement of the parameters and the optimizer state (evaluate).
#include "engine/plan/plan.h"

#include <algorithm>
#include <string>

#include "core/aligned_buffer.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/memory_model.h"
#include "engine/plan/plan_internal.h"
#include "engine/schedule/schedule.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
using plan_detail::ceil_div;
using plan_detail::Inputs;
using plan_detail::round_up_to;
using plan_detail::sat_add;
using plan_detail::sat_mul;
using plan_detail::u64;

// The planner's derived ring takes 1 / kRingShareOfPinnedLeft of what
// a pinned budget leaves beyond the host gradients, the pinned compute copies
// and the pinned state. Half is the engine's rule from before finalize
// reserved the step's working memory itself; finalize now gives the ring all
// that the budget leaves beyond the state, the schedule's extra memory and
// that working memory (PinnedWorking), so under a pinned budget the two can
// count different slots. Kept so the plan's bytes do not change here.
constexpr std::uint64_t kRingShareOfPinnedLeft = 2;

std::string count_times(std::int64_t n, std::uint64_t bytes, std::string_view what = {}) {
  std::string s = str_cat(group_digits(u64(n)), " x ", bytes, " B");
  if (!what.empty()) s += str_cat(" (", what, ")");
  return s;
}

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

}  // namespace

namespace plan_detail {

std::string precision_label(const Config& config) {
  switch (config.precision) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp32: return "fp32";
  }
  return "?";
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
    // The disk pipeline's ring, by the engine's rule (memory_model.h's
    // ring_slots): a slot holds the largest chunk's master and moments;
    // strata.budgets.staging sets the slots, else the schedule's depth,
    // fewer when a pinned budget leaves less room; never more than the
    // chunks. The room differs from finalize's (kRingShareOfPinnedLeft).
    const std::uint64_t states = 1 + moments / 4;
    const RingShape nvme_ring{.slot_bytes = ring_slot_bytes(std::max<std::int64_t>(shape.chunk, 1), state),
                              .nvme_chunks = static_cast<std::size_t>(shape.nvme_chunks)};
    const BudgetsConfig& b = cfg.strata.budgets;
    std::uint64_t ring_room = kNoRoomLimit;
    if (b.staging_bytes == 0 && b.pinned_bytes > 0) {
      std::uint64_t held = sat_mul(u64(T), g);
      if (pl.param_device == OffloadDevice::kCpu) held = sat_add(held, sat_mul(u64(P), c));
      held = sat_add(held, sat_mul(u64(t_keep), state));
      const std::uint64_t left = b.pinned_bytes > held ? b.pinned_bytes - held : 0;
      ring_room = left / kRingShareOfPinnedLeft;
    }
    const RingSlots ring = ring_slots({.shape = nvme_ring,
                                       .staging_bytes = b.staging_bytes,
                                       .pinned_room_bytes = ring_room,
                                       .depth = u64(schedule.ring_depth())});
    const std::uint64_t slot = ring.slot_bytes;
    // A staging budget below one slot: the one slot the engine needs
    // (make_plan's note says the budget is short).
    const std::uint64_t slots = ring.staging_below_slot ? 1 : ring.slots;
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
        swap == 0 ? 0 : budget > 0 ? budget : swap_files_bytes(swap);
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

}  // namespace plan_detail

std::uint64_t PlacementPlan::item_bytes(Tier t, std::string_view name) const {
  std::uint64_t total = 0;
  for (const PlanItem& item : items) {
    if (item.tier == t && item.name == name) total += item.size_bytes;
  }
  return total;
}

}  // namespace strata::engine
