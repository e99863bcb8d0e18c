#include "engine/step/optimizer_runner.h"

#include <algorithm>
#include <utility>

#include "core/str.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

OptimizerRunner::OptimizerRunner(std::size_t groups, bool threaded, Run run) : run_(std::move(run)) {
  {
    const core::MutexLock lock(mu_);
    done_.assign(groups, 0);
    grads_in_.assign(groups, 0);
  }
  if (threaded) thread_ = std::thread([this] { thread_main(); });
}

OptimizerRunner::~OptimizerRunner() { stop(); }

core::Result<std::int64_t> OptimizerRunner::submit(std::unique_ptr<OptimizerJob> job) {
  {
    const core::MutexLock lock(mu_);
    job->id = ++next_id_;
    if (!job->early()) decided_ = job->id;
    if (thread_.joinable()) {
      const std::int64_t id = job->id;
      queue_.push_back(std::move(job));
      cv_.notify_all();
      return id;
    }
  }
  // No thread (overlap "none"): run it here, to the end.
  Status s = run_(*job);
  finish(*job, s);
  if (!s.ok()) return std::move(s).annotate(str_cat("the optimizer of step ", job->step));
  return job->id;
}

void OptimizerRunner::stop() {
  if (!thread_.joinable()) return;
  {
    const core::MutexLock lock(mu_);
    stop_ = true;  // queued jobs still run first (an early one without a verdict stops at once)
    cv_.notify_all();
  }
  thread_.join();
}

void OptimizerRunner::thread_main() {
  for (;;) {
    std::unique_ptr<OptimizerJob> job;
    {
      const core::MutexLock lock(mu_);
      cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    finish(*job, run_(*job));
  }
}

void OptimizerRunner::finish(const OptimizerJob& job, const Status& s) {
  const core::MutexLock lock(mu_);
  finished_ = job.id;
  totals_.bytes += job.bytes;
  totals_.seconds += job.seconds;
  totals_.discarded_elems += job.discarded_elems;
  if (job.early()) {
    quiet_ = std::max(quiet_, job.id);
    reads_done_ = std::max(reads_done_, job.id);
    arrivals_.erase(job.id);
  }
  if (s.ok() && job.deferred_verdict) verdicts_.push_back(job.verdict);
  if (!s.ok() && error_.ok()) error_ = Status(s).annotate(str_cat("the optimizer of step ", job.step));
  cv_.notify_all();
}

void OptimizerRunner::mark_done(std::size_t g, std::int64_t job) {
  const core::MutexLock lock(mu_);
  done_[g] = job;
  cv_.notify_all();
}

OptimizerRunner::Gate OptimizerRunner::gate(std::int64_t job, std::size_t g, Until until) {
  const core::MutexLock lock(mu_);
  cv_.wait(mu_, [&]() STRATA_REQUIRES(mu_) {
    return stop_ || verdict_job_ == job || (until == Until::kGradientsIn && grads_in_[g] == job);
  });
  if (verdict_job_ == job) return verdict_apply_ ? Gate::kGoDecided : Gate::kStop;
  if (stop_) return Gate::kStop;
  return Gate::kGo;
}

void OptimizerRunner::note_quiet(std::int64_t job) {
  const core::MutexLock lock(mu_);
  quiet_ = std::max(quiet_, job);
  cv_.notify_all();
}

void OptimizerRunner::note_reads_done(std::int64_t job) {
  const core::MutexLock lock(mu_);
  reads_done_ = std::max(reads_done_, job);
  cv_.notify_all();
}

core::Status OptimizerRunner::wait_until(const char* op, const std::function<bool()>& done) {
  const core::MutexLock lock(mu_);
  cv_.wait(mu_, [&]() STRATA_REQUIRES(mu_) { return finished_ >= decided_ || done(); });
  if (!error_.ok()) return Status(error_).annotate(str_cat(op, ": the engine cannot go on after its optimizer failed"));
  return Status();
}

core::Status OptimizerRunner::wait_group(std::size_t g, const char* op) {
  return wait_until(op, [&]() STRATA_NO_THREAD_SAFETY_ANALYSIS { return done_[g] >= decided_; });
}

core::Status OptimizerRunner::wait_all(const char* op) {
  return wait_until(op, [] { return false; });
}

core::Status OptimizerRunner::wait_group_job(std::size_t g, std::int64_t job, const char* op) {
  return wait_until(op, [&]() STRATA_NO_THREAD_SAFETY_ANALYSIS { return done_[g] >= job; });
}

core::Status OptimizerRunner::error(const char* op) {
  return wait_until(op, [] { return true; });
}

std::int64_t OptimizerRunner::decided() {
  const core::MutexLock lock(mu_);
  return decided_;
}

void OptimizerRunner::note_grads_in(std::size_t g, std::int64_t job) {
  const core::MutexLock lock(mu_);
  grads_in_[g] = job;
  arrivals_[job].push_back(g);
  cv_.notify_all();
}

std::size_t OptimizerRunner::arrival(std::int64_t job, std::size_t k) {
  const core::MutexLock lock(mu_);
  const auto it = arrivals_.find(job);
  return it != arrivals_.end() && k < it->second.size() ? it->second[k] : SIZE_MAX;
}

core::Status OptimizerRunner::settle(std::int64_t job, Settle verdict) {
  const bool apply = verdict == Settle::kApply;
  const bool reads_too = verdict == Settle::kStopWithReads;
  const core::MutexLock lock(mu_);
  verdict_job_ = job;
  verdict_apply_ = apply;
  if (apply) decided_ = job;  // from now on, fetch and the rest wait for its marks
  cv_.notify_all();
  if (apply) return Status();
  // It must stop reading the host gradients before the next step writes them
  // (and, with kStopWithReads, the current state before the caller reads it).
  cv_.wait(mu_, [&]() STRATA_REQUIRES(mu_) { return quiet_ >= job && (!reads_too || reads_done_ >= job); });
  if (!error_.ok()) return Status(error_).annotate("step_end: the engine cannot go on after its optimizer failed");
  return Status();
}

OptimizerRunner::Totals OptimizerRunner::take_totals() {
  const core::MutexLock lock(mu_);
  return std::exchange(totals_, {});
}

std::deque<VerdictRecord> OptimizerRunner::take_verdicts() {
  const core::MutexLock lock(mu_);
  return std::exchange(verdicts_, {});
}

}  // namespace strata::engine
