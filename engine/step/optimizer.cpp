#include "engine/step/optimizer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/clock.h"
#include "core/str.h"
#include "engine/internal/elem_types.h"
#include "engine/internal/engine_util.h"
#include "engine/step/verdict.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

namespace {

// The elements of one Adam call: about a millisecond of cpu_adam on two
// cores, the longest a gradient pass waits for the optimizer.
constexpr std::int64_t kAdamSliceElems = std::int64_t{1} << 21;

core::numerics::Bf16Rounding bf16_rounding(const Config& config) {
  return config.strata.optimizer_state.rounding == StateRounding::kStochastic
             ? core::numerics::Bf16Rounding::kStochastic
             : core::numerics::Bf16Rounding::kNearestEven;
}

}  // namespace

core::Result<std::unique_ptr<Optimizer>> Optimizer::create(const Parts& parts, std::int64_t ring_depth) {
  std::unique_ptr<Optimizer> o(new Optimizer(parts));
  STRATA_ASSIGN_OR_RETURN(o->stream_, parts.device.create_stream("optimizer"));
  STRATA_ASSIGN_OR_RETURN(o->pipeline_, DiskPipeline::create(parts.state, parts.device, parts.staging_budget,
                                                             parts.pinned_room, ring_depth));
  return o;
}

core::Status Optimizer::update_on_cpu(const UpdateConstants& k, const ChunkState& st, std::size_t off, std::size_t n,
                                      UpdateAt at, const adam::ConstTypedSpan& grad, const adam::TypedSpan& copy_out) {
  const OptimizerSpec& spec = parts_.layout.optimizer;
  switch (spec.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      if (spec.blockwise()) {
        // off starts a block (a parameter's offset and a slice's both do).
        const std::size_t b = off / core::numerics::kQuantBlockElems, nb = OptimizerSpec::blocks(static_cast<std::int64_t>(n));
        return parts_.cpu_adam.step_int8_blockwise({.constants = k.adam,
                                                    .master = st.master().subspan(off, n),
                                                    .exp_avg = st.arrays[1].codes().subspan(off, n),
                                                    .exp_avg_sq = st.arrays[2].codes().subspan(off, n),
                                                    .exp_avg_scale = st.arrays[1].block_scales().subspan(b, nb),
                                                    .exp_avg_sq_scale = st.arrays[2].block_scales().subspan(b, nb),
                                                    .grad = grad,
                                                    .copy_out = copy_out});
      }
      if (spec.format == StateFormat::kBf16) {
        return parts_.cpu_adam.step_bf16_moments({.constants = k.adam,
                                                  .master = st.master().subspan(off, n),
                                                  .exp_avg = st.arrays[1].bf16().subspan(off, n),
                                                  .exp_avg_sq = st.arrays[2].bf16().subspan(off, n),
                                                  .grad = grad,
                                                  .copy_out = copy_out,
                                                  .rounding = bf16_rounding(parts_.config),
                                                  .seed = parts_.config.strata.seed,
                                                  .step = at.step,
                                                  .index_base = at.index});
      }
      return parts_.cpu_adam.step({.constants = k.adam,
                                   .master = st.master().subspan(off, n),
                                   .exp_avg = st.arrays[1].f32().subspan(off, n),
                                   .exp_avg_sq = st.arrays[2].f32().subspan(off, n),
                                   .grad = grad,
                                   .copy_out = copy_out});
    case OptimizerType::kLion:
      return parts_.cpu_adam.lion_step({.constants = k.lion,
                                        .master = st.master().subspan(off, n),
                                        .exp_avg = st.arrays[1].f32().subspan(off, n),
                                        .grad = grad,
                                        .copy_out = copy_out});
    case OptimizerType::kAdagrad:
      return parts_.cpu_adam.adagrad_step({.constants = k.adagrad,
                                           .master = st.master().subspan(off, n),
                                           .exp_avg_sq = st.arrays[1].f32().subspan(off, n),
                                           .grad = grad,
                                           .copy_out = copy_out});
  }
  return Status::internal("unknown optimizer type");
}

