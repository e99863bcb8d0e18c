// One placement's bytes: what each tier holds and each link moves per step for
// a placement of the parameters and the optimizer state (evaluate), one part
// per family of items; the formulas it shares with the engine's finalize are
// engine/memory_model.h's.
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
using plan_detail::TierCapacities;
using plan_detail::round_up_to;
using plan_detail::sat_add;
using plan_detail::sat_mul;
using plan_detail::u64;

std::string count_times(std::int64_t n, std::uint64_t bytes, std::string_view what = {}) {
  std::string s = str_cat(group_digits(u64(n)), " x ", bytes, " B");
  if (!what.empty()) s += str_cat(" (", what, ")");
  return s;
}

// "N x B B", for the optimizer's arrays of n elements (with the master when
// `master`) in the spec's format; blockwise formats add their scales.
std::string state_times(const OptimizerSpec& spec, std::int64_t n, bool master, std::string_view what = {}) {
  const std::uint64_t per = spec.moment_bytes(std::int64_t{1} << 20) >> 20;  // whole bytes an element, scales apart
  std::string s = str_cat(group_digits(u64(n)), " x ", per + (master ? 4 : 0), " B");
  if (spec.blockwise()) {
    s += str_cat(" + ", group_digits(OptimizerSpec::blocks(n)), " blocks x ", 4 * (spec.arrays - 1), " B of scales");
  }
  if (!what.empty()) s += str_cat(" (", what, ")");
  return s;
}

// What the planner knows of the layout the engine builds (layout.cpp) for
// `groups` equal fetch groups: each group's trainable elements rounded up to
// whole norm blocks (N of them per rank with `ranks` N, the rank keeping
// one shard of each), cut into optimizer chunks that never cross a group,
// and the state split by the placement rule over the rank's trainable space.
struct LayoutShape {
  std::int64_t group_padded = 0;     // trainable elements of a group, padded (N norm blocks with N ranks)
  std::int64_t group_trainable = 0;  // the rank's shard of a group (norm-block aligned; the group with one rank)
  std::int64_t chunk = 0;            // elements of the largest chunk
  std::int64_t nvme_chunks = 0;      // chunks whose state lives on NVMe, counted up to `count_limit`
  std::int64_t nvme_groups = 0;      // groups with at least one chunk on NVMe (every one counted)
};

LayoutShape layout_shape(std::int64_t trainable, std::int64_t groups, std::uint64_t chunk_bytes,
                         const Placement& pl, std::int64_t count_limit, int ranks) {
  constexpr std::int64_t kBlock = core::numerics::kNormBlockElems;
  LayoutShape s;
  if (trainable == 0 || groups == 0) return s;
  s.group_padded = round_up_to(ceil_div(trainable, groups), kBlock * ranks);
  s.group_trainable = s.group_padded / ranks;
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
  // Every group from the first nvme chunk's to the one holding the last
  // chunk start below `hi` begins with a chunk on nvme.
  if (at < hi) s.nvme_groups = (hi - 1) / s.group_trainable - at / s.group_trainable + 1;
  while (at < hi && s.nvme_chunks < count_limit) {
    ++s.nvme_chunks;
    const std::int64_t group_end = (at / s.group_trainable + 1) * s.group_trainable;
    at = std::min(at + chunk_elems, group_end);
  }
  return s;
}

// What evaluate's parts share: the inputs, the counts they derive from them,
// the choices one part makes and a later one reads (the window, the gradient
// buffers), and the plan they fill in.
struct Evaluation {
  Evaluation(const Inputs& inputs, const Placement& placement);

  // Adds an item, unless it holds nothing.
  void add(std::string name, Tier tier, std::uint64_t bytes, std::string detail) {
    if (bytes == 0) return;
    plan.items.push_back(PlanItem{std::move(name), tier, bytes, std::move(detail)});
  }
  // "3 fetch groups of 1,000,000"
  std::string groups_of(std::int64_t n) const {
    return str_cat(n, n == 1 ? " fetch group of " : " fetch groups of ", group_digits(u64(group)));
  }
  std::string window_detail(std::int64_t n) const {
    return str_cat(groups_of(n), " x ", c, " B (",
                   !threaded           ? "the fetched one: strata.overlap \"none\" keeps none"
                   : persistent_groups ? "all: each under stage3_param_persistence_threshold"
                   : sharded           ? "fetched, prefetched (gathered) and kept, within stage3_max_live_parameters"
                                       : "fetched, prefetched and kept, within stage3_max_live_parameters",
                   n < window_groups ? " and the device budget" : "", ")");
  }
  std::string grads_detail(std::int64_t n) const {
    const std::string what = trainable_part_bytes != group_bytes
                                 ? str_cat(n, " x ", group_digits(trainable_part_bytes),
                                           " B (a group's trainable part: its frozen parameters have no slots; ")
                                 : str_cat(groups_of(n), " x ", c, " B (");
    return str_cat(what, threaded ? "on their way down, within reduce_bucket_size" : "one at a time",
                   n < grad_buffers ? " and the device budget" : "", ")");
  }

  const Inputs& in;
  const Config& cfg;
  const Schedule& schedule;
  const ModelSummary& m;
  const Placement& pl;
  PlacementPlan plan;

