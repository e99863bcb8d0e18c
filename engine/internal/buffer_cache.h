// BufferCache: device or pinned buffers the step asks for again and again
// (fetched groups, gradients, their host staging) kept for reuse by exact
// size, so a step does not fault in fresh pages for every call. A cached
// buffer stays charged to its budget; when an allocation is refused for
// lack of budget (kResourceExhausted: the budget, or a device arena with no
// free range that large), the cache gives everything back and tries again (while it
// had anything to give), so caching never makes a placement fail. A buffer may come back with a fence:
// an event after which nothing else reads it (the framework's last kernels
// on a released group); get() hands it out only once the fence has passed,
// and clear() frees it only then; get_fenced() hands it out at once, with
// its fence, for a caller that orders its own writes after it on a stream
// (and prefers a buffer whose fence has passed). An optional divert takes
// buffers put() is given before the cache keeps them (the device memory of
// views lent to the framework: engine/internal/view_holds.h), and hands
// them back later through put_returned().
//
// Device buffers come from either end of the device's arena (gpu::ArenaEnd:
// fetched copies from the low end, gradients and an update's working
// copies from the high end), and the cache keeps them apart by end. An
// optional headroom (the device budget's bytes left) tells the cache when
// the budget is tight: when the memory in use (charged, less what the cache
// holds) leaves no more room than this buffer and the largest one allocated
// so far. Then a get() gives back the cached buffers of its end first, each
// once its fence has passed, and places its buffer afresh, lowest (or
// highest) first; a low-end hit too: a cached buffer left below a new one
// would, once given back, leave a range too small for the next large one,
// and a fetched group's cached buffer placed while another group was still
// read may sit above the room that one left (the least budget the planner
// names has none to spare). A device runs behind the host: the group released
// last is still read when the next is fetched; waiting for it there, under a
// tight budget only, is what places the next where the one after can fit.
// A high-end hit (gradients, an update's working copies) is kept: the
// optimizer's update has no fallback if a fresh one were refused. Thread-safe.
// Private to engine/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "core/mutex.h"
#include "core/result.h"
#include "gpu/device.h"

namespace strata::engine {

// The arena end a buffer came from: its own for a device buffer, the low end
// for any other kind.
template <typename Buffer>
gpu::ArenaEnd arena_end_of(const Buffer& b) {
  if constexpr (requires { b.arena_end(); }) {
    return b.arena_end();
  } else {
    return gpu::ArenaEnd::kLow;
  }
}

template <typename Buffer>
class BufferCache {
 public:
  using Allocate =
      std::function<core::Result<Buffer>(std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end)>;
  // Blocks until the fence's work is done (the device's synchronize).
  using Wait = std::function<core::Status(gpu::Event& fence)>;
  // Whether the fence's work is done, without waiting (the device's query).
  // Called with the cache's lock held (get_fenced): it must not block, nor
  // call back into this cache.
  using Query = std::function<core::Result<bool>(gpu::Event& fence)>;
  // Takes a buffer put() is given, with its fence, instead of the cache
  // (returns true; it then owns both), or leaves both as they are (false).
  // Called without the cache's lock.
  using Divert = std::function<bool(Buffer& b, std::shared_ptr<gpu::Event>& fence)>;
  // The bytes the budget behind the allocator still allows.
  using Headroom = std::function<std::uint64_t()>;
  explicit BufferCache(Allocate allocate, Wait wait = nullptr, Query query = nullptr, Divert divert = nullptr)
      : allocate_(std::move(allocate)), wait_(std::move(wait)), query_(std::move(query)), divert_(std::move(divert)) {}

  // With a headroom, a get() under a tight budget (above) gives back the
  // cached buffers of its end (each after its fence), a low-end hit among
  // them, and allocates afresh. Set before first use.
  void set_headroom(Headroom headroom) { headroom_ = std::move(headroom); }

  struct Fenced {
    Buffer buffer;
    std::shared_ptr<gpu::Event> fence;  // null: free to write now
  };
  // A cached buffer of exactly `bytes` without waiting for its fence (one
  // whose fence has passed first), or a new one. Asks query_ about the
  // cached fences of that size while holding the cache's lock (a
  // non-blocking device call; the lock order is the cache's lock, then
  // whatever the device's query takes).
  core::Result<Fenced> get_fenced(std::uint64_t bytes, const std::string& what,
                                  gpu::ArenaEnd end = gpu::ArenaEnd::kLow) STRATA_EXCLUDES(mu_) {
    {
      const core::MutexLock lock(mu_);
      auto [lo, hi] = free_.equal_range(Key{end, bytes});
      auto pick = hi;
      for (auto it = lo; it != hi; ++it) {
        if (it->second.fence == nullptr || query_ == nullptr) {
          pick = it;
          break;
        }
        core::Result<bool> done = query_(*it->second.fence);
        if (done.ok() && *done) {
          it->second.fence.reset();
          pick = it;
          break;
        }
        if (pick == hi) pick = it;  // the oldest, if none has passed
      }
      if (pick != hi) {
        Fenced f{std::move(pick->second.buffer), std::move(pick->second.fence)};
        cached_bytes_ -= bytes;
        free_.erase(pick);
        return f;
      }
    }
    STRATA_ASSIGN_OR_RETURN(Buffer b, get(bytes, what, end));
    return Fenced{std::move(b), nullptr};
  }