core::Status Optimizer::update_on_device(const UpdateConstants& k, const DeviceViews& v, UpdateAt at,
                                         const gpu::DeviceTypedSpan& grad, const gpu::DeviceTypedSpan& copy_out) {
  const gpu::DeviceSpan master = v.master, state1 = v.state1, state2 = v.state2;
  const OptimizerSpec& spec = parts_.layout.optimizer;
  switch (spec.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      if (spec.blockwise()) {
        return parts_.device.adam_step_int8_blockwise(stream_, {.constants = k.adam,
                                                                .master = master,
                                                                .exp_avg = state1,
                                                                .exp_avg_sq = state2,
                                                                .exp_avg_scale = v.scales1,
                                                                .exp_avg_sq_scale = v.scales2,
                                                                .grad = grad,
                                                                .copy_out = copy_out});
      }
      if (spec.format == StateFormat::kBf16) {
        return parts_.device.adam_step_bf16_moments(stream_, {.constants = k.adam,
                                                              .master = master,
                                                              .exp_avg = state1,
                                                              .exp_avg_sq = state2,
                                                              .grad = grad,
                                                              .copy_out = copy_out,
                                                              .rounding = bf16_rounding(parts_.config),
                                                              .seed = parts_.config.strata.seed,
                                                              .step = at.step,
                                                              .index_base = at.index});
      }
      return parts_.device.adam_step(stream_, {.constants = k.adam,
                                               .master = master,
                                               .exp_avg = state1,
                                               .exp_avg_sq = state2,
                                               .grad = grad,
                                               .copy_out = copy_out});
    case OptimizerType::kLion:
      return parts_.device.lion_step(
          stream_, {.constants = k.lion, .master = master, .exp_avg = state1, .grad = grad, .copy_out = copy_out});
    case OptimizerType::kAdagrad:
      return parts_.device.adagrad_step(
          stream_, {.constants = k.adagrad, .master = master, .exp_avg_sq = state1, .grad = grad, .copy_out = copy_out});
  }
  return Status::internal("unknown optimizer type");
}

core::Result<bool> Optimizer::take_verdict(OptimizerJob& job) {
  // Only the delayed update decides after step_end (Schedule::defers_verdicts).
  STRATA_CHECK(job.kind == JobKind::kDelayed);
  const DeferredVerdict& dv = *job.deferred_verdict;
  STRATA_ASSIGN_OR_RETURN(const GradientPath::Marker m, parts_.gradients.wait_marker(dv.marker, dv.norm_step));
  const double raw_norm = m.raw_norm;
  const bool nonfinite = m.nonfinite;
  Verdict::Deferred d = Verdict::decide_deferred(parts_.config, raw_norm, nonfinite, dv.hyper, job.step, dv.norm_step);
  job.verdict = d.record;
  job.constants = std::move(d.constants);
  job.hyper = dv.hyper;
  job.grad_scale = d.grad_scale;
  return !job.verdict.skipped;
}

// One job's walk through its groups' chunks (Optimizer::run) and what its
// steps share: the chunks in the order they are updated and the disk
// pipeline's pass over them, the groups whose compute copies are open, and
// for an early job whether its verdict came and what it updated before.
class Optimizer::JobRun {
 public:
  JobRun(Optimizer& o, OptimizerJob& job, const core::Stopwatch& clock);
  JobRun(const JobRun&) = delete;
  JobRun& operator=(const JobRun&) = delete;
  // Every chunk, then an early job's wait for its verdict, then the writes
  // left behind.
  core::Status run();

 private:
  struct Item {
    std::size_t group, chunk;
  };
  // A group whose compute copies are open: a host view (the pinned home
  // itself, or a staging copy; a speculative or delayed job's is always a
  // copy, see OptimizerJob::shadows_pinned_compute), the chunks still to
  // update, and when the group was opened.
  struct Open {
    gpu::PinnedBuffer buffer;
    // The group's compute copies on the host: the whole home, or (a group
    // with frozen parameters) its trainable range alone, starting at byte
    // `compute_lo` of the home.
    std::span<std::byte> compute;
    std::uint64_t compute_lo = 0;
    std::size_t left = 0;
    std::int64_t begin_ns = 0;
  };

