// CpuAdam: validation, run-time kernel choice, and oneTBB threads over fixed
// tiles, pinned with hwloc to the physical cores of the memory's NUMA node.
#include "cpu_adam/cpu_adam.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <hwloc.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "cpu_adam/kernels/kernels.h"
#include "core/aligned_buffer.h"
#include "core/check.h"
#include "core/logging.h"
#include "core/mutex.h"
#include "core/str.h"

namespace strata::adam {
namespace {

namespace nx = core::numerics;
using core::Status;
using core::str_cat;

constexpr std::int64_t kDefaultTileElems = 4 * nx::kNormBlockElems;

// Keeps the floating-point environment at the contract's settings while a
// kernel runs: round to nearest, no flush-to-zero, no denormals-are-zero (an
// embedding framework may have set them on its threads).
class FpEnvGuard {
 public:
  FpEnvGuard() {
#if defined(__x86_64__)
    saved_ = __builtin_ia32_stmxcsr();
    // MXCSR bits: 6 DAZ, 13-14 rounding control, 15 FTZ.
    const unsigned wanted = saved_ & ~((1u << 6) | (3u << 13) | (1u << 15));
    if (wanted != saved_) __builtin_ia32_ldmxcsr(wanted);
#endif
  }
  ~FpEnvGuard() {
#if defined(__x86_64__)
    if (__builtin_ia32_stmxcsr() != saved_) __builtin_ia32_ldmxcsr(saved_);
#endif
  }
  FpEnvGuard(const FpEnvGuard&) = delete;
  FpEnvGuard& operator=(const FpEnvGuard&) = delete;

 private:
  unsigned saved_ = 0;
};

const kernels::KernelTable& table_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return kernels::avx512_bf16_kernels();
    case Isa::kAvx512:
      return kernels::avx512_kernels();
    case Isa::kAvx2:
      return kernels::avx2_kernels();
    case Isa::kScalar:
      break;
  }
  return kernels::scalar_kernels();
}

struct ByteRange {
  const char* name;
  std::uintptr_t begin;
  std::uintptr_t end;
};

// Errors when any two ranges overlap. The ranges named `identical_a` and
// `identical_b` may coincide exactly (src == dst in the gradient pass).
Status check_disjoint(const std::vector<ByteRange>& ranges, std::string_view identical_a = {},
                      std::string_view identical_b = {}) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    for (size_t j = i + 1; j < ranges.size(); ++j) {
      const ByteRange& x = ranges[i];
      const ByteRange& y = ranges[j];
      if (x.begin >= y.end || y.begin >= x.end) continue;
      const std::string_view xn = x.name, yn = y.name;
      const bool pair = !identical_a.empty() && ((xn == identical_a && yn == identical_b) ||
                                                 (xn == identical_b && yn == identical_a));
      if (pair && x.begin == y.begin && x.end == y.end) continue;
      return Status::invalid_argument(str_cat("buffers ", x.name, " and ", y.name, " overlap"));
    }
  }
  return Status();
}

ByteRange range_of(const char* name, const void* p, std::int64_t n, int elem_bytes) {
  const auto b = reinterpret_cast<std::uintptr_t>(p);
  return {name, b, b + static_cast<std::uintptr_t>(n) * static_cast<std::uintptr_t>(elem_bytes)};
}

Status check_aligned(const char* name, const void* p, int elem_bytes) {
  if (p == nullptr) return Status::invalid_argument(str_cat(name, " is null"));
  if (!core::is_aligned(p, static_cast<std::size_t>(elem_bytes))) {
    return Status::invalid_argument(
        str_cat(name, " at ", p, " is not aligned to its element size (", elem_bytes, " bytes)"));
  }
  return Status();
}

// An optimizer state array (fp32, bf16 bit patterns or 8-bit codes) and its
// name, for the step checks.
struct NamedState {
  NamedState(const char* name_in, std::span<const float> s)
      : name(name_in), data(s.data()), size(static_cast<std::int64_t>(s.size())), elem_bytes(4) {}
  NamedState(const char* name_in, std::span<const std::uint16_t> s)
      : name(name_in), data(s.data()), size(static_cast<std::int64_t>(s.size())), elem_bytes(2) {}
  NamedState(const char* name_in, std::span<const std::uint8_t> s)
      : name(name_in), data(s.data()), size(static_cast<std::int64_t>(s.size())), elem_bytes(1) {}
  const char* name;
  const void* data;
  std::int64_t size;  // elements
  int elem_bytes;
};

