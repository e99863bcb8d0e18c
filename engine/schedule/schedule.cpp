#include "engine/schedule/schedule.h"

#include "engine/schedule/modes.h"

namespace strata::engine {

std::uint64_t extra_bytes(ExtraBasis basis, const ExtraShape& shape) {
  switch (basis) {
    case ExtraBasis::kNvmeState: return shape.nvme_state_bytes;
    case ExtraBasis::kNvmeGroupCompute: return shape.nvme_group_compute_bytes;
    case ExtraBasis::kTrainableGroupCompute: return shape.trainable_group_compute_bytes;
  }
  return 0;
}

const Schedule& schedule_for(OverlapMode mode) {
  switch (mode) {
    case OverlapMode::kNone: return none_schedule();
    case OverlapMode::kExact: return exact_schedule();
    case OverlapMode::kSpeculative: return speculative_schedule();
    case OverlapMode::kDelayed: return delayed_schedule();
  }
  return exact_schedule();
}

}  // namespace strata::engine