  const Layout& layout() const { return o_.parts_.layout; }
  OptimizerRunner& runner() const { return *o_.runner_; }
  static std::vector<Item> items_of(const Layout& layout, const std::vector<std::size_t>& order);
  // Chunk i's update with its state on the host (pinned or nvme) / on the
  // device, its new compute copies into the group's host view.
  core::Status update_host_chunk(std::size_t i);
  core::Status update_device_chunk(std::size_t i);
  // Where piece p's compute copies sit in the host view `compute` (the
  // group's home: its compute buffer, or a sharded home).
  std::byte* compute_at(const Open& o, const Layout::Piece& p) const;
  core::Status open_group(std::size_t g);
  // Several ranks: every rank's shard of group g's new compute copies into
  // its host view (all-gather, in the trainable layout).
  core::Status gather_over_ranks(std::size_t g);
  // Several ranks with whole compute copies (stage 1-2): the optimizer
  // gathers each group's new ones over the ranks.
  bool gathers() const { return o_.parts_.ranks != nullptr && !layout().compute_sharded; }
  // Gathers what may be gathered now: the updated groups in the gather
  // order, up to the first one not updated yet; each then committed, or left
  // for the verdict. A speculative job gathers nothing before its verdict.
  core::Status drain_gathers();
  // The i-th group to gather, or SIZE_MAX when not known yet.
  std::size_t to_gather(std::size_t i);
  // Group g's last chunk is done.
  core::Status group_updated(std::size_t g);
  core::Status commit_group(std::size_t g);
  // An early job's verdict: apply (what it updated counts from now on) or
  // stop (nothing it did counts).
  core::Status on_apply(std::size_t current);
  core::Status stop();
  // strata.no_grad "skip": parameter pi got no gradient in any micro-batch of
  // the job's step (on any rank), and is left as it is (its new compute
  // copies are its unchanged master's).
  bool skips(std::size_t pi) {
    if (!skip_enabled_ || !o_.parts_.gradients.no_gradient(pi)) return false;
    skipped_.push_back(pi);
    return true;
  }
  // The constants of parameter pi: the job's, at the parameter's own step
  // count when steps have left it as it was.
  const UpdateConstants& constants_for(std::size_t pi);

  Optimizer& o_;
  OptimizerJob& job_;
  const core::Stopwatch& clock_;
  const int cb_, gb_;  // bytes per compute copy and per gradient element
  const adam::ElemType grad_type_, compute_type_;
  const CopyLane lane_;
  std::vector<Item> items_;
  // An early job knows whether its work counts only from the verdict on.
  bool decided_;
  // The disk pipeline's walk through the items' chunks (kept in the items'
  // order: on_apply reorders those not read yet).
  std::vector<std::size_t> chunks_;
  DiskPipeline::Pass disk_;
  std::map<std::size_t, Open> open_;
  std::vector<std::size_t> waiting_;  // early: updated groups whose commit awaits the verdict
  std::int64_t updated_elems_ = 0;    // early: elements updated before the verdict
  // With gathers(): every rank gathers the groups in one order (an
  // all-gather is matched by its place in the sequence of calls, and the
  // order groups finish in is each rank's own: its reads, its verdict's
  // arrival). An early job's is the order its gradients came in (the gradient
  // path's passes, whose reduce-scatters every rank issues alike), which its
  // updates follow, so that few groups wait open for their turn; a decided
  // job's, the layout's (its own order, Step::make_job). gather_order_ holds
  // the groups with chunks in the layout's order; how many are gathered;
  // which are updated.
  std::vector<std::size_t> gather_order_;
  std::size_t gathered_ = 0;
  std::vector<bool> updated_;
  const bool skip_enabled_;
  std::vector<std::size_t> skipped_;  // parameters left as they were (once per piece)
  std::map<std::pair<int, std::int64_t>, UpdateConstants> other_steps_;  // (optimizer group, step) -> constants
};

std::vector<Optimizer::JobRun::Item> Optimizer::JobRun::items_of(const Layout& layout,
                                                                 const std::vector<std::size_t>& order) {
  std::vector<Item> items;
  for (std::size_t g : order) {
    const GroupPlace& gp = layout.groups[g];
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) items.push_back({g, c});
  }
  return items;
}

