#include "engine/step/optimizer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/clock.h"
#include "core/str.h"
#include "engine/internal/elem_types.h"
#include "engine/step/verdict.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

namespace {

// The elements of one Adam call: about a millisecond of cpu_adam on two
// cores, the longest a gradient pass waits for the optimizer.
constexpr std::int64_t kAdamSliceElems = std::int64_t{1} << 21;

}  // namespace

core::Result<std::unique_ptr<Optimizer>> Optimizer::create(const Parts& parts, std::int64_t ring_depth) {
  std::unique_ptr<Optimizer> o(new Optimizer(parts));
  STRATA_ASSIGN_OR_RETURN(o->stream_, parts.device.create_stream("optimizer"));
  STRATA_ASSIGN_OR_RETURN(o->pipeline_, DiskPipeline::create(parts.state, parts.device, parts.staging_budget,
                                                             parts.pinned_room, ring_depth));
  return o;
}

core::Status Optimizer::update_on_cpu(const UpdateConstants& k, const ChunkState& st, std::size_t off, std::size_t n,
                                      const adam::ConstTypedSpan& grad, const adam::TypedSpan& copy_out) {
  switch (parts_.layout.optimizer.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      return parts_.cpu_adam.step({.constants = k.adam,
                                   .master = st.arrays[0].subspan(off, n),
                                   .exp_avg = st.arrays[1].subspan(off, n),
                                   .exp_avg_sq = st.arrays[2].subspan(off, n),
                                   .grad = grad,
                                   .copy_out = copy_out});
    case OptimizerType::kLion:
      return parts_.cpu_adam.lion_step({.constants = k.lion,
                                        .master = st.arrays[0].subspan(off, n),
                                        .exp_avg = st.arrays[1].subspan(off, n),
                                        .grad = grad,
                                        .copy_out = copy_out});
    case OptimizerType::kAdagrad:
      return parts_.cpu_adam.adagrad_step({.constants = k.adagrad,
                                           .master = st.arrays[0].subspan(off, n),
                                           .exp_avg_sq = st.arrays[1].subspan(off, n),
                                           .grad = grad,
                                           .copy_out = copy_out});
  }
  return Status::internal("unknown optimizer type");
}

