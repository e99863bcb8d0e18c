// Housekeeping of a checkpoint root after a save (docs/checkpoints.md):
// retention (keep the newest K checkpoints and every M-th step) and the
// removal of what interrupted saves left behind (.step-<N>.tmp folders).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"

namespace strata::engine {

// strata.checkpoint.keep_last / keep_every.
struct RetentionPolicy {
  std::int64_t keep_last = 0;   // keep the newest K checkpoints (by step); 0: keep all
  std::int64_t keep_every = 0;  // also keep every checkpoint whose step is a multiple of M; 0: none
};

// The steps among `steps` (the step-<N> folders of a root) that `policy`
// removes: all but the newest keep_last and the multiples of keep_every, and
// never `latest_step` (the folder `latest` names). Nothing when keep_last is
// 0. Pure; the result is sorted.
std::vector<std::int64_t> checkpoints_to_remove(std::span<const std::int64_t> steps, std::int64_t latest_step,
                                                const RetentionPolicy& policy);

// Removes the checkpoints `policy` does not keep from `root` (step-<N>
// folders only; anything else there is left alone), each with an info line
// naming it. `latest_step` is the step `latest` names (the save that just
// became latest). Returns the folders removed. Errors: kIoError/errno naming
// the folder that could not be listed or removed (those before it are gone).
core::Result<std::vector<std::string>> apply_retention(const std::string& root, std::int64_t latest_step,
                                                       const RetentionPolicy& policy);

// Removes the ".step-<N>.tmp" folders interrupted saves left in `root`, each
// with an info line naming it and its size. Returns the folders removed.
// Errors as apply_retention.
core::Result<std::vector<std::string>> remove_interrupted_saves(const std::string& root);

}  // namespace strata::engine
