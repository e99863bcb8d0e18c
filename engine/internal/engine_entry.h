// The first line of every public Engine member function (engine.cpp,
// save_load.cpp): holds the engine's lock until the function returns, and
// refuses any call while finalize runs (finalize lets go of the lock around
// each init callback, so a callback that calls into the engine gets an
// error, not a deadlock). Private to engine/.
#pragma once

#include "core/mutex.h"

#define STRATA_ENGINE_ENTRY(op)                                   \
  const ::strata::core::MutexLock strata_engine_lock_(mu_);       \
  if (finalizing_) return finalize_running(op)
