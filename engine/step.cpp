// The engine's step calls: grad_buffer, grads_ready (into the gradient
// path), micro_step_end, and step_end (the verdict, the step's job, its
// statistics), with "delayed"'s pending copies.
#include <cstring>

#include "core/str.h"
#include "engine/engine.h"
#include "engine/internal/engine_entry.h"
#include "engine/internal/engine_util.h"
#include "engine/internal/group_state.h"
#include "engine/state/compute_homes.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

namespace nx = core::numerics;

core::Result<gpu::DeviceSpan> Engine::grad_buffer(std::string_view group) {
  STRATA_ENGINE_ENTRY("grad_buffer");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "grad_buffer"));
  return grad_buffer_locked(g);
}

core::Result<gpu::DeviceSpan> Engine::grad_buffer_locked(std::size_t g) {
  const GroupPlace& gp = layout_.groups[g];
  const std::string& group = gp.name;
  GroupState& gs = groups_[g];
  if (gp.trainable_elems == 0) {
    return Status::failed_precondition(str_cat("grad_buffer('", group, "'): the group has no trainable parameters"));
  }
  if (gs.grads_micro_step == step_.micro_step) {
    return Status::failed_precondition(
        str_cat("grad_buffer('", group, "'): its gradients for this micro-batch have arrived already"));
  }
  // (Under "delayed" the gradient pass waits instead: see grads_ready.)
  if (schedule_.gradients_wait_for_optimizer()) STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "grad_buffer"));
  // The group's last gradients are down (they may still be on their way
  // when step_end did not wait for them): so the framework runs at most a
  // step ahead of the copies, with one gradient buffer per group; and the
  // gradients on their way down stay within reduce_bucket_size elements
  // (two groups' buffers at least), so a framework that runs ahead of the
  // device does not fill it with gradient buffers.
  STRATA_RETURN_IF_ERROR(gradients_->wait_down(g, group, config_.zero.reduce_bucket_size));
  copies_.trace.note_backward(g);
  if (gs.grad.empty()) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(gp.compute_elems) * static_cast<std::uint64_t>(layout_.compute_bytes);
    STRATA_ASSIGN_OR_RETURN(gs.grad, allocate_working(bytes, str_cat("gradients of group '", gp.name, "'")));
  }
  return gs.grad.span();
}

core::Status Engine::grads_ready(std::string_view group, gpu::Stream* written_on) {
  STRATA_ENGINE_ENTRY("grads_ready");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "grads_ready"));
  const StageTimer timer(step_.times.grads_s);
  TraceScope t(trace_, TraceTrack::kStep, str_cat("grads_ready ", group));
  GroupState& gs = groups_[g];
  if (gs.grad.empty()) {
    return Status::failed_precondition(str_cat("grads_ready('", group, "') without grad_buffer('", group, "')"));
  }
  // The host gradients of this group are the last step optimizer's input:
  // the pass that writes them waits for its update. Here, except under
  // "delayed", where the framework goes on (nothing it reads changes) and
  // the pass thread waits for the job submitted by now (the next step_end
  // may submit another before the pass runs).
  std::int64_t pass_after_job = 0;
  if (!schedule_.gradients_wait_for_optimizer()) {
    pass_after_job = runner_->decided();
  } else {
    STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "grads_ready"));
  }
  const int micro_step = step_.micro_step;
  // The framework's writes, as an event its stream records now.
  std::shared_ptr<gpu::Event> written;
  if (written_on != nullptr) {
    STRATA_ASSIGN_OR_RETURN(gpu::Event ev, dev().create_event());
    STRATA_RETURN_IF_ERROR(dev().record(ev, *written_on));
    written = std::make_shared<gpu::Event>(std::move(ev));
  }
  gs.grads_micro_step = micro_step;
  // overlap "speculative", or "exact" with certain steps: the step's
  // optimizer job (started by the last step_end, or here for the first step)
  // updates each group as its gradients of the last micro-batch are in.
  std::int64_t early = 0;
  if (gradients_->threaded() && early_jobs() && micro_step + 1 == config_.gradient_accumulation_steps) {
    if (early_.job == 0) STRATA_RETURN_IF_ERROR(start_early_job());
    early = early_.job;
    early_.applying_in_place = certain_steps();
  }
  gpu::DeviceBuffer grad = std::move(gs.grad);
  gs.grad = {};
  // The pass writes the host gradients the last step's job reads (under
  // "delayed" that job may still be running): it waits for the job's mark.
  OptimizerRunner* runner = runner_.get();
  auto before = [runner, g, pass_after_job] { return runner->wait_group_job(g, pass_after_job, "the gradient pass"); };
  auto after = [runner, g, early] {
    if (early != 0) runner->note_grads_in(g, early);
  };
  return gradients_->submit(g, std::move(grad), std::move(written), micro_step, before, after);
}