Optimizer::JobRun::JobRun(Optimizer& o, OptimizerJob& job, const core::Stopwatch& clock)
    : o_(o),
      job_(job),
      clock_(clock),
      cb_(o.parts_.layout.compute_bytes),
      gb_(o.parts_.layout.grad_bytes),
      grad_type_(adam_type(gb_, o.parts_.config.precision)),
      compute_type_(adam_type(cb_, o.parts_.config.precision)),
      lane_{&o.stream_, &job.bytes, TraceTrack::kOptDevice},
      items_(items_of(o.parts_.layout, job.order)),
      decided_(!job.early()),
      chunks_(items_.size()),
      disk_(*o.pipeline_, chunks_, job.read_ahead, job.write_behind, job.bytes, o.parts_.trace),
      skip_enabled_(o.parts_.config.strata.no_grad == NoGradPolicy::kSkip) {
  for (std::size_t i = 0; i < items_.size(); ++i) chunks_[i] = items_[i].chunk;
  if (gathers()) {
    updated_.assign(layout().groups.size(), false);
    for (std::size_t g : job_.order) {
      if (layout().groups[g].chunk_count > 0) gather_order_.push_back(g);
    }
    std::sort(gather_order_.begin(), gather_order_.end());
  }
}

core::Status Optimizer::JobRun::run() {
  if (decided_) {
    for (std::size_t g : job_.order) {
      if (layout().groups[g].chunk_count == 0) runner().mark_done(g, job_.id);  // frozen: nothing to update
    }
  }
  for (std::size_t i = 0; i < items_.size(); ++i) {
    const std::size_t g = items_[i].group;
    const ChunkPlace& cp = layout().chunks[items_[i].chunk];

    // Writes that are done give their slots back; then the reads ahead.
    STRATA_RETURN_IF_ERROR(disk_.advance(i));

    // Before the verdict an update waits for the group's gradients or for
    // the verdict (OptimizerJob::updates_before_verdict).
    if (!decided_) {
      const auto until = job_.updates_before_verdict(g, cp.state_tier) ? OptimizerRunner::Until::kGradientsIn
                                                                        : OptimizerRunner::Until::kVerdict;
      const OptimizerRunner::Gate gate = runner().gate(job_.id, g, until);
      if (gate == OptimizerRunner::Gate::kStop) return stop();
      if (gate == OptimizerRunner::Gate::kGoDecided) STRATA_RETURN_IF_ERROR(on_apply(i));
    }
    // The group's compute copies are read only now: an early job may
    // have started before the forward that fetches them.
    if (!open_.contains(g)) STRATA_RETURN_IF_ERROR(open_group(g));
    if (cp.state_tier != Tier::kDevice) {
      STRATA_RETURN_IF_ERROR(update_host_chunk(i));
    } else {
      STRATA_RETURN_IF_ERROR(update_device_chunk(i));
    }
    if (!decided_) updated_elems_ += cp.elems;
    if (--open_.at(g).left == 0) STRATA_RETURN_IF_ERROR(group_updated(g));
  }
  // An early job that updated everything before its verdict waits for it here.
  if (!decided_) {
    const OptimizerRunner::Gate gate = runner().gate(job_.id, SIZE_MAX, OptimizerRunner::Until::kVerdict);
    if (gate == OptimizerRunner::Gate::kStop) return stop();
    STRATA_RETURN_IF_ERROR(on_apply(items_.size()));
  }
  STRATA_CHECK(!gathers() || gathered_ == gather_order_.size())
      << "the optimizer gathered " << gathered_ << " of " << gather_order_.size() << " groups";
  STRATA_RETURN_IF_ERROR(disk_.drain_writes());
  // Applied: the parameters it left as they were count one step fewer.
  std::sort(skipped_.begin(), skipped_.end());
  skipped_.erase(std::unique(skipped_.begin(), skipped_.end()), skipped_.end());
  for (std::size_t pi : skipped_) ++o_.missed_[pi];
  job_.seconds += clock_.elapsed_s();
  return Status();
}

const UpdateConstants& Optimizer::JobRun::constants_for(std::size_t pi) {
  const int og = layout().params[pi].optimizer_group;
  const std::int64_t missed = o_.missed_[pi];
  if (missed == 0) return job_.constants[static_cast<std::size_t>(og)];
  const std::int64_t step = job_.step - missed;
  auto [it, inserted] = other_steps_.try_emplace({og, step});
  if (inserted) {
    STRATA_CHECK(static_cast<std::size_t>(og) < job_.hyper.size()) << "an optimizer job without its hyperparameters";
    it->second = update_constants_at(o_.parts_.config, job_.hyper[static_cast<std::size_t>(og)], step, job_.grad_scale);
  }
  return it->second;
}

