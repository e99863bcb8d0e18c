// The optimizer of a step (Engine members declared in engine/engine.h):
// the job step_end hands over, the thread that runs it while the next
// forward goes on (overlap "exact"), and the disk pipeline inside it.
//
// Exactness: a job applies the step's constants (norm, clipping, loss scale
// and learning rate are all known when step_end builds it) to every chunk;
// chunks are independent, so the order they are updated in, and what runs
// beside them, never changes a bit. The next step waits per group: fetch,
// grad_buffer and grads_ready of group g return only after the job has
// written g's new compute copies home and consumed g's gradients.
//
// The disk pipeline: nvme chunks are read into the staging ring up to
// `read_ahead` chunks ahead of the one cpu_adam works on, and written back
// behind it; a slot is free again when its write has completed. With the
// ring's K slots, K - 1 reads and writes are in flight around the chunk in
// Adam (read i+2, Adam i+1, write i for K = 3).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "cpu_adam/cpu_adam.h"
#include "core/clock.h"
#include "core/logging.h"
#include "core/str.h"
#include "engine/engine.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/cpu_turns.h"
#include "engine/internal/elem_types.h"
#include "engine/internal/group_state.h"
#include "engine/step/optimizer_job.h"
#include "engine/step/optimizer_runner.h"
#include "engine/internal/serial_queue.h"
#include "engine/state/compute_homes.h"
#include "engine/state/state_store.h"
#include "nvme/swap_store.h"

namespace strata::engine {

using core::Status;
using core::str_cat;
namespace nx = core::numerics;

namespace {

// The elements of one Adam call: about a millisecond of cpu_adam on two
// cores, the longest a gradient pass waits for the optimizer.
constexpr std::int64_t kAdamSliceElems = std::int64_t{1} << 21;

}  // namespace

core::Status Engine::create_staging_ring() {
  std::uint64_t slot = 0;
  std::size_t nvme_chunks = 0;
  for (std::size_t c = 0; c < layout_.chunks.size(); ++c) {
    if (state_->tier(c) != Tier::kNvme) continue;
    slot = std::max(slot, core::align_up(state_->staging_bytes(c), 4096));
    ++nvme_chunks;
  }
  if (nvme_chunks == 0) return Status();
  const std::uint64_t limit = staging_budget_.limit_bytes();
  std::uint64_t slots = limit / slot;
  if (limit == core::MemoryBudget::kUnlimited) {
    // Derived: four slots (six when speculative: reads also run ahead of the
    // gradients), or fewer when pinned memory is tight (at most half of what
    // it has left, and at least one slot).
    const auto depth = static_cast<std::uint64_t>(schedule_.ring_depth());
    slots = depth;
    if (pinned_budget_.limit_bytes() != core::MemoryBudget::kUnlimited) {
      slots = std::clamp<std::uint64_t>(pinned_budget_.available_bytes() / (2 * slot), 1, depth);
    }
  }
  if (slots == 0) {
    return Status::resource_exhausted(str_cat(
        "the disk pipeline needs at least one chunk's optimizer state in staging memory (",
        core::format_bytes(slot), "); strata.budgets.staging allows ", core::format_bytes(limit),
        ". Raise strata.budgets.staging (three chunks or more let reads, Adam and writes overlap) or lower "
        "strata.chunk_bytes"));
  }
  slots = std::min<std::uint64_t>(slots, nvme_chunks);
  STRATA_ASSIGN_OR_RETURN(ring_charge_, staging_budget_.charge(slots * slot, "the disk pipeline's staging ring"));
  for (std::uint64_t i = 0; i < slots; ++i) {
    STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer b, device_->allocate_pinned(slot, "the disk pipeline's staging ring"));
    ring_.push_back(std::move(b));
  }
  return Status();
}

std::unique_ptr<OptimizerJob> Engine::make_optimizer_job(std::vector<nx::AdamStepConstants> constants,
                                                                 std::int64_t step) {
  auto job = std::make_unique<OptimizerJob>();
  job->step = step;
  job->constants = std::move(constants);
  // The next forward's order (the learned sequence's first fetches).
  job->order = fetch_trace_.forward_order(layout_.groups.size());
  job->delayed = schedule_.delays_update();
  const bool compute_on_nvme = std::any_of(layout_.groups.begin(), layout_.groups.end(),
                                           [](const GroupPlace& gp) { return gp.compute_tier == Tier::kNvme; });
  if (schedule_.updates_in_backward_order(compute_on_nvme)) fetch_trace_.sort_in_backward_order(job->order);
  const bool threaded = schedule_.threaded();
  job->read_ahead = threaded && !ring_.empty() ? ring_.size() - 1 : 0;
  job->write_behind = threaded;
  return job;
}

