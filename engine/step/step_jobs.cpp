// Step: building the step's optimizer jobs (engine/step/step.h): the job
// step_end hands over (the next forward's order, or the backward's per the
// schedule), the early job that starts before the verdict and the calls that
// stop it, and folding the deferred verdicts jobs took into the step counts.
// The runner runs the jobs and the job body is engine/step/optimizer.cpp.
//
// Exactness: a job applies the step's constants (norm, clipping, loss scale
// and learning rate are all known when step_end builds it) to every chunk;
// chunks are independent, so the order they are updated in, and what runs
// beside them, never changes a bit. The next step waits per group: fetch,
// grad_buffer and grads_ready of group g return only after the job has
// written g's new compute copies home and consumed g's gradients.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/str.h"
#include "engine/fetch/fetcher.h"
#include "engine/state/state_store.h"
#include "engine/step/step.h"

namespace strata::engine {

using core::Status;
using core::str_cat;
namespace nx = core::numerics;

std::unique_ptr<OptimizerJob> Step::make_job(std::vector<UpdateConstants> constants, std::int64_t step) const {
  auto job = std::make_unique<OptimizerJob>();
  job->step = step;
  job->constants = std::move(constants);
  // The next forward's order (the learned sequence's first fetches).
  job->order = fetcher_->sequence().forward_order(parts_.layout.groups.size());
  job->kind = parts_.schedule.step_job_kind();
  const bool compute_on_nvme = std::any_of(parts_.layout.groups.begin(), parts_.layout.groups.end(),
                                           [](const GroupPlace& gp) { return gp.compute_tier == Tier::kNvme; });
  if (parts_.schedule.updates_in_backward_order(compute_on_nvme)) fetcher_->sequence().sort_in_backward_order(job->order);
  // With several ranks the job gathers each group's compute copies from
  // every rank, so every rank walks the groups in one order: the layout's
  // (a learned sequence is each rank's own: a fetch on one rank only changes it).
  if (parts_.layout.share.ranks > 1) std::sort(job->order.begin(), job->order.end());
  const bool threaded = parts_.schedule.threaded();
  job->read_ahead = threaded && optimizer_->ring_slots() > 0 ? optimizer_->ring_slots() - 1 : 0;
  job->write_behind = threaded;
  return job;
}

core::Status Step::start_early_job() {
  // The constants of a step that is applied and not clipped.
  early_.constants = verdict_.constants(parts_.layout.optimizer_groups, 1.0);
  std::unique_ptr<OptimizerJob> job = make_job(early_.constants, verdict_.applied_steps() + 1);
  job->hyper = verdict_.hyperparams(parts_.layout.optimizer_groups);
  job->grad_scale = verdict_.grad_scale(1.0);
  job->kind = parts_.schedule.early_job_kind(rules());
  // Update in the order the backward hands gradients over; after the
  // verdict, in the next forward's order.
  const std::size_t n = parts_.layout.groups.size();
  job->rank.assign(n, n);
  for (std::size_t i = 0; i < job->order.size(); ++i) job->rank[job->order[i]] = i;
  fetcher_->sequence().sort_in_backward_order(job->order);
  // A certain job balances the CPU between the two phases: the groups the
  // next forward needs in its second half (those whose gradients come first)
  // wait for step_end and are updated during the forward, ahead of their
  // fetches; the rest as their gradients arrive. A group with state on nvme
  // never waits: the disk works through both phases anyway.
  job->deferred.assign(n, false);
  // With several ranks none waits: the groups are gathered in the order
  // their gradients come in, and one waiting for the verdict would hold the
  // others open until then (Optimizer::JobRun::drain_gathers).
  if (job->kind == JobKind::kCertainEarly && !fetcher_->sequence().empty() && parts_.layout.share.ranks == 1) {
    for (std::size_t g = 0; g < n; ++g) {
      const GroupPlace& gp = parts_.layout.groups[g];
      bool nvme = false;
      for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
        nvme = nvme || chunks_->tier(c) == Tier::kNvme;
      }
      job->deferred[g] = !nvme && job->rank[g] >= (n + 1) / 2;
    }
    std::stable_partition(job->order.begin(), job->order.end(), [&](std::size_t g) { return !job->deferred[g]; });
  }
  STRATA_ASSIGN_OR_RETURN(early_.job, runner_->submit(std::move(job)));
  return Status();
}

core::Status Step::refuse_while_applying(const char* op) const {
  if (!early_.applying_in_place) return Status();
  return Status::failed_precondition(str_cat(
      op, ": the optimizer is applying this step during the backward (strata.overlap \"", parts_.schedule.name(),
      "\" with no clipping, no loss scaler and strata.nonfinite \"apply\" updates each group as its gradients "
      "arrive); call it before the step's first grads_ready or after step_end"));
}

core::Status Step::abandon_speculation(const char* op) {
  if (early_.job == 0) return Status();
  STRATA_RETURN_IF_ERROR(refuse_while_applying(op));
  // The verdict has one slot: the job before this one must have had its
  // verdict acted on (it may still be waiting for it at its end).
  STRATA_RETURN_IF_ERROR(wait_optimizer(op));
  const std::int64_t job = std::exchange(early_.job, 0);
  return runner_->settle(job, OptimizerRunner::Settle::kStopWithReads);
}

core::Status Step::wait_optimizer(const char* op) {
  if (runner_ == nullptr) return Status();  // before finalize: nothing ran
  STRATA_RETURN_IF_ERROR(runner_->wait_all(op));
  // The verdicts deferred to the jobs, into the step counts.
  for (const VerdictRecord& v : runner_->take_verdicts()) verdict_.fold(v);
  return Status();
}

}  // namespace strata::engine
