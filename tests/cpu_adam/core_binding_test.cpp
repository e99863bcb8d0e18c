// Where CpuAdam's threads run: one thread per physical core of one NUMA node
// (the memory's, a given one, or every node's), threads cut to the cores,
// bindings given back when workers leave, and the same bits pinned or not.
#include <hwloc.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/numerics.h"
#include "cpu_adam/cpu_adam.h"

namespace strata::adam {
namespace {

namespace nx = core::numerics;

// Two NUMA nodes of four cores, two hyperthreads each: node 0 holds CPUs
// 0-7 (cores' first CPUs 0, 2, 4, 6), node 1 CPUs 8-15.
constexpr const char* kTwoNodes = "pack:1 numa:2 core:4 pu:2";

CpuAdamOptions options(BindMode bind, int threads = 0, int numa_node = -1) {
  CpuAdamOptions o;
  o.bind = bind;
  o.threads = threads;
  o.numa_node = numa_node;
  return o;
}

// This machine's topology, for checking the choice independently.
class Machine {
 public:
  Machine() {
    ok_ = hwloc_topology_init(&topology_) == 0 && hwloc_topology_load(topology_) == 0;
  }
  ~Machine() { hwloc_topology_destroy(topology_); }
  Machine(const Machine&) = delete;
  Machine& operator=(const Machine&) = delete;
  bool ok() const { return ok_; }
  hwloc_topology_t get() const { return topology_; }
  hwloc_obj_t core_of_cpu(int cpu) const {
    hwloc_obj_t pu = hwloc_get_pu_obj_by_os_index(topology_, static_cast<unsigned>(cpu));
    return pu == nullptr ? nullptr : hwloc_get_ancestor_obj_by_type(topology_, HWLOC_OBJ_CORE, pu);
  }
  hwloc_obj_t node(int os_index) const {
    for (hwloc_obj_t n = nullptr; (n = hwloc_get_next_obj_by_type(topology_, HWLOC_OBJ_NUMANODE, n));) {
      if (static_cast<int>(n->os_index) == os_index) return n;
    }
    return nullptr;
  }
  int cores() const { return hwloc_get_nbobjs_by_type(topology_, HWLOC_OBJ_CORE); }

