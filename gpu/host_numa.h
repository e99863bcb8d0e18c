#pragma once
// Placing host memory on a NUMA node (Linux mbind), for pinned memory that
// belongs near one GPU: a rank's staging and optimizer state on the node its
// GPU and its CPU optimizer threads sit on (DESIGN.md section 10). The
// policy is "preferred": pages go to the node while it has room, elsewhere
// after, never an allocation failure because one node is full.

#include <cstddef>

#include "core/status.h"

namespace strata::gpu {

// Asks that the pages of [p, p + size_bytes) live on NUMA node `node` (the
// OS's number), moving those already placed elsewhere; `p` page-aligned.
// Errors: kInvalidArgument for a negative node or an unaligned `p`; the
// kernel's refusal as from_errno gives it (EINVAL: no such node;
// EPERM: a container that forbids mbind; ENOSYS: a kernel without NUMA).
core::Status prefer_numa_node(void* p, std::size_t size_bytes, int node);

// The NUMA node the page holding `p` lives on (placed by touching it
// first), or -1 when the kernel does not say (move_pages refused).
int numa_node_of_page(const void* p);

}  // namespace strata::gpu
