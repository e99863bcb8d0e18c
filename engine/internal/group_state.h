// The engine's per-group gradient state: the buffer the framework writes a
// group's gradients into (grad_buffer to grads_ready) and the micro-batch
// whose gradients arrived. Private to engine/.
#pragma once

#include "gpu/device.h"

namespace strata::engine {

struct GroupGradients {
  gpu::DeviceBuffer grad;     // gradients, between grad_buffer and grads_ready
  int grads_micro_step = -1;  // the micro-batch whose gradients arrived
};

}  // namespace strata::engine