core::Status Engine::micro_step_end() {
  STRATA_ENGINE_ENTRY("micro_step_end");
  STRATA_RETURN_IF_ERROR(check_finalized("micro_step_end"));
  STRATA_RETURN_IF_ERROR(gradients_->wait("micro_step_end"));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (layout_.groups[g].trainable_elems > 0 && groups_[g].grads_micro_step != step_.micro_step) {
      return Status::failed_precondition(str_cat("micro_step_end: group '", layout_.groups[g].name,
                                                 "' has no gradients for micro-batch ", step_.micro_step + 1));
    }
  }
  if (step_.micro_step + 1 >= config_.gradient_accumulation_steps) {
    return Status::failed_precondition(str_cat("micro_step_end after micro-batch ", step_.micro_step + 1, " of ",
                                               config_.gradient_accumulation_steps,
                                               " (gradient_accumulation_steps): call step_end instead"));
  }
  ++step_.micro_step;
  return Status();
}

core::Result<StepStats> Engine::step_end() {
  STRATA_ENGINE_ENTRY("step_end");
  STRATA_RETURN_IF_ERROR(check_finalized("step_end"));
  TraceScope t(trace_, TraceTrack::kStep, "step_end");
  // The previous step's optimizer is done by now in a well-ordered step
  // (every group was fetched); this also collects its traffic and errors.
  STRATA_RETURN_IF_ERROR(wait_optimizer("step_end"));
  // With deferred verdicts the step's job waits for its last gradients, not
  // step_end (which only checks that every grads_ready was called).
  const bool defer = deferred_verdicts();
  if (!defer) STRATA_RETURN_IF_ERROR(gradients_->wait("step_end"));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (layout_.groups[g].trainable_elems > 0 && groups_[g].grads_micro_step != step_.micro_step) {
      return Status::failed_precondition(str_cat("step_end: group '", layout_.groups[g].name,
                                                 "' has no gradients for micro-batch ", step_.micro_step + 1));
    }
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    // The optimizer writes new compute copies home: no view of them may be out.
    if (groups_[g].fetched) {
      return Status::failed_precondition(str_cat("step_end: group '", layout_.groups[g].name,
                                                 "' is still fetched; release it first"));
    }
  }
  if (step_.micro_step + 1 != config_.gradient_accumulation_steps) {
    return Status::failed_precondition(str_cat("step_end after ", step_.micro_step + 1, " micro-batches; ",
                                               "gradient_accumulation_steps is ", config_.gradient_accumulation_steps));
  }
  // The step's job writes compute copies home: no copy fetch queued for a
  // framework's stream may still read them (in a well-ordered step they all
  // ended long ago, before the gradients that followed them).
  STRATA_RETURN_IF_ERROR(settle_fetch_copies());
  // overlap "delayed": the update of the step before this one becomes what
  // the next step computes with.
  STRATA_RETURN_IF_ERROR(commit_pending("step_end"));
  StepStats stats;
  std::unique_ptr<OptimizerJob> job;
  if (defer) {
    // The job takes this step's verdict; the stats report the last one taken.
    take_optimizer_stats(stats);
    learn_fetch_trace();
    job = make_optimizer_job({}, verdict_.applied_steps() + 1);
    job->deferred_verdict = DeferredVerdict{.marker = ++step_.markers,
                                            .norm_step = verdict_.verdicts() + 1,
                                            .hyper = verdict_.hyperparams(layout_.optimizer_groups)};
    gradients_->post_marker(job->deferred_verdict->marker);
    stats.grad_norm = verdict_.last().grad_norm;
    stats.lr = verdict_.last().lr;
    stats.skipped = verdict_.last().skipped;
    stats.norm_step = verdict_.last().norm_step;
  } else {
    STRATA_ASSIGN_OR_RETURN(job, decide_step(stats));
  }
  const bool applied = !defer && !stats.skipped;
  early_.job = 0;
  early_.applying_in_place = false;
  stats.step = verdict_.applied_steps();
  stats.skipped_total = verdict_.skipped_steps();
  stats.loss_scale = verdict_.loss_scale();
  // This step's own traffic (the optimizer's is in already).
  stats.bytes += step_.bytes;
  stats.fetch_s = step_.times.fetch_s;
  stats.grads_s += step_.times.grads_s;
  if (!defer) {  // (else the gradient path's own, behind the marker)
    const GradientPath::Totals grads = gradients_->take_totals();
    stats.bytes += grads.bytes;
    stats.grads_s += grads.seconds;
  }
  stats.nvme_total = swap_traffic_now();
  stats.prefetched = step_.prefetched;
  step_.prefetched = 0;
  stats.resident = step_.resident;
  stats.resident_bytes = step_.resident_bytes;
  step_.resident = 0;
  step_.resident_bytes = 0;
  step_.bytes = {};
  step_.times = {};
  step_.micro_step = 0;
  for (GroupState& gs : groups_) gs.grads_micro_step = -1;
  if (applied && !schedule_.delays_update()) {
    // A copy prefetched during this step (an evaluation pass's, or one the
    // trace ran ahead to), or kept since a release, holds compute copies the
    // step's job replaces.
    drop_device_copies(DropCopies::kUpdated);
  }
  if (job != nullptr) STRATA_RETURN_IF_ERROR(runner_->submit(std::move(job)).status());
  // The next step's job starts now (overlap "speculative", or "exact" with
  // certain steps), so that it reads the first chunks the backward will need
  // while the forward runs.
  if (early_jobs()) STRATA_RETURN_IF_ERROR(start_early_job());
  issue_prefetches();  // the next step's first groups, as the optimizer finishes them
  return stats;
}

