#include "gpu/arena.h"

#include <algorithm>
#include <iterator>

#include "core/check.h"

namespace strata::gpu {

Arena::Arena(std::uint64_t size_bytes, std::uint64_t alignment)
    : size_bytes_(size_bytes), alignment_(alignment) {
  STRATA_CHECK(alignment > 0 && size_bytes % alignment == 0) << "arena of " << size_bytes << " bytes, alignment "
                                                             << alignment;
  if (size_bytes > 0) free_.emplace(0, size_bytes);
}

std::optional<std::uint64_t> Arena::allocate(std::uint64_t size_bytes, ArenaEnd end) {
  const std::uint64_t need = round_up(size_bytes);
  core::MutexLock lock(mu_);
  if (end == ArenaEnd::kLow) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const std::uint64_t offset = it->first;
      const std::uint64_t left = it->second - need;
      free_.erase(it);
      if (left > 0) free_.emplace(offset + need, left);
      return offset;
    }
    return std::nullopt;
  }
  for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
    if (it->second < need) continue;
    it->second -= need;  // the range keeps its start; the allocation takes its top
    const std::uint64_t offset = it->first + it->second;
    if (it->second == 0) free_.erase(std::next(it).base());
    return offset;
  }
  return std::nullopt;
}

void Arena::free(std::uint64_t offset, std::uint64_t size_bytes) {
  std::uint64_t begin = offset;
  std::uint64_t size = round_up(size_bytes);
  core::MutexLock lock(mu_);
  auto next = free_.lower_bound(begin);
  if (next != free_.end() && begin + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(begin, size);
}

std::uint64_t Arena::largest_free() const {
  core::MutexLock lock(mu_);
  std::uint64_t best = 0;
  for (const auto& [offset, size] : free_) best = std::max(best, size);
  return best;
}

}  // namespace strata::gpu