 private:
  hwloc_topology_t topology_ = nullptr;
  bool ok_ = false;
};

// A 2-socket machine with 8 GPUs as hwloc XML: each socket a NUMA node of
// 8 cores (2 hyperthreads each: node 0 CPUs 0-15, node 1 CPUs 16-31), GPUs
// 0-3 (PCI devices with their "cuda<i>" OS devices) on socket 0, 4-7 on
// socket 1. Made from hwloc's export of the synthetic machine, the GPUs
// added inside each package.
std::string two_sockets_eight_gpus() {
  hwloc_topology_t t = nullptr;
  std::string xml;
  if (hwloc_topology_init(&t) != 0) return xml;
  char* buffer = nullptr;
  int length = 0;
  if (hwloc_topology_set_synthetic(t, "pack:2 numa:1 core:8 pu:2") == 0 && hwloc_topology_load(t) == 0 &&
      hwloc_topology_export_xmlbuffer(t, &buffer, &length, 0) == 0) {
    xml.assign(buffer, static_cast<std::size_t>(length));
    hwloc_free_xmlbuffer(t, buffer);
  }
  hwloc_topology_destroy(t);
  // Each package's object closes with a line of four spaces and "</object>".
  std::string out;
  int package = -1, gp_index = 1000;
  for (std::size_t at = 0; at < xml.size();) {
    const std::size_t end = std::min(xml.find('\n', at), xml.size());
    const std::string line = xml.substr(at, end - at);
    if (line.starts_with("    <object type=\"Package\"")) ++package;
    if (line == "    </object>" && package >= 0) {
      for (int g = 0; g < 4; ++g) {
        const int gpu = package * 4 + g;
        char busid[32];
        std::snprintf(busid, sizeof busid, "0000:%02x:00.0", 0x10 + gpu);
        out += "      <object type=\"PCIDev\" gp_index=\"" + std::to_string(gp_index++) + "\" pci_busid=\"" + busid +
               "\" pci_type=\"0302 [10de:2330] [10de:16c1] a1\" pci_link_speed=\"0.000000\">\n";
        out += "        <object type=\"OSDev\" gp_index=\"" + std::to_string(gp_index++) + "\" name=\"cuda" +
               std::to_string(gpu) + "\" subtype=\"CUDA\" osdev_type=\"5\"/>\n      </object>\n";
      }
    }
    out += line + "\n";
    at = end + 1;
  }
  return out;
}

TEST(CoreBinding, EachLocalRankTakesItsShareOfItsGpusNode) {
  const std::string xml = two_sockets_eight_gpus();
  ASSERT_FALSE(xml.empty());
  std::set<int> every;
  for (int l = 0; l < 8; ++l) {
    CpuAdamOptions o = options(BindMode::kAuto);
    o.local_rank = l;
    o.local_ranks = 8;
    auto b = plan_core_binding(o, xml);
    ASSERT_TRUE(b.ok()) << b.status();
    // GPUs 0-3 sit on node 0, 4-7 on node 1; each node's 8 cores split 4 ways: 2 each.
    EXPECT_EQ(b->numa_node, l / 4) << "local rank " << l;
    EXPECT_EQ(b->node_from, "GPU " + std::to_string(l));
    // The rank's pinned memory belongs on its GPU's node too.
    EXPECT_EQ(b->memory_node, l / 4) << "local rank " << l;
    EXPECT_EQ(b->sharing_ranks, 4);
    EXPECT_EQ(b->share_index, l % 4);
    ASSERT_EQ(b->threads, 2) << "local rank " << l;
    ASSERT_EQ(b->cpus.size(), 2u);
    for (int cpu : b->cpus) {
      EXPECT_GE(cpu, 16 * (l / 4));  // its node's CPUs
      EXPECT_LT(cpu, 16 * (l / 4 + 1));
      EXPECT_TRUE(every.insert(cpu).second) << "CPU " << cpu << " taken by two local ranks";
    }
    EXPECT_TRUE(b->bound);
    EXPECT_NE(b->describe().find("share " + std::to_string(l % 4 + 1) + " of its cores among 4 local ranks"),
              std::string::npos)
        << b->describe();
  }
  EXPECT_EQ(every.size(), 16u);  // every physical core, each to one rank
  // Three local ranks (GPUs 0-2, all on node 0): 8 cores as 2, 3, 3.
  std::vector<std::size_t> counts;
  for (int l = 0; l < 3; ++l) {
    CpuAdamOptions o = options(BindMode::kAuto);
    o.local_rank = l;
    o.local_ranks = 3;
    auto b = plan_core_binding(o, xml);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->numa_node, 0);
    counts.push_back(b->cpus.size());
  }
  EXPECT_EQ(counts, (std::vector<std::size_t>{2, 3, 3}));
  // A given PCI bus id names the GPU where no "cuda<i>" device is known:
  // local rank 0 driving the device at 0000:15:00.0 (GPU 5's, socket 1).
  CpuAdamOptions o = options(BindMode::kAuto);
  o.local_rank = 0;
  o.local_ranks = 2;
  o.gpu_pci_busids = {"0000:15:00.0", "0000:16:00.0"};
  auto b = plan_core_binding(o, xml);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->numa_node, 1);
  EXPECT_EQ(b->memory_node, 1);
  EXPECT_EQ(b->sharing_ranks, 2);
  // Bind "cores" (every node's) and "none" place no memory; neither does one
  // rank, whose GPU is not looked up (its memory's node is where it is).
  for (BindMode mode : {BindMode::kCores, BindMode::kNone}) {
    o.bind = mode;
    auto every = plan_core_binding(o, xml);
    ASSERT_TRUE(every.ok()) << every.status();
    EXPECT_EQ(every->memory_node, -1) << bind_mode_name(mode);
  }
  CpuAdamOptions one = options(BindMode::kAuto);
  auto alone = plan_core_binding(one, xml);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->memory_node, -1) << alone->describe();
}