core::Status Optimizer::update_on_device(const UpdateConstants& k, gpu::DeviceSpan master, gpu::DeviceSpan state1,
                                         gpu::DeviceSpan state2, const gpu::DeviceTypedSpan& grad,
                                         const gpu::DeviceTypedSpan& copy_out) {
  switch (parts_.layout.optimizer.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
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
  STRATA_ASSIGN_OR_RETURN(const GradientPath::Marker m, parts_.gradients.wait_marker(job.marker, job.norm_step));
  const double raw_norm = m.raw_norm;
  const bool nonfinite = m.nonfinite;
  Verdict::Deferred d = Verdict::decide_deferred(parts_.config, raw_norm, nonfinite, job.hyper, job.step, job.norm_step);
  job.verdict = d.record;
  job.constants = std::move(d.constants);
  return !job.verdict.skipped;
}

core::Status Optimizer::run(OptimizerJob& job) {
  const core::Stopwatch clock;
  const int cb = parts_.layout.compute_bytes, gb = parts_.layout.grad_bytes;
  const adam::ElemType grad_type = adam_type(gb, parts_.config.precision);
  const adam::ElemType compute_type = adam_type(cb, parts_.config.precision);
  const CopyLane lane{&stream_, &job.bytes, TraceTrack::kOptDevice};
  if (job.deferred_verdict) {
    STRATA_ASSIGN_OR_RETURN(const bool apply, take_verdict(job));
    if (!apply) {
      for (std::size_t g : job.order) runner_->mark_done(g, job.id);
      job.seconds += clock.elapsed_s();
      return Status();
    }
  }

  struct Item {
    std::size_t group, chunk;
  };
  std::vector<Item> items;
  for (std::size_t g : job.order) {
    const GroupPlace& gp = parts_.layout.groups[g];
    if (gp.chunk_count == 0 && !job.early) runner_->mark_done(g, job.id);  // frozen: nothing to update
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) items.push_back({g, c});
  }
  // An early job knows whether its work counts only from the verdict on.
  bool decided = !job.early;

  // The disk pipeline's walk through the items' chunks (kept in the items'
  // order: on_apply reorders those not read yet).
  std::vector<std::size_t> chunks(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) chunks[i] = items[i].chunk;
  DiskPipeline::Pass disk(*pipeline_, chunks, job.read_ahead, job.write_behind, job.bytes, parts_.trace);

  // The groups whose compute copies are open: a host view (the pinned home
  // itself, or a staging copy; an uncertain early job's is always a shadow copy),
  // the chunks still to update, and when the group was opened.
  struct Open {
    gpu::PinnedBuffer buffer;
    std::span<std::byte> compute;
    std::size_t left = 0;
    std::int64_t begin_ns = 0;
  };
  std::map<std::size_t, Open> open;
  std::vector<std::size_t> waiting;  // speculative: updated groups awaiting the verdict
  std::int64_t updated_elems = 0;    // speculative: elements updated before the verdict
  auto open_group = [&](std::size_t g) -> Status {
    const GroupPlace& gp = parts_.layout.groups[g];
    Open o;
    o.left = gp.chunk_count;
    o.begin_ns = core::monotonic_ns();
    if (((job.early && !job.certain) || job.delayed) && gp.compute_tier == Tier::kPinned) {
      const std::span<std::byte> home = parts_.homes.pinned_home(g).bytes();
      STRATA_ASSIGN_OR_RETURN(o.buffer, parts_.pinned_cache.get(home.size(), job.delayed ? "delayed compute copies"
                                                                                       : "speculative compute copies"));
      std::memcpy(o.buffer.data(), home.data(), home.size());
      o.compute = o.buffer.bytes();
    } else {
      STRATA_ASSIGN_OR_RETURN(o.compute, parts_.homes.load(g, o.buffer, lane));
    }
    open.emplace(g, std::move(o));
    return Status();
  };
  // The group's new state becomes the current one: the next versions of its
  // nvme chunks (speculative) and its compute copies; then the next step may
  // fetch it.
  auto commit_group = [&](std::size_t g) -> Status {
    const GroupPlace& gp = parts_.layout.groups[g];
    Open& o = open.at(g);
    if (job.early && !job.certain) {
      for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
        if (parts_.state.tier(c) == Tier::kNvme) STRATA_RETURN_IF_ERROR(parts_.state.commit_next(c));
      }
    }
    if (job.delayed) {
      // Home at the next step_end (commit_pending): the next step computes
      // with the old copies.
      parts_.homes.hold_pending(g, std::move(o.buffer), parts_.homes.bytes(g));
      o.buffer = {};
    } else if (job.early && !job.certain && gp.compute_tier == Tier::kPinned) {
      std::swap(parts_.homes.pinned_home(g), o.buffer);  // the shadow is the new home
    } else {
      STRATA_RETURN_IF_ERROR(parts_.homes.commit(g, o.compute, lane));
    }
    parts_.trace.span(TraceTrack::kOptimizer, str_cat("step ", job.step, " group ", gp.name), o.begin_ns,
                core::monotonic_ns());
    parts_.pinned_cache.put(std::move(o.buffer));
    open.erase(g);
    runner_->mark_done(g, job.id);
    return Status();
  };
  // The verdict said apply: what was updated is committed in the next
  // forward's order, and the rest follows that order.
  auto on_apply = [&](std::size_t current) -> Status {
    decided = true;
    std::sort(waiting.begin(), waiting.end(), [&](std::size_t a, std::size_t b) { return job.rank[a] < job.rank[b]; });
    for (std::size_t g : waiting) STRATA_RETURN_IF_ERROR(commit_group(g));
    waiting.clear();
    for (std::size_t g : job.order) {
      if (parts_.layout.groups[g].chunk_count == 0) runner_->mark_done(g, job.id);
    }
    const auto from = static_cast<std::ptrdiff_t>(std::max(disk.next_read(), current + 1));
    std::stable_sort(items.begin() + std::min<std::ptrdiff_t>(from, static_cast<std::ptrdiff_t>(items.size())),
                     items.end(), [&](const Item& a, const Item& b) { return job.rank[a.group] < job.rank[b.group]; });
    for (std::size_t i = 0; i < items.size(); ++i) chunks[i] = items[i].chunk;
    return Status();
  };
  // The verdict said stop: nothing this job did counts.
  auto stop = [&]() -> Status {
    for (auto& [g, o] : open) parts_.pinned_cache.put(std::move(o.buffer));
    open.clear();
    job.discarded_elems += updated_elems;
    // step_end may go on: no gradient or compute copy is read any more.
    runner_->note_quiet(job.id);
    disk.abandon_reads();  // the current versions it reads are the caller's again after this
    // Nor any current state (the writes left go to the next versions).
    runner_->note_reads_done(job.id);
    Status s = disk.drain_writes();
    job.seconds += clock.elapsed_s();
    return s;
  };

  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::size_t g = items[i].group, c = items[i].chunk;
    const ChunkPlace& cp = parts_.layout.chunks[c];

    // Writes that are done give their slots back; then the reads ahead.
    STRATA_RETURN_IF_ERROR(disk.advance(i));

    // A speculative update waits for the group's gradients (an nvme chunk,
    // whose current state stays intact, or a chunk of a certain job that is
    // not deferred) or for the verdict (anything else).
    if (!decided) {
      const bool go_early = job.certain ? !job.deferred[g] : cp.state_tier == Tier::kNvme;
      const OptimizerRunner::Gate gate = runner_->gate(job.id, g, go_early);
      if (gate == OptimizerRunner::Gate::kStop) return stop();
      if (gate == OptimizerRunner::Gate::kGoDecided) STRATA_RETURN_IF_ERROR(on_apply(i));
    }
    // The group's compute copies are read only now: an early job may
    // have started before the forward that fetches them.
    if (!open.contains(g)) STRATA_RETURN_IF_ERROR(open_group(g));
    const std::vector<Layout::Piece> pieces = parts_.layout.pieces(cp);
    std::span<std::byte> compute = open.at(g).compute;
    auto compute_at = [&](const Layout::Piece& p) {
      const ParamPlace& pl = parts_.layout.places[p.param];
      return compute.data() + (pl.compute_offset + (p.lo - pl.trainable_offset)) * cb;
    };

    if (cp.state_tier != Tier::kDevice) {
      ChunkState st;
      if (cp.state_tier == Tier::kNvme) {
        STRATA_ASSIGN_OR_RETURN(st, disk.take(i));
      } else {
        STRATA_ASSIGN_OR_RETURN(st, parts_.state.load(c, {}));
      }
      // In slices, each a turn of its own: a gradient pass waiting (the
      // backward's critical path) goes first. Adam is elementwise, so the
      // slicing changes no bit.
      const std::string label =
          str_cat(decided || job.certain ? "adam chunk " : "adam (speculative) chunk ", c);
      for (const Layout::Piece& p : pieces) {
        for (std::int64_t lo = p.lo; lo < p.hi; lo += kAdamSliceElems) {
          const std::int64_t hi = std::min(p.hi, lo + kAdamSliceElems);
          const auto off = static_cast<std::size_t>(lo - cp.begin);
          const auto n = static_cast<std::size_t>(hi - lo);
          std::byte* out = compute_at(p) + (lo - p.lo) * cb;
          const CpuTurns::Turn turn(parts_.turns, CpuTurns::kBackground);
          TraceScope tc(parts_.trace, TraceTrack::kCpuAdam, label, static_cast<std::uint64_t>(n));
          const UpdateConstants& k =
              job.constants[static_cast<std::size_t>(parts_.layout.params[p.param].optimizer_group)];
          const adam::ConstTypedSpan grad{parts_.gradients.host_grads() + lo * gb, grad_type,
                                          static_cast<std::int64_t>(n)};
          const adam::TypedSpan copy_out =
              cb == 2 ? adam::TypedSpan{out, compute_type, static_cast<std::int64_t>(n)} : adam::TypedSpan{};
          STRATA_RETURN_IF_ERROR(update_on_cpu(k, st, off, n, grad, copy_out));
          if (cb == 4) std::memcpy(out, st.master().data() + off, n * 4);
        }
      }
      if (cp.state_tier == Tier::kNvme) {
        const auto version =
            job.early && !job.certain ? StateStore::Version::kNext : StateStore::Version::kCurrent;
        STRATA_RETURN_IF_ERROR(disk.store(i, version));
      }
    } else {
      // State on the device: gradients go up, the device steps, the new
      // compute copies come back down into the group's host view.
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan state, parts_.state.device_state(c));
      const std::uint64_t n_all = static_cast<std::uint64_t>(cp.elems);
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer dgrad, parts_.device_cache.get(n_all * gb, "optimizer gradients"));
      STRATA_RETURN_IF_ERROR(
          lane_h2d(parts_.device, parts_.trace, lane, dgrad.span(), {parts_.gradients.host_grads() + cp.begin * gb, n_all * gb}));
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer dcopy, parts_.device_cache.get(n_all * cb, "optimizer compute copies"));
      for (const Layout::Piece& p : pieces) {
        const auto off = static_cast<std::uint64_t>(p.lo - cp.begin);
        const auto n = static_cast<std::uint64_t>(p.hi - p.lo);
        // Array k of the chunk's state: [master | state 1 | state 2], n_all elements each.
        auto array = [&](std::uint64_t k) { return state.subspan(k * n_all * 4 + off * 4, n * 4); };
        const UpdateConstants& k =
            job.constants[static_cast<std::size_t>(parts_.layout.params[p.param].optimizer_group)];
        const gpu::DeviceTypedSpan grad =
            gpu::typed(dgrad.subspan(off * gb, n * gb), gpu_type(gb, parts_.config.precision));
        const gpu::DeviceTypedSpan copy_out =
            cb == 2 ? gpu::typed(dcopy.subspan(off * cb, n * cb), gpu_type(cb, parts_.config.precision))
                    : gpu::DeviceTypedSpan{};
        STRATA_RETURN_IF_ERROR(update_on_device(k, array(0), array(1), array(2), grad, copy_out));
        if (cb == 4) STRATA_RETURN_IF_ERROR(parts_.device.copy_d2d(stream_, dcopy.subspan(off * 4, n * 4), array(0)));
      }
      STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer back, parts_.pinned_cache.get(n_all * cb, "optimizer compute copies"));
      STRATA_RETURN_IF_ERROR(lane_d2h(parts_.device, parts_.trace, lane, back.bytes().first(n_all * cb), dcopy.span()));
      for (const Layout::Piece& p : pieces) {
        std::memcpy(compute_at(p), back.data() + (p.lo - cp.begin) * cb, static_cast<std::size_t>(p.hi - p.lo) * cb);
      }
      parts_.device_cache.put(std::move(dgrad));
      parts_.device_cache.put(std::move(dcopy));
      parts_.pinned_cache.put(std::move(back));
    }

    if (!decided) updated_elems += cp.elems;
    // The group's last chunk: its new compute copies go home (once the
    // verdict says so, or at once for a certain job unless they live on the
    // device, where the framework may still be reading them), and the next
    // step may fetch it.
    if (--open.at(g).left == 0) {
      if (decided || (job.certain && parts_.layout.groups[g].compute_tier != Tier::kDevice)) {
        STRATA_RETURN_IF_ERROR(commit_group(g));
      } else {
        waiting.push_back(g);
      }
    }
  }
  // An early job that updated everything before its verdict waits for it here.
  if (!decided) {
    const OptimizerRunner::Gate gate = runner_->gate(job.id, SIZE_MAX, false);
    if (gate == OptimizerRunner::Gate::kStop) return stop();
    STRATA_RETURN_IF_ERROR(on_apply(items.size()));
  }
  STRATA_RETURN_IF_ERROR(disk.drain_writes());
  job.seconds += clock.elapsed_s();
  return Status();
}

}  // namespace strata::engine