// The checks every step makes before a thread starts: sizes, the copy type,
// alignment, disjoint buffers. `what` begins each message ("adam step").
// `block_scales` (8-bit moments) must each hold one fp32 value per
// numerics::kQuantBlockElems elements, the last block counting even when short.
Status check_step_buffers(std::string_view what, std::span<const float> master,
                          std::initializer_list<NamedState> states, const ConstTypedSpan& grad,
                          const TypedSpan& copy_out, std::initializer_list<NamedState> block_scales = {}) {
  const std::int64_t n = static_cast<std::int64_t>(master.size());
  if (n == 0) return Status::invalid_argument(str_cat(what, ": zero elements"));
  const bool copy = copy_out.data != nullptr;
  bool sizes_match = grad.size == n && (!copy || copy_out.size == n);
  std::string sizes = str_cat("master ", n);
  for (const NamedState& s : states) {
    sizes_match = sizes_match && s.size == n;
    sizes += str_cat(", ", s.name, " ", s.size);
  }
  if (!sizes_match) {
    return Status::invalid_argument(str_cat(what, ": sizes differ: ", sizes, ", grad ", grad.size,
                                            copy ? str_cat(", copy_out ", copy_out.size) : std::string()));
  }
  const std::int64_t blocks = (n + nx::kQuantBlockElems - 1) / nx::kQuantBlockElems;
  for (const NamedState& s : block_scales) {
    if (s.size != blocks) {
      return Status::invalid_argument(str_cat(what, ": ", s.name, " holds ", s.size, " scales; ", n,
                                              " elements need ceil(", n, " / ", nx::kQuantBlockElems,
                                              ") = ", blocks));
    }
  }
  if (copy && copy_out.type == ElemType::kF32) {
    return Status::invalid_argument(
        str_cat(what, ": copy_out must be bf16 or fp16 (the master is the fp32 copy)"));
  }
  STRATA_RETURN_IF_ERROR(check_aligned("master", master.data(), 4));
  for (const NamedState& s : states) STRATA_RETURN_IF_ERROR(check_aligned(s.name, s.data, s.elem_bytes));
  for (const NamedState& s : block_scales) STRATA_RETURN_IF_ERROR(check_aligned(s.name, s.data, s.elem_bytes));
  STRATA_RETURN_IF_ERROR(check_aligned("grad", grad.data, elem_size_bytes(grad.type)));
  if (copy) STRATA_RETURN_IF_ERROR(check_aligned("copy_out", copy_out.data, 2));
  std::vector<ByteRange> ranges = {range_of("master", master.data(), n, 4)};
  for (const NamedState& s : states) ranges.push_back(range_of(s.name, s.data, n, s.elem_bytes));
  for (const NamedState& s : block_scales) ranges.push_back(range_of(s.name, s.data, blocks, s.elem_bytes));
  ranges.push_back(range_of("grad", grad.data, n, elem_size_bytes(grad.type)));
  if (copy) ranges.push_back(range_of("copy_out", copy_out.data, n, 2));
  return check_disjoint(ranges);
}

// Where a tile starting at element `begin` finds its gradient and its copy.
const void* grad_at(const ConstTypedSpan& grad, std::int64_t begin) {
  return static_cast<const std::byte*>(grad.data) + begin * elem_size_bytes(grad.type);
}
void* copy_at(const TypedSpan& copy_out, std::int64_t begin) {
  if (copy_out.data == nullptr) return nullptr;
  return static_cast<std::byte*>(copy_out.data) + begin * elem_size_bytes(copy_out.type);
}

// An owned hwloc bitmap.
class Bitmap {
 public:
  Bitmap() : bits_(hwloc_bitmap_alloc()) { STRATA_CHECK(bits_ != nullptr); }
  ~Bitmap() { hwloc_bitmap_free(bits_); }
  Bitmap(const Bitmap&) = delete;
  Bitmap& operator=(const Bitmap&) = delete;
  hwloc_bitmap_t get() const { return bits_; }

 private:
  hwloc_bitmap_t bits_;
};

// The machine's topology (or a synthetic one), owned; null when hwloc could
// not read it, with the reason in `error`.
struct Topology {
  hwloc_topology_t topology = nullptr;
  std::string error;

