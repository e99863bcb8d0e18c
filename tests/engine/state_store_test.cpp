// StateStore over the host device and a real swap store: every tier holds
// what was stored, nvme corruption is caught, budgets are enforced.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/memory_budget.h"
#include "core/numerics.h"
#include "engine/layout.h"
#include "engine/state/compute_homes.h"
#include "engine/state/state_store.h"
#include "gpu/host_device.h"
#include "nvme/swap_store.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
constexpr std::int64_t kB = 65536;

class StateStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_state_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // 3 groups of 2 blocks, chunks of 1 block: 6 chunks; nvme with half of the
  // offloaded share pinned, and DeepSpeed's ratio leaving 2 chunks on the device.
  Layout layout(StateFormat format = StateFormat::kFp32) {
    Config c;
    c.strata.optimizer_state.format = format;
    c.precision = Precision::kBf16;
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_optimizer.ratio = 4.0 / 6.0;
    c.strata.optimizer_cpu_fraction = 0.5;
    c.strata.chunk_bytes = kB * 4;
    std::vector<ParamDesc> params;
    for (int g = 0; g < 3; ++g) params.push_back({"w" + std::to_string(g), {2 * kB}, "g" + std::to_string(g)});
    auto l = plan_layout(params, {}, c);
    EXPECT_TRUE(l.ok()) << l.status();
    return std::move(l).value();
  }

  std::unique_ptr<nvme::SwapStore> swap() {
    nvme::SwapStoreOptions o;
    o.paths = {dir_.string()};
    o.capacity_bytes = 64ull << 20;
    o.io.kind = nvme::BackendKind::kPsync;
    auto s = nvme::SwapStore::create(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  fs::path dir_;
  core::MemoryBudget device_budget_{"device memory", 64ull << 20, "strata.budgets.device"};
  core::MemoryBudget pinned_budget_{"pinned host memory", 64ull << 20, "strata.budgets.pinned"};

  // Every tier keeps what was stored in each array, at the size the format
  // gives (fp32: 12 bytes an element; bf16 moments: 8; int8 codes: 6 and
  // 2 x 4 bytes of scales per block of 256).
  void every_tier_keeps_what_was_stored(StateFormat format);
};

void StateStoreTest::every_tier_keeps_what_was_stored(StateFormat format) {
  const Layout l = layout(format);
  const std::uint64_t chunk_bytes = format == StateFormat::kFp32   ? 12 * kB
                                    : format == StateFormat::kBf16 ? 8 * kB
                                                                   : 6 * kB + 8 * (kB / 256);
  ASSERT_EQ(l.optimizer.state_bytes(kB), chunk_bytes);
  // A moment value and its stored form: exact in both formats.
  auto moment = [](std::int64_t k) { return -static_cast<float>(k % 256); };
  int tiers[3] = {0, 0, 0};
  for (const ChunkPlace& c : l.chunks) ++tiers[static_cast<int>(c.state_tier)];
  ASSERT_EQ(tiers[0], 2);  // device
  ASSERT_EQ(tiers[1], 2);  // pinned
  ASSERT_EQ(tiers[2], 2);  // nvme
  auto device = gpu::make_host_device({{&device_budget_, &pinned_budget_}, {}});
  ASSERT_TRUE(device.ok()) << device.status();
  auto sw = swap();
  ASSERT_NE(sw, nullptr);
  auto store = StateStore::create(l, **device, sw.get());
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(device_budget_.used_bytes(), 2u * chunk_bytes);
  EXPECT_EQ(pinned_budget_.used_bytes(), 2u * chunk_bytes);

  auto staging = core::AlignedBuffer::allocate(chunk_bytes, core::kDirectIoAlignment);
  ASSERT_TRUE(staging.ok());
  for (std::size_t i = 0; i < l.chunks.size(); ++i) {
    if ((*store)->tier(i) == Tier::kDevice) continue;
    auto st = (*store)->load(i, staging->bytes());
    ASSERT_TRUE(st.ok()) << st.status();
    for (std::int64_t k = 0; k < kB; ++k) {
      ASSERT_EQ(st->master()[k], 0.0f);  // zero-filled at creation
      st->master()[k] = static_cast<float>(i * 1000 + k);
      if (format == StateFormat::kBf16) {
        st->arrays[1].bf16()[k] = core::numerics::fp32_to_bf16_bits(1.0f);
        st->arrays[2].bf16()[k] = core::numerics::fp32_to_bf16_bits(moment(k));
      } else if (format == StateFormat::kInt8Blockwise) {
        st->arrays[1].codes()[k] = 0x7f;  // +1 x the block's scale
        st->arrays[2].codes()[k] = static_cast<std::uint8_t>(k % 256);
        st->arrays[1].block_scales()[k / 256] = 1.0f;
        st->arrays[2].block_scales()[k / 256] = static_cast<float>(k / 256);
      } else {
        st->arrays[1].f32()[k] = 1.0f;
        st->arrays[2].f32()[k] = moment(k);
      }
    }
    // The arrays sit one after the other: [master | exp_avg | exp_avg_sq],
    // then blockwise scales [exp_avg's | exp_avg_sq's].
    const auto* base = reinterpret_cast<const std::byte*>(st->master().data());
    const int eb = l.optimizer.elem_bytes(1);
    EXPECT_EQ(st->arrays[1].data, base + kB * 4);
    EXPECT_EQ(st->arrays[2].data, base + kB * (4 + eb));
    if (format == StateFormat::kInt8Blockwise) {
      EXPECT_EQ(reinterpret_cast<const std::byte*>(st->arrays[1].scales), base + kB * 6);
      EXPECT_EQ(reinterpret_cast<const std::byte*>(st->arrays[2].scales), base + kB * 6 + 4 * (kB / 256));
    } else {
      EXPECT_EQ(st->arrays[1].scales, nullptr);
    }
    ASSERT_TRUE((*store)->store(i, staging->bytes()).ok());
  }
  for (std::size_t i = 0; i < l.chunks.size(); ++i) {
    if ((*store)->tier(i) == Tier::kDevice) {
      auto span = (*store)->device_state(i);
      ASSERT_TRUE(span.ok());
      EXPECT_EQ(span->size_bytes(), chunk_bytes);
      EXPECT_EQ((*store)->load(i, staging->bytes()).status().code(), core::StatusCode::kFailedPrecondition);
      continue;
    }
    std::memset(staging->data(), 0xff, staging->size_bytes());
    auto st = (*store)->load(i, staging->bytes());
    ASSERT_TRUE(st.ok()) << st.status();
    for (std::int64_t k = 0; k < kB; k += 997) {
      EXPECT_EQ(st->master()[k], static_cast<float>(i * 1000 + k)) << i << " " << k;
      if (format == StateFormat::kBf16) {
        EXPECT_EQ(core::numerics::bf16_bits_to_fp32(st->arrays[1].bf16()[k]), 1.0f);
        EXPECT_EQ(core::numerics::bf16_bits_to_fp32(st->arrays[2].bf16()[k]), moment(k));
      } else if (format == StateFormat::kInt8Blockwise) {
        EXPECT_EQ(st->arrays[1].codes()[k], 0x7f);
        EXPECT_EQ(st->arrays[2].codes()[k], k % 256);
        EXPECT_EQ(st->arrays[1].block_scales()[k / 256], 1.0f);
        EXPECT_EQ(st->arrays[2].block_scales()[k / 256], static_cast<float>(k / 256));
      } else {
        EXPECT_EQ(st->arrays[1].f32()[k], 1.0f);
        EXPECT_EQ(st->arrays[2].f32()[k], moment(k));
      }
    }
  }
  EXPECT_EQ((*store)->device_state(2).status().code(), core::StatusCode::kFailedPrecondition);
  store->reset();
  EXPECT_EQ(device_budget_.used_bytes(), 0u);
  EXPECT_EQ(pinned_budget_.used_bytes(), 0u);
}

TEST_F(StateStoreTest, EveryTierKeepsWhatWasStored) { every_tier_keeps_what_was_stored(StateFormat::kFp32); }

TEST_F(StateStoreTest, EveryTierKeepsBf16MomentsInTwoBytes) {
  every_tier_keeps_what_was_stored(StateFormat::kBf16);
}

TEST_F(StateStoreTest, EveryTierKeepsInt8CodesAndTheirBlockScales) {
  every_tier_keeps_what_was_stored(StateFormat::kInt8Blockwise);
}

// The store's chunks in `tier`, in order.
std::vector<std::size_t> chunks_in(const StateStore& store, Tier tier) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < store.chunk_count(); ++i) {
    if (store.tier(i) == tier) out.push_back(i);
  }
  return out;
}

