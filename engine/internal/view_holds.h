// Device memory lent to the framework (Engine::lend_view, the C API's DLPack
// tensors) and the device it lives on. A lent buffer stays the framework's
// to read until its lease ends, whatever the engine does meanwhile:
//  - SharedDevice owns the device and the budgets its buffers charge; the
//    engine and every lease share it, so a lease that outlives the engine
//    keeps the device (and nothing else of the engine) alive.
//  - ViewHolds counts the leases per buffer. The engine's buffer cache
//    diverts a leased buffer to it (park) instead of keeping it for reuse;
//    when its last lease ends, the buffer goes back to the cache, or, once
//    the engine is gone, is freed after its fence (the framework's last work
//    queued on it, from release_on).
// Lock order: ViewHolds::mu_ before the buffer cache's lock (end() hands a
// buffer back with mu_ held; the cache calls park() without its own).
// Thread-safe. Private to engine/.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <string>

#include "core/check.h"
#include "core/memory_budget.h"
#include "core/mutex.h"
#include "engine/internal/buffer_cache.h"
#include "gpu/device.h"

namespace strata::engine {

// Members are destroyed in reverse: the device before the budgets it charges.
// (The staging budget is the engine's disk pipeline's; it lives here with the
// other two.)
struct SharedDevice {
  SharedDevice(std::uint64_t device_limit_bytes, std::uint64_t pinned_limit_bytes, std::uint64_t staging_limit_bytes)
      : device_budget("device memory", device_limit_bytes, "strata.budgets.device"),
        pinned_budget("pinned host memory", pinned_limit_bytes, "strata.budgets.pinned"),
        staging_budget("the disk pipeline's staging memory", staging_limit_bytes, "strata.budgets.staging") {}
  core::MemoryBudget device_budget;
  core::MemoryBudget pinned_budget;
  core::MemoryBudget staging_budget;
  std::unique_ptr<gpu::Device> device;  // set once by Engine::create
};

class ViewHolds {
 public:
  explicit ViewHolds(std::shared_ptr<SharedDevice> device) : device_(std::move(device)) {}
  ViewHolds(const ViewHolds&) = delete;
  ViewHolds& operator=(const ViewHolds&) = delete;

  // Where a parked buffer goes when its last lease ends: the engine's cache
  // (borrowed), or null once the engine is going away (then it is freed).
  void set_home(BufferCache<gpu::DeviceBuffer>* cache) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    home_ = cache;
  }

  // One more lease on buffer `id` (gpu::DeviceBuffer::id()).
  void hold(std::uint64_t id) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    ++leases_[id];
  }

  // Takes `buffer` and its fence when a lease holds it (returns true) and
  // keeps them until the last lease ends; otherwise leaves both (false).
  bool park(gpu::DeviceBuffer& buffer, std::shared_ptr<gpu::Event>& fence) STRATA_EXCLUDES(mu_) {
    if (buffer.empty()) return false;
    const core::MutexLock lock(mu_);
    if (!leases_.contains(buffer.id())) return false;
    const std::uint64_t id = buffer.id();
    parked_[id] = Parked{std::move(buffer), std::move(fence)};
    return true;
  }

  // Ends one lease on `id`. When it was the last and the buffer is parked,
  // the buffer goes home or is freed. Any thread, also after the engine.
  void end(std::uint64_t id) noexcept STRATA_EXCLUDES(mu_) {
    Parked p;
    {
      const core::MutexLock lock(mu_);
      auto it = leases_.find(id);
      STRATA_CHECK(it != leases_.end()) << "a view lease on buffer " << id << " ended twice";
      if (--it->second > 0) return;
      leases_.erase(it);
      auto pk = parked_.find(id);
      if (pk == parked_.end()) return;  // still the engine's (fetched, or a gradient buffer)
      p = std::move(pk->second);
      parked_.erase(pk);
      if (home_ != nullptr) {
        try {
          home_->put_returned(std::move(p.buffer), std::move(p.fence));
          return;
        } catch (const std::bad_alloc&) {  // the cache could not keep it: free it below
        }
      }
    }
    // Freed once the framework's last work on it has passed.
    if (p.fence != nullptr) {
      device_->device->synchronize(*p.fence).ignore_error();  // no caller to report to; freeing is all that is left
    }
  }

 private:
  struct Parked {
    gpu::DeviceBuffer buffer;
    std::shared_ptr<gpu::Event> fence;  // null: no work of the framework's queued on it
  };

  // First: destroyed last, after the parked buffers it frees.
  std::shared_ptr<SharedDevice> device_;
  core::Mutex mu_;
  std::map<std::uint64_t, int> leases_ STRATA_GUARDED_BY(mu_);     // buffer id -> live leases
  std::map<std::uint64_t, Parked> parked_ STRATA_GUARDED_BY(mu_);  // leased buffers the engine let go of
  BufferCache<gpu::DeviceBuffer>* home_ STRATA_GUARDED_BY(mu_) = nullptr;
};

}  // namespace strata::engine
