// OptimizerJob: one step's optimizer work, as step_end (or an early start)
// hands it to the optimizer runner (engine/step/optimizer_runner.h), which
// runs it through the job body (engine/step/optimizer.h). Private to
// engine/.
#pragma once

#include <cstdint>
#include <vector>

#include "core/numerics.h"
#include "engine/step/verdict.h"
#include "engine/step_stats.h"

namespace strata::engine {

struct OptimizerJob {
  std::int64_t id = 0;    // set by OptimizerRunner::submit
  std::int64_t step = 0;  // the optimizer step it applies
  std::vector<UpdateConstants> constants;  // per optimizer group
  std::vector<std::size_t> order;                // groups, in the order the next forward needs them
  std::size_t read_ahead = 0;                    // nvme chunks read ahead of Adam
  bool write_behind = false;                     // false: each write is waited for at once
  // Early (Schedule::early_jobs): started before step_end with the
  // constants the step has unless clipping fires or it is skipped; `order` is
  // then the backward's order and `rank` each group's place in the next
  // forward (the order after the verdict). Unless certain (below), it is
  // speculative: nvme chunks are updated as their group's gradients arrive,
  // into the next version of their state and a shadow of the group's compute
  // copies; nothing is committed before step_end's verdict
  // (OptimizerRunner::settle).
  bool early = false;
  std::vector<std::size_t> rank;
  // Certain (StepRules::certain): the verdict can only be to apply, so
  // every chunk is updated in place as soon as its group's gradients are in,
  // and the group's compute copies go home at once (those on the device,
  // which the framework may still be reading, at the verdict).
  bool certain = false;
  // overlap "delayed": the new compute copies go to ComputeHomes::hold_pending,
  // not home (Engine::commit_pending).
  bool delayed = false;
  // Per group, for a certain job: wait for the verdict all the same (see
  // Engine::start_early_job).
  std::vector<bool> deferred;
  // Deferred verdict (Schedule::defers_verdicts): the job waits for the
  // gradient marker `marker`, then decides skip and clipping from the norm
  // and the inf/NaN flag as step_end would have, and computes `constants`
  // from `hyper` (per optimizer group). Its verdict goes to `verdict`.
  bool deferred_verdict = false;
  std::int64_t marker = 0;
  std::int64_t norm_step = 0;
  std::vector<core::numerics::AdamHyperparams> hyper;
  VerdictRecord verdict;
  // Written by the job, read after it finished (OptimizerRunner::finish).
  StepBytes bytes;
  double seconds = 0.0;
  std::int64_t discarded_elems = 0;  // elements updated speculatively and thrown away
};

}  // namespace strata::engine
