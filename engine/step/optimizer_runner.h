// OptimizerRunner: runs the optimizer's jobs one after another on its own
// thread (every schedule but "none", where submit runs a job to the end in
// the caller), and keeps what the step's calls wait on:
//  - per group, the last job done with it (its new compute copies home): the
//    next step's fetch, grad_buffer and grads_ready of a group wait for the
//    last decided job's mark only, so the next forward overlaps the job;
//  - the first error of any job (sticky: every later wait returns it);
//  - for early jobs (Schedule::early_jobs), started before their verdict:
//    the gradient path's note that a group's gradients are in, the verdict
//    (apply: the job becomes the decided one; stop: it stops, and settle
//    waits until it no longer reads the gradients, or the current state),
//    and the gate the job passes before updating a group;
//  - the finished jobs' traffic, seconds and deferred verdicts, taken by the
//    next step_end.
// The job body is handed in (Run: Optimizer::run, engine/step/optimizer.h).
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "core/result.h"
#include "engine/step/optimizer_job.h"

namespace strata::engine {

class OptimizerRunner {
 public:
  using Run = std::function<core::Status(OptimizerJob& job)>;
  OptimizerRunner(std::size_t groups, bool threaded, Run run);
  // stop(), if not done.
  ~OptimizerRunner();
  OptimizerRunner(const OptimizerRunner&) = delete;
  OptimizerRunner& operator=(const OptimizerRunner&) = delete;

  // Gives the job its id and queues it (threaded) or runs it to the end
  // here (its error, naming the step). A job that is not early
  // (OptimizerJob::early) becomes the decided one, which waits wait for; an
  // early one only at its verdict.
  core::Result<std::int64_t> submit(std::unique_ptr<OptimizerJob> job);
  // The jobs queued run first; an early job still waiting for its verdict
  // stops. Then the thread ends.
  void stop();

  // --- from the job body ---
  // `job` is done with group g.
  void mark_done(std::size_t g, std::int64_t job);
  // An early job's gate before it updates group g (SIZE_MAX: the verdict
  // only): waits until what `until` names, or the verdict, came.
  enum class Until {
    kGradientsIn,  // g's gradients are in: an update before the verdict
    kVerdict,      // the verdict only
  };
  enum class Gate {
    kGo,         // update g (before the verdict: kGradientsIn)
    kGoDecided,  // the verdict applies the job: from now on its work counts
    kStop,       // the verdict (or stop()) stops it
  };
  Gate gate(std::int64_t job, std::size_t g, Until until);
  // A stopping early job no longer reads the host gradients or compute
  // copies (quiet), and no longer reads the current state (reads done).
  void note_quiet(std::int64_t job);
  void note_reads_done(std::int64_t job);

  // --- from the engine's calls ---
  // Wait until the decided job is done with group g / with every group (or
  // finished); then the sticky error, if any, annotated with `op`.
  core::Status wait_group(std::size_t g, const char* op);
  core::Status wait_all(const char* op);
  // Wait until job `job` (or a later one) is done with group g, or every
  // decided job finished; the sticky error.
  core::Status wait_group_job(std::size_t g, std::int64_t job, const char* op);
  // The sticky error only (no wait).
  core::Status error(const char* op);
  // The decided job's id (0: none yet).
  std::int64_t decided();
  // The gradient path: group g's gradients of early job `job` are in.
  void note_grads_in(std::size_t g, std::int64_t job);
  // The k-th group whose gradients came in for early job `job` (the order of
  // the gradient path's passes, which every rank's collectives share), or
  // SIZE_MAX when fewer came in yet.
  std::size_t arrival(std::int64_t job, std::size_t k);
  // An early job's verdict; the sticky error.
  enum class Settle {
    kApply,          // it becomes the decided job
    kStop,           // it stops: waits until it is quiet (note_quiet)
    kStopWithReads,  // as kStop, and until its reads of the current state ended (note_reads_done)
  };
  core::Status settle(std::int64_t job, Settle verdict);

  // What the jobs finished since the last take did.
  struct Totals {
    StepBytes bytes;
    double seconds = 0.0;
    std::int64_t discarded_elems = 0;  // early work thrown away
  };
  Totals take_totals();
  // The verdicts deferred jobs took, in order, since the last take.
  std::deque<VerdictRecord> take_verdicts();

 private:
  void thread_main();
  void finish(const OptimizerJob& job, const core::Status& s);
  // Waits with mu_ held until every decided job finished or done().
  core::Status wait_until(const char* op, const std::function<bool()>& done) STRATA_EXCLUDES(mu_);

  const Run run_;
  core::Mutex mu_;
  core::CondVar cv_;
  std::deque<std::unique_ptr<OptimizerJob>> queue_ STRATA_GUARDED_BY(mu_);
  std::int64_t next_id_ STRATA_GUARDED_BY(mu_) = 0;
  std::int64_t decided_ STRATA_GUARDED_BY(mu_) = 0;   // the last decided job (what waits wait for)
  std::int64_t finished_ STRATA_GUARDED_BY(mu_) = 0;  // the last job finished
  std::vector<std::int64_t> done_ STRATA_GUARDED_BY(mu_);      // per group: the last job done with it
  std::vector<std::int64_t> grads_in_ STRATA_GUARDED_BY(mu_);  // per group: the early job whose gradients are in
  // Per early job until it finished: its groups in the order their gradients came in.
  std::map<std::int64_t, std::vector<std::size_t>> arrivals_ STRATA_GUARDED_BY(mu_);
  std::int64_t verdict_job_ STRATA_GUARDED_BY(mu_) = 0;        // the early job with a verdict, and the verdict
  bool verdict_apply_ STRATA_GUARDED_BY(mu_) = false;
  std::int64_t quiet_ STRATA_GUARDED_BY(mu_) = 0;       // the last early job that stopped reading gradients
  std::int64_t reads_done_ STRATA_GUARDED_BY(mu_) = 0;  // ... and the current state
  core::Status error_ STRATA_GUARDED_BY(mu_);
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  Totals totals_ STRATA_GUARDED_BY(mu_);
  std::deque<VerdictRecord> verdicts_ STRATA_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace strata::engine
