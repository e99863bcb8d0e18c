// DoneLatch: work that another thread finishes once, and its outcome:
// finish(status) on the worker's side, wait() on the taker's, which blocks
// until then and returns the status. Whatever else the work wrote (its
// buffers, events, traffic) is the taker's to read once wait() returned.
// Thread-safe. Private to engine/.
#pragma once

#include <utility>

#include "core/mutex.h"
#include "core/status.h"

namespace strata::engine {

class DoneLatch {
 public:
  void finish(core::Status s) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    status_ = std::move(s);
    done_ = true;
    cv_.notify_all();
  }
  core::Status wait() STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return done_; });
    return status_;
  }

 private:
  core::Mutex mu_;
  core::CondVar cv_;
  bool done_ STRATA_GUARDED_BY(mu_) = false;
  core::Status status_ STRATA_GUARDED_BY(mu_);
};

}  // namespace strata::engine