  // `description`: empty (this machine), hwloc synthetic, or XML (starts
  // with '<'). With `io`, PCI and OS devices are kept (GPUs' locality).
  explicit Topology(std::string_view description, bool io = false) {
    if (hwloc_topology_init(&topology) != 0) {
      error = str_cat("hwloc_topology_init: ", std::generic_category().message(errno));
      topology = nullptr;
      return;
    }
    const bool xml = description.starts_with('<');
    if (io || xml) hwloc_topology_set_io_types_filter(topology, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    const std::string text(description);  // NUL-terminated, as the XML reader wants
    if (xml && hwloc_topology_set_xmlbuffer(topology, text.c_str(), static_cast<int>(text.size()) + 1) != 0) {
      error = "hwloc cannot read the XML topology given";
    } else if (!xml && !description.empty() &&
               hwloc_topology_set_synthetic(topology, std::string(description).c_str()) != 0) {
      error = str_cat("hwloc cannot read the synthetic topology \"", description, "\"");
    } else if (load(topology, io && description.empty()) != 0) {
      error = str_cat("hwloc_topology_load: ", std::generic_category().message(errno));
    }
    if (!error.empty()) {
      hwloc_topology_destroy(topology);
      topology = nullptr;
    }
  }
  ~Topology() {
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

 private:
  // hwloc_topology_load; with `machine_io` (this machine's PCI devices) one
  // load at a time in the process: the discovery goes through libudev and
  // libpciaccess, whose globals are not thread-safe (ranks as threads each
  // create their CPU optimizer at once; ThreadSanitizer saw libudev race).
  static int load(hwloc_topology_t t, bool machine_io) {
    if (!machine_io) return hwloc_topology_load(t);
    static core::Mutex mu;
    const core::MutexLock lock(mu);
    return hwloc_topology_load(t);
  }
};

// The physical cores whose PUs all lie in `set`, in hwloc's (logical) order.
std::vector<hwloc_obj_t> cores_inside(hwloc_topology_t topology, hwloc_const_cpuset_t set) {
  std::vector<hwloc_obj_t> cores;
  for (hwloc_obj_t c = nullptr; (c = hwloc_get_next_obj_inside_cpuset_by_type(topology, set, HWLOC_OBJ_CORE, c));) {
    cores.push_back(c);
  }
  return cores;
}

hwloc_obj_t numa_node_by_os_index(hwloc_topology_t topology, unsigned os_index) {
  for (hwloc_obj_t n = nullptr; (n = hwloc_get_next_obj_by_type(topology, HWLOC_OBJ_NUMANODE, n));) {
    if (n->os_index == os_index) return n;
  }
  return nullptr;
}

std::string numa_node_list(hwloc_topology_t topology) {
  std::string out;
  for (hwloc_obj_t n = nullptr; (n = hwloc_get_next_obj_by_type(topology, HWLOC_OBJ_NUMANODE, n));) {
    out += str_cat(out.empty() ? "" : ", ", n->os_index);
  }
  return out;
}

// The first node holding a page of `memory` (the lowest number when its pages
// are spread); null, with `why`, when the OS cannot say or no page is placed.
hwloc_obj_t numa_node_of_memory(hwloc_topology_t topology, std::span<const std::byte> memory, std::string* why) {
  Bitmap nodes;
  if (hwloc_get_area_memlocation(topology, memory.data(), memory.size(), nodes.get(), HWLOC_MEMBIND_BYNODESET) != 0) {
    *why = str_cat("hwloc_get_area_memlocation: ", std::generic_category().message(errno));
    return nullptr;
  }
  const int first = hwloc_bitmap_first(nodes.get());
  if (first < 0) {
    *why = "no page of the memory is placed yet";
    return nullptr;
  }
  return numa_node_by_os_index(topology, static_cast<unsigned>(first));
}

// The node of the CPU the calling thread last ran on; null when unknown.
hwloc_obj_t numa_node_of_calling_thread(hwloc_topology_t topology) {
  Bitmap where;
  if (hwloc_get_last_cpu_location(topology, where.get(), HWLOC_CPUBIND_THREAD) != 0) return nullptr;
  for (hwloc_obj_t n = nullptr; (n = hwloc_get_next_obj_by_type(topology, HWLOC_OBJ_NUMANODE, n));) {
    if (hwloc_bitmap_intersects(n->cpuset, where.get())) return n;
  }
  return nullptr;
}

// The NUMA node of the GPU local rank `l` drives: the node holding its PCI
// device (o.gpu_pci_busids[l] when given) or its "cuda<l>" OS device; null
// when hwloc does not know it.
hwloc_obj_t numa_node_of_gpu(hwloc_topology_t topology, const CpuAdamOptions& o, int l) {
  hwloc_obj_t device = nullptr;
  if (static_cast<std::size_t>(l) < o.gpu_pci_busids.size() && !o.gpu_pci_busids[static_cast<std::size_t>(l)].empty()) {
    device = hwloc_get_pcidev_by_busidstring(topology, o.gpu_pci_busids[static_cast<std::size_t>(l)].c_str());
  }
  const std::string name = str_cat("cuda", l);
  for (hwloc_obj_t d = nullptr; device == nullptr && (d = hwloc_get_next_osdev(topology, d)) != nullptr;) {
    if (d->name != nullptr && name == d->name) device = d;
  }
  if (device == nullptr) return nullptr;
  hwloc_obj_t home = hwloc_get_non_io_ancestor_obj(topology, device);
  // A device attached above the nodes (no locality known, as in many VMs) is no node's.
  if (home == nullptr || home->nodeset == nullptr || hwloc_bitmap_weight(home->nodeset) != 1) return nullptr;
  return numa_node_by_os_index(topology, static_cast<unsigned>(hwloc_bitmap_first(home->nodeset)));
}

// What choose_cores() decided: the report, and the cores to pin to (in slot
// order; empty when the threads stay unpinned).
struct CoreChoice {
  CoreBinding binding;
  std::vector<hwloc_obj_t> cores;
};

// Chooses the threads' cores for `o` on `topology` (null: hwloc failed, for
// `topology_error`), at most `max_threads` threads. Pins nothing.
core::Result<CoreChoice> choose_cores(hwloc_topology_t topology, std::string_view topology_error,
                                      const CpuAdamOptions& o, int max_threads) {
  if (o.threads < 0) return Status::invalid_argument(str_cat("cpu_adam: threads = ", o.threads, " must be >= 0"));
  if (o.numa_node < -1) {
    return Status::invalid_argument(
        str_cat("cpu_adam: numa_node = ", o.numa_node, " must be a node's number (>= 0), or -1 for the node of the memory"));
  }
  if (o.bind != BindMode::kAuto && o.bind != BindMode::kNuma && o.bind != BindMode::kCores &&
      o.bind != BindMode::kNone) {
    return Status::invalid_argument(str_cat("cpu_adam: bind = ", static_cast<int>(o.bind), " is not a BindMode"));
  }
  CoreChoice choice;
  CoreBinding& b = choice.binding;
  b.mode = o.bind;
  b.threads_asked = o.threads;
  const bool strict = o.bind == BindMode::kNuma || o.bind == BindMode::kCores;
  const std::string mode = str_cat("bind ", bind_mode_name(o.bind));
  // The thread count without pinning: as asked, else `fallback`, capped.
  auto unpinned = [&](int fallback, std::string why) {
    b.threads = o.threads > 0 ? o.threads : std::max(1, fallback);
    if (b.threads > max_threads) {
      STRATA_LOG(kInfo) << "cpu_adam: " << b.threads << " threads but this process may run " << max_threads
                        << " at once; using " << max_threads;
      b.threads = max_threads;
    }
    b.bound = false;
    b.why_unbound = std::move(why);
    return choice;
  };
  if (topology == nullptr) {
    if (strict || o.numa_node >= 0) {
      return Status::unavailable(str_cat("cpu_adam: ", mode, o.numa_node >= 0 ? str_cat(", numa_node ", o.numa_node) : "",
                                         ": hwloc cannot read this machine's topology (", topology_error, ")"));
    }
    return unpinned(max_threads, str_cat("hwloc cannot read the topology (", topology_error, ")"));
  }
  const std::vector<hwloc_obj_t> all_cores = cores_inside(topology, hwloc_topology_get_topology_cpuset(topology));
  const int nodes = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
  if (o.bind == BindMode::kNone) return unpinned(static_cast<int>(all_cores.size()), mode);

  if (o.local_ranks < 1 || o.local_rank < 0 || o.local_rank >= o.local_ranks) {
    return Status::invalid_argument(str_cat("cpu_adam: local_rank ", o.local_rank, " of local_ranks ", o.local_ranks,
                                            ": the rank must be in [0, local_ranks)"));
  }
  // Each local rank's GPU node, for the choice and the split below: used
  // only when every local rank's is known (a rank that sees its own GPU
  // alone, under CUDA_VISIBLE_DEVICES, cannot place the others': then none is).
  std::vector<hwloc_obj_t> gpu_nodes(static_cast<std::size_t>(o.local_ranks), nullptr);
  if (o.local_ranks > 1) {
    for (int l = 0; l < o.local_ranks; ++l) gpu_nodes[static_cast<std::size_t>(l)] = numa_node_of_gpu(topology, o, l);
    if (std::any_of(gpu_nodes.begin(), gpu_nodes.end(), [](hwloc_obj_t n) { return n == nullptr; })) {
      std::fill(gpu_nodes.begin(), gpu_nodes.end(), nullptr);
    }
  }
  hwloc_obj_t node = nullptr;
  if (o.bind != BindMode::kCores) {
    if (o.numa_node < 0 && gpu_nodes[static_cast<std::size_t>(o.local_rank)] != nullptr) {
      node = gpu_nodes[static_cast<std::size_t>(o.local_rank)];
      b.node_from = str_cat("GPU ", o.local_rank);
    }
    if (node == nullptr && o.numa_node >= 0) {
      node = numa_node_by_os_index(topology, static_cast<unsigned>(o.numa_node));
      if (node == nullptr) {
        return Status::invalid_argument(str_cat("cpu_adam: numa_node = ", o.numa_node,
                                                " is not a NUMA node of this machine (its nodes: ",
                                                numa_node_list(topology), ")"));
      }
      b.node_from = "numa_node";
    }
    std::string memory_why;
    if (node == nullptr && !o.near_memory.empty()) {
      node = numa_node_of_memory(topology, o.near_memory, &memory_why);
      if (node != nullptr) b.node_from = "memory";
    }
    if (node == nullptr) {
      node = numa_node_of_calling_thread(topology);
      if (node != nullptr) b.node_from = "calling thread";
    }
    if (node == nullptr && nodes == 1) {
      node = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, 0);
      b.node_from = "the only node";
    }
    if (!memory_why.empty()) {
      STRATA_LOG(kDebug) << "cpu_adam: the node of the memory is unknown (" << memory_why << "); "
                         << (node != nullptr ? str_cat("using ", b.node_from, "'s") : std::string("using every core"));
    }
  }
  std::vector<hwloc_obj_t> cores = node != nullptr ? cores_inside(topology, node->cpuset) : all_cores;
  if (node != nullptr && cores.empty()) {
    if (o.numa_node >= 0) {
      return Status::invalid_argument(str_cat("cpu_adam: numa_node = ", o.numa_node,
                                              " has no cores (a memory-only node); give a node with cores (nodes: ",
                                              numa_node_list(topology), ")"));
    }
    node = nullptr;  // memory without cores (a memory-only node): every core
    b.node_from.clear();
    cores = all_cores;
  }
  // Every core of a machine of one node is that node's (kCores there too).
  if (node == nullptr && nodes == 1) node = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, 0);
  b.numa_node = node != nullptr ? static_cast<int>(node->os_index) : -1;
  if (nodes > 1 && b.numa_node >= 0 && (b.node_from == "numa_node" || b.node_from.starts_with("GPU "))) {
    b.memory_node = b.numa_node;
  }
  if (cores.empty()) {
    if (strict) return Status::unavailable(str_cat("cpu_adam: ", mode, ": hwloc finds no cores on this machine"));
    b.numa_node = b.memory_node = -1;
    return unpinned(max_threads, "hwloc finds no cores");
  }
  // Several local ranks: the node's cores split among those that choose it
  // (the ranks whose GPU sits on it; without GPU locality, every local rank,
  // as all choose the node of their memory alike).
  if (o.local_ranks > 1) {
    // (A rank whose node is not its GPU's, given or every node's, shares with
    // every local rank: it cannot know which others chose the same.)
    std::vector<int> sharing;
    const bool by_gpu = gpu_nodes[0] != nullptr && node == gpu_nodes[static_cast<std::size_t>(o.local_rank)];
    for (int l = 0; l < o.local_ranks; ++l) {
      if (!by_gpu || gpu_nodes[static_cast<std::size_t>(l)] == node) sharing.push_back(l);
    }
    const auto at = std::find(sharing.begin(), sharing.end(), o.local_rank);
    {
      const auto k = sharing.size();
      const auto i = static_cast<std::size_t>(at - sharing.begin());
      b.sharing_ranks = static_cast<int>(k);
      b.share_index = static_cast<int>(i);
      const std::size_t c = cores.size();
      if (c >= k) {
        cores = std::vector<hwloc_obj_t>(cores.begin() + static_cast<std::ptrdiff_t>(i * c / k),
                                         cores.begin() + static_cast<std::ptrdiff_t>((i + 1) * c / k));
      } else {
        // Fewer cores than ranks: this rank takes one core, shared with others. Copied out first
        // (GCC 13's -Warray-bounds misreads assigning a braced list built from the vector).
        const hwloc_obj_t one = cores[i % c];
        cores.assign(1, one);
      }
    }
  }
  const int available = static_cast<int>(cores.size());
  int threads = o.threads > 0 ? o.threads : available;
  if (threads > available) {
    STRATA_LOG(kInfo) << "cpu_adam: " << threads << " threads asked, but "
                      << (b.numa_node >= 0 && nodes > 1 ? str_cat("NUMA node ", b.numa_node, " has ")
                                                        : std::string("this machine has "))
                      << available << " physical cores; using " << available << ", one per core (" << mode << ")";
    threads = available;
  }
  if (threads > max_threads) {
    STRATA_LOG(kInfo) << "cpu_adam: " << threads << " threads but this process may run " << max_threads
                      << " at once; using " << max_threads;
    threads = max_threads;
  }
  cores.resize(static_cast<std::size_t>(threads));
  b.threads = threads;
  for (hwloc_obj_t c : cores) b.cpus.push_back(hwloc_bitmap_first(c->cpuset));
  if (threads == 1) {
    b.bound = false;
    b.why_unbound = "one thread: the calling thread, which is never pinned";
    return choice;
  }
  b.bound = true;
  choice.cores = std::move(cores);
  return choice;
}