  std::int64_t P = 0;            // parameters
  std::int64_t T = 0;            // trainable parameters
  int N = 1;                     // data-parallel ranks
  std::int64_t T_rank = 0;       // the rank's trainable elements (its shards, padded; T with one rank)
  // Stage 3 with several ranks (Layout::compute_sharded): each rank's
  // compute homes hold its shard, each fetch gathers the group whole (no
  // prefetched or kept copies), the optimizer gathers nothing.
  bool sharded = false;
  // Several ranks running their collectives on the device
  // (strata.device_collectives): each rank's fp32 shard of the gradients'
  // sum comes down, and at stage 3 a fetch gathers on the device.
  bool device_collectives = false;
  // Bytes of an element of the gradients' sums: 4, or with the collectives
  // on the device and communication_data_type bf16, 2.
  std::uint64_t sb = 4;
  std::int64_t home = 0;         // a trainable group's home on this rank (elements): the group, or its shard
  std::int64_t L = 0;            // layers (fetch groups)
  std::uint64_t c = 0;           // bytes of a compute copy's element
  std::uint64_t accum = 0;       // gradient_accumulation_steps
  std::uint64_t g = 0;           // bytes of a host gradient's element (fp32 when accumulating)
  OptimizerSpec spec;            // the optimizer's state per trainable element, in its format
  // Bytes of the optimizer's arrays (and with the master) of n trainable
  // elements, saturating.
  std::uint64_t moments_of(std::int64_t n) const { return n >= (std::int64_t{1} << 58) ? UINT64_MAX : spec.moment_bytes(n); }
  std::uint64_t state_of(std::int64_t n) const { return n >= (std::int64_t{1} << 58) ? UINT64_MAX : spec.state_bytes(n); }
  std::string prec;              // "bf16", "fp16", "fp32"
  bool threaded = false;         // Schedule::threaded
  // Whether the step runs early jobs (Step::early_jobs).
  bool early_jobs() const { return schedule.early_jobs(StepRules::of(cfg)); }
  // The trainable parameters' optimizer state, by the layout's rule (tier.h).
  std::int64_t t_gpu = 0;
  std::int64_t t_keep = 0;  // CPU-updated and resident in pinned memory
  std::int64_t t_nvme = 0;
  bool params_offloaded = false;
  // A fetch copies the group (its home is not on the device, or holds a
  // shard only): the fetch window, and the fetches' traffic.
  bool fetches_copy = false;
  Tier param_tier = Tier::kDevice;
  // A fetch group (the largest), and the groups with something to train.
  std::int64_t group = 0;
  std::uint64_t group_bytes = 0;
  std::int64_t trainable_groups = 0;
  // What a step's gradients and new compute copies of one trainable group
  // are: the group's compute copies, or with mixed groups (LoRA) its
  // trainable part (the engine's copy down and optimizer view).
  std::uint64_t trainable_part_bytes = 0;
  // The frozen parameters' compute copies are read from the safetensors
  // files they were imported from (strata.frozen_base not "swap", their
  // home on nvme, not sharded): in no tier.
  bool frozen_in_files = false;
  bool persistent_groups = false;  // every group under stage3_param_persistence_threshold
  // Compute copies on nvme: the groups whose homes offload_param.max_in_cpu
  // keeps in pinned memory (whole homes, as plan_layout keeps them).
  std::int64_t cpu_groups = 0;
  // Every compute home in pinned memory (offload_param.device cpu, or nvme
  // with max_in_cpu keeping them all).
  bool homes_pinned() const {
    return pl.param_device == OffloadDevice::kCpu || (pl.param_device == OffloadDevice::kNvme && cpu_groups >= L);
  }
  // The other groups' share of a figure every group takes alike (their
  // homes on nvme).
  std::uint64_t nvme_share(std::uint64_t x) const {
    return cpu_groups == 0 ? x : cpu_groups >= L ? 0 : x - x / u64(L) * u64(cpu_groups);
  }
  LayoutShape shape;
  // Chosen by add_compute_copies and add_gradients, fitted to the device by
  // fit_device_budget.
  std::int64_t window_groups = 0, resident_groups = 0, grad_buffers = 0;
  // Stage 3 over ranks: a group gathered on the host (ComputeHomes::gather):
  // every rank's home with its status, and with the group unpacked whole.
  std::uint64_t gather_payload() const { return gather_payload_bytes(u64(N), sat_mul(u64(home), c)); }
  std::uint64_t host_gather_bytes() const { return sat_add(gather_payload(), group_bytes); }
};

Evaluation::Evaluation(const Inputs& inputs, const Placement& placement)
    : in(inputs), cfg(inputs.config), schedule(schedule_for(inputs.config.strata.overlap)), m(inputs.model),
      pl(placement) {
  plan.placement = pl;
  P = m.num_params;
  T = m.num_trainable_params;
  L = m.num_layers;
  c = static_cast<std::uint64_t>(cfg.compute_bytes());
  accum = u64(cfg.gradient_accumulation_steps);
  g = accum == 1 ? c : 4;
  spec = optimizer_spec(cfg.optimizer.type, cfg.strata.optimizer_state.format);
  prec = plan_detail::precision_label(cfg);
  threaded = schedule.threaded();
  N = inputs.options.ranks;
  plan.ranks_per_node = N / inputs.options.nodes;
  shape = layout_shape(T, L, cfg.strata.chunk_bytes, pl, schedule.ring_depth(), N);
  // One rank: the trainable parameters as counted (the planner's figures
  // have always left the padding out); several: the rank's shards, padding
  // included, which is what each keeps state for.
  T_rank = N == 1 ? T : shape.group_trainable * L;
  if (N > 1) g = 4;  // host gradients summed over the ranks: fp32
  sharded = N > 1 && cfg.zero.stage == 3;
  // "auto" as Engine::create decides it on the machine planned for, which
  // has a library for them (the host device's Gloo, or NCCL with CUDA),
  // whatever the build that plans (ranks that share a GPU aside).
  device_collectives = N > 1 && cfg.strata.device_collectives != DeviceCollectives::kOff;
  sb = device_collectives && cfg.communication_data_type != Precision::kFp32 ? 2 : 4;
  const OptimizerSplit split = split_optimizer_state(T_rank, pl.optimizer_device, pl.optimizer_ratio,
                                                     pl.optimizer_cpu_fraction);
  t_gpu = split.device_elems;
  t_keep = split.pinned_elems;
  t_nvme = split.nvme_elems;
  params_offloaded = pl.param_device != OffloadDevice::kNone;
  fetches_copy = params_offloaded || sharded;
  param_tier = tier_of(pl.param_device);
  group = m.group_params;
  group_bytes = sat_mul(u64(group), c);
  home = sharded ? (T > 0 ? shape.group_trainable : ceil_div(group, N)) : group;
  trainable_groups = T > 0 ? std::clamp<std::int64_t>(ceil_div(T, group), 1, L) : 0;
  trainable_part_bytes = group_bytes;
  if (m.mixed_groups && T > 0) {
    trainable_groups = L;
    trainable_part_bytes = sat_mul(u64(ceil_div(T, L)), c);
  }
  frozen_in_files = pl.param_device == OffloadDevice::kNvme && P > T && !sharded &&
                    cfg.strata.frozen_base != FrozenBase::kSwap;
  persistent_groups = !m.has_shape && group <= cfg.zero.stage3_param_persistence_threshold;
  if (pl.param_device == OffloadDevice::kNvme && home > 0) {
    cpu_groups = std::min<std::int64_t>(L, cfg.zero.offload_param.max_in_cpu / home);
  }
}