TEST(CoreBinding, LocalRanksWithoutGpusSplitTheNodeOfTheirMemory) {
  // No GPU locality (the host device): every local rank takes the same node
  // (here the only one), its four cores split between the two ranks.
  for (int l = 0; l < 2; ++l) {
    CpuAdamOptions o = options(BindMode::kAuto);
    o.local_rank = l;
    o.local_ranks = 2;
    auto b = plan_core_binding(o, "pack:1 numa:1 core:4 pu:2");
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->sharing_ranks, 2);
    EXPECT_EQ(b->cpus, l == 0 ? (std::vector<int>{0, 2}) : (std::vector<int>{4, 6}));
    EXPECT_EQ(b->memory_node, -1);  // one node: first touch places the memory
  }
  CpuAdamOptions bad = options(BindMode::kAuto);
  bad.local_rank = 2;
  bad.local_ranks = 2;
  auto r = plan_core_binding(bad, "pack:1 numa:1 core:4 pu:2");
  EXPECT_EQ(r.status().code(), core::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("local_rank 2 of local_ranks 2"), std::string::npos) << r.status();
}

TEST(CoreBinding, ChosenCoresAreDistinctPhysicalCoresOfOneNode) {
  Machine machine;
  ASSERT_TRUE(machine.ok());
  auto cpu = CpuAdam::create(options(BindMode::kNuma));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const CoreBinding& b = (*cpu)->binding();
  EXPECT_EQ(b.mode, BindMode::kNuma);
  EXPECT_EQ(b.threads, (*cpu)->threads());
  ASSERT_GE(b.numa_node, 0) << b.describe();
  ASSERT_EQ(static_cast<int>(b.cpus.size()), b.threads) << b.describe();
  hwloc_obj_t node = machine.node(b.numa_node);
  ASSERT_NE(node, nullptr);
  std::set<hwloc_obj_t> cores;
  for (int c : b.cpus) {
    hwloc_obj_t core = machine.core_of_cpu(c);
    ASSERT_NE(core, nullptr) << "CPU " << c;
    EXPECT_TRUE(hwloc_bitmap_isincluded(core->cpuset, node->cpuset)) << "CPU " << c << " outside node " << b.numa_node;
    EXPECT_TRUE(cores.insert(core).second) << "two threads on the core of CPU " << c;
  }
  // The default thread count is the node's physical cores.
  int node_cores = 0;
  for (hwloc_obj_t c = nullptr; (c = hwloc_get_next_obj_inside_cpuset_by_type(machine.get(), node->cpuset,
                                                                                  HWLOC_OBJ_CORE, c));) {
    ++node_cores;
  }
  EXPECT_EQ(b.threads, std::min(node_cores, std::max(1, static_cast<int>(std::thread::hardware_concurrency()))));
  if (b.threads == 1) {
    EXPECT_FALSE(b.bound);
    GTEST_SKIP() << "one core on node " << b.numa_node << ": nothing to pin (" << b.describe() << ")";
  }
  EXPECT_TRUE(b.bound) << b.describe();
  EXPECT_NE(b.describe().find("NUMA node " + std::to_string(b.numa_node)), std::string::npos) << b.describe();
}

TEST(CoreBinding, NodeOfTheMemoryIsChosen) {
  Machine machine;
  ASSERT_TRUE(machine.ok());
  auto buffer = core::AlignedBuffer::allocate(1 << 20, 4096);
  ASSERT_TRUE(buffer.ok());
  std::memset(buffer->data(), 1, buffer->size_bytes());  // place the pages
  hwloc_bitmap_t nodes = hwloc_bitmap_alloc();
  const int where = hwloc_get_area_memlocation(machine.get(), buffer->data(), buffer->size_bytes(), nodes,
                                               HWLOC_MEMBIND_BYNODESET);
  const int first = hwloc_bitmap_first(nodes);
  hwloc_bitmap_free(nodes);
  if (where != 0 || first < 0) GTEST_SKIP() << "the OS does not say where memory lives (move_pages)";
  CpuAdamOptions o = options(BindMode::kNuma);
  o.near_memory = buffer->bytes();
  auto cpu = CpuAdam::create(o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->binding().node_from, "memory");
  EXPECT_EQ((*cpu)->binding().numa_node, first);
}

