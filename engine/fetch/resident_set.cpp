#include "engine/fetch/resident_set.h"

namespace strata::engine {

bool ResidentSet::persistent(std::size_t g) const {
  return layout_.groups[g].compute_elems <= persistence_threshold_;
}

void ResidentSet::keep(std::size_t g, gpu::DeviceBuffer buffer, std::shared_ptr<gpu::Event> fence) {
  auto it = kept_.find(g);
  if (it != kept_.end()) cache_.put(std::move(it->second.buffer), std::move(it->second.fence));
  kept_[g] = Kept{std::move(buffer), std::move(fence)};
}

std::optional<ResidentSet::Taken> ResidentSet::take(std::size_t g) {
  auto it = kept_.find(g);
  if (it == kept_.end()) return std::nullopt;
  Taken t{std::move(it->second.buffer), std::move(it->second.fence)};
  kept_.erase(it);
  return t;
}

std::uint64_t ResidentSet::live_bytes() const {
  std::uint64_t live = 0;
  for (const auto& [g, k] : kept_) {
    if (!persistent(g)) live += k.buffer.size_bytes();
  }
  return live;
}

std::uint64_t ResidentSet::make_room(std::uint64_t live, std::uint64_t bytes, std::size_t before,
                                     const FetchTrace& trace) {
  while (live + bytes > max_live_) {
    auto victim = kept_.end();
    std::size_t victim_use = 0;
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (persistent(it->first)) continue;
      const std::size_t use = trace.next_use(it->first);
      if (victim == kept_.end() || use > victim_use) {
        victim = it;
        victim_use = use;
      }
    }
    // Keep a copy used again before the one that wants the room.
    if (victim == kept_.end() || (before != SIZE_MAX && victim_use <= before)) break;
    live -= victim->second.buffer.size_bytes();
    cache_.put(std::move(victim->second.buffer), std::move(victim->second.fence));
    kept_.erase(victim);
  }
  return live;
}

void ResidentSet::drop(DropCopies which) {
  for (auto it = kept_.begin(); it != kept_.end();) {
    if (which == DropCopies::kUpdated && layout_.groups[it->first].chunk_count == 0) {
      ++it;  // frozen: its copy stays what the compute copies hold
      continue;
    }
    cache_.put(std::move(it->second.buffer), std::move(it->second.fence));
    it = kept_.erase(it);
  }
}

}  // namespace strata::engine