// defer_pinned: create() allocates the first pinned chunk alone (zeroed); allocate_deferred()
// allocates the others through the fill it is given (the engine's: zeros written on CpuAdam's
// threads before the memory is locked), once each, and their state is the fill's zeros.
TEST_F(StateStoreTest, DeferredPinnedChunksAreAllocatedThroughTheFill) {
  const Layout l = layout();
  const std::uint64_t chunk_bytes = 12 * kB;
  auto device = gpu::make_host_device({{&device_budget_, &pinned_budget_}, {}});
  ASSERT_TRUE(device.ok());
  auto sw = swap();
  ASSERT_NE(sw, nullptr);
  auto store = StateStore::create(l, **device, sw.get(), {.defer_pinned = true});
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(pinned_budget_.used_bytes(), chunk_bytes);  // the first pinned chunk alone
  const std::vector<std::size_t> pinned = chunks_in(**store, Tier::kPinned);
  ASSERT_EQ(pinned.size(), 2u);
  auto first = (*store)->load(pinned[0], {});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->master()[kB - 1], 0.0f);

  std::vector<const std::byte*> filled;
  const gpu::Device::PinnedFill zeros = [&](std::span<std::byte> b) {
    filled.push_back(b.data());
    EXPECT_EQ(b.size(), chunk_bytes);
    std::memset(b.data(), 0, b.size());
  };
  ASSERT_TRUE((*store)->allocate_deferred(zeros).ok());
  ASSERT_EQ(filled.size(), 1u);
  EXPECT_EQ(pinned_budget_.used_bytes(), 2 * chunk_bytes);
  auto second = (*store)->load(pinned[1], {});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(reinterpret_cast<const std::byte*>(second->master().data()), filled[0]);
  for (int a = 0; a < 3; ++a) {
    const auto* f = reinterpret_cast<const float*>(filled[0]) + a * kB;
    EXPECT_EQ(f[0], 0.0f);
    EXPECT_EQ(f[kB - 1], 0.0f);
  }
  ASSERT_TRUE((*store)->allocate_deferred(zeros).ok());  // nothing left to allocate
  EXPECT_EQ(filled.size(), 1u);

  // A budget that holds the first chunk only: the deferred one is refused, naming the budget.
  core::MemoryBudget one_chunk{"pinned host memory", chunk_bytes, "strata.budgets.pinned"};
  auto small = gpu::make_host_device({{&device_budget_, &one_chunk}, {}});
  ASSERT_TRUE(small.ok());
  store->reset();
  sw.reset();
  auto sw2 = swap();
  ASSERT_NE(sw2, nullptr);
  auto tight = StateStore::create(l, **small, sw2.get(), {.defer_pinned = true});
  ASSERT_TRUE(tight.ok()) << tight.status();
  const core::Status refused = (*tight)->allocate_deferred(zeros);
  EXPECT_EQ(refused.code(), core::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("strata.budgets.pinned"), std::string::npos) << refused;
  EXPECT_EQ(filled.size(), 1u);
}