// The optimizer's traffic and time since the last step_end: with overlap
// "exact" that is the previous step's job, which ran during this step's
// forward (and finished: step_end's wait_optimizer); with deferred verdicts
// also the last step's gradient path. Taken before this step's job gets its
// verdict, so that a job which finishes right after it is counted by the
// next step, always.
void Engine::take_optimizer_stats(StepStats& stats) {
  const OptimizerRunner::Totals opt = runner_->take_totals();
  stats.bytes += opt.bytes;
  stats.optimizer_s += opt.seconds;
  stats.speculative_discarded += opt.discarded_elems;
  const GradientPath::Totals late = gradients_->take_late_totals();
  stats.bytes += late.bytes;
  stats.grads_s += late.seconds;
}

// step_end's verdict, taken at once (not deferred): skip, clipping, and what
// becomes of an early job under way. The job to submit: none when the step is
// skipped, when the early job applies it, or under "none" (it ran here).
core::Result<std::unique_ptr<OptimizerJob>> Engine::decide_step(StepStats& stats) {
  std::unique_ptr<OptimizerJob> job;
  STRATA_ASSIGN_OR_RETURN(const Verdict::Decision decision,
                          verdict_.decide(gradients_->raw_norm(), gradients_->take_nonfinite()));
  const bool skip = decision.skip;
  stats.grad_norm = decision.grad_norm;
  take_optimizer_stats(stats);
  learn_fetch_trace();
  if (!skip) {
    std::vector<UpdateConstants> constants = verdict_.constants(layout_.optimizer_groups, decision.clip);
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
    if (!speculated) job = make_optimizer_job(std::move(constants), verdict_.applied_steps() + 1);
    const double lr = verdict_.next_lr();
    if (job != nullptr && !schedule_.threaded()) {
      // The sequential schedule: the optimizer runs here, to the end.
      TraceScope t(trace_, TraceTrack::kStep, str_cat("optimizer, step ", verdict_.applied_steps() + 1));
      STRATA_RETURN_IF_ERROR(runner_->submit(std::move(job)).status());
      take_optimizer_stats(stats);
    }
    verdict_.count(Verdict::Outcome::kApplied);
    stats.lr = lr * layout_.optimizer_groups[0].lr_scale;
  } else {
    // An early job under way stops; nothing it did is committed.
    if (early_.job != 0) STRATA_RETURN_IF_ERROR(runner_->settle(early_.job, OptimizerRunner::Settle::kStop));
    verdict_.count(Verdict::Outcome::kSkipped);
  }
  stats.skipped = skip;
  stats.norm_step = verdict_.verdicts();
  return job;
}

core::Status Engine::commit_pending(const char* op) {
  if (!homes_->has_pending()) return Status();
  STRATA_RETURN_IF_ERROR(settle_fetch_copies());  // an evaluation pass's copies may still read the homes
  // Copies on the device since a release or a prefetch hold the old ones. They
  // go first: a prefetch still in flight reads the pinned homes that
  // commit_pending swaps.
  drop_device_copies(DropCopies::kUpdated);
  core::Result<bool> committed = homes_->commit_pending(step_lane());
  if (!committed.ok()) return std::move(committed).status().annotate(op);
  return Status();
}

core::Status Engine::flush_delayed(const char* op) {
  if (!schedule_.delays_update()) return Status();
  STRATA_RETURN_IF_ERROR(wait_optimizer(op));
  return commit_pending(op);
}

}  // namespace strata::engine