  // A cached buffer of exactly `bytes` (after its fence; one whose fence has
  // passed first), or a new one.
  core::Result<Buffer> get(std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end = gpu::ArenaEnd::kLow)
      STRATA_EXCLUDES(mu_) {
    Entry e;
    bool cached = false;
    std::multimap<Key, Entry> drop;  // given back below, without the lock
    {
      const core::MutexLock lock(mu_);
      auto [lo, hi] = free_.equal_range(Key{end, bytes});
      auto it = lo;
      for (auto c = lo; query_ != nullptr && c != hi; ++c) {
        if (c->second.fence == nullptr) {
          it = c;
          break;
        }
        const core::Result<bool> done = query_(*c->second.fence);
        if (done.ok() && *done) {
          c->second.fence.reset();  // passed: nothing to wait for
          it = c;
          break;
        }
      }
      if (tight(bytes) && (it == hi || end == gpu::ArenaEnd::kLow)) {
        // Placed afresh, after the end's cached buffers are given back: a
        // cached one may sit above a range that has come free since.
        auto c = free_.lower_bound(Key{end, 0});
        while (c != free_.end() && c->first.first == end) {
          cached_bytes_ -= c->first.second;
          drop.insert(free_.extract(c++));
        }
      } else if (it != hi) {
        e = std::move(it->second);
        cached_bytes_ -= bytes;
        free_.erase(it);
        cached = true;
      }
    }
    STRATA_RETURN_IF_ERROR(give_back(drop));
    if (cached) {
      STRATA_RETURN_IF_ERROR(pass(e));
      return std::move(e.buffer);
    }
    // Refused for lack of budget: give back what is cached and try again,
    // as long as there was something to give back (another thread may have
    // put buffers back since the last clear; those were charged while in use).
    for (;;) {
      core::Result<Buffer> b = allocate_(bytes, what, end);
      if (b.ok()) {
        const core::MutexLock lock(mu_);
        largest_ = std::max(largest_, bytes);
      }
      if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
      bool had_cached = false;
      {
        const core::MutexLock lock(mu_);
        had_cached = !free_.empty();
      }
      if (!had_cached) return b;
      STRATA_RETURN_IF_ERROR(clear());
    }
  }
  // Keeps `b` for a later get() of its size (an empty buffer is dropped),
  // unless the divert takes it; `fence`, when given, must pass before anyone
  // else uses it.
  void put(Buffer b, std::shared_ptr<gpu::Event> fence = nullptr) STRATA_EXCLUDES(mu_) {
    if (b.empty()) return;
    if (divert_ != nullptr && divert_(b, fence)) return;
    put_returned(std::move(b), std::move(fence));
  }
  // As put(), past the divert: for the buffers it hands back.
  void put_returned(Buffer b, std::shared_ptr<gpu::Event> fence = nullptr) STRATA_EXCLUDES(mu_) {
    if (b.empty()) return;
    const Key key{arena_end_of(b), b.size_bytes()};
    const core::MutexLock lock(mu_);
    cached_bytes_ += key.second;
    free_.emplace(key, Entry{std::move(b), std::move(fence)});
  }
  // Frees every cached buffer, each once its fence has passed; the first
  // error of those waits.
  core::Status clear() STRATA_EXCLUDES(mu_) {
    std::multimap<Key, Entry> drop;
    {
      const core::MutexLock lock(mu_);
      drop.swap(free_);
      cached_bytes_ = 0;
    }
    return give_back(drop);
  }

 private:
  using Key = std::pair<gpu::ArenaEnd, std::uint64_t>;  // end, bytes
  struct Entry {
    Buffer buffer;
    std::shared_ptr<gpu::Event> fence;
  };
  // A tight budget (the class comment): the room the memory in use leaves
  // (the headroom plus what the cache holds) is no more than `bytes` and the
  // largest buffer allocated so far.
  bool tight(std::uint64_t bytes) const STRATA_REQUIRES(mu_) {
    if (headroom_ == nullptr) return false;
    const std::uint64_t headroom = headroom_();
    const std::uint64_t room = headroom > UINT64_MAX - cached_bytes_ ? UINT64_MAX : headroom + cached_bytes_;
    return room <= bytes + largest_;
  }
  // Frees the buffers taken out of the cache, each once its fence has
  // passed; the first error of those waits.
  core::Status give_back(std::multimap<Key, Entry>& drop) STRATA_EXCLUDES(mu_) {
    core::Status first;
    for (auto& [key, e] : drop) {
      core::Status s = pass(e);
      if (first.ok() && !s.ok()) first = std::move(s);
    }
    drop.clear();
    return first;
  }
  core::Status pass(Entry& e) STRATA_EXCLUDES(mu_) {
    if (e.fence == nullptr || wait_ == nullptr) return core::Status();
    core::Status s = wait_(*e.fence);
    e.fence.reset();
    return s;
  }

  Allocate allocate_;
  Wait wait_;
  Query query_;
  Divert divert_;
  Headroom headroom_;
  core::Mutex mu_;
  std::multimap<Key, Entry> free_ STRATA_GUARDED_BY(mu_);
  std::uint64_t cached_bytes_ STRATA_GUARDED_BY(mu_) = 0;  // of the buffers in free_
  std::uint64_t largest_ STRATA_GUARDED_BY(mu_) = 0;       // the largest buffer allocated
};

}  // namespace strata::engine