// Tries to pin a short-lived thread to each worker's core (slots 1 and up),
// so that a request that cannot be met is known at create(). The first
// failure, or "" when every core took it.
std::string probe_pinning(hwloc_topology_t topology, const std::vector<hwloc_obj_t>& cores) {
  std::string failure;
  std::jthread probe([&] {
    for (std::size_t slot = 1; slot < cores.size() && failure.empty(); ++slot) {
      if (hwloc_set_cpubind(topology, cores[slot]->cpuset, HWLOC_CPUBIND_THREAD) != 0) {
        const int err = errno;
        failure = str_cat("cannot pin a thread to CPU ", hwloc_bitmap_first(cores[slot]->cpuset), ": ",
                          std::generic_category().message(err));
      }
    }
  });
  probe.join();
  return failure;
}

// Pins the worker thread in slot i of the arena to cores[i] while it is in
// the arena, and gives it back its previous binding when it leaves (oneTBB's
// workers serve every arena of the process). Slot 0 is the calling thread's:
// never pinned, it belongs to the embedder.
class CorePinner : public oneapi::tbb::task_scheduler_observer {
 public:
  static constexpr std::chrono::milliseconds kLeaveWait{1000};

  CorePinner(oneapi::tbb::task_arena& arena, hwloc_topology_t topology, std::vector<hwloc_obj_t> cores)
      : oneapi::tbb::task_scheduler_observer(arena), topology_(topology), cores_(std::move(cores)) {
    saved_.reserve(cores_.size());
    for (std::size_t i = 0; i < cores_.size(); ++i) saved_.push_back(std::make_unique<Saved>());
    observe(true);
  }
  // Waits (a moment, at most kLeaveWait) for the pinned workers to leave the
  // arena, so that each gets its binding back before the observer goes.
  ~CorePinner() override {
    const auto deadline = std::chrono::steady_clock::now() + kLeaveWait;
    while (inside_.load() > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (inside_.load() > 0) {
      STRATA_LOG(kDebug) << "cpu_adam: " << inside_.load() << " worker(s) still in the arena; they keep their pins";
    }
    observe(false);
  }

  void on_scheduler_entry(bool is_worker) override {
    Saved* saved = slot_of(is_worker);
    if (saved == nullptr) return;
    saved->valid = hwloc_get_cpubind(topology_, saved->set.get(), HWLOC_CPUBIND_THREAD) == 0;
    if (saved->valid) inside_.fetch_add(1);
    const std::size_t slot = static_cast<std::size_t>(oneapi::tbb::this_task_arena::current_thread_index());
    if (hwloc_set_cpubind(topology_, cores_[slot]->cpuset, HWLOC_CPUBIND_THREAD) != 0 && !warned_.exchange(true)) {
      STRATA_LOG(kInfo) << "cpu_adam: could not pin a worker thread to CPU " << hwloc_bitmap_first(cores_[slot]->cpuset)
                        << "; it runs unpinned";
    }
  }

  void on_scheduler_exit(bool is_worker) override {
    Saved* saved = slot_of(is_worker);
    if (saved == nullptr || !saved->valid) return;
    // Best effort: the thread leaves our arena either way.
    (void)hwloc_set_cpubind(topology_, saved->set.get(), HWLOC_CPUBIND_THREAD);
    saved->valid = false;
    inside_.fetch_sub(1);
  }

 private:
  // A worker's binding from before it entered; touched by that slot's thread only.
  struct Saved {
    Bitmap set;
    bool valid = false;
  };
  Saved* slot_of(bool is_worker) {
    if (!is_worker) return nullptr;
    const int slot = oneapi::tbb::this_task_arena::current_thread_index();
    if (slot <= 0 || static_cast<std::size_t>(slot) >= cores_.size()) return nullptr;
    return saved_[static_cast<std::size_t>(slot)].get();
  }

  hwloc_topology_t topology_;
  std::vector<hwloc_obj_t> cores_;
  std::vector<std::unique_ptr<Saved>> saved_;
  std::atomic<bool> warned_{false};
  std::atomic<int> inside_{0};  // pinned workers in the arena, with a binding to give back
};

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "?";
}