void Engine::fold_verdicts() {
  for (const VerdictRecord& v : runner_->take_verdicts()) verdict_.fold(v);
}

core::Status Engine::start_early_job() {
  // The constants of a step that is applied and not clipped.
  early_constants_ = verdict_.constants(layout_.optimizer_groups, 1.0);
  std::unique_ptr<OptimizerJob> job = make_optimizer_job(early_constants_, verdict_.applied_steps() + 1);
  job->early = true;
  job->certain = certain_steps();
  // Update in the order the backward hands gradients over; after the
  // verdict, in the next forward's order.
  const std::size_t n = layout_.groups.size();
  job->rank.assign(n, n);
  for (std::size_t i = 0; i < job->order.size(); ++i) job->rank[job->order[i]] = i;
  fetch_trace_.sort_in_backward_order(job->order);
  // A certain job balances the CPU between the two phases: the groups the
  // next forward needs in its second half (those whose gradients come first)
  // wait for step_end and are updated during the forward, ahead of their
  // fetches; the rest as their gradients arrive. A group with state on nvme
  // never waits: the disk works through both phases anyway.
  job->deferred.assign(n, false);
  if (job->certain && !fetch_trace_.empty()) {
    for (std::size_t g = 0; g < n; ++g) {
      const GroupPlace& gp = layout_.groups[g];
      bool nvme = false;
      for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
        nvme = nvme || state_->tier(c) == Tier::kNvme;
      }
      job->deferred[g] = !nvme && job->rank[g] >= (n + 1) / 2;
    }
    std::stable_partition(job->order.begin(), job->order.end(), [&](std::size_t g) { return !job->deferred[g]; });
  }
  STRATA_ASSIGN_OR_RETURN(early_job_, runner_->submit(std::move(job)));
  return Status();
}

core::Status Engine::refuse_while_applying(const char* op) const {
  if (!applying_in_place_) return Status();
  return Status::failed_precondition(str_cat(
      op, ": the optimizer is applying this step during the backward (strata.overlap \"", schedule_.name(),
      "\" with no clipping, no loss scaler and strata.nonfinite \"apply\" updates each group as its gradients "
      "arrive); call it before the step's first grads_ready or after step_end"));
}

core::Status Engine::abandon_speculation(const char* op) {
  if (early_job_ == 0) return Status();
  STRATA_RETURN_IF_ERROR(refuse_while_applying(op));
  // The verdict has one slot: the job before this one must have had its
  // verdict acted on (it may still be waiting for it at its end).
  STRATA_RETURN_IF_ERROR(wait_optimizer(op));
  const std::int64_t job = std::exchange(early_job_, 0);
  return runner_->settle(job, false, /*reads_too=*/true);
}

core::Status Engine::wait_optimizer(const char* op) {
  if (runner_ == nullptr) return Status();  // before finalize: nothing ran
  STRATA_RETURN_IF_ERROR(runner_->wait_all(op));
  fold_verdicts();
  return Status();
}

core::Result<bool> Engine::take_verdict(OptimizerJob& job) {
  STRATA_ASSIGN_OR_RETURN(const GradientPath::Marker m, gradients_->wait_marker(job.marker, job.norm_step));
  const double raw_norm = m.raw_norm;
  const bool nonfinite = m.nonfinite;
  Verdict::Deferred d = Verdict::decide_deferred(config_, raw_norm, nonfinite, job.hyper, job.step, job.norm_step);
  job.verdict = d.record;
  job.constants = std::move(d.constants);
  return !job.verdict.skipped;
}

