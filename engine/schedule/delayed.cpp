// strata.overlap "delayed": the one-step delayed update. Step N's job runs
// during step N+1 and writes each group's new compute copies into pinned
// memory (ComputeHomes::hold_pending; JobKind::kDelayed) instead of home; the
// next step_end sends them home, so step N+1 computes with the weights from
// before update N. Nothing the framework calls waits for the job: fetch
// reads the old copies (unless they live on nvme, whose block takes one I/O
// at a time), and the group's next gradient pass waits for its update on the
// pass thread. Without compute copies on nvme the job has until each group's
// next grad_buffer, so it goes in the backward's order.
//
// Deferred verdicts (bf16/fp32 without strata.nonfinite "error"): step_end
// does not wait for the step's last gradients; the job takes the verdict
// (skip, clipping) once they are in (Optimizer::take_verdict; the job's
// DeferredVerdict).
#include "engine/schedule/modes.h"

namespace strata::engine {
namespace {

constexpr ScheduleExtra kExtra[] = {
    {"delayed_compute_copies", Tier::kPinned, ExtraBasis::kTrainableGroupCompute,
     "the new compute copies that strata.overlap \"delayed\" holds until the next step_end"},
};

class DelayedSchedule final : public Schedule {
 public:
  OverlapMode mode() const override { return OverlapMode::kDelayed; }
  std::string_view name() const override { return "delayed"; }
  std::span<const ScheduleExtra> extra_memory() const override { return kExtra; }
  bool delays_update() const override { return true; }
  JobKind step_job_kind() const override { return JobKind::kDelayed; }
  bool defers_verdicts(const StepRules& rules) const override {
    return !rules.loss_scaler && rules.nonfinite != NonfinitePolicy::kError;
  }
  bool fetch_waits_for_optimizer(Tier compute) const override { return compute == Tier::kNvme; }
  bool gradients_wait_for_optimizer() const override { return false; }
  bool updates_in_backward_order(bool compute_on_nvme) const override { return !compute_on_nvme; }
};

}  // namespace

const Schedule& delayed_schedule() {
  static const DelayedSchedule s;
  return s;
}

}  // namespace strata::engine