std::string_view elem_type_name(ElemType type) {
  switch (type) {
    case ElemType::kF32:
      return "fp32";
    case ElemType::kBf16:
      return "bf16";
    case ElemType::kF16:
      return "fp16";
  }
  return "?";
}

#if defined(__x86_64__)
namespace {
// F16C (CPUID leaf 1, ECX bit 29) and AVX512_BF16 (leaf 7 subleaf 1, EAX bit
// 5), read from CPUID: clang 14 (the thread-safety check's compiler) knows
// neither name that GCC's __builtin_cpu_supports takes.
bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & (1u << 29)) != 0;
}
bool has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 5)) != 0;
}
}  // namespace
#endif

bool isa_supported(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && has_f16c() &&
             __builtin_cpu_supports("fma");
    case Isa::kAvx512Bf16:
      return isa_supported(Isa::kAvx512) && has_avx512_bf16();
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

namespace kernels {
bool avx512_vbmi_supported() {
#if defined(__x86_64__)
  static const bool kSupported = [] {
    __builtin_cpu_init();
    return isa_supported(Isa::kAvx512) && __builtin_cpu_supports("avx512vbmi");
  }();
  return kSupported;
#else
  return false;
#endif
}
}  // namespace kernels

Isa best_isa() {
  if (isa_supported(Isa::kAvx512Bf16)) return Isa::kAvx512Bf16;
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

Status validate_adam_constants(const nx::AdamStepConstants& c) {
  auto bad = [](const char* field, float value, const char* expected) {
    return Status::invalid_argument(str_cat("adam constants: ", field, " = ", value, " ", expected));
  };
  const float all[] = {c.grad_scale,
                       c.beta1,
                       c.beta2,
                       c.one_minus_beta1,
                       c.one_minus_beta2,
                       c.eps,
                       c.inv_sqrt_bias_correction2,
                       c.neg_step_size,
                       c.neg_lr_decay,
                       c.l2_decay};
  for (float x : all) {
    if (!std::isfinite(x)) return bad("a constant", x, "is not finite");
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f)) return bad("beta1", c.beta1, "is outside [0, 1)");
  if (!(c.beta2 >= 0.0f && c.beta2 < 1.0f)) return bad("beta2", c.beta2, "is outside [0, 1)");
  if (!(c.eps > 0.0f)) return bad("eps", c.eps, "must be > 0");
  if (!(c.grad_scale > 0.0f)) return bad("grad_scale", c.grad_scale, "must be > 0");
  if (!(c.inv_sqrt_bias_correction2 > 0.0f)) {
    return bad("inv_sqrt_bias_correction2", c.inv_sqrt_bias_correction2, "must be > 0");
  }
  if (c.neg_step_size > 0.0f) return bad("neg_step_size", c.neg_step_size, "must be <= 0 (it is -lr/bc1)");
  return Status();
}

Status validate_lion_constants(const nx::LionStepConstants& c) {
  auto bad = [](const char* field, float value, const char* expected) {
    return Status::invalid_argument(str_cat("lion constants: ", field, " = ", value, " ", expected));
  };
  const float all[] = {c.grad_scale,      c.beta1,  c.beta2,       c.one_minus_beta1,
                       c.one_minus_beta2, c.neg_lr, c.neg_lr_decay};
  for (float x : all) {
    if (!std::isfinite(x)) return bad("a constant", x, "is not finite");
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f)) return bad("beta1", c.beta1, "is outside [0, 1)");
  if (!(c.beta2 >= 0.0f && c.beta2 < 1.0f)) return bad("beta2", c.beta2, "is outside [0, 1)");
  if (!(c.grad_scale > 0.0f)) return bad("grad_scale", c.grad_scale, "must be > 0");
  if (c.neg_lr > 0.0f) return bad("neg_lr", c.neg_lr, "must be <= 0 (it is -lr)");
  if (c.neg_lr_decay > 0.0f) {
    return bad("neg_lr_decay", c.neg_lr_decay, "must be <= 0 (it is -lr * weight_decay)");
  }
  return Status();
}