// The compute copies in their home, and their copies on the device and in
// pinned staging when the home is elsewhere.
void add_compute_copies(Evaluation& e) {
  const std::int64_t P = e.P, L = e.L, group = e.group;
  const std::uint64_t c = e.c;
  // The homes offload_param.max_in_cpu keeps in pinned memory: whole ones
  // (the rank's shards at stage 3 over ranks), frozen parameters included.
  const std::int64_t own = e.sharded ? e.T_rank + ceil_div(P - e.T, e.N) : P;
  const std::int64_t kept = std::min(own, e.cpu_groups * e.home);
  if (kept > 0) {
    e.add("compute_copies_in_cpu", Tier::kPinned, sat_mul(u64(kept), c),
          str_cat(e.cpu_groups == 1 ? "1 home of " : str_cat(e.cpu_groups, " homes of "), group_digits(u64(e.home)),
                  " x ", c, " B (", e.prec, "; zero_optimization.offload_param.max_in_cpu = ",
                  group_digits(u64(e.cfg.zero.offload_param.max_in_cpu)), " keeps them in CPU memory)"));
  }
  const std::string others = kept > 0 ? str_cat(", the other ", L - e.cpu_groups, " groups") : "";
  if (e.sharded) {
    // The rank's shards: of the trainable groups, as the optimizer's; of the frozen parameters, 1/N.
    e.add("compute_copies", e.param_tier, sat_mul(u64(own - kept), c),
          count_times(own - kept, c, str_cat(e.prec, ", the rank's shards: stage 3 over ", e.N, " ranks", others)));
  } else if (e.frozen_in_files) {
    // The frozen base's home is its files: only the trainable parameters' copies live in the tier.
    const std::int64_t trainable = static_cast<std::int64_t>(e.nvme_share(u64(e.T)));
    e.add("compute_copies", e.param_tier, sat_mul(u64(trainable), c),
          count_times(trainable, c,
                      str_cat(e.prec, others, "; the frozen ", group_digits(e.nvme_share(u64(P - e.T))),
                              " are read from their safetensors files (strata.frozen_base)")));
  } else {
    e.add("compute_copies", e.param_tier, sat_mul(u64(P - kept), c), count_times(P - kept, c, str_cat(e.prec, others)));
  }
  // Device copies of offloaded compute copies (the threaded schedules: the
  // fetched, prefetched and resident ones, which share
  // stage3_max_live_parameters; groups of at most
  // stage3_param_persistence_threshold elements all stay), and how many of
  // the backward's fetches a copy kept since the forward serves. Both the
  // window and the gradient buffers below give way to a device budget
  // (fitted at the end).
  const std::int64_t live_groups = std::min<std::int64_t>(L, e.cfg.zero.stage3_max_live_parameters / group);
  if (e.fetches_copy) {
    // (With stage 3 over ranks a copy kept since its release is taken back
    // when every rank kept its own, as every rank does under one plan.)
    e.window_groups = !e.threaded ? 1 : e.persistent_groups ? L : std::max<std::int64_t>(1, live_groups);
    e.resident_groups = !e.threaded ? 0 : e.persistent_groups ? L : live_groups;
    e.add("persistent_params", Tier::kDevice, sat_mul(u64(e.m.persistent_params), c),
          count_times(e.m.persistent_params, c,
                      str_cat("tensors under stage3_param_persistence_threshold = ",
                              group_digits(u64(e.cfg.zero.stage3_param_persistence_threshold)))));
    e.add("fetch_window", Tier::kDevice, sat_mul(e.group_bytes, u64(e.window_groups)),
          e.window_detail(e.window_groups));
  }
  if (e.pl.param_device == OffloadDevice::kNvme && e.cpu_groups < L) {
    // A group read from nvme passes through a pinned staging copy on its way
    // to the device (ComputeHomes::load), one group at a time (the prefetch
    // thread's, or a fetch's). DeepSpeed's offload_param.buffer_count and
    // buffer_size have no effect on it.
    const std::uint64_t staged = sat_mul(u64(e.home), c);
    e.add("param_staging", Tier::kPinned, staged,
          e.sharded ? count_times(e.home, c, "staging copy of the rank's shard of a group read from nvme")
                    : str_cat(e.groups_of(1), " x ", c, " B (staging copy of a group read from nvme)"));
  }
  if (e.sharded && e.device_collectives) {
    // A fetch gathers every rank's home on the device and unpacks it into
    // the fetched buffer (ComputeHomes::gather).
    e.add("device_fetch_gather", Tier::kDevice, sat_mul(u64(e.N), sat_mul(u64(e.home), c)),
          str_cat(e.N, " x ", group_digits(u64(e.home)), " x ", c, " B (every rank's shard of a fetched group)"));
  }
  if (e.sharded && !e.device_collectives) {
    // A fetch gathers every rank's home and unpacks them whole on the host
    // (ComputeHomes::gather).
    e.add("rank_fetch_gather", Tier::kPinned, e.host_gather_bytes(),
          str_cat(e.N, " x (", group_digits(u64(e.home)), " x ", c, " + ", kGatherTrailerBytes,
                  ") B (every rank's shard of a fetched group and its status) + ", e.groups_of(1), " x ", c,
                  " B (the group unpacked whole)"));
  }
}

