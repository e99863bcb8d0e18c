// BufferPool: budget first, then allocation, NUMA binding and first touch.
#include "nvme/buffer_pool.h"

#include <hwloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "core/logging.h"
#include "core/str.h"

namespace strata::nvme {

using core::Result;
using core::Status;
using core::str_cat;

PoolBuffer::PoolBuffer(PoolBuffer&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      index_(other.index_),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

PoolBuffer& PoolBuffer::operator=(PoolBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    index_ = other.index_;
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void PoolBuffer::reset() {
  if (pool_ != nullptr) pool_->give_back(index_);
  pool_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
}

namespace {

constexpr std::size_t kHugePageBytes = 2u << 20;

// Owns an hwloc topology for the length of one pool creation.
class Topology {
 public:
  Topology() {
    if (hwloc_topology_init(&topo_) == 0) {
      loaded_ = hwloc_topology_load(topo_) == 0;
    }
  }
  ~Topology() { hwloc_topology_destroy(topo_); }
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;
  bool loaded() const { return loaded_; }
  hwloc_topology_t get() const { return topo_; }

 private:
  hwloc_topology_t topo_{};
  bool loaded_ = false;
};

}  // namespace

Result<std::unique_ptr<BufferPool>> BufferPool::create(const BufferPoolOptions& options, core::MemoryBudget& budget,
                                                       core::HostAllocator& allocator) {
  if (options.alignment < 512 || (options.alignment & (options.alignment - 1)) != 0) {
    return Status::invalid_argument(str_cat(options.name, ": alignment ", options.alignment,
                                            " is not a power of two >= 512"));
  }
  if (options.buffer_bytes == 0 || options.buffer_count == 0) {
    return Status::invalid_argument(str_cat(options.name, ": needs buffer_bytes > 0 and buffer_count > 0 (got ",
                                            options.buffer_bytes, " and ", options.buffer_count, ")"));
  }
  const std::size_t buffer_bytes = core::align_up(options.buffer_bytes, options.alignment);
  std::unique_ptr<Topology> topology;
  hwloc_obj_t node = nullptr;
  if (options.numa_node >= 0) {
    topology = std::make_unique<Topology>();
    if (!topology->loaded()) return Status::unavailable(str_cat(options.name, ": hwloc cannot load the topology"));
    node = hwloc_get_numanode_obj_by_os_index(topology->get(), static_cast<unsigned>(options.numa_node));
    if (node == nullptr) {
      const int nodes = hwloc_get_nbobjs_by_type(topology->get(), HWLOC_OBJ_NUMANODE);
      return Status::invalid_argument(str_cat(options.name, ": NUMA node ", options.numa_node,
                                              " does not exist (this machine has ", nodes, " node(s))"));
    }
  }
  // Budget first: fail before allocating anything.
  auto charge = budget.charge(static_cast<std::uint64_t>(buffer_bytes) * options.buffer_count,
                              str_cat(options.name, " (", options.buffer_count, " x ",
                                      core::format_bytes(buffer_bytes), ")"));
  if (!charge.ok()) return std::move(charge).status();
  auto pool = std::unique_ptr<BufferPool>(
      new BufferPool(options.name, buffer_bytes, allocator, std::move(charge).value()));
  // One slab for all buffers: one allocation (one cudaHostAlloc when pinned),
  // and, when large, 2 MiB aligned and advised for transparent huge pages, so a
  // request's pages are physically contiguous and a 1 MiB request is one DMA
  // segment run instead of 256 pages (virtio and NVMe cap segments per request).
  const std::size_t slab_bytes = buffer_bytes * options.buffer_count;
  const std::size_t slab_alignment = slab_bytes >= kHugePageBytes ? std::max(options.alignment, kHugePageBytes)
                                                                   : options.alignment;
  const std::size_t slab_alloc = core::align_up(slab_bytes, slab_alignment);
  auto slab = core::HostBlock::allocate(allocator, slab_alloc, slab_alignment, options.numa_node);
  if (!slab.ok()) return std::move(slab).status().annotate(options.name);
  pool->slab_ = std::move(slab).value();
  if (slab_alignment >= kHugePageBytes) {
    // Advice only: memory that cannot take it (pinned, hugetlb) is used as it is.
    (void)::madvise(pool->slab_.data(), slab_alloc, MADV_HUGEPAGE);
  }
  if (node != nullptr) {
    const int rc = hwloc_set_area_membind(topology->get(), pool->slab_.data(), slab_alloc, node->nodeset,
                                          HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_MIGRATE);
    if (rc != 0) {
      const int err = errno;
      STRATA_LOG(kWarn) << options.name << ": cannot bind " << allocator.name() << " to NUMA node "
                        << options.numa_node << " (" << Status::from_errno(err, "hwloc_set_area_membind").message()
                        << "); using it where it is";
    }
  }
  // First touch: fault the pages in now (on the bound node), not in the I/O path.
  std::memset(pool->slab_.data(), 0, slab_alloc);
  core::MutexLock lock(pool->mu_);
  for (std::size_t i = 0; i < options.buffer_count; ++i) {
    pool->buffers_.push_back(pool->slab_.data() + i * buffer_bytes);
    pool->free_.push_back(options.buffer_count - 1 - i);
  }
  return pool;
}

BufferPool::BufferPool(std::string name, std::size_t buffer_bytes, core::HostAllocator& allocator,
                       core::BudgetCharge charge)
    : name_(std::move(name)), buffer_bytes_(buffer_bytes), allocator_(allocator), charge_(std::move(charge)) {}

BufferPool::~BufferPool() {
  core::MutexLock lock(mu_);
  STRATA_CHECK(free_.size() == buffers_.size())
      << name_ << " destroyed with " << (buffers_.size() - free_.size()) << " buffer(s) still in use";
}

Result<PoolBuffer> BufferPool::try_acquire() {
  core::MutexLock lock(mu_);
  if (free_.empty()) {
    return Status::resource_exhausted(str_cat(name_, ": all ", buffers_.size(), " buffers of ",
                                              core::format_bytes(buffer_bytes_), " are in use"));
  }
  const std::size_t i = free_.back();
  free_.pop_back();
  return PoolBuffer(this, i, buffers_[i], buffer_bytes_);
}

PoolBuffer BufferPool::acquire() {
  core::MutexLock lock(mu_);
  cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return !free_.empty(); });
  const std::size_t i = free_.back();
  free_.pop_back();
  return PoolBuffer(this, i, buffers_[i], buffer_bytes_);
}

std::vector<std::span<std::byte>> BufferPool::buffers() const {
  std::vector<std::span<std::byte>> out;
  out.reserve(buffers_.size());
  for (std::byte* b : buffers_) out.emplace_back(b, buffer_bytes_);
  return out;
}

std::size_t BufferPool::free_count() const {
  core::MutexLock lock(mu_);
  return free_.size();
}

void BufferPool::give_back(std::size_t index) {
  core::MutexLock lock(mu_);
  free_.push_back(index);
  cv_.notify_one();
}

}  // namespace strata::nvme