Status validate_adagrad_constants(const nx::AdagradStepConstants& c) {
  auto bad = [](const char* field, float value, const char* expected) {
    return Status::invalid_argument(str_cat("adagrad constants: ", field, " = ", value, " ", expected));
  };
  const float all[] = {c.grad_scale, c.eps, c.neg_lr, c.l2_decay};
  for (float x : all) {
    if (!std::isfinite(x)) return bad("a constant", x, "is not finite");
  }
  if (!(c.eps > 0.0f)) return bad("eps", c.eps, "must be > 0");
  if (!(c.grad_scale > 0.0f)) return bad("grad_scale", c.grad_scale, "must be > 0");
  if (c.neg_lr > 0.0f) return bad("neg_lr", c.neg_lr, "must be <= 0 (it is -lr)");
  if (c.l2_decay < 0.0f) return bad("l2_decay", c.l2_decay, "must be >= 0 (it is weight_decay)");
  return Status();
}

std::string_view bind_mode_name(BindMode mode) {
  switch (mode) {
    case BindMode::kAuto:
      return "auto";
    case BindMode::kNuma:
      return "numa";
    case BindMode::kCores:
      return "cores";
    case BindMode::kNone:
      return "none";
  }
  return "?";
}

std::string CoreBinding::describe() const {
  std::string cpu_list;
  for (int c : cpus) cpu_list += str_cat(cpu_list.empty() ? "" : ",", c);
  std::string where;
  if (numa_node >= 0) {
    where = str_cat("NUMA node ", numa_node);
    if (node_from == "memory") where += " (the node of the memory)";
    else if (node_from == "calling thread") where += " (the calling thread's node)";
    else if (node_from == "numa_node") where += " (numa_node)";
    else if (node_from.starts_with("GPU ")) where += str_cat(" (the node of ", node_from, ")");
    if (sharing_ranks > 1) where += str_cat(", share ", share_index + 1, " of its cores among ", sharing_ranks, " local ranks");
  } else if (!cpus.empty()) {
    where = "every NUMA node";
  }
  const std::string count = str_cat(threads, threads == 1 ? " thread" : " threads");
  if (bound) return str_cat(count, " pinned one per physical core of ", where, ": CPUs ", cpu_list);
  std::string line = str_cat(count, ", not pinned (", why_unbound, ")");
  if (!where.empty()) line += str_cat(" on ", where, ": CPU", cpus.size() == 1 ? " " : "s ", cpu_list);
  return line;
}

core::Result<CoreBinding> plan_core_binding(const CpuAdamOptions& options, std::string_view synthetic_topology) {
  const Topology topology(synthetic_topology, options.local_ranks > 1);
  if (topology.topology == nullptr && !synthetic_topology.empty()) {
    return Status::invalid_argument(str_cat("cpu_adam: ", topology.error));
  }
  const int max_threads = std::max(1, oneapi::tbb::info::default_concurrency());
  // A synthetic machine is not this one: its threads are not capped by what this process may run.
  STRATA_ASSIGN_OR_RETURN(CoreChoice choice,
                          choose_cores(topology.topology, topology.error, options,
                                       synthetic_topology.empty() ? max_threads : std::numeric_limits<int>::max()));
  return std::move(choice.binding);
}

struct CpuAdam::Impl {
  const kernels::KernelTable* table = nullptr;
  CoreBinding binding;
  // Destruction order: the pinner stops observing before the arena goes, and
  // both before the topology they use.
  std::unique_ptr<Topology> topology;
  std::unique_ptr<oneapi::tbb::task_arena> arena;
  std::unique_ptr<CorePinner> pinner;

  ~Impl() {
    pinner.reset();
    arena.reset();
    topology.reset();
  }
};

