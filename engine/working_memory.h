// The pinned memory a step works in beyond the placement's state
// (Layout::bytes) and its schedule's extra copies (Schedule::extra_memory):
// the staging buffers of the gradient path, of compute copies whose home is
// not pinned memory, and of the calls between steps (checkpoints,
// read_state). Engine::finalize reserves it before the disk pipeline's ring
// takes what is left, so the smallest strata.budgets.pinned that works is
// known up front: state + extra + total() + one ring slot (when optimizer
// state lives on nvme). Each figure is an upper bound the engine keeps to
// (GradientPath holds at most kGradientCopiesInFlight copies down at once).
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/layout.h"
#include "engine/memory_model.h"

namespace strata::engine {

// Gradient copies down (device -> pinned) a threaded gradient path holds at
// once: one being passed into the host gradients, one landing.
inline constexpr int kGradientCopiesInFlight = 2;

struct PinnedWorking {
  std::uint64_t gradient_staging = 0;  // copies down and the packed gradient pass
  std::uint64_t compute_staging = 0;   // non-pinned compute homes read for a fetch, a prefetch, the optimizer
  std::uint64_t optimizer_copies = 0;  // speculative jobs' new compute copies of device-resident chunks
  std::uint64_t between_steps = 0;     // one chunk's state and one group's compute copies (checkpoints)
  std::uint64_t step() const { return gradient_staging + compute_staging + optimizer_copies; }
  std::uint64_t total() const { return step() > between_steps ? step() : between_steps; }
};

// `threaded`: Schedule::threaded (copies, passes, prefetches and the
// optimizer on their own threads); `early_jobs`: the schedule's early jobs
// may be uncertain (speculative), holding shadow copies.
PinnedWorking pinned_working_bytes(const Layout& layout, bool threaded, bool early_jobs);

// The disk pipeline's staging ring's shape for this layout (RingShape,
// memory_model.h: one slot holds the largest nvme chunk's master and
// moments, ring_slot_bytes); its slots are memory_model.h's ring_slots.
RingShape ring_shape(const Layout& layout);

}  // namespace strata::engine