// Stage 3 with the fetches gathered on the device: read_compute and export
// still gather a group on the host, outside the step's work. The engine
// reserves the larger of that and the step's working memory
// (memory_model.h's PinnedWorking::between_steps: the staging cache gives
// its buffers back to a tight pinned budget); without one the step's
// staging stays cached beside it, which is what a run holds at its peak.
// (The staging cache reuses buffers by exact size: the group unpacked takes
// a gradient staging buffer when the rank's fp32 shard is its size.)
void add_read_gather(Evaluation& e) {
  if (!e.sharded || !e.device_collectives) return;
  const std::uint64_t parts = e.gather_payload();
  const bool reused = e.T > 0 && sat_mul(u64(e.shape.group_trainable), e.sb) == core::align_up(e.group_bytes, core::kDirectIoAlignment);
  e.add("rank_read_gather", Tier::kPinned, reused ? parts : sat_add(parts, e.group_bytes),
        str_cat(e.N, " x (", group_digits(u64(e.home)), " x ", e.c, " + ", kGatherTrailerBytes, ") B",
                reused ? "" : str_cat(" + ", e.groups_of(1), " x ", e.c, " B"),
                " (a group gathered on the host for read_compute or export, outside the step's work",
                reused ? "; unpacked into a gradient staging buffer)" : ")"));
}

// The gradients: on the host, in the device's buffers, in pinned staging, and
// the optimizer's host view of the compute copies it writes.
void add_gradients(Evaluation& e) {
  const std::int64_t T = e.T;
  const std::uint64_t c = e.c, g = e.g;
  if (T == 0) return;
  // Every trainable group's gradients come down to the host, whatever the
  // optimizer's tier: the gradient pass runs on the CPU.
  if (e.N == 1) {
    e.add("host_gradients", Tier::kPinned, sat_mul(u64(T), g),
          count_times(T, g, e.accum == 1 ? e.prec : "fp32 accumulation"));
  } else {
    e.add("host_gradients", Tier::kPinned, sat_mul(u64(e.T_rank), g),
          count_times(e.T_rank, g, str_cat("the rank's shards, fp32: summed over ", e.N, " ranks")));
    // Summed on the device, a group's fp32 gradients are packed into a
    // device buffer kept for it and summed there in place. On the host the
    // pass writes them to pinned memory and takes the rank's shard of the
    // sum. The optimizer gathers a group's new compute copies from every
    // rank. The staging cache reuses buffers by exact size: on the host a
    // sum or a gather the size of a group's compute copies takes a gradient
    // staging buffer (returned by then), not memory of its own.
    const std::uint64_t padded = u64(e.shape.group_padded), shard = u64(e.shape.group_trainable);
    if (e.device_collectives) {
      e.add("device_gradient_sums", Tier::kDevice, sat_mul(padded, e.sb),
            str_cat(group_digits(padded), " x ", e.sb, " B (a group's ", e.sb == 4 ? "fp32" : "bf16",
                    " gradients, summed over the ranks in place)"));
    } else {
      const std::uint64_t sum = sat_mul(shard, 4) == e.group_bytes ? 0 : sat_mul(shard, 4);
      e.add("rank_gradient_sums", Tier::kPinned, sat_add(sat_mul(padded, 4), sum),
            str_cat(group_digits(padded), " x 4 B (a group's fp32 gradients to sum over the ranks)",
                    sum > 0 ? str_cat(" + ", group_digits(shard), " x 4 B (the rank's shard of the sum)")
                            : std::string(" (the shard of the sum reuses a staging buffer)")));
    }
    if (!e.sharded && (e.device_collectives || sat_mul(padded, c) != e.group_bytes)) {
      e.add("rank_compute_gather", Tier::kPinned, sat_mul(padded, c),
            count_times(e.shape.group_padded, c, "a group's new compute copies gathered from the ranks"));
    }
  }
  // The framework writes each group's gradients into a device buffer (a
  // mixed group's trainable part: Step::grad_buffer); the threaded
  // schedules hold those on their way down within reduce_bucket_size
  // elements (two groups at least).
  const std::int64_t grad_elems = static_cast<std::int64_t>(e.trainable_part_bytes / c);
  e.grad_buffers = !e.threaded ? 1
                               : std::min(e.trainable_groups,
                                          std::max<std::int64_t>(2, e.cfg.zero.reduce_bucket_size / grad_elems));
  e.add("device_gradient_buffers", Tier::kDevice, sat_mul(e.trainable_part_bytes, u64(e.grad_buffers)),
        e.grads_detail(e.grad_buffers));
  // The optimizer's host copy of the group it updates, unless the home is
  // pinned; when a certain step's early job updates groups whose home is
  // the GPU during the backward, it holds every trainable group's until
  // step_end (the framework may still read the home: Optimizer::run).
  const StepRules rules = StepRules::of(e.cfg);
  const bool views_held =
      e.pl.param_device == OffloadDevice::kNone && e.early_jobs() && rules.certain();
  // A group's gradients in its pass, as copied down and packed into the
  // trainable layout, and the next group's as they come down; while the
  // views pile up, two groups are still to pass when a third staging is
  // in use, so the peak counts the last group's only.
  // With several ranks the next group's gradients come down once the pass
  // has summed this one's over the ranks (the pass thread copies them).
  const bool part = e.trainable_part_bytes != e.group_bytes;  // mixed groups: their trainable part
  if (e.device_collectives) {
    // The rank's fp32 shard of a group's sum, in its pass, and threaded the
    // next one's landing.
    const std::int64_t shards = views_held || !e.threaded ? 1 : 2;
    e.add("gradient_staging", Tier::kPinned, sat_mul(u64(e.shape.group_trainable), e.sb * u64(shards)),
          str_cat(shards, " x ", group_digits(e.shape.group_trainable), " x ", e.sb,
                  " B (the rank's shard of a group's gradients summed on the device, in its pass",
                  shards > 1 ? ", and the next one's coming down)" : ")"));
  }
  const std::int64_t staged = e.device_collectives ? 0 : views_held ? 1 : e.N > 1 ? 2 : 3;
  if (staged > 0) e.add("gradient_staging", Tier::kPinned, sat_mul(e.trainable_part_bytes, u64(staged)),
        str_cat(part ? str_cat(staged, " x ", group_digits(e.trainable_part_bytes), " B (a group's trainable part; ")
                     : str_cat(e.groups_of(staged), " x ", c, " B ("),
                views_held ? "the last group's in its pass, when every view is held"
                : e.N > 1  ? "gradients in their pass, copied down and packed"
                           : "gradients in their pass, copied down and packed, and the next group's coming down",
                ")"));
  if (views_held) {
    e.add("optimizer_compute_view", Tier::kPinned, sat_mul(u64(T), c),
          count_times(T, c, "every trainable group's new compute copies, held until step_end"));
  } else if (!e.homes_pinned() && e.sharded) {
    e.add("optimizer_compute_view", Tier::kPinned, sat_mul(u64(e.home), c),
          count_times(e.home, c, "the optimizer's host copy of the rank's shard of the group it updates"));
  } else if (!e.homes_pinned() && part && e.cfg.strata.overlap != OverlapMode::kDelayed) {
    // A mixed group's trainable range alone (ComputeHomes::blank_trainable).
    e.add("optimizer_compute_view", Tier::kPinned, e.trainable_part_bytes,
          str_cat(group_digits(e.trainable_part_bytes),
                  " B (the optimizer's host copy of the trainable part of the group it updates)"));
  } else if (!e.homes_pinned()) {
    e.add("optimizer_compute_view", Tier::kPinned, e.group_bytes,
          str_cat(e.groups_of(1), " x ", c, " B (the optimizer's host copy of the group it updates)"));
  }
}

