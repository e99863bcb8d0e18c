// BufferCache: device or pinned buffers the step asks for again and again
// (fetched groups, gradients, their host staging) kept for reuse by exact
// size, so a step does not fault in fresh pages for every call. A cached
// buffer stays charged to its budget; when an allocation is refused for
// lack of budget, the cache gives everything back and tries once more, so
// caching never makes a placement fail. Thread-safe. Private to engine/.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "engine/core/mutex.h"
#include "engine/core/result.h"

namespace strata::engine {

template <typename Buffer>
class BufferCache {
 public:
  using Allocate = std::function<core::Result<Buffer>(std::uint64_t bytes, const std::string& what)>;
  explicit BufferCache(Allocate allocate) : allocate_(std::move(allocate)) {}

  // A cached buffer of exactly `bytes`, or a new one.
  core::Result<Buffer> get(std::uint64_t bytes, const std::string& what) {
    {
      const core::MutexLock lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        Buffer b = std::move(it->second);
        free_.erase(it);
        return b;
      }
    }
    core::Result<Buffer> b = allocate_(bytes, what);
    if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
    clear();
    return allocate_(bytes, what);
  }
  // Keeps `b` for a later get() of its size (an empty buffer is dropped).
  void put(Buffer b) {
    if (b.empty()) return;
    const std::uint64_t bytes = b.size_bytes();
    const core::MutexLock lock(mu_);
    free_.emplace(bytes, std::move(b));
  }
  void clear() {
    std::multimap<std::uint64_t, Buffer> drop;
    const core::MutexLock lock(mu_);
    drop.swap(free_);
  }

 private:
  Allocate allocate_;
  core::Mutex mu_;
  std::multimap<std::uint64_t, Buffer> free_;
};

}  // namespace strata::engine
