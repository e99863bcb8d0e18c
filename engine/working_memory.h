// The engine's side of memory_model.h's layout-shaped formulas: the largest
// buffers of a Layout that the step's pinned working memory (PinnedWorking,
// pinned_working) and the disk pipeline's ring (RingShape) are sized by.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/layout.h"
#include "engine/memory_model.h"

namespace strata::engine {

// memory_model.h's pinned_working for this layout's WorkingShape (each
// figure the largest over its groups and chunks). `threaded`:
// Schedule::threaded; `early_jobs`: the schedule's early jobs may be
// uncertain (speculative), holding shadow copies.
PinnedWorking pinned_working_bytes(const Layout& layout, bool threaded, bool early_jobs);

// Several ranks summing their gradients on the device
// (RankShare::device_collectives): the gradient path's device buffer, the
// largest group's trainable elements in the sums' dtype (RankShare::sum_bytes), rounded up to `align`
// (gpu::Device::allocate); 0 otherwise.
std::uint64_t device_sums_bytes(const Layout& layout, std::uint64_t align);

// The disk pipeline's staging ring's shape for this layout (RingShape,
// memory_model.h: one slot holds the largest nvme chunk's master and
// moments, ring_slot_bytes); its slots are memory_model.h's ring_slots.
RingShape ring_shape(const Layout& layout);

}  // namespace strata::engine
