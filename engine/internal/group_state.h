// The engine's per-group state (engine.cpp, prefetch.cpp). Private to engine/.
#pragma once

#include <cstdint>
#include <string>

#include "engine/engine.h"
#include "gpu/device.h"

namespace strata::engine {

// A fetch group's compute copies and its transient device buffers.
struct Engine::GroupState {
  gpu::DeviceBuffer working;      // device copy while fetched (home elsewhere)
  bool fetched = false;
  gpu::DeviceBuffer grad;         // gradients, between grad_buffer and grads_ready
  int grads_micro_step = -1;      // the micro-batch whose gradients arrived
};

}  // namespace strata::engine
