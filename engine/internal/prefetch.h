// One prefetched group (engine/prefetch.cpp): its device buffer and the
// copy's outcome. Private to engine/.
#pragma once

#include "core/mutex.h"
#include "core/status.h"
#include "engine/engine.h"

namespace strata::engine {

struct Engine::Prefetch {
  gpu::DeviceBuffer buffer;
  core::Mutex mu;
  core::CondVar cv;
  bool done = false;  // mu
  core::Status status;      // mu
  StepBytes bytes;    // written by the copy, read after done
  void finish(core::Status s) {
    const core::MutexLock lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  }
  core::Status wait() {
    const core::MutexLock lock(mu);
    cv.wait(mu, [this]() STRATA_REQUIRES(mu) { return done; });
    return status;
  }
};

}  // namespace strata::engine
