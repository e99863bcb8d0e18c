// Step: the framework's step calls: grad_buffer, grads_ready (into the
// gradient path), micro_step_end, and step_end (the verdict, the step's job,
// its statistics), with "delayed"'s pending copies. Building and steering
// the optimizer's jobs: step_jobs.cpp.
#include "engine/step/step.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/str.h"
#include "engine/fetch/fetcher.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/engine_util.h"
#include "engine/state/compute_homes.h"
#include "nvme/swap_store.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

std::vector<SwapPathBytes> swap_traffic_of(const nvme::SwapStore* swap) {
  std::vector<SwapPathBytes> out;
  if (swap == nullptr) return out;
  for (const nvme::FileTraffic& t : swap->traffic()) out.push_back({t.bytes_read, t.bytes_written});
  return out;
}

Step::Step(const Parts& parts, Verdict verdict) : parts_(parts), verdict_(std::move(verdict)) {}

Step::~Step() = default;

void Step::start(Rooms rooms) {
  grads_.resize(parts_.layout.groups.size());
  fetcher_ = &rooms.fetcher;
  homes_ = &rooms.homes;
  chunks_ = &rooms.state;
  swap_ = rooms.swap;
  gradients_ = std::move(rooms.gradients);
  optimizer_ = std::move(rooms.optimizer);
  runner_ = std::move(rooms.runner);
}

void Step::shutdown_gradients() {
  if (gradients_ != nullptr) gradients_->shutdown();
}

void Step::stop_runner() {
  if (runner_ != nullptr) runner_->stop();
}

void Step::put_back_buffers(BufferCache<gpu::DeviceBuffer>& cache) {
  for (GroupGradients& gs : grads_) {
    cache.put(std::move(gs.grad));
    gs.grad.reset();
  }
}

bool Step::between_steps() const {
  if (state_.micro_step != 0) return false;
  for (const GroupGradients& gs : grads_) {
    if (gs.micro_step >= 0 || !gs.grad.empty()) return false;
  }
  return true;
}

core::Status Step::may_fetch(std::size_t g) const {
  if (!early_.applying_in_place || grads_[g].micro_step != state_.micro_step) return Status();
  return Status::failed_precondition(str_cat(
      "fetch('", parts_.layout.groups[g].name, "'): its gradients of the step's last micro-batch are in, and the "
      "optimizer is updating it in place (strata.overlap \"", parts_.schedule.name(),
      "\" with no clipping, no loss scaler and strata.nonfinite \"apply\"); fetch it again after step_end"));
}

core::Result<gpu::DeviceSpan> Step::grad_buffer(std::size_t g) {
  const GroupPlace& gp = parts_.layout.groups[g];
  const std::string& group = gp.name;
  GroupGradients& gs = grads_[g];
  if (gp.trainable_elems == 0) {
    return Status::failed_precondition(str_cat("grad_buffer('", group, "'): the group has no trainable parameters"));
  }
  if (gs.micro_step == state_.micro_step) {
    return Status::failed_precondition(
        str_cat("grad_buffer('", group, "'): its gradients for this micro-batch have arrived already"));
  }
  // (Under "delayed" the gradient pass waits instead: see grads_ready.)
  if (parts_.schedule.gradients_wait_for_optimizer()) STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "grad_buffer"));
  // The group's last gradients are down (they may still be on their way
  // when step_end did not wait for them): so the framework runs at most a
  // step ahead of the copies, with one gradient buffer per group; and the
  // gradients on their way down stay within reduce_bucket_size elements
  // (two groups' buffers at least), so a framework that runs ahead of the
  // device does not fill it with gradient buffers.
  STRATA_RETURN_IF_ERROR(gradients_->wait_down(g, group, parts_.config.zero.reduce_bucket_size));
  fetcher_->sequence().note_backward(g);
  if (gs.grad.empty()) {
    const std::uint64_t bytes =
        static_cast<std::uint64_t>(gp.gradient_elems()) * static_cast<std::uint64_t>(parts_.layout.compute_bytes);
    STRATA_ASSIGN_OR_RETURN(gs.grad, fetcher_->allocate_working(bytes, str_cat("gradients of group '", gp.name, "'"),
                                                                    gpu::ArenaEnd::kHigh));
  }
  return gs.grad.span();
}

