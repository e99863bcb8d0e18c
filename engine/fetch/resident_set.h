// ResidentSet: compute copies kept on the device after release(), while they
// still hold what the compute copies hold (until an optimizer updates them),
// so that the next fetch takes them back without a copy. Groups of at most
// stage3_param_persistence_threshold elements always stay (persistent); the
// others share stage3_max_live_parameters with the fetched and prefetched
// groups, and when room is needed the copy used again farthest ahead in the
// learned fetch sequence goes first (Belady's rule), never one used before
// the copy that wants the room. Dropped copies go back to the device cache
// with their fences (the framework's last work on them). Thread-compatible
// (the engine's lock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>

#include "engine/fetch/fetch_trace.h"
#include "engine/internal/buffer_cache.h"
#include "engine/layout.h"
#include "gpu/device.h"

namespace strata::engine {

// Which device copies of compute copies to drop: all of them, or those an
// optimizer step updates (frozen groups keep theirs).
enum class DropCopies { kAll, kUpdated };

class ResidentSet {
 public:
  // `max_live_bytes`: stage3_max_live_parameters in bytes of the compute dtype.
  ResidentSet(const Layout& layout, std::int64_t persistence_threshold, std::uint64_t max_live_bytes,
              BufferCache<gpu::DeviceBuffer>& cache)
      : layout_(layout), persistence_threshold_(persistence_threshold), max_live_(max_live_bytes), cache_(cache) {}
  ResidentSet(const ResidentSet&) = delete;
  ResidentSet& operator=(const ResidentSet&) = delete;
  ~ResidentSet() { drop(DropCopies::kAll); }

  // Whether group g's copy stays whatever the room (small groups).
  bool persistent(std::size_t g) const;
  // Keeps group g's released copy (replacing one kept before).
  void keep(std::size_t g, gpu::DeviceBuffer buffer, std::shared_ptr<gpu::Event> fence);
  // Group g's kept copy, handed back with its release's fence (null: none),
  // which a reader waits for: a fetch's queued copy into the buffer may end
  // only with the framework's work the fence follows.
  struct Taken {
    gpu::DeviceBuffer buffer;
    std::shared_ptr<gpu::Event> fence;
  };
  std::optional<Taken> take(std::size_t g);
  bool contains(std::size_t g) const { return kept_.contains(g); }
  bool empty() const { return kept_.empty(); }
  // Bytes of the non-persistent copies (those counted against the room).
  std::uint64_t live_bytes() const;
  // Evicts non-persistent copies, farthest next use in `trace` first, until
  // `live + bytes` fits within stage3_max_live_parameters or none is left
  // whose next use comes after `before` (a position in the trace; SIZE_MAX:
  // any). `live` is every device copy of compute copies now (fetched,
  // prefetched, these); returns it after the evictions.
  std::uint64_t make_room(std::uint64_t live, std::uint64_t bytes, std::size_t before, const FetchTrace& trace);
  std::uint64_t max_live_bytes() const { return max_live_; }
  void drop(DropCopies which);

 private:
  struct Kept {
    gpu::DeviceBuffer buffer;
    std::shared_ptr<gpu::Event> fence;  // release's: the framework's last work on it
  };
  const Layout& layout_;
  const std::int64_t persistence_threshold_;
  const std::uint64_t max_live_;
  BufferCache<gpu::DeviceBuffer>& cache_;
  std::map<std::size_t, Kept> kept_;
};

}  // namespace strata::engine
