// strata.overlap "exact" (the default): the step's result is the sequential
// one, bit for bit, with the work spread over threads. grads_ready hands the
// copy down to the gradient thread and the pass to the pass thread; step_end
// hands the optimizer job to its thread and returns; the next forward's
// fetches wait per group for the job's mark, so it overlaps the job's tail.
// Prefetches follow the learned fetch sequence, released copies stay on the
// device while current.
//
// Certain steps (StepRules::certain: no clipping, no loss scaler,
// strata.nonfinite "apply"): nothing step_end learns can change the step,
// so the job starts early (the first grads_ready of the last micro-batch, the
// next one at step_end) and updates each group in place as its gradients
// arrive (Step::start_early_job, JobKind::kCertainEarly).
#include "engine/schedule/modes.h"

namespace strata::engine {
namespace {

class ExactSchedule final : public Schedule {
 public:
  OverlapMode mode() const override { return OverlapMode::kExact; }
  std::string_view name() const override { return "exact"; }
  bool early_jobs(const StepRules& rules) const override { return rules.certain(); }
  // Its early jobs come with certain steps only: nothing to undo.
  JobKind early_job_kind(const StepRules&) const override { return JobKind::kCertainEarly; }
};

}  // namespace

const Schedule& exact_schedule() {
  static const ExactSchedule s;
  return s;
}

}  // namespace strata::engine