core::Status Step::no_grads(std::size_t g, std::span<const std::size_t> params) {
  const GroupPlace& gp = parts_.layout.groups[g];
  GroupGradients& gs = grads_[g];
  if (gs.micro_step == state_.micro_step) {
    return Status::failed_precondition(str_cat("no_grads('", gp.name,
                                               "'): its gradients for this micro-batch have arrived already"));
  }
  for (std::size_t pi : params) {  // all checked before any is taken
    if (parts_.layout.places[pi].group != g || parts_.layout.places[pi].trainable_offset < 0) {
      return Status::invalid_argument(str_cat("no_grads('", gp.name, "'): '", parts_.layout.params[pi].name,
                                              "' is not a trainable parameter of the group"));
    }
  }
  gs.absent.insert(gs.absent.end(), params.begin(), params.end());
  std::sort(gs.absent.begin(), gs.absent.end());
  gs.absent.erase(std::unique(gs.absent.begin(), gs.absent.end()), gs.absent.end());
  return Status();
}

core::Status Step::grads_ready(std::size_t g, gpu::Stream* written_on) {
  const GroupPlace& gp = parts_.layout.groups[g];
  const StageTimer timer(state_.grads_s);
  TraceScope t(parts_.trace, TraceTrack::kStep, str_cat("grads_ready ", gp.name));
  GroupGradients& gs = grads_[g];
  if (gs.grad.empty()) {
    return Status::failed_precondition(str_cat("grads_ready('", gp.name, "') without grad_buffer('", gp.name, "')"));
  }
  // The parameters without a gradient go with this micro-batch whatever
  // becomes of it (none is carried into a later one).
  std::vector<std::size_t> absent = std::exchange(gs.absent, {});
  // The host gradients of this group are the last step optimizer's input:
  // the pass that writes them waits for its update. Here, except under
  // "delayed", where the framework goes on (nothing it reads changes) and
  // the pass thread waits for the job submitted by now (the next step_end
  // may submit another before the pass runs).
  std::int64_t pass_after_job = 0;
  if (!parts_.schedule.gradients_wait_for_optimizer()) {
    pass_after_job = runner_->decided();
  } else {
    STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "grads_ready"));
  }
  const int micro_step = state_.micro_step;
  // The framework's writes, as an event its stream records now.
  std::shared_ptr<gpu::Event> written;
  if (written_on != nullptr) {
    STRATA_ASSIGN_OR_RETURN(gpu::Event ev, parts_.device.create_event());
    STRATA_RETURN_IF_ERROR(parts_.device.record(ev, *written_on));
    written = std::make_shared<gpu::Event>(std::move(ev));
  }
  gs.micro_step = micro_step;
  // overlap "speculative", or "exact" with certain steps: the step's
  // optimizer job (started by the last step_end, or here for the first step)
  // updates each group as its gradients of the last micro-batch are in.
  std::int64_t early = 0;
  if (gradients_->threaded() && early_jobs() && micro_step + 1 == parts_.config.gradient_accumulation_steps) {
    if (early_.job == 0) STRATA_RETURN_IF_ERROR(start_early_job());
    early = early_.job;
    early_.applying_in_place = rules().certain();
  }
  gpu::DeviceBuffer grad = std::exchange(gs.grad, {});
  // The parameters without a gradient are counted where the pass runs: the
  // step's job reads the counts with the host gradients.
  GradientPath* gradients = gradients_.get();
  if (!gradients->threaded()) gradients->note_absent(g, micro_step, absent);
  // The pass writes the host gradients the last step's job reads (under
  // "delayed" that job may still be running): it waits for the job's mark.
  OptimizerRunner* runner = runner_.get();
  auto before = [runner, gradients, g, pass_after_job, micro_step, absent = std::move(absent)] {
    STRATA_RETURN_IF_ERROR(runner->wait_group_job(g, pass_after_job, "the gradient pass"));
    gradients->note_absent(g, micro_step, absent);
    return Status();
  };
  auto after = [runner, g, early] {
    if (early != 0) runner->note_grads_in(g, early);
  };
  return gradients_->submit(g, std::move(grad), std::move(written), micro_step, before, after);
}

core::Status Step::micro_step_end() {
  STRATA_RETURN_IF_ERROR(gradients_->wait("micro_step_end"));
  for (std::size_t g = 0; g < grads_.size(); ++g) {
    if (parts_.layout.groups[g].trainable_elems > 0 && grads_[g].micro_step != state_.micro_step) {
      return Status::failed_precondition(str_cat("micro_step_end: group '", parts_.layout.groups[g].name,
                                                 "' has no gradients for micro-batch ", state_.micro_step + 1));
    }
  }
  if (state_.micro_step + 1 >= parts_.config.gradient_accumulation_steps) {
    return Status::failed_precondition(str_cat("micro_step_end after micro-batch ", state_.micro_step + 1, " of ",
                                               parts_.config.gradient_accumulation_steps,
                                               " (gradient_accumulation_steps): call step_end instead"));
  }
  ++state_.micro_step;
  return Status();
}

