// The engine's per-group fetch state: the fetched device copy and the
// gradient buffer (fetch.cpp, step.cpp). Private to engine/.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "gpu/device.h"

namespace strata::engine {

// A fetch group's transient device buffers while a step uses them.
struct Engine::GroupState {
  gpu::DeviceBuffer working;      // device copy while fetched (home elsewhere)
  bool fetched = false;
  std::shared_ptr<gpu::Event> landed;  // after fetch's queued copy into `working` (null: complete)
  gpu::DeviceBuffer grad;         // gradients, between grad_buffer and grads_ready
  int grads_micro_step = -1;      // the micro-batch whose gradients arrived
};

}  // namespace strata::engine