std::byte* Optimizer::JobRun::compute_at(const Open& o, const Layout::Piece& p) const {
  const ParamPlace& pl = layout().places[p.param];
  // A sharded home holds the rank's trainable shard in the trainable layout.
  const std::uint64_t at =
      layout().compute_sharded
          ? static_cast<std::uint64_t>(p.lo - layout().groups[pl.group].shard_begin) * static_cast<std::uint64_t>(cb_)
          : static_cast<std::uint64_t>(pl.compute_offset + (p.lo - pl.trainable_offset)) * static_cast<std::uint64_t>(cb_);
  return o.compute.data() + (at - o.compute_lo);
}

core::Status Optimizer::JobRun::update_host_chunk(std::size_t i) {
  const std::size_t g = items_[i].group, c = items_[i].chunk;
  const ChunkPlace& cp = layout().chunks[c];
  const Open& open = open_.at(g);
  const std::int64_t shard_begin = layout().groups[g].shard_begin;  // where the host gradients of g start
  ChunkState st;
  if (cp.state_tier == Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(st, disk_.take(i));
  } else {
    STRATA_ASSIGN_OR_RETURN(st, o_.parts_.state.load(c, {}));
  }
  // In slices, each a turn of its own: a gradient pass waiting (the
  // backward's critical path) goes first. Adam is elementwise, so the
  // slicing changes no bit.
  const std::string label =
      str_cat(!decided_ && job_.updates_into_next_version() ? "adam (speculative) chunk " : "adam chunk ", c);
  for (const Layout::Piece& p : layout().pieces(cp)) {
    if (skips(p.param)) {  // no gradient in the step: its state stays, its copies are its master's
      to_compute(st.master().subspan(static_cast<std::size_t>(p.lo - cp.begin), static_cast<std::size_t>(p.hi - p.lo)),
                 compute_at(open, p), cb_, o_.parts_.config.precision);
      continue;
    }
    const UpdateConstants& k = constants_for(p.param);
    for (std::int64_t lo = p.lo; lo < p.hi; lo += kAdamSliceElems) {
      const std::int64_t hi = std::min(p.hi, lo + kAdamSliceElems);
      const auto off = static_cast<std::size_t>(lo - cp.begin);
      const auto n = static_cast<std::size_t>(hi - lo);
      std::byte* out = compute_at(open, p) + (lo - p.lo) * cb_;
      const CpuTurns::Turn turn(o_.parts_.turns, CpuTurns::kBackground);
      TraceScope tc(o_.parts_.trace, TraceTrack::kCpuAdam, label, static_cast<std::uint64_t>(n));
      const adam::ConstTypedSpan grad{o_.parts_.gradients.shard_grads(g) + (lo - shard_begin) * gb_, grad_type_,
                                      static_cast<std::int64_t>(n)};
      const adam::TypedSpan copy_out =
          cb_ == 2 ? adam::TypedSpan{out, compute_type_, static_cast<std::int64_t>(n)} : adam::TypedSpan{};
      STRATA_RETURN_IF_ERROR(o_.update_on_cpu(k, st, off, n, {.index = lo, .step = job_.step}, grad, copy_out));
      if (cb_ == 4) std::memcpy(out, st.master().data() + off, n * 4);
    }
  }
  if (cp.state_tier != Tier::kNvme) return Status();
  return disk_.store(i, job_.updates_into_next_version() ? StateStore::Version::kNext
                                                         : StateStore::Version::kCurrent);
}