core::Result<std::unique_ptr<CpuAdam>> CpuAdam::create(const CpuAdamOptions& options) {
  Isa isa = options.auto_isa ? best_isa() : options.isa;
  if (!isa_supported(isa)) {
    return Status::unimplemented(
        str_cat("cpu_adam: ISA ", isa_name(isa),
                " was requested but this CPU does not support it (best: ", isa_name(best_isa()), ")"));
  }
  std::int64_t tile = options.tile_elems == 0 ? kDefaultTileElems : options.tile_elems;
  if (tile < 0 || tile % nx::kNormBlockElems != 0) {
    return Status::invalid_argument(str_cat("cpu_adam: tile_elems = ", options.tile_elems,
                                            " must be a positive multiple of ", nx::kNormBlockElems,
                                            " (the norm block)"));
  }
  auto impl = std::make_unique<Impl>();
  impl->table = &table_for(isa);
  impl->topology = std::make_unique<Topology>(std::string_view(), options.local_ranks > 1);
  const int max_threads = std::max(1, oneapi::tbb::info::default_concurrency());
  STRATA_ASSIGN_OR_RETURN(CoreChoice choice,
                          choose_cores(impl->topology->topology, impl->topology->error, options, max_threads));
  CoreBinding& binding = choice.binding;
  if (binding.bound) {
    if (const std::string failure = probe_pinning(impl->topology->topology, choice.cores); !failure.empty()) {
      if (options.bind != BindMode::kAuto) {
        return Status::unavailable(str_cat("cpu_adam: bind ", bind_mode_name(options.bind), ": ", failure));
      }
      STRATA_LOG(kInfo) << "cpu_adam: bind auto: " << failure << "; the threads run unpinned";
      binding.bound = false;
      binding.why_unbound = failure;
      choice.cores.clear();
    }
  } else if (options.bind == BindMode::kAuto && binding.threads > 1) {
    STRATA_LOG(kInfo) << "cpu_adam: bind auto: " << binding.why_unbound << "; the threads run unpinned";
  }
  const int threads = binding.threads;
  impl->arena = std::make_unique<oneapi::tbb::task_arena>(threads);
  if (binding.bound) {
    impl->pinner = std::make_unique<CorePinner>(*impl->arena, impl->topology->topology, std::move(choice.cores));
  }
  STRATA_LOG(kDebug) << "cpu_adam: " << isa_name(isa) << " kernels, tiles of " << tile << " elements, "
                     << binding.describe();
  impl->binding = std::move(binding);
  return std::unique_ptr<CpuAdam>(new CpuAdam(threads, tile, std::move(impl)));
}

const CoreBinding& CpuAdam::binding() const { return impl_->binding; }

CpuAdam::CpuAdam(int threads, std::int64_t tile_elems, std::unique_ptr<Impl> impl)
    : threads_(threads), tile_elems_(tile_elems), impl_(std::move(impl)) {}

Isa CpuAdam::isa() const { return impl_->table->isa; }

CpuAdam::~CpuAdam() = default;

Status CpuAdam::set_isa(Isa isa) {
  if (!isa_supported(isa)) {
    return Status::unimplemented(str_cat("cpu_adam: this CPU does not support ISA ", isa_name(isa)));
  }
  impl_->table = &table_for(isa);
  return Status();
}

void CpuAdam::for_each_tile(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  const std::int64_t tile = tile_elems_;
  const std::int64_t tiles = (n + tile - 1) / tile;
  impl_->arena->execute([&] {
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<std::int64_t>(0, tiles, 1),
        [&](const oneapi::tbb::blocked_range<std::int64_t>& r) {
          FpEnvGuard fp_env;
          for (std::int64_t t = r.begin(); t < r.end(); ++t) fn(t * tile, std::min(tile, n - t * tile));
        },
        oneapi::tbb::simple_partitioner());
  });
}

Status CpuAdam::step(const AdamStepArgs& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers(
      "adam step", args.master, {{"exp_avg", args.exp_avg}, {"exp_avg_sq", args.exp_avg_sq}}, args.grad,
      args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_adam_constants(args.constants));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    kernels::AdamKernelArgs k{&args.constants,
                              args.master.data() + begin,
                              args.exp_avg.data() + begin,
                              args.exp_avg_sq.data() + begin,
                              grad_at(args.grad, begin),
                              args.grad.type,
                              copy_at(args.copy_out, begin),
                              args.copy_out.type,
                              length};
    table.adam(k);
  });
  return Status();
}

Status CpuAdam::step_bf16_moments(const AdamStepBf16MomentsArgs& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers("adam step (bf16 moments)", args.master,
                                            {{"exp_avg", args.exp_avg}, {"exp_avg_sq", args.exp_avg_sq}},
                                            args.grad, args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_adam_constants(args.constants));
  const std::int64_t n = static_cast<std::int64_t>(args.master.size());
  if (args.rounding != nx::Bf16Rounding::kNearestEven && args.rounding != nx::Bf16Rounding::kStochastic) {
    return Status::invalid_argument(str_cat("adam step (bf16 moments): rounding = ",
                                            static_cast<int>(args.rounding),
                                            " is neither kNearestEven (0) nor kStochastic (1)"));
  }
  if (args.index_base < 0 || args.index_base > std::numeric_limits<std::int64_t>::max() - n) {
    return Status::invalid_argument(str_cat("adam step (bf16 moments): index_base = ", args.index_base,
                                            " must be >= 0 and index_base + n (n = ", n,
                                            ") must not pass INT64_MAX"));
  }

  const kernels::KernelTable& table = *impl_->table;
  const std::uint64_t key = nx::stochastic_rounding_key(args.seed, args.step);
  for_each_tile(n, [&](std::int64_t begin, std::int64_t length) {
    kernels::AdamBf16MomentsKernelArgs k{&args.constants,
                                         args.master.data() + begin,
                                         args.exp_avg.data() + begin,
                                         args.exp_avg_sq.data() + begin,
                                         grad_at(args.grad, begin),
                                         args.grad.type,
                                         copy_at(args.copy_out, begin),
                                         args.copy_out.type,
                                         args.rounding,
                                         args.seed,
                                         args.step,
                                         key,
                                         args.index_base + begin,
                                         length};
    table.adam_bf16_moments(k);
  });
  return Status();
}

