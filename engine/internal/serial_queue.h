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
  ~SerialQueue() {
    {
      const core::MutexLock lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }
  SerialQueue(const SerialQueue&) = delete;
  SerialQueue& operator=(const SerialQueue&) = delete;

  void post(std::function<core::Status()> job) {
    const core::MutexLock lock(mu_);
    jobs_.push_back(std::move(job));
    cv_.notify_all();
  }

  core::Status drain() {
    const core::MutexLock lock(mu_);
    cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return jobs_.empty() && !busy_; });
    return error_;
  }

 private:
  void run() {
    const core::MutexLock lock(mu_);
    for (;;) {
      cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left
      std::function<core::Status()> job = std::move(jobs_.front());
      jobs_.pop_front();
      if (!error_.ok()) {  // after a failure nothing more runs
        cv_.notify_all();
        continue;
      }
      busy_ = true;
      mu_.unlock();
      core::Status s = job();
      mu_.lock();
      busy_ = false;
      if (!s.ok() && error_.ok()) error_ = std::move(s);
      cv_.notify_all();
    }
  }

  core::Mutex mu_;
  core::CondVar cv_;
  std::deque<std::function<core::Status()>> jobs_;
  bool busy_ = false;
  bool stop_ = false;
  core::Status error_;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace strata::engine