TEST(CoreBinding, GivenNodeTakesOneThreadPerPhysicalCore) {
  auto b = plan_core_binding(options(BindMode::kNuma, 0, 1), kTwoNodes);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->bound);
  EXPECT_EQ(b->numa_node, 1);
  EXPECT_EQ(b->node_from, "numa_node");
  EXPECT_EQ(b->memory_node, 1);  // the memory goes where the threads were told to run
  EXPECT_EQ(b->threads, 4);
  EXPECT_EQ(b->cpus, (std::vector<int>{8, 10, 12, 14}));  // never both hyperthreads of a core
  EXPECT_EQ(b->describe(), "4 threads pinned one per physical core of NUMA node 1 (numa_node): CPUs 8,10,12,14");
}

TEST(CoreBinding, MoreThreadsThanCoresAreCutToTheCores) {
  auto b = plan_core_binding(options(BindMode::kNuma, 16, 0), kTwoNodes);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->threads_asked, 16);
  EXPECT_EQ(b->threads, 4);
  EXPECT_EQ(b->cpus, (std::vector<int>{0, 2, 4, 6}));
  auto fewer = plan_core_binding(options(BindMode::kAuto, 3, 0), kTwoNodes);
  ASSERT_TRUE(fewer.ok()) << fewer.status();
  EXPECT_EQ(fewer->threads, 3);
  EXPECT_EQ(fewer->cpus, (std::vector<int>{0, 2, 4}));
  // Every node's cores with kCores; more threads than those are cut as well.
  auto all = plan_core_binding(options(BindMode::kCores, 99), kTwoNodes);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->threads, 8);
  EXPECT_EQ(all->numa_node, -1);
  EXPECT_EQ(all->cpus, (std::vector<int>{0, 2, 4, 6, 8, 10, 12, 14}));
  // On this machine too: never more threads than its physical cores.
  Machine machine;
  ASSERT_TRUE(machine.ok());
  auto cpu = CpuAdam::create(options(BindMode::kCores, machine.cores() + 3));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_LE((*cpu)->threads(), machine.cores());
  EXPECT_EQ((*cpu)->binding().threads_asked, machine.cores() + 3);
}

TEST(CoreBinding, NoneAndOneThreadAreNotPinned) {
  auto none = plan_core_binding(options(BindMode::kNone), kTwoNodes);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->bound);
  EXPECT_EQ(none->threads, 8);  // every physical core
  EXPECT_TRUE(none->cpus.empty());
  EXPECT_EQ(none->describe(), "8 threads, not pinned (bind none)");
  auto one = plan_core_binding(options(BindMode::kNuma, 1, 1), kTwoNodes);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE(one->bound);
  EXPECT_EQ(one->cpus, (std::vector<int>{8}));
  EXPECT_NE(one->why_unbound.find("one thread"), std::string::npos) << one->why_unbound;
}

TEST(CoreBinding, BadNodesAndThreadsAreErrors) {
  auto missing = plan_core_binding(options(BindMode::kAuto, 0, 5), kTwoNodes);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), core::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("numa_node = 5 is not a NUMA node of this machine (its nodes: 0, 1)"),
            std::string::npos)
      << missing.status();
  EXPECT_EQ(plan_core_binding(options(BindMode::kNuma, 0, -2), kTwoNodes).status().code(),
            core::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_core_binding(options(BindMode::kNuma, -1), kTwoNodes).status().code(),
            core::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_core_binding(options(BindMode::kNuma), "no such topology").status().code(),
            core::StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuAdam::create(options(BindMode::kNuma, 0, 4095)).status().code(), core::StatusCode::kInvalidArgument);
}