core::Status Optimizer::JobRun::update_device_chunk(std::size_t i) {
  // State on the device: gradients go up, the device steps, the new
  // compute copies come back down into the group's host view.
  const std::size_t g = items_[i].group, c = items_[i].chunk;
  const ChunkPlace& cp = layout().chunks[c];
  const Parts& parts = o_.parts_;
  const std::vector<Layout::Piece> pieces = layout().pieces(cp);
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan state, parts.state.device_state(c));
  const std::uint64_t n_all = static_cast<std::uint64_t>(cp.elems);
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer dgrad, parts.device_cache.get(n_all * gb_, "optimizer gradients", gpu::ArenaEnd::kHigh));
  STRATA_RETURN_IF_ERROR(lane_h2d(parts.device, parts.trace, lane_, dgrad.span(),
                                  {parts.gradients.shard_grads(g) + (cp.begin - layout().groups[g].shard_begin) * gb_,
                                   n_all * gb_}));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer dcopy, parts.device_cache.get(n_all * cb_, "optimizer compute copies",
                                                                                   gpu::ArenaEnd::kHigh));
  for (const Layout::Piece& p : pieces) {
    const auto off = static_cast<std::uint64_t>(p.lo - cp.begin);
    const auto n = static_cast<std::uint64_t>(p.hi - p.lo);
    // Array k of the chunk's state: [master | state 1 | state 2], n_all elements each.
    const OptimizerSpec& spec = layout().optimizer;
    auto array = [&](int k) {
      if (k >= spec.arrays) return gpu::DeviceSpan{};
      const auto eb = static_cast<std::uint64_t>(spec.elem_bytes(k));
      return state.subspan(spec.array_offset(k, cp.elems) + off * eb, n * eb);
    };
    // Blockwise: the scales of the blocks [off, off + n) covers (off starts one).
    auto scales = [&](int k) {
      if (!spec.blockwise() || k >= spec.arrays) return gpu::DeviceSpan{};
      return state.subspan(spec.scales_offset(k, cp.elems) + off / core::numerics::kQuantBlockElems * 4,
                           OptimizerSpec::blocks(static_cast<std::int64_t>(n)) * 4);
    };
    if (skips(p.param)) {  // no gradient in the step: its state stays, its copies are its master's
      const gpu::DeviceTypedSpan master = gpu::typed(array(0), gpu::ElemType::kF32);
      STRATA_RETURN_IF_ERROR(
          cb_ == 4 ? parts.device.copy_d2d(o_.stream_, dcopy.subspan(off * 4, n * 4), array(0))
                   : parts.device.convert(o_.stream_,
                                          gpu::typed(dcopy.subspan(off * cb_, n * cb_),
                                                     gpu_type(cb_, parts.config.precision)),
                                          master));
      continue;
    }
    const UpdateConstants& k = constants_for(p.param);
    const gpu::DeviceTypedSpan grad =
        gpu::typed(dgrad.subspan(off * gb_, n * gb_), gpu_type(gb_, parts.config.precision));
    const gpu::DeviceTypedSpan copy_out =
        cb_ == 2 ? gpu::typed(dcopy.subspan(off * cb_, n * cb_), gpu_type(cb_, parts.config.precision))
                 : gpu::DeviceTypedSpan{};
    STRATA_RETURN_IF_ERROR(
        o_.update_on_device(k, {array(0), array(1), array(2), scales(1), scales(2)},
                            {.index = p.lo, .step = job_.step}, grad, copy_out));
    if (cb_ == 4) STRATA_RETURN_IF_ERROR(parts.device.copy_d2d(o_.stream_, dcopy.subspan(off * 4, n * 4), array(0)));
  }
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer back, parts.pinned_cache.get(n_all * cb_, "optimizer compute copies"));
  STRATA_RETURN_IF_ERROR(lane_d2h(parts.device, parts.trace, lane_, back.bytes().first(n_all * cb_), dcopy.span()));
  const Open& open = open_.at(g);
  for (const Layout::Piece& p : pieces) {
    std::memcpy(compute_at(open, p), back.data() + (p.lo - cp.begin) * cb_,
                static_cast<std::size_t>(p.hi - p.lo) * cb_);
  }
  parts.device_cache.put(std::move(dgrad));
  parts.device_cache.put(std::move(dcopy));
  parts.pinned_cache.put(std::move(back));
  return Status();
}

