// HostAllocator: where a module gets large host buffers (I/O staging, swap
// buffers) without knowing who provides them. The default allocates ordinary
// page-aligned memory; the engine hands the GPU's pinned allocator
// (cudaHostAlloc / cudaHostRegister) to nvme/ through this interface, so nvme/
// never sees the GPU (DESIGN.md section 2). Budgets are charged by the caller
// that owns the buffer (a pool, a device), not by the allocator.
#pragma once

#include <cstddef>
#include <string_view>

#include "core/result.h"

namespace strata::core {

class HostAllocator {
 public:
  virtual ~HostAllocator() = default;

  // What the memory is, for messages ("pageable host memory", "pinned host memory (cuda)").
  virtual std::string_view name() const = 0;

  // Allocates `size_bytes` (> 0) aligned to `alignment` (a power of two >=
  // sizeof(void*)). `numa_node` is a hint (-1: no preference); an allocator that
  // cannot place memory ignores it. Memory is not initialised.
  // Errors: kInvalidArgument for a bad size or alignment; kOutOfMemory (naming
  // the allocator and the size) when the memory is not there.
  virtual Result<void*> allocate(std::size_t size_bytes, std::size_t alignment, int numa_node) = 0;

  // Returns memory from allocate(); `size_bytes` is the size asked for.
  virtual void deallocate(void* p, std::size_t size_bytes) noexcept = 0;
};

// Ordinary pageable memory (posix_memalign). Thread-safe; lives forever.
HostAllocator& default_host_allocator();

// One owner of a block from a HostAllocator. Move-only; thread-compatible.
class HostBlock {
 public:
  HostBlock() = default;
  HostBlock(HostBlock&& other) noexcept;
  HostBlock& operator=(HostBlock&& other) noexcept;
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  ~HostBlock() { reset(); }

  static Result<HostBlock> allocate(HostAllocator& allocator, std::size_t size_bytes, std::size_t alignment,
                                    int numa_node = -1);

  std::byte* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }
  HostAllocator* allocator() const { return allocator_; }
  // Frees the memory now (idempotent).
  void reset() noexcept;

 private:
  HostAllocator* allocator_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t size_bytes_ = 0;
};

}  // namespace strata::core
