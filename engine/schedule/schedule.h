// Schedule: what one overlap mode (strata.overlap) does differently from the
// others, in one place per mode (none.cpp, exact.cpp, speculative.cpp,
// delayed.cpp). The engine's step, the optimizer runner and the planner ask
// the schedule instead of testing the mode; a mode's extra memory is written
// once, here, and measured by finalize (from the layout) and by `strata plan`
// (from the model) alike. engine/README.md describes each mode at length.
//
//   none         every call does its work before it returns: no threads; the
//                optimizer runs inside step_end.
//   exact        (default) gradient passes, the optimizer and prefetches on
//                their own threads and streams; the step's optimizer job runs
//                during the next forward, which waits per group. With certain
//                steps (StepRules::certain) the job starts early and updates
//                each group in place as its gradients arrive.
//   speculative  as exact, and the job always starts early: it updates nvme
//                state into a second version during the backward, kept or
//                thrown away by step_end's verdict.
//   delayed      the one-step delayed update: step N's job runs during step
//                N+1, which computes with the weights from before it; its
//                verdict may be taken by the job itself (deferred).
//
// Results are bit-identical under every mode but "delayed", whose trajectory
// differs by design (DESIGN.md section 6). Schedules are stateless and
// thread-compatible; `schedule_for` returns a static instance.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "engine/config.h"
#include "engine/step/job_kind.h"
#include "engine/tier.h"

namespace strata::engine {

// What decides whether a step's verdict can change anything it does.
struct StepRules {
  bool clipping = false;     // gradient_clipping > 0
  bool loss_scaler = false;  // fp16: DeepSpeed's dynamic loss scaler
  NonfinitePolicy nonfinite = NonfinitePolicy::kSkip;

  static StepRules of(const Config& c) {
    return {c.gradient_clipping > 0.0, c.precision == Precision::kFp16, c.strata.nonfinite};
  }
  // Nothing the gradients hold can change the step's constants or skip it:
  // an optimizer job may update in place as the gradients arrive.
  bool certain() const { return !clipping && !loss_scaler && nonfinite == NonfinitePolicy::kApply; }
};

// An amount of state both finalize and the planner know how to measure.
enum class ExtraBasis {
  kNvmeState,            // the fp32 optimizer state (master and moments) on nvme
  kNvmeGroupCompute,     // compute copies of the groups with optimizer state on nvme
  kTrainableGroupCompute,  // compute copies of the groups with trainable parameters
};

// What each ExtraBasis measures, in bytes, as the engine holds it: the state
// in its chunks, and compute copies in whole groups (a group with one chunk on
// nvme, or one trainable element, holds all its compute copies). Finalize
// takes them from its Layout, the planner from its estimate of it.
struct ExtraShape {
  std::uint64_t nvme_state_bytes = 0;               // every nvme chunk's state, one version
  std::uint64_t nvme_group_compute_bytes = 0;       // compute copies of the groups with a chunk on nvme
  std::uint64_t trainable_group_compute_bytes = 0;  // compute copies of the groups with trainable elements
};
// The bytes of one copy of `basis` (ScheduleExtra::basis) in `shape`.
std::uint64_t extra_bytes(ExtraBasis basis, const ExtraShape& shape);

// Memory a schedule holds beyond the placement's own state.
struct ScheduleExtra {
  std::string_view item;  // the planner's item name ("speculative_state")
  Tier tier;              // kPinned or kNvme
  ExtraBasis basis;       // how much: one copy of this
  std::string_view why;   // "a second version (strata.overlap speculative)"
};

class Schedule {
 public:
  virtual ~Schedule() = default;

  virtual OverlapMode mode() const = 0;
  // The config's spelling: "none", "exact", "speculative", "delayed".
  virtual std::string_view name() const = 0;

  // --- threads and memory ---
  // The gradient path, the optimizer and prefetches run on their own threads
  // and streams, and released copies stay on the device while current
  // (resident). False: every call does its work before it returns.
  virtual bool threaded() const { return true; }
  // Slots of the disk pipeline's staging ring when strata.budgets.staging is
  // derived (measured: docs/benchmarks.md, step).
  virtual std::int64_t ring_depth() const { return 4; }
  // Memory held beyond the placement's state.
  virtual std::span<const ScheduleExtra> extra_memory() const { return {}; }
  // Optimizer state on nvme keeps a second version (StateStore kNext),
  // written by updates that step_end may throw away.
  virtual bool second_state_version() const { return false; }

  // --- the step ---
  // The step's optimizer job starts before step_end: at the first
  // grads_ready of the step's last micro-batch, and the next one at step_end.
  virtual bool early_jobs(const StepRules&) const { return false; }
  // The kind of the job step_end builds once it knows the verdict
  // (Step::make_job). (optional) default: kOrdinary.
  virtual JobKind step_job_kind() const { return JobKind::kOrdinary; }
  // The kind of an early job (asked only when early_jobs(rules)):
  // kCertainEarly or kSpeculative (Step::start_early_job). (optional)
  // default: kCertainEarly.
  virtual JobKind early_job_kind(const StepRules&) const { return JobKind::kCertainEarly; }
  // New compute copies wait in pinned memory until the next step_end
  // (ComputeHomes::hold_pending): the next step computes with the old ones.
  virtual bool delays_update() const { return false; }
  // step_end does not wait for the step's last gradients: the step's own job
  // takes the verdict once they are in (Optimizer::take_verdict).
  virtual bool defers_verdicts(const StepRules&) const { return false; }
  // fetch (and prefetch) of a group whose compute copies live in `compute`
  // waits for the last step's job on it.
  virtual bool fetch_waits_for_optimizer(Tier /*compute*/) const { return true; }
  // grad_buffer and grads_ready wait for the last step's job on the group;
  // false: the gradient pass waits instead, on its own thread.
  virtual bool gradients_wait_for_optimizer() const { return true; }
  // The job updates groups in the backward's order (else the next forward's).
  virtual bool updates_in_backward_order(bool /*compute_on_nvme*/) const { return false; }
};

// The schedule of `mode`: a static instance.
const Schedule& schedule_for(OverlapMode mode);

}  // namespace strata::engine
