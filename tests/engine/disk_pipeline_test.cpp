// The disk pipeline (engine/step/disk_pipeline.h) over the host device and a
// real swap store: the ring stays within strata.budgets.staging, a pass
// reads ahead and writes behind within it and round-trips every chunk,
// whatever the ring's size, and a budget below one slot is a named error.
#include "engine/step/disk_pipeline.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/memory_budget.h"
#include "core/str.h"
#include "engine/layout.h"
#include "gpu/host_device.h"
#include "nvme/swap_store.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
constexpr std::int64_t kB = 65536;  // a norm block

class DiskPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_disk_pipeline_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // 6 chunks of one block each, all on nvme.
    Config c;
    c.precision = Precision::kBf16;
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.strata.chunk_bytes = kB * 4;
    std::vector<ParamDesc> params;
    for (int g = 0; g < 3; ++g) params.push_back({"w" + std::to_string(g), {2 * kB}, "g" + std::to_string(g)});
    auto l = plan_layout(params, {}, c);
    ASSERT_TRUE(l.ok()) << l.status();
    layout_ = std::move(l).value();
    ASSERT_EQ(layout_.chunks.size(), 6u);
    auto d = gpu::make_host_device({{&device_budget_, &pinned_budget_}, {}});
    ASSERT_TRUE(d.ok());
    device_ = std::move(d).value();
    nvme::SwapStoreOptions o;
    o.paths = {dir_.string()};
    o.capacity_bytes = 64ull << 20;
    o.io.kind = nvme::BackendKind::kPsync;
    auto s = nvme::SwapStore::create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    swap_ = std::move(s).value();
    auto st = StateStore::create(layout_, *device_, swap_.get());
    ASSERT_TRUE(st.ok()) << st.status();
    state_ = std::move(st).value();
  }
  void TearDown() override {
    state_.reset();
    swap_.reset();
    fs::remove_all(dir_);
  }
  std::uint64_t slot_bytes() const { return state_->staging_bytes(0); }

  fs::path dir_;
  Layout layout_;
  core::MemoryBudget device_budget_{"device memory", 64ull << 20, "strata.budgets.device"};
  core::MemoryBudget pinned_budget_{"pinned host memory", core::MemoryBudget::kUnlimited, "strata.budgets.pinned"};
  static constexpr std::uint64_t kRoom = core::MemoryBudget::kUnlimited;  // pinned room for a derived ring
  std::unique_ptr<gpu::Device> device_;
  std::unique_ptr<nvme::SwapStore> swap_;
  std::unique_ptr<StateStore> state_;
  Trace trace_{""};
};

TEST_F(DiskPipelineTest, TheRingStaysWithinTheStagingBudget) {
  core::MemoryBudget staging("staging", 3 * slot_bytes() + 100, "strata.budgets.staging");
  auto p = DiskPipeline::create(*state_, *device_, staging, kRoom, /*ring_depth=*/4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->slots(), 3u);  // what the budget holds, not the depth
  EXPECT_LE(staging.used_bytes(), staging.limit_bytes());
  EXPECT_EQ(staging.used_bytes(), 3 * slot_bytes());
  core::MemoryBudget derived("staging", core::MemoryBudget::kUnlimited, "strata.budgets.staging");
  auto q = DiskPipeline::create(*state_, *device_, derived, kRoom, 4);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ((*q)->slots(), 4u);  // derived: the schedule's depth
}

TEST_F(DiskPipelineTest, ADerivedRingTakesThePinnedRoomItIsGiven) {
  core::MemoryBudget derived("staging", core::MemoryBudget::kUnlimited, "strata.budgets.staging");
  auto two = DiskPipeline::create(*state_, *device_, derived, 2 * slot_bytes() + slot_bytes() / 2, 4);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ((*two)->slots(), 2u);  // whole slots within the room
  core::MemoryBudget derived2("staging", core::MemoryBudget::kUnlimited, "strata.budgets.staging");
  auto one = DiskPipeline::create(*state_, *device_, derived2, 0, 4);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)->slots(), 1u);  // never fewer than one (finalize checks that one fits)
  core::MemoryBudget derived3("staging", core::MemoryBudget::kUnlimited, "strata.budgets.staging");
  auto many = DiskPipeline::create(*state_, *device_, derived3, 100 * slot_bytes(), 3);
  ASSERT_TRUE(many.ok()) << many.status();
  EXPECT_EQ((*many)->slots(), 3u);  // never more than the depth
}