core::Status Engine::run_optimizer_job(OptimizerJob& job) {
  const core::Stopwatch clock;
  const int cb = layout_.compute_bytes, gb = layout_.grad_bytes;
  const adam::ElemType grad_type = adam_type(gb, config_.precision);
  const adam::ElemType compute_type = adam_type(cb, config_.precision);
  const Lane lane{&opt_stream_, &job.bytes, TraceTrack::kOptDevice};
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
    const GroupPlace& gp = layout_.groups[g];
    if (gp.chunk_count == 0 && !job.early) runner_->mark_done(g, job.id);  // frozen: nothing to update
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) items.push_back({g, c});
  }
  // A speculative job knows whether its work counts only from the verdict on.
  bool decided = !job.early;

  // The disk pipeline's state: free slots, reads ahead, writes behind.
  struct Flight {
    std::size_t item, slot;
    nvme::SwapIo io;
    std::int64_t begin_ns;
  };
  std::deque<std::size_t> free_slots;
  for (std::size_t i = 0; i < ring_.size(); ++i) free_slots.push_back(i);
  std::deque<Flight> reads, writes;
  std::size_t next_read = 0;
  auto is_nvme = [&](std::size_t i) { return state_->tier(items[i].chunk) == Tier::kNvme; };
  auto finish_write = [&]() -> Status {
    Flight f = std::move(writes.front());
    writes.pop_front();
    const Status s = f.io.wait();
    trace_.span(TraceTrack::kSwapWrite, str_cat("write chunk ", items[f.item].chunk), f.begin_ns,
                core::monotonic_ns(), state_->staging_bytes(items[f.item].chunk));
    free_slots.push_back(f.slot);
    return s;
  };
  auto drain_writes = [&]() -> Status {
    Status first;
    while (!writes.empty()) {
      Status s = finish_write();
      if (first.ok()) first = std::move(s);
    }
    return first;
  };
  // Reads for the chunks up to `current + read_ahead`, while slots are free.
  auto issue_reads = [&](std::size_t current) -> Status {
    while (next_read < items.size() && next_read <= current + job.read_ahead) {
      if (!is_nvme(next_read)) {
        ++next_read;
        continue;
      }
      if (free_slots.empty()) break;
      const std::size_t slot = free_slots.front();
      const std::size_t c = items[next_read].chunk;
      STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, state_->start_load(c, ring_[slot].bytes()));
      free_slots.pop_front();
      job.bytes.nvme_read += state_->staging_bytes(c);
      reads.push_back({next_read, slot, std::move(io), core::monotonic_ns()});
      ++next_read;
    }
    return Status();
  };

  // The groups whose compute copies are open: a host view (the pinned home
  // itself, or a staging copy; a speculative job's is always a shadow copy),
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
    const GroupPlace& gp = layout_.groups[g];
    Open o;
    o.left = gp.chunk_count;
    o.begin_ns = core::monotonic_ns();
    if (((job.early && !job.certain) || job.delayed) && gp.compute_tier == Tier::kPinned) {
      const std::span<std::byte> home = homes_->pinned_home(g).bytes();
      STRATA_ASSIGN_OR_RETURN(o.buffer, pinned_cache_->get(home.size(), job.delayed ? "delayed compute copies"
                                                                                       : "speculative compute copies"));
      std::memcpy(o.buffer.data(), home.data(), home.size());
      o.compute = o.buffer.bytes();
    } else {
      STRATA_ASSIGN_OR_RETURN(o.compute, homes_->load(g, o.buffer, lane));
    }
    open.emplace(g, std::move(o));
    return Status();
  };
  // The group's new state becomes the current one: the next versions of its
  // nvme chunks (speculative) and its compute copies; then the next step may
  // fetch it.
  auto commit_group = [&](std::size_t g) -> Status {
    const GroupPlace& gp = layout_.groups[g];
    Open& o = open.at(g);
    if (job.early && !job.certain) {
      for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
        if (state_->tier(c) == Tier::kNvme) STRATA_RETURN_IF_ERROR(state_->commit_next(c));
      }
    }
    if (job.delayed) {
      // Home at the next step_end (commit_pending): the next step computes
      // with the old copies.
      homes_->hold_pending(g, std::move(o.buffer), homes_->bytes(g));
      o.buffer = {};
    } else if (job.early && !job.certain && gp.compute_tier == Tier::kPinned) {
      std::swap(homes_->pinned_home(g), o.buffer);  // the shadow is the new home
    } else {
      STRATA_RETURN_IF_ERROR(homes_->commit(g, o.compute, lane));
    }
    trace_.span(TraceTrack::kOptimizer, str_cat("step ", job.step, " group ", gp.name), o.begin_ns,
                core::monotonic_ns());
    pinned_cache_->put(std::move(o.buffer));
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
      if (layout_.groups[g].chunk_count == 0) runner_->mark_done(g, job.id);
    }
    const auto from = static_cast<std::ptrdiff_t>(std::max(next_read, current + 1));
    std::stable_sort(items.begin() + std::min<std::ptrdiff_t>(from, static_cast<std::ptrdiff_t>(items.size())),
                     items.end(), [&](const Item& a, const Item& b) { return job.rank[a.group] < job.rank[b.group]; });
    return Status();
  };
  // The verdict said stop: nothing this job did counts.
  auto stop = [&]() -> Status {
    for (auto& [g, o] : open) pinned_cache_->put(std::move(o.buffer));
    open.clear();
    job.discarded_elems += updated_elems;
    // step_end may go on: no gradient or compute copy is read any more.
    runner_->note_quiet(job.id);
    while (!reads.empty()) {  // the current versions it reads are the caller's again after this
      reads.front().io.wait().ignore_error();
      reads.pop_front();
    }
    // Nor any current state (the writes left go to the next versions).
    runner_->note_reads_done(job.id);
    Status s = drain_writes();
    job.seconds += clock.elapsed_s();
    return s;
  };

  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::size_t g = items[i].group, c = items[i].chunk;
    const ChunkPlace& cp = layout_.chunks[c];

    // Writes that are done give their slots back; then the reads ahead.
    while (!writes.empty() && writes.front().io.ready()) STRATA_RETURN_IF_ERROR(finish_write());
    STRATA_RETURN_IF_ERROR(issue_reads(i));

    // A speculative update waits for the group's gradients (an nvme chunk,
    // whose current state stays intact, or a chunk of a certain job that is
    // not deferred) or for the verdict (anything else).
    if (!decided) {
      const bool go_early = job.certain ? !job.deferred[g] : cp.state_tier == Tier::kNvme;
      const OptimizerRunner::Gate gate = runner_->gate(job.id, g, go_early);
      if (gate == OptimizerRunner::Gate::kStop) return stop();
      if (gate == OptimizerRunner::Gate::kGoDecided) STRATA_RETURN_IF_ERROR(on_apply(i));
    }
    // The group's compute copies are read only now: a speculative job may
    // have started before the forward that fetches them.
    if (!open.contains(g)) STRATA_RETURN_IF_ERROR(open_group(g));
    const std::vector<Layout::Piece> pieces = layout_.pieces(cp);
    std::span<std::byte> compute = open.at(g).compute;
    auto compute_at = [&](const Layout::Piece& p) {
      const ParamPlace& pl = layout_.places[p.param];
      return compute.data() + (pl.compute_offset + (p.lo - pl.trainable_offset)) * cb;
    };

    if (cp.state_tier != Tier::kDevice) {
      ChunkState st;
      std::size_t slot = SIZE_MAX;
      if (cp.state_tier == Tier::kNvme) {
        // No slot was free for this chunk's read: wait for the oldest write.
        while (reads.empty() || reads.front().item != i) {
          if (writes.empty()) return Status::internal(str_cat("disk pipeline: no read in flight for chunk ", c));
          STRATA_RETURN_IF_ERROR(finish_write());
          STRATA_RETURN_IF_ERROR(issue_reads(i));
        }
        Flight f = std::move(reads.front());
        reads.pop_front();
        STRATA_RETURN_IF_ERROR(f.io.wait());
        trace_.span(TraceTrack::kSwapRead, str_cat("read chunk ", c), f.begin_ns, core::monotonic_ns(),
                    state_->staging_bytes(c));
        slot = f.slot;
        st = state_->staged_views(c, ring_[slot].bytes());
      } else {
        STRATA_ASSIGN_OR_RETURN(st, state_->load(c, {}));
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
          const CpuTurns::Turn turn(*cpu_turns_, CpuTurns::kBackground);
          TraceScope tc(trace_, TraceTrack::kCpuAdam, label, static_cast<std::uint64_t>(n));
          adam::AdamStepArgs a;
          a.constants = job.constants[static_cast<std::size_t>(layout_.params[p.param].optimizer_group)];
          a.master = st.master.subspan(off, n);
          a.exp_avg = st.exp_avg.subspan(off, n);
          a.exp_avg_sq = st.exp_avg_sq.subspan(off, n);
          a.grad = {gradients_->host_grads() + lo * gb, grad_type, static_cast<std::int64_t>(n)};
          if (cb == 2) a.copy_out = {out, compute_type, static_cast<std::int64_t>(n)};
          STRATA_RETURN_IF_ERROR(cpu_adam_->step(a));
          if (cb == 4) std::memcpy(out, a.master.data(), n * 4);
        }
      }
      if (cp.state_tier == Tier::kNvme) {
        const auto version =
            job.early && !job.certain ? StateStore::Version::kNext : StateStore::Version::kCurrent;
        STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, state_->start_store(c, ring_[slot].bytes(), version));
        job.bytes.nvme_write += state_->staging_bytes(c);
        writes.push_back({i, slot, std::move(io), core::monotonic_ns()});
        if (!job.write_behind) STRATA_RETURN_IF_ERROR(finish_write());
      }
    } else {
      // State on the device: gradients go up, the device steps, the new
      // compute copies come back down into the group's host view.
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan state, state_->device_state(c));
      const std::uint64_t n_all = static_cast<std::uint64_t>(cp.elems);
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer dgrad, device_cache_->get(n_all * gb, "optimizer gradients"));
      STRATA_RETURN_IF_ERROR(copy_h2d(dgrad.span(), {gradients_->host_grads() + cp.begin * gb, n_all * gb}, lane));
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer dcopy, device_cache_->get(n_all * cb, "optimizer compute copies"));
      for (const Layout::Piece& p : pieces) {
        const auto off = static_cast<std::uint64_t>(p.lo - cp.begin);
        const auto n = static_cast<std::uint64_t>(p.hi - p.lo);
        gpu::AdamStepArgs a;
        a.constants = job.constants[static_cast<std::size_t>(layout_.params[p.param].optimizer_group)];
        a.master = state.subspan(off * 4, n * 4);
        a.exp_avg = state.subspan(n_all * 4 + off * 4, n * 4);
        a.exp_avg_sq = state.subspan(2 * n_all * 4 + off * 4, n * 4);
        a.grad = gpu::typed(dgrad.subspan(off * gb, n * gb), gpu_type(gb, config_.precision));
        if (cb == 2) a.copy_out = gpu::typed(dcopy.subspan(off * cb, n * cb), gpu_type(cb, config_.precision));
        STRATA_RETURN_IF_ERROR(device_->adam_step(opt_stream_, a));
        if (cb == 4) STRATA_RETURN_IF_ERROR(device_->copy_d2d(opt_stream_, dcopy.subspan(off * 4, n * 4), a.master));
      }
      STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer back, pinned_cache_->get(n_all * cb, "optimizer compute copies"));
      STRATA_RETURN_IF_ERROR(copy_d2h(back.bytes().first(n_all * cb), dcopy.span(), lane));
      for (const Layout::Piece& p : pieces) {
        std::memcpy(compute_at(p), back.data() + (p.lo - cp.begin) * cb, static_cast<std::size_t>(p.hi - p.lo) * cb);
      }
      device_cache_->put(std::move(dgrad));
      device_cache_->put(std::move(dcopy));
      pinned_cache_->put(std::move(back));
    }

    if (!decided) updated_elems += cp.elems;
    // The group's last chunk: its new compute copies go home (once the
    // verdict says so, or at once for a certain job unless they live on the
    // device, where the framework may still be reading them), and the next
    // step may fetch it.
    if (--open.at(g).left == 0) {
      if (decided || (job.certain && layout_.groups[g].compute_tier != Tier::kDevice)) {
        STRATA_RETURN_IF_ERROR(commit_group(g));
      } else {
        waiting.push_back(g);
      }
    }
  }
  // A speculative job that updated everything before its verdict waits for it here.
  if (!decided) {
    const OptimizerRunner::Gate gate = runner_->gate(job.id, SIZE_MAX, false);
    if (gate == OptimizerRunner::Gate::kStop) return stop();
    STRATA_RETURN_IF_ERROR(on_apply(items.size()));
  }
  STRATA_RETURN_IF_ERROR(drain_writes());
  job.seconds += clock.elapsed_s();
  return Status();
}

}  // namespace strata::engine
