// strata.overlap "none": the sequential schedule. Every call does its work
// before it returns: grads_ready runs the copy down and the gradient pass,
// step_end the whole optimizer (one chunk at a time: no read-ahead, each
// write waited for), fetch copies in line. No threads, no prefetch, no
// resident copies: the reference the other schedules' bits are checked
// against.
#include "engine/schedule/modes.h"

namespace strata::engine {
namespace {

class NoneSchedule final : public Schedule {
 public:
  OverlapMode mode() const override { return OverlapMode::kNone; }
  std::string_view name() const override { return "none"; }
  bool threaded() const override { return false; }
};

}  // namespace

const Schedule& none_schedule() {
  static const NoneSchedule s;
  return s;
}

}  // namespace strata::engine
