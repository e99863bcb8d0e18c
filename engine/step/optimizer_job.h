// OptimizerJob: one step's optimizer work, as step_end (or an early start)
// hands it to the optimizer runner (engine/step/optimizer_runner.h), which
// runs it through the job body (engine/step/optimizer.h). Its kind
// (engine/step/job_kind.h, decided by the schedule) says what the body does
// differently; the predicates below name those differences. Private to
// engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/numerics.h"
#include "engine/step/job_kind.h"
#include "engine/step/verdict.h"
#include "engine/step_stats.h"
#include "engine/tier.h"

namespace strata::engine {

// A verdict the job takes itself (Schedule::defers_verdicts, a kDelayed
// job's): it waits for the gradient marker `marker`, then decides skip and
// clipping from the norm and the inf/NaN flag as step_end would have, and
// computes the job's constants from `hyper` (Optimizer::take_verdict).
struct DeferredVerdict {
  std::int64_t marker = 0;     // GradientPath::post_marker's number
  std::int64_t norm_step = 0;  // the verdict's place among all verdicts (StepStats::norm_step)
  std::vector<core::numerics::AdamHyperparams> hyper;  // per optimizer group
};

struct OptimizerJob {
  std::int64_t id = 0;    // set by OptimizerRunner::submit
  std::int64_t step = 0;  // the optimizer step it applies
  JobKind kind = JobKind::kOrdinary;
  std::vector<UpdateConstants> constants;  // per optimizer group (a deferred verdict fills them in)
  // What they were made of (update_constants_at): the constants of a
  // parameter whose step count is not `step` (strata.no_grad "skip").
  std::vector<core::numerics::AdamHyperparams> hyper;  // per optimizer group
  double grad_scale = 1.0;
  std::vector<std::size_t> order;                // groups, in the order the next forward needs them
  std::size_t read_ahead = 0;                    // nvme chunks read ahead of Adam
  bool write_behind = false;                     // false: each write is waited for at once
  // An early job's `order` is the backward's, and `rank` each group's place
  // in the next forward (the order after the verdict).
  std::vector<std::size_t> rank;
  // Per group, for a kCertainEarly job: wait for the verdict all the same
  // (see Step::start_early_job).
  std::vector<bool> deferred;
  // Set when the job takes its own verdict; the verdict goes to `verdict`.
  std::optional<DeferredVerdict> deferred_verdict;
  VerdictRecord verdict;
  // Written by the job, read after it finished (OptimizerRunner::finish).
  StepBytes bytes;
  double seconds = 0.0;
  std::int64_t discarded_elems = 0;  // elements updated speculatively and thrown away

  // --- what the kind changes ---
  // Started before step_end's verdict (Schedule::early_jobs): it passes the
  // runner's gate before it updates a group and becomes the decided job only
  // at its verdict (OptimizerRunner::settle).
  bool early() const { return kind == JobKind::kSpeculative || kind == JobKind::kCertainEarly; }
  // Its work before the verdict may be thrown away: nvme chunks are written
  // to the next version of their state, committed per group once applied.
  bool updates_into_next_version() const { return kind == JobKind::kSpeculative; }
  // The new compute copies wait as pending (ComputeHomes::hold_pending) for
  // the next step_end instead of going home.
  bool holds_compute_pending() const { return kind == JobKind::kDelayed; }
  // A pinned compute home is not written in place: the new copies go into a
  // copy of it (a speculative shadow, or the pending copies).
  bool shadows_pinned_compute() const { return updates_into_next_version() || holds_compute_pending(); }
  // Before the verdict, group g's chunk with state in `state` is updated as
  // soon as g's gradients are in: a certain job's (unless g is deferred),
  // a speculative job's on nvme (its current state stays intact). The rest
  // waits for the verdict.
  bool updates_before_verdict(std::size_t g, Tier state) const {
    return kind == JobKind::kCertainEarly ? !deferred[g] : state == Tier::kNvme;
  }
  // Before the verdict, a group whose compute copies live in `compute` goes
  // home as soon as it is updated: a certain job's, unless on the device,
  // where the framework may still be reading them.
  bool commits_before_verdict(Tier compute) const {
    return kind == JobKind::kCertainEarly && compute != Tier::kDevice;
  }
};

}  // namespace strata::engine