core::Status Optimizer::JobRun::open_group(std::size_t g) {
  const GroupPlace& gp = layout().groups[g];
  ComputeHomes& homes = o_.parts_.homes;
  Open o;
  o.left = gp.chunk_count;
  o.begin_ns = core::monotonic_ns();
  if (job_.shadows_pinned_compute() && gp.compute_tier == Tier::kPinned) {
    const std::span<std::byte> home = homes.pinned_home(g).bytes();
    STRATA_ASSIGN_OR_RETURN(o.buffer, o_.parts_.pinned_cache.get(home.size(), job_.holds_compute_pending()
                                                                               ? "delayed compute copies"
                                                                               : "speculative compute copies"));
    std::memcpy(o.buffer.data(), home.data(), home.size());
    o.compute = o.buffer.bytes();
  } else if (homes.rewritten_whole(g)) {
    // Every parameter's copies are written below: the old ones are not read
    // (no disk read or device copy for a home on nvme or the device).
    STRATA_ASSIGN_OR_RETURN(o.compute, homes.blank(g, o.buffer));
  } else if (homes.frozen_apart(g) && !job_.holds_compute_pending()) {
    // Every trainable parameter's copies are written below and only they go
    // home (commit_trainable): the trainable range alone is opened, blank,
    // and the frozen copies are neither read nor staged. (A copy held
    // pending, under delayed, is whole: the next forward's fetches read it.)
    o.compute_lo = layout().trainable_home_range(gp).lo;
    STRATA_ASSIGN_OR_RETURN(o.compute, homes.blank_trainable(g, o.buffer));
  } else {
    STRATA_ASSIGN_OR_RETURN(o.compute, homes.load(g, o.buffer, lane_));
  }
  open_.emplace(g, std::move(o));
  return Status();
}

core::Status Optimizer::JobRun::gather_over_ranks(std::size_t g) {
  partition::Communicator& comm = *o_.parts_.ranks;
  const GroupPlace& gp = layout().groups[g];
  const Open& open = open_.at(g);
  const std::size_t shard_bytes = static_cast<std::size_t>(gp.shard_elems) * static_cast<std::size_t>(cb_);
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer all,
                          o_.parts_.pinned_cache.get(shard_bytes * static_cast<std::size_t>(comm.size()),
                                                     "compute copies gathered over ranks"));
  std::byte* mine = all.data() + static_cast<std::size_t>(comm.rank()) * shard_bytes;  // gathered in place
  std::memset(mine, 0, shard_bytes);
  for (const Layout::Piece& p : layout().pieces({g, gp.shard_begin, gp.shard_elems, Tier::kDevice})) {
    std::memcpy(mine + (p.lo - gp.shard_begin) * cb_, compute_at(open, p), static_cast<std::size_t>(p.hi - p.lo) * cb_);
  }
  {
    TraceScope t(o_.parts_.trace, TraceTrack::kRanks, str_cat("all-gather ", gp.name), shard_bytes * comm.size());
    Status s = comm.all_gather(mine, all.data(), shard_bytes, partition::DType::kU8);
    if (!s.ok()) {
      o_.parts_.pinned_cache.put(std::move(all));
      return std::move(s).annotate(str_cat("the new compute copies of group '", gp.name, "'"));
    }
  }
  for (const Layout::Piece& p : layout().pieces({g, gp.trainable_begin, gp.trainable_elems, Tier::kDevice})) {
    std::memcpy(compute_at(open, p), all.data() + (p.lo - gp.trainable_begin) * cb_,
                static_cast<std::size_t>(p.hi - p.lo) * cb_);
  }
  o_.parts_.pinned_cache.put(std::move(all));
  return Status();
}

core::Status Optimizer::JobRun::group_updated(std::size_t g) {
  if (gathers()) {
    updated_[g] = true;
    return drain_gathers();
  }
  // Its new compute copies go home once the verdict says so, or at once when
  // the job may (OptimizerJob::commits_before_verdict); then the next step
  // may fetch it.
  if (decided_ || job_.commits_before_verdict(layout().groups[g].compute_tier)) return commit_group(g);
  waiting_.push_back(g);
  return Status();
}

std::size_t Optimizer::JobRun::to_gather(std::size_t i) {
  if (i >= gather_order_.size()) return SIZE_MAX;
  return job_.early() ? runner().arrival(job_.id, i) : gather_order_[i];
}

core::Status Optimizer::JobRun::drain_gathers() {
  // A speculative job's verdict may stop it, and each rank learns it at a
  // point of its own: gathers before it would leave the ranks' sequences of
  // calls apart. A certain job is never stopped once it updated a group
  // (Step::refuse_while_applying), so it gathers as it goes.
  if (!decided_ && job_.kind != JobKind::kCertainEarly) return Status();
  for (;;) {
    const std::size_t g = to_gather(gathered_);
    if (g == SIZE_MAX || !updated_[g]) break;
    ++gathered_;
    STRATA_RETURN_IF_ERROR(gather_over_ranks(g));
    if (decided_ || job_.commits_before_verdict(layout().groups[g].compute_tier)) {
      STRATA_RETURN_IF_ERROR(commit_group(g));
    } else {
      waiting_.push_back(g);
    }
  }
  return Status();
}