// The optimizer state kept on the device (with the buffers of a chunk's
// update there) and in pinned memory.
void add_resident_state(Evaluation& e) {
  const std::int64_t t_gpu = e.t_gpu, t_keep = e.t_keep, chunk = e.shape.chunk;
  const std::uint64_t c = e.c, g = e.g;
  if (t_gpu > 0) {
    e.add("master_weights", Tier::kDevice, sat_mul(u64(t_gpu), 4), count_times(t_gpu, 4, "fp32"));
    e.add("optimizer_moments", Tier::kDevice, e.moments_of(t_gpu),
          state_times(e.spec, t_gpu, false, optimizer_label(e.cfg.optimizer.type)));
    // A chunk updated on the device: its gradients go up, its new compute
    // copies come down through a pinned buffer.
    e.add("optimizer_device_buffers", Tier::kDevice, sat_mul(u64(chunk), g + c),
          count_times(chunk, g + c, "one chunk's gradients and new compute copies"));
    e.add("optimizer_device_copies", Tier::kPinned, sat_mul(u64(chunk), c),
          count_times(chunk, c, "one chunk's new compute copies on their way down"));
  }
  if (t_keep > 0) {
    e.add("master_weights", Tier::kPinned, sat_mul(u64(t_keep), 4), count_times(t_keep, 4, "fp32"));
    e.add("optimizer_moments", Tier::kPinned, e.moments_of(t_keep),
          state_times(e.spec, t_keep, false, optimizer_label(e.cfg.optimizer.type)));
  }
}

// What the schedule's extra copies measure (schedule.h's ExtraShape) in the
// planner's estimate of the layout: the nvme state, and compute copies in
// whole fetch groups, as the engine holds them.
ExtraShape planned_extra_shape(const Evaluation& e) {
  return {.nvme_state_bytes = e.state_of(e.t_nvme),
          .nvme_group_compute_bytes = sat_mul(e.group_bytes, u64(e.shape.nvme_groups)),
          .trainable_group_compute_bytes = sat_mul(e.group_bytes, u64(e.trainable_groups))};
}

// The step's pinned working memory as Engine::finalize reserves it
// (memory_model.h's pinned_working), for the planner's estimate of the
// layout's largest buffers: a fetch group's compute copies, its trainable
// elements, the largest chunk.
PinnedWorking planned_pinned_working(const Evaluation& e) {
  const std::uint64_t staged = core::align_up(sat_mul(u64(e.home), e.c), core::kDirectIoAlignment);  // ComputeHomes::load
  const std::uint64_t chunk = u64(e.shape.chunk);
  WorkingShape w;
  if (e.T > 0 && e.device_collectives) {
    w.wire_bytes = sat_mul(u64(e.shape.group_trainable), e.sb);  // the rank's shard of the sum
  } else if (e.T > 0) {
    w.wire_bytes = e.trainable_part_bytes;  // the copy down: a group's trainable range
    w.packed_bytes = sat_mul(u64(e.shape.group_trainable), e.c);
  }
  // (Compute homes on nvme, unless max_in_cpu keeps every one in pinned memory.)
  const bool nvme_homes = e.pl.param_device == OffloadDevice::kNvme && e.cpu_groups < e.L;
  if (nvme_homes) w.nvme_compute_bytes = staged;
  if (e.pl.param_device == OffloadDevice::kNone || nvme_homes) w.unpinned_compute_bytes = staged;
  if (e.t_gpu > 0 || e.t_nvme > 0) w.unpinned_state_bytes = e.state_of(e.shape.chunk);
  if (e.t_gpu > 0) w.device_chunk_compute_bytes = sat_mul(chunk, e.c);
  if (e.N > 1 && e.T > 0) {
    if (!e.device_collectives) w.ranks_gradient_bytes = sat_mul(u64(e.shape.group_padded + e.shape.group_trainable), 4);
    if (!e.sharded) w.ranks_compute_bytes = sat_mul(u64(e.shape.group_padded), e.c);
  }
  if (e.sharded) {
    (e.device_collectives ? w.read_gather_bytes : w.ranks_compute_bytes) =
        sat_add(e.gather_payload(), core::align_up(e.group_bytes, core::kDirectIoAlignment));
  }
  return pinned_working(w, e.threaded, e.early_jobs());
}