// Step results with the threads pinned (numa, cores) and not (none), over
// several tiles and a tail: the same bits.
TEST(CoreBinding, ResultsAreBitIdenticalPinnedOrNot) {
  const std::int64_t n = 5 * 65536 + 123;
  const std::int64_t tile = 65536;
  std::vector<float> p0(n), m0(n), v0(n), g(n);
  std::uint32_t x = 7;
  for (std::int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    const float r = static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
    p0[i] = r;
    m0[i] = r * 1e-2f;
    v0[i] = r * r * 1e-4f;
    g[i] = r * 3.0f;
  }
  const nx::AdamStepConstants c = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.01}, 3, 1.0);
  std::vector<std::vector<float>> results;
  for (BindMode bind : {BindMode::kNone, BindMode::kNuma, BindMode::kCores, BindMode::kAuto}) {
    CpuAdamOptions o = options(bind, 2);
    o.tile_elems = tile;
    auto cpu = CpuAdam::create(o);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    std::vector<float> p = p0, m = m0, v = v0;
    std::vector<std::uint16_t> copy(n);
    for (int step = 0; step < 3; ++step) {
      AdamStepArgs a;
      a.constants = c;
      a.master = p;
      a.exp_avg = m;
      a.exp_avg_sq = v;
      a.grad = {g.data(), ElemType::kF32, n};
      a.copy_out = {copy.data(), ElemType::kBf16, n};
      ASSERT_TRUE((*cpu)->step(a).ok());
    }
    std::vector<float> all = p;
    all.insert(all.end(), m.begin(), m.end());
    all.insert(all.end(), v.begin(), v.end());
    for (std::uint16_t h : copy) all.push_back(static_cast<float>(h));
    results.push_back(std::move(all));
  }
  for (std::size_t i = 1; i < results.size(); ++i) {
    ASSERT_EQ(std::memcmp(results[0].data(), results[i].data(), results[0].size() * sizeof(float)), 0)
        << "bind mode " << i << " changed the bits";
  }
}

// A worker pinned in a bound CpuAdam's arena gets its previous binding back
// when it leaves: oneTBB's workers serve every arena of the process, and an
// unpinned CpuAdam made after a pinned one must not inherit its pins.
TEST(CoreBinding, WorkersGetTheirBindingBackOnLeaving) {
  Machine machine;
  ASSERT_TRUE(machine.ok());
  if (machine.cores() < 2) GTEST_SKIP() << "one core: nothing is pinned";
  hwloc_bitmap_t all = hwloc_bitmap_dup(hwloc_topology_get_allowed_cpuset(machine.get()));
  const std::thread::id caller = std::this_thread::get_id();
  // The bindings seen by threads other than the caller while they ran tiles.
  auto worker_bindings = [&](CpuAdam& cpu) {
    std::mutex mu;
    std::vector<std::string> seen;
    for (int round = 0; round < 50 && seen.empty(); ++round) {
      cpu.for_each_tile(64 * 65536, [&](std::int64_t, std::int64_t) {
        // Every tile takes a while, so that the workers wake up and take some.
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        if (std::this_thread::get_id() == caller) return;
        hwloc_bitmap_t set = hwloc_bitmap_alloc();
        if (hwloc_get_cpubind(machine.get(), set, HWLOC_CPUBIND_THREAD) == 0) {
          char* text = nullptr;
          hwloc_bitmap_asprintf(&text, set);
          std::lock_guard lock(mu);
          seen.push_back(hwloc_bitmap_isequal(set, all) ? std::string("all") : std::string(text));
          std::free(text);
        }
        hwloc_bitmap_free(set);
      });
    }
    return seen;
  };
  {
    auto bound = CpuAdam::create(options(BindMode::kCores, 2));
    ASSERT_TRUE(bound.ok()) << bound.status();
    ASSERT_TRUE((*bound)->binding().bound) << (*bound)->binding().describe();
    const std::vector<std::string> seen = worker_bindings(**bound);
    if (seen.empty()) GTEST_SKIP() << "no worker thread joined the arena (the host is busy)";
    for (const std::string& s : seen) EXPECT_NE(s, "all") << "a worker ran unpinned in the bound arena";
  }
  auto unbound = CpuAdam::create(options(BindMode::kNone, 2));
  ASSERT_TRUE(unbound.ok()) << unbound.status();
  const std::vector<std::string> seen = worker_bindings(**unbound);
  if (seen.empty()) GTEST_SKIP() << "no worker thread joined the arena (the host is busy)";
  for (const std::string& s : seen) EXPECT_EQ(s, "all") << "a worker kept a pin from the bound arena";
  hwloc_bitmap_free(all);
}

}  // namespace
}  // namespace strata::adam