// nvme_unwritten: the nvme chunks' blocks are allocated, not written (a read before the caller's
// write is refused, never zeros or garbage); a chunk written whole through staged_views reads back.
TEST_F(StateStoreTest, UnwrittenNvmeChunksHoldWhatTheFirstStoreWrote) {
  const Layout l = layout();
  auto device = gpu::make_host_device({{&device_budget_, &pinned_budget_}, {}});
  ASSERT_TRUE(device.ok());
  auto sw = swap();
  ASSERT_NE(sw, nullptr);
  auto store = StateStore::create(l, **device, sw.get(), {.nvme_unwritten = true});
  ASSERT_TRUE(store.ok()) << store.status();
  const std::vector<std::size_t> nvme = chunks_in(**store, Tier::kNvme);
  ASSERT_EQ(nvme.size(), 2u);
  const std::size_t bytes = (*store)->staging_bytes(nvme[0]);
  auto staging = core::AlignedBuffer::allocate(bytes, core::kDirectIoAlignment);
  ASSERT_TRUE(staging.ok());
  for (std::size_t c : nvme) {
    auto unread = (*store)->load(c, staging->bytes());
    EXPECT_EQ(unread.status().code(), core::StatusCode::kFailedPrecondition) << unread.status();
  }
  for (std::size_t c : nvme) {
    std::memset(staging->data(), 0, bytes);
    ChunkState st = (*store)->staged_views(c, staging->bytes());
    for (std::int64_t k = 0; k < kB; ++k) st.master()[k] = static_cast<float>(c * 7 + k);
    ASSERT_TRUE((*store)->store(c, staging->bytes()).ok());
  }
  for (std::size_t c : nvme) {
    std::memset(staging->data(), 0xff, bytes);
    auto st = (*store)->load(c, staging->bytes());
    ASSERT_TRUE(st.ok()) << st.status();
    for (std::int64_t k = 0; k < kB; k += 991) {
      EXPECT_EQ(st->master()[k], static_cast<float>(c * 7 + k));
      EXPECT_EQ(st->arrays[1].f32()[k], 0.0f);
      EXPECT_EQ(st->arrays[2].f32()[k], 0.0f);
    }
  }
}

