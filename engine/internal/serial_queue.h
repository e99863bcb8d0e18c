// SerialQueue: one worker thread running posted jobs in order (the engine's
// gradient path). drain() waits for every job posted before it and returns
// the first error any job returned (sticky: later jobs are skipped and every
// later drain() returns it too). Thread-safe. The destructor drains and
// joins. Private to engine/.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "core/mutex.h"
#include "core/status.h"

namespace strata::engine {

class SerialQueue {
 public:
  SerialQueue() : thread_([this] { run(); }) {}
  ~SerialQueue() STRATA_EXCLUDES(mu_) {
    {
      const core::MutexLock lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }
  SerialQueue(const SerialQueue&) = delete;
  SerialQueue& operator=(const SerialQueue&) = delete;

  void post(std::function<core::Status()> job) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    jobs_.push_back(std::move(job));
    cv_.notify_all();
  }

  // Returns once every job posted before it has run (or was skipped) and
  // was destroyed, with what it captured.
  core::Status drain() STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return jobs_.empty() && !busy_; });
    return error_;
  }

 private:
  // Each job runs, and is destroyed, without the lock: what its lambda
  // captured may take locks of its own (or post) when it goes. busy_ stays
  // set until then, so drain() still returns only after that.
  void run() STRATA_EXCLUDES(mu_) {
    for (;;) {
      std::function<core::Status()> job;
      bool skip = false;
      {
        const core::MutexLock lock(mu_);
        cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, and nothing left
        job = std::move(jobs_.front());
        jobs_.pop_front();
        skip = !error_.ok();  // after a failure nothing more runs
        busy_ = true;
      }
      core::Status s = skip ? core::Status() : job();
      job = nullptr;
      {
        const core::MutexLock lock(mu_);
        busy_ = false;
        if (!s.ok() && error_.ok()) error_ = std::move(s);
        cv_.notify_all();
      }
    }
  }

  core::Mutex mu_;
  core::CondVar cv_;
  std::deque<std::function<core::Status()>> jobs_ STRATA_GUARDED_BY(mu_);
  bool busy_ STRATA_GUARDED_BY(mu_) = false;  // a popped job is running or being destroyed
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  core::Status error_ STRATA_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace strata::engine
