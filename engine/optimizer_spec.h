// The optimizer seam: what an optimizer keeps per trainable element, read by
// everything that sizes, stores, moves or names the state (layout, state
// store, disk pipeline, working memory, finalize's budgets, checkpoints,
// read_state, the planner) instead of "three fp32 arrays". Its update is
// cpu_adam's (lion_step, adagrad_step, step) on the host and the device's
// optimizer_step on the device, dispatched on `type` by the optimizer's job
// (engine/step/optimizer.cpp).
//
// A chunk's state is `arrays` fp32 arrays of its elements, kept together as
// [master | state 1 | state 2]: the master weight first, then the
// optimizer's own arrays under their checkpoint names.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "core/numerics.h"
#include "engine/config.h"

namespace strata::engine {

struct OptimizerSpec {
  OptimizerType type = OptimizerType::kAdamW;
  int arrays = 3;  // fp32 arrays per trainable element, the master included
  // The arrays' names in checkpoints, exports and read_state: "master", then
  // the optimizer's (DeepSpeed's names: Adagrad's sum of squares is "exp_avg_sq").
  std::array<std::string_view, 3> names{"master", "exp_avg", "exp_avg_sq"};

  std::uint64_t bytes_per_elem() const { return 4 * static_cast<std::uint64_t>(arrays); }
  // The index of the array called `name` (0: master), or -1.
  int index_of(std::string_view name) const {
    for (int i = 0; i < arrays; ++i) {
      if (names[static_cast<std::size_t>(i)] == name) return i;
    }
    return -1;
  }
};

// One optimizer group's constants for one step: the member of the spec's type
// is used (AdamW and Adam: adam). All floats, so two compare with memcmp.
struct UpdateConstants {
  core::numerics::AdamStepConstants adam;
  core::numerics::LionStepConstants lion;
  core::numerics::AdagradStepConstants adagrad;
};

inline const OptimizerSpec& optimizer_spec(OptimizerType type) {
  static const OptimizerSpec kAdam{OptimizerType::kAdam, 3, {"master", "exp_avg", "exp_avg_sq"}};
  static const OptimizerSpec kAdamW{OptimizerType::kAdamW, 3, {"master", "exp_avg", "exp_avg_sq"}};
  static const OptimizerSpec kLion{OptimizerType::kLion, 2, {"master", "exp_avg", ""}};
  static const OptimizerSpec kAdagrad{OptimizerType::kAdagrad, 2, {"master", "exp_avg_sq", ""}};
  switch (type) {
    case OptimizerType::kAdam: return kAdam;
    case OptimizerType::kAdamW: return kAdamW;
    case OptimizerType::kLion: return kLion;
    case OptimizerType::kAdagrad: return kAdagrad;
  }
  return kAdamW;
}

}  // namespace strata::engine
