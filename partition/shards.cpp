#include "partition/shards.h"

#include <algorithm>
#include <limits>

#include "core/str.h"

namespace strata::partition {

core::Result<ShardPlan> plan_shards(std::uint64_t elems, int ranks, std::uint64_t align) {
  if (ranks < 1) return core::Status::invalid_argument(core::str_cat("plan_shards: ranks = ", ranks, " must be >= 1"));
  if (align < 1) return core::Status::invalid_argument("plan_shards: align must be >= 1");
  const std::uint64_t n = static_cast<std::uint64_t>(ranks);
  if (align > std::numeric_limits<std::uint64_t>::max() / n) {
    return core::Status::out_of_range(core::str_cat("plan_shards: ", ranks, " ranks x ", align, " overflows"));
  }
  const std::uint64_t unit = n * align;
  const std::uint64_t units = elems / unit + (elems % unit != 0 ? 1 : 0);
  if (units > std::numeric_limits<std::uint64_t>::max() / unit) {
    return core::Status::out_of_range(core::str_cat("plan_shards: ", elems, " elements padded overflow"));
  }
  ShardPlan p;
  p.elems = elems;
  p.padded_elems = units * unit;
  p.shard_elems = p.padded_elems / n;
  p.shards.resize(n);
  for (std::uint64_t r = 0; r < n; ++r) {
    const std::uint64_t offset = r * p.shard_elems;
    p.shards[r] = {offset, offset >= elems ? 0 : std::min(p.shard_elems, elems - offset)};
  }
  return p;
}

}  // namespace strata::partition
