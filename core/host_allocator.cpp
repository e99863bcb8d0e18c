#include "core/host_allocator.h"

#include <cerrno>
#include <cstdlib>
#include <utility>

#include "core/str.h"

namespace strata::core {
namespace {

class PageableAllocator final : public HostAllocator {
 public:
  std::string_view name() const override { return "pageable host memory"; }

  Result<void*> allocate(std::size_t size_bytes, std::size_t alignment, int /*numa_node*/) override {
    if (size_bytes == 0) return Status::invalid_argument("host allocation of 0 bytes");
    if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
      return Status::invalid_argument(str_cat("host allocation alignment ", alignment,
                                              " is not a power of two >= ", sizeof(void*)));
    }
    void* p = nullptr;
    const int rc = posix_memalign(&p, alignment, size_bytes);
    if (rc != 0) {
      return Status::out_of_memory(str_cat(name(), ": cannot allocate ", format_bytes(size_bytes),
                                           " aligned to ", alignment));
    }
    return p;
  }

  void deallocate(void* p, std::size_t /*size_bytes*/) noexcept override { std::free(p); }
};

}  // namespace

HostAllocator& default_host_allocator() {
  static PageableAllocator* allocator = new PageableAllocator();  // never destroyed: safe at exit
  return *allocator;
}

HostBlock::HostBlock(HostBlock&& other) noexcept
    : allocator_(std::exchange(other.allocator_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

HostBlock& HostBlock::operator=(HostBlock&& other) noexcept {
  if (this != &other) {
    reset();
    allocator_ = std::exchange(other.allocator_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

Result<HostBlock> HostBlock::allocate(HostAllocator& allocator, std::size_t size_bytes, std::size_t alignment,
                                      int numa_node) {
  STRATA_ASSIGN_OR_RETURN(void* p, allocator.allocate(size_bytes, alignment, numa_node));
  HostBlock b;
  b.allocator_ = &allocator;
  b.data_ = static_cast<std::byte*>(p);
  b.size_bytes_ = size_bytes;
  return b;
}

void HostBlock::reset() noexcept {
  if (data_ != nullptr) allocator_->deallocate(data_, size_bytes_);
  allocator_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
}

}  // namespace strata::core
