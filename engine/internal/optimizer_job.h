// One step's optimizer work, as step_end hands it to the optimizer
// (engine/optimizer.cpp). Private to engine/.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/core/numerics.h"
#include "engine/engine.h"

namespace strata::engine {

struct Engine::OptimizerJob {
  std::int64_t id = 0;    // set by submit_optimizer_job
  std::int64_t step = 0;  // the optimizer step it applies
  std::vector<core::numerics::AdamStepConstants> constants;  // per optimizer group
  std::vector<std::size_t> order;                // groups, in the order the next forward needs them
  std::size_t read_ahead = 0;                    // nvme chunks read ahead of Adam
  bool write_behind = false;                     // false: each write is waited for at once
};

}  // namespace strata::engine
