// CpuTurns: cpu_adam runs one call at a time (each call uses all of its
// threads), and some calls are more urgent than others. A gradient pass is
// on the backward's critical path: the gradient thread copies the next
// group's gradients down only after it, and step_end waits for the last one.
// The optimizer's Adam is not: it works in slices and takes its next slice
// only when no gradient pass is waiting, so a pass waits at most one slice.
//
//   CpuTurns turns;
//   { CpuTurns::Turn t(turns, CpuTurns::kUrgent); ... }      // gradient pass
//   { CpuTurns::Turn t(turns, CpuTurns::kBackground); ... }  // one Adam slice
//
// Thread-safe.
#pragma once

#include "core/mutex.h"

namespace strata::engine {

class CpuTurns {
 public:
  enum Priority { kUrgent, kBackground };

  class Turn {
   public:
    Turn(CpuTurns& turns, Priority p) : turns_(turns) { turns_.acquire(p); }
    ~Turn() { turns_.release(); }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

   private:
    CpuTurns& turns_;
  };

 private:
  void acquire(Priority p) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    if (p == kUrgent) ++urgent_waiting_;
    cv_.wait(mu_, [&]() STRATA_REQUIRES(mu_) { return !busy_ && (p == kUrgent || urgent_waiting_ == 0); });
    if (p == kUrgent) --urgent_waiting_;
    busy_ = true;
  }
  void release() STRATA_EXCLUDES(mu_) {
    {
      const core::MutexLock lock(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }

  core::Mutex mu_;
  core::CondVar cv_;
  bool busy_ STRATA_GUARDED_BY(mu_) = false;
  int urgent_waiting_ STRATA_GUARDED_BY(mu_) = 0;
};

}  // namespace strata::engine
