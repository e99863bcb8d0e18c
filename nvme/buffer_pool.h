// BufferPool: a fixed set of equal, O_DIRECT-aligned host buffers for swap I/O,
// charged to a MemoryBudget up front (never beyond it), allocated through an
// injected HostAllocator (pageable by default; the engine hands in the GPU's
// pinned allocator) and placed on a NUMA node with hwloc. BufferPool is
// thread-safe; PoolBuffer is move-only and returns its buffer when destroyed.
// The pool must outlive its PoolBuffers.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/host_allocator.h"
#include "core/memory_budget.h"
#include "core/mutex.h"
#include "core/result.h"

namespace strata::nvme {

class BufferPool;

struct BufferPoolOptions {
  std::size_t buffer_bytes = 0;  // bytes per buffer, > 0; rounded up to `alignment`
  std::size_t buffer_count = 0;  // buffers, > 0
  // Address and size alignment, a power of two >= 512; default 4096 (safe for
  // O_DIRECT on every file system and drive).
  std::size_t alignment = core::kDirectIoAlignment;
  // NUMA node (OS index) to place the memory on; -1 (default): wherever the
  // allocator puts it. A node that does not exist is an error; a binding the
  // OS refuses (memory pinned by its allocator) is logged once and ignored.
  int numa_node = -1;
  std::string name = "nvme buffer pool";  // in messages and budget charges
};

class PoolBuffer {
 public:
  PoolBuffer() = default;
  PoolBuffer(PoolBuffer&& other) noexcept;
  PoolBuffer& operator=(PoolBuffer&& other) noexcept;
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;
  ~PoolBuffer() { reset(); }

  std::byte* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }
  std::span<std::byte> bytes() const { return {data_, size_bytes_}; }
  bool valid() const { return data_ != nullptr; }
  // Returns the buffer to the pool now (idempotent).
  void reset();

 private:
  friend class BufferPool;
  PoolBuffer(BufferPool* pool, std::size_t index, std::byte* data, std::size_t size)
      : pool_(pool), index_(index), data_(data), size_bytes_(size) {}
  BufferPool* pool_ = nullptr;
  std::size_t index_ = 0;
  std::byte* data_ = nullptr;
  std::size_t size_bytes_ = 0;
};

class BufferPool {
 public:
  // Charges buffer_count x buffer_bytes to `budget` first, then allocates all
  // buffers as one slab (2 MiB aligned and advised for transparent huge pages
  // when at least 2 MiB) and touches it. `budget` and `allocator` are borrowed and must
  // outlive the pool. Errors: kInvalidArgument (sizes, alignment, NUMA node);
  // kResourceExhausted naming the budget and its key when it would go over;
  // the allocator's kOutOfMemory.
  static core::Result<std::unique_ptr<BufferPool>> create(
      const BufferPoolOptions& options, core::MemoryBudget& budget,
      core::HostAllocator& allocator = core::default_host_allocator());

  // Checks that every buffer came back.
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A free buffer, or kResourceExhausted when all are out.
  core::Result<PoolBuffer> try_acquire() STRATA_EXCLUDES(mu_);
  // A free buffer; blocks until one is returned.
  PoolBuffer acquire() STRATA_EXCLUDES(mu_);

  // Every buffer (for IoBackend::register_buffers).
  std::vector<std::span<std::byte>> buffers() const;
  std::size_t buffer_bytes() const { return buffer_bytes_; }
  std::size_t buffer_count() const { return buffers_.size(); }
  std::size_t free_count() const STRATA_EXCLUDES(mu_);
  const std::string& name() const { return name_; }
  const core::HostAllocator& allocator() const { return allocator_; }

 private:
  friend class PoolBuffer;
  BufferPool(std::string name, std::size_t buffer_bytes, core::HostAllocator& allocator, core::BudgetCharge charge);
  void give_back(std::size_t index) STRATA_EXCLUDES(mu_);

  const std::string name_;
  const std::size_t buffer_bytes_;
  core::HostAllocator& allocator_;
  // Destruction order: the slab goes back to the allocator, then the charge to the budget.
  core::BudgetCharge charge_;
  core::HostBlock slab_;              // every buffer, back to back
  std::vector<std::byte*> buffers_;   // buffer i starts here; set by create(), then read-only
  mutable core::Mutex mu_;
  core::CondVar cv_;
  std::vector<std::size_t> free_ STRATA_GUARDED_BY(mu_);
};

}  // namespace strata::nvme
