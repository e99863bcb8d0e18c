// strata.overlap "speculative": "exact", and the step's job always starts
// early, with the constants of a step that is applied and not clipped. It
// updates a group's nvme chunks as soon as the group's gradients are in, into
// a second version of their state, and the group's new compute copies into a
// pinned shadow; step_end's verdict keeps that work (the constants agree bit
// for bit) or throws it away (skipped or clipped step: an ordinary job
// follows). Pinned and device chunks wait for the verdict
// (JobKind::kSpeculative; a certain step's job is exact's, kCertainEarly).
// Reads run ahead of the backward too, so the staging ring is deeper.
#include "engine/schedule/modes.h"

namespace strata::engine {
namespace {

constexpr ScheduleExtra kExtra[] = {
    {"speculative_state", Tier::kNvme, ExtraBasis::kNvmeState,
     "the second of the two versions of the nvme optimizer state that strata.overlap \"speculative\" keeps"},
    {"speculative_compute_copies", Tier::kPinned, ExtraBasis::kNvmeGroupCompute,
     "the new compute copies that strata.overlap \"speculative\" holds until step_end"},
};

class SpeculativeSchedule final : public Schedule {
 public:
  OverlapMode mode() const override { return OverlapMode::kSpeculative; }
  std::string_view name() const override { return "speculative"; }
  std::int64_t ring_depth() const override { return 6; }
  std::span<const ScheduleExtra> extra_memory() const override { return kExtra; }
  bool second_state_version() const override { return true; }
  bool early_jobs(const StepRules&) const override { return true; }
  // A certain step's early job has nothing to undo (as under "exact"); any
  // other is speculative.
  JobKind early_job_kind(const StepRules& rules) const override {
    return rules.certain() ? JobKind::kCertainEarly : JobKind::kSpeculative;
  }
};

}  // namespace

const Schedule& speculative_schedule() {
  static const SpeculativeSchedule s;
  return s;
}

}  // namespace strata::engine