// What finalize counts as held in pinned memory before the step's working
// memory and the ring (Layout::bytes' pinned bytes with the schedule's extra
// pinned memory): the host gradients, the pinned compute copies, the pinned
// state and the schedule's pinned extra copies.
std::uint64_t planned_pinned_held(const Evaluation& e) {
  std::uint64_t held = sat_mul(u64(e.T_rank), e.g);
  if (e.pl.param_device == OffloadDevice::kCpu) held = sat_add(held, e.plan.item_bytes(Tier::kPinned, "compute_copies"));
  held = sat_add(held, e.plan.item_bytes(Tier::kPinned, "compute_copies_in_cpu"));
  held = sat_add(held, e.state_of(e.t_keep));
  const ExtraShape extra = planned_extra_shape(e);
  for (const ScheduleExtra& x : e.schedule.extra_memory()) {
    if (x.tier == Tier::kPinned) held = sat_add(held, extra_bytes(x.basis, extra));
  }
  return held;
}

// The disk pipeline's ring as the planner estimates its shape: a slot holds
// the largest chunk's master and moments; the nvme chunks counted up to the
// schedule's depth (layout_shape). The pinned room is left unlimited.
RingInputs planned_ring(const Evaluation& e) {
  return {.shape = {.slot_bytes = ring_slot_bytes(e.spec, std::max<std::int64_t>(e.shape.chunk, 1)),
                    .nvme_chunks = static_cast<std::size_t>(e.shape.nvme_chunks)},
          .staging_bytes = e.cfg.strata.budgets.staging_bytes,
          .depth = u64(e.schedule.ring_depth())};
}

// The pinned bytes a derived ring may take (the RingInputs::pinned_room_bytes
// it passes), by finalize's rule (memory_model.h's ring_room_bytes): what the
// pinned budget leaves beyond what is held (planned_pinned_held) and the
// step's working memory; kNoRoomLimit without a pinned budget (or with a
// staging budget, which sets the slots itself).
std::uint64_t planned_ring_room(const Evaluation& e) {
  const BudgetsConfig& b = e.cfg.strata.budgets;
  if (b.staging_bytes > 0 || b.pinned_bytes == 0) return kNoRoomLimit;
  return ring_room_bytes(b.pinned_bytes, planned_pinned_held(e), planned_pinned_working(e));
}

// The optimizer state on nvme, and the disk pipeline's staging ring.
void add_nvme_state(Evaluation& e) {
  const std::int64_t t_nvme = e.t_nvme;
  if (t_nvme == 0) return;
  e.add("master_weights", Tier::kNvme, sat_mul(u64(t_nvme), 4), count_times(t_nvme, 4, "fp32"));
  e.add("optimizer_moments", Tier::kNvme, e.moments_of(t_nvme),
        state_times(e.spec, t_nvme, false, optimizer_label(e.cfg.optimizer.type)));
  // The disk pipeline's ring, by the engine's rule (memory_model.h's
  // ring_slots): a slot holds the largest chunk's master and moments;
  // strata.budgets.staging sets the slots, else the schedule's depth,
  // fewer when a pinned budget leaves less room (planned_ring_room, as
  // finalize's); never more than the chunks.
  RingInputs inputs = planned_ring(e);
  inputs.pinned_room_bytes = planned_ring_room(e);
  const RingSlots ring = ring_slots(inputs);
  const std::uint64_t slot = ring.slot_bytes;
  // A staging budget below one slot: the one slot the engine needs
  // (make_plan's note says the budget is short).
  const std::uint64_t slots = ring.staging_below_slot ? 1 : ring.slots;
  e.add("optimizer_staging", Tier::kPinned, sat_mul(slot, slots),
        str_cat(slots, " slots of ", core::format_bytes(slot), " (the largest nvme chunk's fp32 master and ",
                state_format_name(e.spec.format), " ", optimizer_label(e.cfg.optimizer.type), ")"));
}

// What the overlap schedule holds beyond the placement's state, as the
// engine's finalize counts it (engine/schedule/'s extra_bytes over
// planned_extra_shape: compute copies in whole fetch groups).
void add_schedule_extra(Evaluation& e) {
  const ExtraShape extra = planned_extra_shape(e);
  for (const ScheduleExtra& x : e.schedule.extra_memory()) {
    const std::string why(x.why);
    std::string detail;
    switch (x.basis) {
      case ExtraBasis::kNvmeState: detail = state_times(e.spec, e.t_nvme, true, why); break;
      case ExtraBasis::kNvmeGroupCompute:
        detail = str_cat(e.groups_of(e.shape.nvme_groups), " x ", e.c, " B (", why, ")");
        break;
      case ExtraBasis::kTrainableGroupCompute:
        detail = str_cat(e.groups_of(e.trainable_groups), " x ", e.c, " B (", why, ")");
        break;
    }
    e.add(std::string(x.item), x.tier, extra_bytes(x.basis, extra), std::move(detail));
  }
}

// The activations and the logits, from a transformer shape.
void add_activations(Evaluation& e) {
  const ModelSummary& m = e.m;
  if (!m.activations) return;
  const ActivationEstimate& a = *m.activations;
  e.add("activations", Tier::kDevice, a.layers_bytes,
        m.activation_checkpointing
            ? str_cat(m.num_layers, " layer inputs of ", core::format_bytes(a.kept_layer_bytes),
                      " + 1 layer recomputed (", core::format_bytes(a.full_layer_bytes), ")")
            : str_cat(m.num_layers, " layers x ", core::format_bytes(a.full_layer_bytes),
                      " (no checkpointing)"));
  e.add("logits", Tier::kDevice, a.logits_bytes,
        str_cat("4 B x seq ", m.seq_len, " x micro-batch ", m.micro_batch, " x vocab ",
                group_digits(u64(m.vocab_size))));
}