core::Status Step::check_step_end() const {
  const std::vector<GroupPlace>& groups = parts_.layout.groups;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].trainable_elems > 0 && grads_[g].micro_step != state_.micro_step) {
      return Status::failed_precondition(str_cat("step_end: group '", groups[g].name,
                                                 "' has no gradients for micro-batch ", state_.micro_step + 1));
    }
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    // The optimizer writes new compute copies home: no view of them may be out.
    if (fetcher_->fetched(g)) {
      return Status::failed_precondition(
          str_cat("step_end: group '", groups[g].name, "' is still fetched; release it first"));
    }
  }
  const int gas = parts_.config.gradient_accumulation_steps;
  if (state_.micro_step + 1 != gas) {
    return Status::failed_precondition(
        str_cat("step_end after ", state_.micro_step + 1, " micro-batches; gradient_accumulation_steps is ", gas));
  }
  return Status();
}

core::Result<StepStats> Step::step_end() {
  TraceScope t(parts_.trace, TraceTrack::kStep, "step_end");
  // The previous step's optimizer is done by now in a well-ordered step
  // (every group was fetched); this also collects its traffic and errors.
  STRATA_RETURN_IF_ERROR(wait_optimizer("step_end"));
  // With deferred verdicts the step's job waits for its last gradients, not
  // step_end (which only checks that every grads_ready was called).
  const bool defer = deferred_verdicts();
  if (!defer) STRATA_RETURN_IF_ERROR(gradients_->wait("step_end"));
  STRATA_RETURN_IF_ERROR(check_step_end());
  // The step's job writes compute copies home: no copy fetch queued for a
  // framework's stream may still read them (in a well-ordered step they all
  // ended long ago, before the gradients that followed them).
  STRATA_RETURN_IF_ERROR(fetcher_->settle_copies());
  // overlap "delayed": the update of the step before this one becomes what
  // the next step computes with.
  STRATA_RETURN_IF_ERROR(commit_pending("step_end"));
  StepStats stats;
  bool applied = false;
  std::unique_ptr<OptimizerJob> job;
  if (defer) {
    job = deferred_job(stats);
  } else {
    STRATA_ASSIGN_OR_RETURN(job, decide(stats, applied));
  }
  early_ = {};
  finish_stats(stats, defer);
  if (applied && !parts_.schedule.delays_update()) {
    // A copy prefetched during this step (an evaluation pass's, or one the
    // trace ran ahead to), or kept since a release, holds compute copies the
    // step's job replaces.
    fetcher_->drop_copies(DropCopies::kUpdated);
  }
  if (job != nullptr) STRATA_RETURN_IF_ERROR(runner_->submit(std::move(job)).status());
  // The next step's job starts now (overlap "speculative", or "exact" with
  // certain steps), so that it reads the first chunks the backward will need
  // while the forward runs.
  if (early_jobs()) STRATA_RETURN_IF_ERROR(start_early_job());
  fetcher_->issue_prefetches();  // the next step's first groups, as the optimizer finishes them
  return stats;
}

void Step::take_optimizer_stats(StepStats& stats) {
  // Taken before this step's job gets its verdict, so that a job which
  // finishes right after it is counted by the next step, always.
  const OptimizerRunner::Totals opt = runner_->take_totals();
  stats.bytes += opt.bytes;
  stats.optimizer_s += opt.seconds;
  stats.speculative_discarded += opt.discarded_elems;
  const GradientPath::Totals late = gradients_->take_late_totals();
  stats.bytes += late.bytes;
  stats.grads_s += late.seconds;
}

std::unique_ptr<OptimizerJob> Step::deferred_job(StepStats& stats) {
  // The job takes this step's verdict; the stats report the last one taken.
  take_optimizer_stats(stats);
  fetcher_->learn_sequence();
  std::unique_ptr<OptimizerJob> job = make_job({}, verdict_.applied_steps() + 1);
  job->deferred_verdict = DeferredVerdict{.marker = ++state_.markers,
                                          .norm_step = verdict_.verdicts() + 1,
                                          .hyper = verdict_.hyperparams(parts_.layout.optimizer_groups)};
  gradients_->post_marker(job->deferred_verdict->marker);
  const VerdictRecord& last = verdict_.last();
  stats.grad_norm = last.grad_norm;
  stats.lr = last.lr;
  stats.skipped = last.skipped;
  stats.norm_step = last.norm_step;
  return job;
}