TEST_F(StateStoreTest, CorruptSwapIsDataLossNotGarbage) {
  const Layout l = layout();
  auto device = gpu::make_host_device({{&device_budget_, &pinned_budget_}, {}});
  ASSERT_TRUE(device.ok());
  auto sw = swap();
  ASSERT_NE(sw, nullptr);
  auto store = StateStore::create(l, **device, sw.get());
  ASSERT_TRUE(store.ok()) << store.status();
  const std::size_t nvme_chunk = l.chunks.size() - 3;  // pinned, pinned, nvme, nvme, device, device
  ASSERT_EQ((*store)->tier(nvme_chunk), Tier::kNvme);
  auto extents = sw->extents("state/" + std::to_string(nvme_chunk));
  ASSERT_TRUE(extents.ok()) << extents.status();
  {
    std::fstream f(extents->front().file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(extents->front().file_offset + 4096 + 3));
    f.put('\x5a');
  }
  auto staging = core::AlignedBuffer::allocate(kB * 12, core::kDirectIoAlignment);
  ASSERT_TRUE(staging.ok());
  auto st = (*store)->load(nvme_chunk, staging->bytes());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), core::StatusCode::kDataLoss) << st.status();
  EXPECT_NE(st.status().message().find(extents->front().file), std::string::npos) << st.status();
}

TEST_F(StateStoreTest, BudgetsAreEnforcedWithTheirNames) {
  const Layout l = layout();
  core::MemoryBudget small_pinned{"pinned host memory", kB * 12, "strata.budgets.pinned"};
  auto device = gpu::make_host_device({{&device_budget_, &small_pinned}, {}});
  ASSERT_TRUE(device.ok());
  auto sw = swap();
  ASSERT_NE(sw, nullptr);
  auto store = StateStore::create(l, **device, sw.get());
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), core::StatusCode::kResourceExhausted);
  EXPECT_NE(store.status().message().find("strata.budgets.pinned"), std::string::npos) << store.status();
  EXPECT_EQ(small_pinned.used_bytes(), 0u);  // nothing kept from the failed attempt
  // No swap store while chunks live on nvme: a clear error, not a crash.
  auto roomy = gpu::make_host_device({{&device_budget_, &pinned_budget_}, {}});
  ASSERT_TRUE(roomy.ok());
  auto no_swap = StateStore::create(l, **roomy, nullptr);
  ASSERT_FALSE(no_swap.ok());
  EXPECT_NE(no_swap.status().message().find("no swap store"), std::string::npos) << no_swap.status();
}

TEST(ComputeHomesPacking, EveryRanksHomeUnpacksToTheGroupWithZeroPadding) {
  // Stage 3 over three ranks, a group mixing trainable and frozen
  // parameters of odd sizes: each rank's home packed from the whole group,
  // the homes side by side (each after a gap, as gather lays them out),
  // unpacked: the group back, its padding zero whatever the buffer held.
  Config c;
  c.precision = Precision::kBf16;
  c.zero.stage = 3;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  const std::vector<ParamDesc> params = {{"a", {70001}, "g", true, 0},
                                         {"f1", {333}, "g", false, 0},
                                         {"b", {5}, "g", true, 0},
                                         {"f2", {65}, "g", false, 0}};
  const int n = 3;
  std::vector<Layout> ranks;
  for (int r = 0; r < n; ++r) {
    auto l = plan_layout(params, {}, c, {r, n});
    ASSERT_TRUE(l.ok()) << l.status();
    ranks.push_back(*std::move(l));
  }
  const GroupPlace& gp = ranks[0].groups[0];
  const std::size_t cb = 2, whole = static_cast<std::size_t>(gp.compute_elems) * cb;
  const std::size_t home = static_cast<std::size_t>(ranks[0].home_elems(gp)) * cb, gap = 24;
  std::vector<std::byte> group(whole, std::byte{0});
  std::uint16_t next = 1;
  for (std::size_t pi = 0; pi < params.size(); ++pi) {
    for (std::int64_t i = 0; i < params[pi].numel(); ++i, ++next) {
      std::memcpy(group.data() + static_cast<std::size_t>(ranks[0].places[pi].compute_offset + i) * cb, &next, cb);
    }
  }
  std::vector<std::byte> blocks(n * (gap + home), std::byte{0x5a});
  for (int r = 0; r < n; ++r) {
    std::span<std::byte> mine(blocks.data() + static_cast<std::size_t>(r) * (gap + home) + gap, home);
    pack_home(ranks[static_cast<std::size_t>(r)], 0, r, group, mine);
    // Every byte of the home written: packed into a buffer of other bytes, the same.
    std::vector<std::byte> other(home, std::byte{0xff});
    pack_home(ranks[static_cast<std::size_t>(r)], 0, r, group, other);
    EXPECT_EQ(std::memcmp(other.data(), mine.data(), home), 0) << "rank " << r << ": bytes left unwritten";
  }
  std::vector<std::byte> back(whole, std::byte{0xff});
  unpack_homes(ranks[0], 0, blocks, gap + home, gap, back);
  EXPECT_EQ(std::memcmp(back.data(), group.data(), whole), 0);
}

}  // namespace
}  // namespace strata::engine