// The disk beyond the blocks: the swap files' reserve and a checkpoint.
void add_disk_reserves(Evaluation& e) {
  const std::int64_t P = e.P, T = e.T;
  // The swap files: the engine reserves 1/16 + 64 MiB beyond its blocks
  // (finalize), or strata.budgets.disk when set.
  std::uint64_t swap = 0;
  for (const PlanItem& item : e.plan.items) {
    if (item.tier == Tier::kNvme) swap = sat_add(swap, item.size_bytes);
  }
  const std::uint64_t budget = e.cfg.strata.budgets.disk_bytes;
  const std::uint64_t files =
      swap == 0 ? 0 : budget > 0 ? budget : swap_files_bytes(swap);
  e.add("swap_reserve", Tier::kNvme, files > swap ? files - swap : 0,
        budget > 0 ? "strata.budgets.disk beyond the blocks" : "1/16 + 64 MiB beyond the blocks, rounded to 1 MiB");
  if (e.in.options.include_checkpoint) {
    // A frozen base read from its files is left out of a checkpoint (the
    // manifest names the files): the trainable parameters' copies alone,
    // unless strata.checkpoint.keep_base.
    const bool base_left_out = e.frozen_in_files && !e.cfg.strata.checkpoint.keep_base;
    const std::int64_t copies = base_left_out ? T : P;
    const std::uint64_t whole = sat_add(sat_mul(u64(copies), e.c), e.state_of(T));
    const std::string what =
        str_cat(group_digits(u64(copies)), " x ", e.c, " B + ", state_times(e.spec, T, true),
                base_left_out ? " (the trainable compute copies, master, moments; the base stays in its files)"
                              : " (compute copies, master, moments)");
    if (e.N == 1) {
      e.add("checkpoint", Tier::kNvme, whole, what);
    } else {
      e.add("checkpoint", Tier::kNvme, ceil_div(static_cast<std::int64_t>(std::min<std::uint64_t>(whole, INT64_MAX)), e.N),
            str_cat("1/", e.N, " of ", what, ": each rank saves its shards"));
    }
  }
}

// A device budget (or the GPU) too small for the whole window and every
// gradient buffer: the engine gives resident copies back first, then
// waits for gradients to go down (Engine::allocate_working), down to one
// group of each. What is left of the room is what it holds.
void fit_device_budget(Evaluation& e) {
  const std::uint64_t group_bytes = e.group_bytes;
  std::uint64_t device = 0;
  for (const PlanItem& item : e.plan.items) {
    if (item.tier == Tier::kDevice) device = sat_add(device, item.size_bytes);
  }
  const std::uint64_t room = e.in.capacities[static_cast<int>(Tier::kDevice)].available_bytes;
  std::int64_t window = e.window_groups, grads = e.grad_buffers;
  while (device > room && group_bytes > 0 && (window > 1 || grads > 1)) {
    if (window > 1) {
      --window;
      device -= group_bytes;
    } else {
      --grads;
      device -= e.trainable_part_bytes;
    }
  }
  for (PlanItem& item : e.plan.items) {
    if (item.name == "fetch_window" && window < e.window_groups) {
      item.size_bytes = sat_mul(group_bytes, u64(window));
      item.detail = e.window_detail(window);
    } else if (item.name == "device_gradient_buffers" && grads < e.grad_buffers) {
      item.size_bytes = sat_mul(e.trainable_part_bytes, u64(grads));
      item.detail = e.grads_detail(grads);
    }
  }
  e.resident_groups = std::min(e.resident_groups, window);
}

// Each tier's bytes against its capacity, and why a tier is over.
void tally_tiers(const TierCapacities& capacities, PlacementPlan& plan) {
  plan.tiers = capacities;
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
}

// A pinned budget below the smallest that finalize accepts (memory_model.h's
// pinned_least: what is held, the step's working memory as finalize reserves
// it, and the least ring) does not fit, whatever the items add up to: they
// count the step's measured peak, finalize an upper bound on it.
void check_pinned_least(const Evaluation& e, PlacementPlan& plan) {
  const std::uint64_t budget = e.cfg.strata.budgets.pinned_bytes;
  if (budget == 0) return;
  const PinnedWorking working = planned_pinned_working(e);
  const PinnedLeast least = pinned_least(planned_pinned_held(e), working, planned_ring(e));
  if (least.bytes <= budget) return;
  TierPlan& t = plan.tiers[static_cast<int>(Tier::kPinned)];
  if (!t.fits) return;  // said already
  t.fits = false;
  plan.fits = false;
  plan.reasons.push_back(str_cat(
      "strata.budgets.pinned = ", core::format_bytes(budget), " is below the ", core::format_bytes(least.bytes),
      " the engine needs before a step (held: state, host gradients, pinned compute copies and the schedule's extra copies ", core::format_bytes(least.bytes - working.total() - least.ring_bytes),
      ", the step's working memory ", core::format_bytes(working.total()),
      least.ring_bytes > 0 ? str_cat(", the least staging ring ", core::format_bytes(least.ring_bytes)) : std::string(),
      "): strata.budgets.pinned >= ", least.bytes, " works"));
}