core::Result<std::unique_ptr<OptimizerJob>> Step::decide(StepStats& stats, bool& applied) {
  STRATA_ASSIGN_OR_RETURN(const Verdict::Decision decision,
                          verdict_.decide(gradients_->raw_norm(), gradients_->take_nonfinite()));
  stats.grad_norm = decision.grad_norm;
  take_optimizer_stats(stats);
  fetcher_->learn_sequence();
  std::unique_ptr<OptimizerJob> job;
  if (decision.skip) {
    // An early job under way stops; nothing it did is committed.
    if (early_.job != 0) STRATA_RETURN_IF_ERROR(runner_->settle(early_.job, OptimizerRunner::Settle::kStop));
    verdict_.count(Verdict::Outcome::kSkipped);
  } else {
    std::vector<UpdateConstants> constants = verdict_.constants(parts_.layout.optimizer_groups, decision.clip);
    // overlap "speculative": the job under way applies these very constants
    // (no clipping, same learning rate): it commits what it did and goes on.
    const bool speculated =
        early_.job != 0 && constants.size() == early_.constants.size() &&
        std::memcmp(constants.data(), early_.constants.data(), constants.size() * sizeof(UpdateConstants)) == 0;
    // A certain job under way has updated in place already: it cannot but
    // agree (set_lr is refused while it applies).
    if (early_.applying_in_place && !speculated) {
      return Status::internal("step_end: the optimizer job updating in place disagrees with the step's constants");
    }
    if (early_.job != 0) {
      STRATA_RETURN_IF_ERROR(runner_->settle(
          early_.job, speculated ? OptimizerRunner::Settle::kApply : OptimizerRunner::Settle::kStop));
    }
    if (!speculated) {
      job = make_job(std::move(constants), verdict_.applied_steps() + 1);
      job->hyper = verdict_.hyperparams(parts_.layout.optimizer_groups);
      job->grad_scale = verdict_.grad_scale(decision.clip);
    }
    const double lr = verdict_.next_lr();
    if (job != nullptr && !parts_.schedule.threaded()) {
      // The sequential schedule: the optimizer runs here, to the end.
      TraceScope t(parts_.trace, TraceTrack::kStep, str_cat("optimizer, step ", verdict_.applied_steps() + 1));
      STRATA_RETURN_IF_ERROR(runner_->submit(std::move(job)).status());
      take_optimizer_stats(stats);
    }
    applied = true;
    verdict_.count(Verdict::Outcome::kApplied);
    stats.lr = lr * parts_.layout.optimizer_groups[0].lr_scale;
  }
  stats.skipped = decision.skip;
  stats.norm_step = verdict_.verdicts();
  return job;
}

void Step::finish_stats(StepStats& stats, bool defer) {
  stats.step = verdict_.applied_steps();
  stats.skipped_total = verdict_.skipped_steps();
  stats.loss_scale = verdict_.loss_scale();
  // This step's own traffic (the optimizer's is in already), its fetches'.
  const Fetcher::Totals fetches = fetcher_->take_totals();
  stats.bytes += state_.bytes;
  stats.bytes += fetches.bytes;
  stats.fetch_s = fetches.fetch_s;
  stats.grads_s += state_.grads_s;
  if (!defer) {  // (else the gradient path's own, behind the marker)
    const GradientPath::Totals grads = gradients_->take_totals();
    stats.bytes += grads.bytes;
    stats.grads_s += grads.seconds;
  }
  stats.nvme_total = swap_traffic_of(swap_);
  stats.prefetched = fetches.prefetched;
  stats.resident = fetches.resident;
  stats.resident_bytes = fetches.resident_bytes;
  stats.resident_nvme_bytes = fetches.resident_nvme_bytes;
  state_.bytes = {};
  state_.grads_s = 0.0;
  state_.micro_step = 0;
  for (GroupGradients& gs : grads_) gs.micro_step = -1;
}

core::Status Step::commit_pending(const char* op) {
  if (!homes_->has_pending()) return Status();
  STRATA_RETURN_IF_ERROR(fetcher_->settle_copies());  // an evaluation pass's copies may still read the homes
  // Copies on the device since a release or a prefetch hold the old ones. They
  // go first: a prefetch still in flight reads the pinned homes that
  // commit_pending swaps.
  fetcher_->drop_copies(DropCopies::kUpdated);
  core::Result<bool> committed = homes_->commit_pending(lane());
  if (!committed.ok()) return std::move(committed).status().annotate(op);
  return Status();
}

core::Status Step::flush_delayed(const char* op) {
  if (!parts_.schedule.delays_update()) return Status();
  STRATA_RETURN_IF_ERROR(wait_optimizer(op));
  return commit_pending(op);
}

}  // namespace strata::engine