TEST_F(DiskPipelineTest, ABudgetBelowOneSlotNamesTheKeyAndTheSize) {
  core::MemoryBudget staging("staging", slot_bytes() - 1, "strata.budgets.staging");
  auto p = DiskPipeline::create(*state_, *device_, staging, kRoom, 4);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), core::StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("strata.budgets.staging"), std::string::npos) << p.status();
  EXPECT_NE(p.status().message().find("strata.chunk_bytes"), std::string::npos) << p.status();
  // The smallest budget that works, and that it does.
  const std::string want = core::str_cat("strata.budgets.staging >= ", slot_bytes(), " (one chunk) works");
  EXPECT_NE(p.status().message().find(want), std::string::npos) << p.status();
  core::MemoryBudget one_slot("staging", slot_bytes(), "strata.budgets.staging");
  auto q = DiskPipeline::create(*state_, *device_, one_slot, kRoom, 4);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ((*q)->slots(), 1u);
}

// Every chunk read, changed and written back through rings of 1 to 4 slots,
// read ahead as far as each allows, with and without write-behind: the
// swap files hold every change, and the traffic is counted once per chunk.
TEST_F(DiskPipelineTest, APassRoundTripsEveryChunkWhateverTheRing) {
  for (std::size_t slots = 1; slots <= 4; ++slots) {
    for (bool behind : {false, true}) {
      core::MemoryBudget staging("staging", slots * slot_bytes(), "strata.budgets.staging");
      auto p = DiskPipeline::create(*state_, *device_, staging, kRoom, 4);
      ASSERT_TRUE(p.ok());
      ASSERT_EQ((*p)->slots(), slots);
      const std::vector<std::size_t> chunks = {5, 0, 3, 1, 4, 2};
      StepBytes bytes;
      {
        DiskPipeline::Pass pass(**p, chunks, slots - 1, behind, bytes, trace_);
        for (std::size_t i = 0; i < chunks.size(); ++i) {
          ASSERT_TRUE(pass.advance(i).ok());
          EXPECT_LE(pass.next_read(), i + slots);  // never further ahead than the ring allows
          auto st = pass.take(i);
          ASSERT_TRUE(st.ok()) << st.status();
          st->master()[0] += 1.0f;
          st->arrays[1].f32()[7] = static_cast<float>(chunks[i]);
          ASSERT_TRUE(pass.store(i, StateStore::Version::kCurrent).ok());
        }
        ASSERT_TRUE(pass.drain_writes().ok());
      }
      EXPECT_EQ(bytes.nvme_read, 6 * slot_bytes());
      EXPECT_EQ(bytes.nvme_write, 6 * slot_bytes());
    }
  }
  // 8 passes added 1 to each master's first element.
  core::MemoryBudget staging("staging", core::MemoryBudget::kUnlimited, "strata.budgets.staging");
  auto p = DiskPipeline::create(*state_, *device_, staging, kRoom, 6);  // a slot each: no store needed
  ASSERT_TRUE(p.ok());
  const std::vector<std::size_t> chunks = {0, 1, 2, 3, 4, 5};
  StepBytes bytes;
  DiskPipeline::Pass pass(**p, chunks, 5, false, bytes, trace_);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    ASSERT_TRUE(pass.advance(i).ok());
    auto st = pass.take(i);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->master()[0], 8.0f) << "chunk " << i;
    EXPECT_EQ(st->arrays[1].f32()[7], static_cast<float>(i));
  }
}

TEST_F(DiskPipelineTest, StoringAChunkThatWasNotTakenIsAnError) {
  core::MemoryBudget staging("staging", core::MemoryBudget::kUnlimited, "strata.budgets.staging");
  auto p = DiskPipeline::create(*state_, *device_, staging, kRoom, 4);
  ASSERT_TRUE(p.ok());
  const std::vector<std::size_t> chunks = {0, 1};
  StepBytes bytes;
  DiskPipeline::Pass pass(**p, chunks, 3, true, bytes, trace_);
  ASSERT_TRUE(pass.advance(0).ok());
  EXPECT_EQ(pass.store(0, StateStore::Version::kCurrent).code(), core::StatusCode::kInternal);
  pass.abandon_reads();  // reads in flight are dropped, their slots free again
  ASSERT_TRUE(pass.advance(0).ok());
}

}  // namespace
}  // namespace strata::engine