// Bytes per optimizer step (G micro-batches). Fetches of offloaded
// compute copies: every group forward and backward, less those a kept
// copy serves: the backward's first `resident_groups`, and as many of each
// later micro-batch's forward (the backward kept its last groups, which
// the forward wants first).
StepTraffic step_traffic(const Evaluation& e) {
  const std::int64_t P = e.P, T = e.T, L = e.L;
  const std::uint64_t c = e.c, g = e.g, accum = e.accum;
  StepTraffic tr;
  const std::uint64_t passes = 2 * accum;
  const std::uint64_t kept = u64(e.resident_groups) * (2 * accum - 1);
  const std::uint64_t fetch =
      e.fetches_copy
          ? sat_mul(c, sat_mul(u64(P), passes) - std::min(sat_mul(u64(P), passes), u64(P) / u64(L) * kept))
          : 0;
  // Summed on the device, the rank's fp32 shard of each micro-batch's sum.
  const std::uint64_t gradients_down =
      sat_mul(e.device_collectives ? sat_mul(e.sb, u64(e.T_rank)) : sat_mul(c, u64(T)), accum);
  // Stage 3 over ranks: a fetch reads the rank's shard from its home (and
  // gathers the others' over the network); the optimizer writes its shard.
  const std::uint64_t fetches = e.fetches_copy && e.group > 0 ? fetch / sat_mul(u64(e.group), c) : 0;
  const std::uint64_t home_fetch = e.sharded ? sat_mul(fetches, sat_mul(u64(e.home), c)) : fetch;
  // Once per step the optimizer writes each trainable group's new compute
  // copies on the host (in place when their home is pinned) and sends them
  // home; it does not read the old ones, every one of which it rewrites (a
  // mixed group's trainable range alone: ComputeHomes::blank_trainable). A chunk updated
  // on the device takes its gradients up and its new compute copies down.
  const std::uint64_t view = sat_mul(c, u64(e.sharded ? e.T_rank : T));
  const bool home_device = e.pl.param_device == OffloadDevice::kNone;
  const bool home_nvme = e.pl.param_device == OffloadDevice::kNvme;
  // Gathered on the device, a fetch brings up the rank's shard alone (a
  // home on the device: none); gathered on the host, the group whole, a
  // home on the device first coming down.
  const bool gathered_on_device = e.sharded && e.device_collectives;
  const std::uint64_t fetched_up = !gathered_on_device ? fetch : home_device ? 0 : home_fetch;
  tr.host_to_device_bytes =
      sat_add(sat_add(fetched_up, home_device ? view : 0), sat_mul(g, u64(e.t_gpu)));
  tr.device_to_host_bytes = sat_add(gradients_down, sat_mul(c, u64(e.t_gpu)));
  if (e.sharded && home_device && !gathered_on_device) {
    tr.device_to_host_bytes = sat_add(tr.device_to_host_bytes, home_fetch);
  }
  tr.disk_read_bytes = e.state_of(e.t_nvme);
  tr.disk_write_bytes = e.state_of(e.t_nvme);
  if (e.N > 1) {
    // Ring-optimal collectives: (N-1)/N of each buffer leaves the rank.
    // The gradients' sums, and the optimizer's gather of the new compute
    // copies; at stage 3 instead each fetch's gather of the group's shards.
    const std::uint64_t padded = sat_mul(u64(e.shape.group_padded), u64(L));
    // (Every fetch exchanges the ranks' tags; a gathered one then each
    // rank's home and trailer, one every rank kept nothing more.)
    const std::uint64_t tags = sat_mul(sat_mul(u64(L), passes), sat_mul(u64(e.N), kGatherTagBytes));
    const std::uint64_t copies =
        e.sharded ? sat_add(sat_mul(fetches, e.gather_payload()), tags) : sat_mul(padded, c);
    const std::uint64_t per_step = sat_add(sat_mul(sat_mul(padded, e.sb), accum), copies);
    tr.network_bytes = per_step / u64(e.N) * u64(e.N - 1);
  }
  if (home_nvme) {
    // The groups offload_param.max_in_cpu keeps in pinned memory read and
    // write nothing on the drive; they are the first in registration
    // (forward) order. Of the fetches, in units of one group's, each group
    // has `passes`, less those its copies kept on the device serve (this
    // step's model of them, above: the last resident_groups each
    // micro-batch's backward, the first resident_groups each later
    // micro-batch's forward); the drive reads the other groups'.
    std::uint64_t read = home_fetch;
    if (e.cpu_groups > 0) {
      const std::int64_t resident = e.resident_groups;
      std::uint64_t all_units = 0, nvme_units = 0;
      for (std::int64_t gi = 0; gi < L; ++gi) {
        const std::uint64_t served = std::min(
            passes, (gi >= L - resident ? accum : 0) + (gi < resident ? accum - 1 : 0));
        all_units += passes - served;
        if (gi >= e.cpu_groups) nvme_units += passes - served;
      }
      read = all_units == 0 ? 0
                            : static_cast<std::uint64_t>(static_cast<long double>(home_fetch) *
                                                         static_cast<long double>(nvme_units) /
                                                         static_cast<long double>(all_units));
    }
    tr.disk_read_bytes = sat_add(tr.disk_read_bytes, read);
    tr.disk_write_bytes = sat_add(tr.disk_write_bytes, e.nvme_share(view));
    // Of the fetches' reads, the frozen parameters' come from their files.
    // (In long double, whose 64-bit mantissa holds any byte count: read / P
    // in integers first would drop up to a whole share of the base.)
    if (e.frozen_in_files && P > 0) {
      tr.file_read_bytes = static_cast<std::uint64_t>(static_cast<long double>(read) * static_cast<long double>(P - T) /
                                                      static_cast<long double>(P));
    }
  }
  return tr;
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

std::uint64_t planned_pinned_spare(const Inputs& in, const Placement& pl) {
  Evaluation e(in, pl);
  const std::uint64_t budget = e.cfg.strata.budgets.pinned_bytes;
  if (budget == 0) return 0;
  add_compute_copies(e);  // (what planned_pinned_held reads)
  const RingSlots full = ring_slots(planned_ring(e));  // no room limit: the ring at its depth
  const std::uint64_t used = sat_add(sat_add(planned_pinned_held(e), planned_pinned_working(e).total()), full.bytes());
  return budget > used ? budget - used : 0;
}

PlannedHomes planned_homes(const Inputs& in, const Placement& pl) {
  const Evaluation e(in, pl);
  return {.home = e.home, .groups = e.L};
}

PlacementPlan evaluate(const Inputs& in, const Placement& pl) {
  Evaluation e(in, pl);
  // The items in the order the output lists them.
  add_compute_copies(e);
  add_gradients(e);
  add_read_gather(e);
  add_resident_state(e);
  add_nvme_state(e);
  add_schedule_extra(e);
  add_activations(e);
  add_disk_reserves(e);  // after every other nvme item: the reserve is theirs
  fit_device_budget(e);
  tally_tiers(in.capacities, e.plan);
  check_pinned_least(e, e.plan);
  e.plan.traffic = step_traffic(e);
  return std::move(e.plan);
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