Status CpuAdam::step_int8_blockwise(const AdamStepInt8Args& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers("adam step (8-bit moments)", args.master,
                                            {{"exp_avg", args.exp_avg}, {"exp_avg_sq", args.exp_avg_sq}},
                                            args.grad, args.copy_out,
                                            {{"exp_avg_scale", args.exp_avg_scale},
                                             {"exp_avg_sq_scale", args.exp_avg_sq_scale}}));
  STRATA_RETURN_IF_ERROR(validate_adam_constants(args.constants));

  // Tiles are multiples of 65536 elements, so each starts on a block boundary
  // and its scales at begin / 256.
  static_assert(nx::kNormBlockElems % nx::kQuantBlockElems == 0);
  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    const std::int64_t block = begin / nx::kQuantBlockElems;
    kernels::AdamInt8KernelArgs k{&args.constants,
                                  args.master.data() + begin,
                                  args.exp_avg.data() + begin,
                                  args.exp_avg_sq.data() + begin,
                                  args.exp_avg_scale.data() + block,
                                  args.exp_avg_sq_scale.data() + block,
                                  grad_at(args.grad, begin),
                                  args.grad.type,
                                  copy_at(args.copy_out, begin),
                                  args.copy_out.type,
                                  length};
    table.adam_int8(k);
  });
  return Status();
}

Status CpuAdam::lion_step(const LionStepArgs& args) {
  STRATA_RETURN_IF_ERROR(
      check_step_buffers("lion step", args.master, {{"exp_avg", args.exp_avg}}, args.grad, args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_lion_constants(args.constants));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    kernels::LionKernelArgs k{&args.constants,
                              args.master.data() + begin,
                              args.exp_avg.data() + begin,
                              grad_at(args.grad, begin),
                              args.grad.type,
                              copy_at(args.copy_out, begin),
                              args.copy_out.type,
                              length};
    table.lion(k);
  });
  return Status();
}

Status CpuAdam::adagrad_step(const AdagradStepArgs& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers("adagrad step", args.master, {{"exp_avg_sq", args.exp_avg_sq}},
                                            args.grad, args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_adagrad_constants(args.constants));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    kernels::AdagradKernelArgs k{&args.constants,
                                 args.master.data() + begin,
                                 args.exp_avg_sq.data() + begin,
                                 grad_at(args.grad, begin),
                                 args.grad.type,
                                 copy_at(args.copy_out, begin),
                                 args.copy_out.type,
                                 length};
    table.adagrad(k);
  });
  return Status();
}

core::Result<GradPassResult> CpuAdam::grad_pass(const GradPassArgs& args) {
  const std::int64_t n = args.src.size;
  if (n == 0) return Status::invalid_argument("gradient pass: zero elements");
  if (args.dst.size != n) {
    return Status::invalid_argument(str_cat("gradient pass: sizes differ: src ", n, ", dst ", args.dst.size));
  }
  const bool same_type = args.src.type == args.dst.type;
  if (args.dst.type != ElemType::kF32 && !same_type) {
    return Status::invalid_argument(str_cat(
        "gradient pass: cannot convert ", elem_type_name(args.src.type), " into ",
        elem_type_name(args.dst.type), " (16-bit gradients are kept as they arrive or widened to fp32)"));
  }
  if (args.accumulate && args.dst.type != ElemType::kF32) {
    return Status::invalid_argument(str_cat("gradient pass: accumulation needs an fp32 destination, not ",
                                            elem_type_name(args.dst.type)));
  }
  if (args.accumulate && args.src.data == args.dst.data) {
    return Status::invalid_argument("gradient pass: cannot accumulate a buffer into itself");
  }
  const std::int64_t blocks = nx::norm_block_count(n);
  if (static_cast<std::int64_t>(args.norm_partials.size()) < blocks) {
    return Status::invalid_argument(str_cat("gradient pass: norm_partials holds ", args.norm_partials.size(),
                                            " values, ", blocks, " needed for ", n, " elements"));
  }
  const int src_bytes = elem_size_bytes(args.src.type);
  const int dst_bytes = elem_size_bytes(args.dst.type);
  STRATA_RETURN_IF_ERROR(check_aligned("src", args.src.data, src_bytes));
  STRATA_RETURN_IF_ERROR(check_aligned("dst", args.dst.data, dst_bytes));
  STRATA_RETURN_IF_ERROR(check_aligned("norm_partials", args.norm_partials.data(), 8));
  STRATA_RETURN_IF_ERROR(check_disjoint(
      {range_of("src", args.src.data, n, src_bytes), range_of("dst", args.dst.data, n, dst_bytes),
       range_of("norm_partials", args.norm_partials.data(), blocks, 8)},
      "src", "dst"));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(n, [&](std::int64_t begin, std::int64_t length) {
    kernels::GradKernelArgs k{static_cast<const std::byte*>(args.src.data) + begin * src_bytes,
                              args.src.type,
                              static_cast<std::byte*>(args.dst.data) + begin * dst_bytes,
                              args.dst.type,
                              args.accumulate,
                              args.norm_partials.data() + begin / nx::kNormBlockElems,
                              length};
    table.grad_pass(k);
  });
  // A block partial is inf or NaN exactly when one of its values is: squares
  // of finite floats sum far below the double range.
  GradPassResult result;
  for (std::int64_t b = 0; b < blocks; ++b) {
    if (!std::isfinite(args.norm_partials[static_cast<size_t>(b)])) {
      result.nonfinite = true;
      break;
    }
  }
  return result;
}

}  // namespace strata::adam
