// partition/shards.h: how a fetch group's flat buffer is cut among N ranks
// (DESIGN.md section 10), as plain data. The buffer is padded to a multiple
// of N x `align` elements and cut into N equal shards, so that every
// collective moves equal counts; rank r owns [r * shard, (r + 1) * shard) of
// the padded buffer, of which `size` elements are real (the rest padding, the
// last ranks' shards possibly all padding). With `align` the norm block
// (core/numerics.h kNormBlockElems) every shard starts on a block, so the
// global squared norm stays a sum over whole blocks whatever N is.
#pragma once

#include <cstdint>
#include <vector>

#include "core/result.h"

namespace strata::partition {

struct Shard {
  std::uint64_t offset = 0;  // the shard's first element in the padded buffer
  std::uint64_t size = 0;    // real elements in it (<= ShardPlan::shard_elems)

  bool operator==(const Shard&) const = default;
};

struct ShardPlan {
  std::uint64_t elems = 0;         // the buffer's real elements
  std::uint64_t padded_elems = 0;  // ranks x shard_elems
  std::uint64_t shard_elems = 0;   // every rank's count in a collective
  std::vector<Shard> shards;       // one per rank

  // The rank owning element i (i < elems).
  int owner(std::uint64_t i) const { return static_cast<int>(i / shard_elems); }
};

// The plan for `elems` elements over `ranks` ranks with shards starting on
// multiples of `align` elements. INVALID_ARGUMENT for ranks < 1 or align < 1,
// OUT_OF_RANGE when the padded size overflows.
core::Result<ShardPlan> plan_shards(std::uint64_t elems, int ranks, std::uint64_t align);

}  // namespace strata::partition
