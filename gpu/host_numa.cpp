#include "gpu/host_numa.h"

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <climits>
#include <cstdint>

#include "core/str.h"

namespace strata::gpu {

using core::Status;
using core::str_cat;

namespace {

// Linux numbers nodes below 1024 (CONFIG_NODES_SHIFT <= 10).
constexpr int kMaxNodes = 1024;
constexpr std::size_t kMaskWords = kMaxNodes / (sizeof(unsigned long) * CHAR_BIT);

}  // namespace

Status prefer_numa_node(void* p, std::size_t size_bytes, int node) {
  const long page = ::sysconf(_SC_PAGESIZE);
  if (node < 0 || node >= kMaxNodes) {
    return Status::invalid_argument(str_cat("NUMA node ", node, " is not a node's number (0 to ", kMaxNodes - 1, ")"));
  }
  if (page <= 0 || reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(page) != 0) {
    return Status::invalid_argument("placing memory on a NUMA node: the range does not start on a page");
  }
  if (size_bytes == 0) return Status();
  std::array<unsigned long, kMaskWords> mask{};
  constexpr std::size_t kWordBits = sizeof(unsigned long) * CHAR_BIT;
  mask[static_cast<std::size_t>(node) / kWordBits] = 1UL << (static_cast<std::size_t>(node) % kWordBits);
  // The kernel reads maxnode - 1 bits of the mask.
  if (::syscall(SYS_mbind, p, size_bytes, MPOL_PREFERRED, mask.data(), kMaxNodes + 1, MPOL_MF_MOVE) != 0) {
    const int err = errno;
    return Status::from_errno(err, str_cat("mbind (NUMA node ", node, ")"));
  }
  return Status();
}

int numa_node_of_page(const void* p) {
  void* pages[1] = {const_cast<void*>(p)};
  int status[1] = {-1};
  if (::syscall(SYS_move_pages, 0, 1UL, pages, nullptr, status, 0) != 0) return -1;
  return status[0] >= 0 ? status[0] : -1;
}

}  // namespace strata::gpu
