// JobKind: what kind of optimizer job a step gets, as its schedule decides
// (engine/schedule/schedule.h: step_job_kind, early_job_kind) and the job
// body acts on (engine/step/optimizer_job.h). Its own header so that the
// schedules name it without seeing the job. Private to engine/.
#pragma once

namespace strata::engine {

enum class JobKind {
  // Built by step_end once the verdict is known: every chunk in place, the
  // new compute copies home as each group is done.
  kOrdinary,
  // Early (started before step_end's verdict, with the constants of a step
  // that is applied and not clipped) and undoable: nvme chunks go into the
  // next version of their state as their group's gradients are in, the new
  // compute copies into a shadow; everything else waits for the verdict,
  // which keeps the work or throws it away.
  kSpeculative,
  // Early, for a certain step (StepRules::certain: the verdict can only be to
  // apply): every chunk in place as its group's gradients are in, and the new
  // compute copies home at once (those on the device at the verdict).
  kCertainEarly,
  // The one-step delayed update: as kOrdinary, but the new compute copies
  // wait in pinned memory (ComputeHomes::hold_pending) until the next
  // step_end. Only such a job may take its own verdict (DeferredVerdict).
  kDelayed,
};

}  // namespace strata::engine
