#include "engine/schedule/schedule.h"

#include "engine/schedule/modes.h"

namespace strata::engine {

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