// The group's new state becomes the current one: the next versions of its
// nvme chunks (speculative) and its compute copies; then the next step may
// fetch it.
core::Status Optimizer::JobRun::commit_group(std::size_t g) {
  const GroupPlace& gp = layout().groups[g];
  ComputeHomes& homes = o_.parts_.homes;
  Open& o = open_.at(g);
  if (job_.updates_into_next_version()) {
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
      if (o_.parts_.state.tier(c) == Tier::kNvme) STRATA_RETURN_IF_ERROR(o_.parts_.state.commit_next(c));
    }
  }
  if (job_.holds_compute_pending()) {
    // Home at the next step_end (commit_pending): the next step computes
    // with the old copies.
    homes.hold_pending(g, std::move(o.buffer), homes.bytes(g));
    o.buffer = {};
  } else if (job_.shadows_pinned_compute() && gp.compute_tier == Tier::kPinned) {
    std::swap(homes.pinned_home(g), o.buffer);  // the shadow is the new home
  } else {
    STRATA_RETURN_IF_ERROR(homes.commit_trainable(g, o.compute, lane_, o.compute_lo));
  }
  o_.parts_.trace.span(TraceTrack::kOptimizer, str_cat("step ", job_.step, " group ", gp.name), o.begin_ns,
                       core::monotonic_ns());
  o_.parts_.pinned_cache.put(std::move(o.buffer));
  open_.erase(g);
  runner().mark_done(g, job_.id);
  return Status();
}

// The verdict said apply: what was updated is committed in the next
// forward's order, and the rest follows that order.
core::Status Optimizer::JobRun::on_apply(std::size_t current) {
  decided_ = true;
  const std::vector<std::size_t>& rank = job_.rank;
  std::sort(waiting_.begin(), waiting_.end(), [&](std::size_t a, std::size_t b) { return rank[a] < rank[b]; });
  for (std::size_t g : waiting_) STRATA_RETURN_IF_ERROR(commit_group(g));
  waiting_.clear();
  if (gathers()) STRATA_RETURN_IF_ERROR(drain_gathers());
  for (std::size_t g : job_.order) {
    if (layout().groups[g].chunk_count == 0) runner().mark_done(g, job_.id);
  }
  const auto from = static_cast<std::ptrdiff_t>(std::max(disk_.next_read(), current + 1));
  std::stable_sort(items_.begin() + std::min<std::ptrdiff_t>(from, static_cast<std::ptrdiff_t>(items_.size())),
                   items_.end(), [&](const Item& a, const Item& b) { return rank[a.group] < rank[b.group]; });
  for (std::size_t i = 0; i < items_.size(); ++i) chunks_[i] = items_[i].chunk;
  return Status();
}

// The verdict said stop: nothing this job did counts.
core::Status Optimizer::JobRun::stop() {
  for (auto& [g, o] : open_) o_.parts_.pinned_cache.put(std::move(o.buffer));
  open_.clear();
  job_.discarded_elems += updated_elems_;
  // step_end may go on: no gradient or compute copy is read any more.
  runner().note_quiet(job_.id);
  disk_.abandon_reads();  // the current versions it reads are the caller's again after this
  // Nor any current state (the writes left go to the next versions).
  runner().note_reads_done(job_.id);
  Status s = disk_.drain_writes();
  job_.seconds += clock_.elapsed_s();
  return s;
}

core::Status Optimizer::run(OptimizerJob& job) {
  const core::Stopwatch clock;
  if (job.deferred_verdict) {
    STRATA_ASSIGN_OR_RETURN(const bool apply, take_verdict(job));
    if (!apply) {  // a skipped step: every group is done as it is
      for (std::size_t g : job.order) runner_->mark_done(g, job.id);
      job.seconds += clock.elapsed_s();
      return Status();
    }
  }
  JobRun walk(*this, job, clock);
  return walk.run();
}

}  // namespace strata::engine
