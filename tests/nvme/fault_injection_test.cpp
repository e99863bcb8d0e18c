// Fault injection over every backend: EIO, ENOSPC, short reads and writes,
// EINTR and EAGAIN, delays and flipped bits, each ending in the documented
// error or a correct retry, with no data loss and no hang.
#include "nvme/fault_injection.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "nvme/swap_store.h"
#include "tests/nvme/test_util.h"

namespace strata::nvme {
namespace {

using core::Status;
using core::StatusCode;
using testing_util::random_buffer;
using testing_util::same_bytes;
using testing_util::TempDir;
using testing_util::zero_buffer;

constexpr std::uint64_t kBlock = 512 << 10;  // 8 requests of 64 KiB

class FaultInjectionTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    const std::string why = testing_util::unavailable_reason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
    SwapStoreOptions o;
    o.paths = {dir_.path()};
    o.capacity_bytes = 16 << 20;
    o.stripe_bytes = 1 << 20;
    o.request_bytes = 64 << 10;
    o.io.kind = GetParam();
    o.io.queue_depth = 4;
    o.io.max_retries = 16;
    o.io.fault_injector = &faults_;
    auto s = SwapStore::create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(s).value();
    ASSERT_TRUE(store_->allocate("blk", kBlock).ok());
    src_ = random_buffer(kBlock, 21);
    dst_ = zero_buffer(kBlock);
  }

  Status write() { return store_->write("blk", std::span<const std::byte>(src_.data(), kBlock)); }
  Status read() {
    std::fill(dst_.data(), dst_.data() + kBlock, std::byte{0});
    return store_->read("blk", std::span<std::byte>(dst_.data(), kBlock));
  }
  std::string file() const { return store_->file_path(0); }

  TempDir dir_;
  FaultInjector faults_;  // outlives store_ (declared first)
  std::unique_ptr<SwapStore> store_;
  core::AlignedBuffer src_, dst_;
};

// The message names the failing request ("request i of n") and its file
// offset, which must be that request's: i x 64 KiB (one extent, 64 KiB
// requests). Which request fails depends on the backend: psync's threads take
// requests in any order.
void expect_offset_of_named_request(const Status& s) {
  const std::string text(s.message());
  // The number after `label` in the message, or -1.
  auto number_after = [&](const char* label) -> long long {
    const std::size_t at = text.find(label);
    return at == std::string::npos ? -1 : std::atoll(text.c_str() + at + std::strlen(label));
  };
  const long long index = number_after("request "), count = number_after(" of "), offset = number_after("at offset ");
  ASSERT_GE(index, 0) << s;
  EXPECT_LT(index, count) << s;
  EXPECT_EQ(offset, index * 65536) << s;
}

TEST_P(FaultInjectionTest, EioOnWriteIsIoErrorWithPathAndOffsetAndBlockHoldsNoData) {
  faults_.add({.kind = FaultKind::kEio, .ops = FaultOps::kWrites, .skip = 2});
  Status s = write();
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_EQ(s.error_number(), EIO);
  EXPECT_NE(s.message().find(file()), std::string_view::npos) << s;
  expect_offset_of_named_request(s);  // which request fails first depends on the backend's threads
  EXPECT_NE(s.message().find("wanted 65536 bytes"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("swap block 'blk'"), std::string_view::npos) << s;
  EXPECT_EQ(faults_.total_hits(), 1u);
  // The half-written block is not served.
  EXPECT_EQ(read().code(), StatusCode::kFailedPrecondition);
  // A new write heals it.
  ASSERT_TRUE(write().ok());
  ASSERT_TRUE(read().ok());
  EXPECT_TRUE(same_bytes(src_, dst_, kBlock));
}

TEST_P(FaultInjectionTest, EioOnReadIsIoError) {
  ASSERT_TRUE(write().ok());
  faults_.add({.kind = FaultKind::kEio, .ops = FaultOps::kReads, .skip = 5});
  Status s = read();
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_NE(s.message().find(file()), std::string_view::npos) << s;
  // The data on disk is fine: the next read succeeds.
  ASSERT_TRUE(read().ok());
  EXPECT_TRUE(same_bytes(src_, dst_, kBlock));
}

TEST_P(FaultInjectionTest, EnospcIsResourceExhaustedWithPath) {
  faults_.add({.kind = FaultKind::kEnospc, .ops = FaultOps::kWrites});
  Status s = write();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.error_number(), ENOSPC);
  EXPECT_NE(s.message().find(file()), std::string_view::npos) << s;
  expect_offset_of_named_request(s);
}

TEST_P(FaultInjectionTest, ShortWritesAndReadsAreCompleted) {
  faults_.add({.kind = FaultKind::kShortTransfer, .ops = FaultOps::kWrites, .times = 3});
  ASSERT_TRUE(write().ok());
  EXPECT_EQ(faults_.hits(0), 3u);
  faults_.add({.kind = FaultKind::kShortTransfer, .ops = FaultOps::kReads, .skip = 1, .times = -1,
               .short_bytes = 4096});
  Status s = read();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_GT(faults_.hits(1), 8u);  // every read op after the first moved 4 KiB at a time
  EXPECT_TRUE(same_bytes(src_, dst_, kBlock));
}

TEST_P(FaultInjectionTest, EintrAndEagainAreRetried) {
  faults_.add({.kind = FaultKind::kEintr, .times = 3});
  faults_.add({.kind = FaultKind::kEagain, .skip = 1, .times = 3});
  ASSERT_TRUE(write().ok());
  ASSERT_TRUE(read().ok());
  EXPECT_TRUE(same_bytes(src_, dst_, kBlock));
  EXPECT_EQ(faults_.hits(0), 3u);
  EXPECT_EQ(faults_.hits(1), 3u);
}

TEST_P(FaultInjectionTest, EndlessEagainGivesUpRetryableWithoutHanging) {
  ASSERT_TRUE(write().ok());
  faults_.add({.kind = FaultKind::kEagain, .ops = FaultOps::kReads, .times = -1});
  Status s = read();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_TRUE(s.retryable());
  EXPECT_NE(s.message().find("gave up after 16 retries"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find(file()), std::string_view::npos) << s;
  faults_.clear();
  ASSERT_TRUE(read().ok());
  EXPECT_TRUE(same_bytes(src_, dst_, kBlock));
}

TEST_P(FaultInjectionTest, FlippedBitOnReadIsDataLossAndTheDiskIsFine) {
  ASSERT_TRUE(write().ok());
  faults_.add({.kind = FaultKind::kFlipBit, .ops = FaultOps::kReads, .skip = 3, .bit = 12345});
  Status s = read();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_TRUE(s.is_data_loss());
  EXPECT_NE(s.message().find(file()), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("at offset 0"), std::string_view::npos) << s;  // the extent holding the bit
  ASSERT_TRUE(read().ok());
  EXPECT_TRUE(same_bytes(src_, dst_, kBlock));
}

TEST_P(FaultInjectionTest, FlippedBitOnWriteIsCaughtOnRead) {
  faults_.add({.kind = FaultKind::kFlipBit, .ops = FaultOps::kWrites, .skip = 7, .bit = 8 * 60000 + 3});
  ASSERT_TRUE(write().ok());  // the disk took the bad byte silently, as a drive might
  EXPECT_EQ(faults_.total_hits(), 1u);
  Status s = read();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(file()), std::string_view::npos) << s;
  // The caller's buffer was never touched.
  auto again = random_buffer(kBlock, 21);
  EXPECT_TRUE(same_bytes(src_, again, kBlock));
}

TEST_P(FaultInjectionTest, DelaysChangeNothingButTime) {
  faults_.add({.kind = FaultKind::kDelay, .times = 4, .delay_ms = 20});
  ASSERT_TRUE(write().ok());
  ASSERT_TRUE(read().ok());
  EXPECT_TRUE(same_bytes(src_, dst_, kBlock));
  EXPECT_EQ(faults_.total_hits(), 4u);
}

TEST_P(FaultInjectionTest, FaultsAcrossManyBlocksInFlightLoseNothing) {
  constexpr int kBlocks = 12;
  std::vector<core::AlignedBuffer> src, dst;
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(store_->allocate("f" + std::to_string(i), 200000).ok());
    src.push_back(random_buffer(200000, 300 + i));
    dst.push_back(zero_buffer(200000));
  }
  faults_.add({.kind = FaultKind::kShortTransfer, .skip = 1, .times = 10});
  faults_.add({.kind = FaultKind::kEintr, .skip = 3, .times = 10});
  faults_.add({.kind = FaultKind::kEagain, .skip = 5, .times = 10});
  std::vector<SwapIo> ios;
  for (int i = 0; i < kBlocks; ++i) {
    auto io = store_->start_write("f" + std::to_string(i), std::span<const std::byte>(src[i].data(), 200000));
    ASSERT_TRUE(io.ok());
    ios.push_back(std::move(io).value());
  }
  for (auto& io : ios) {
    Status s = io.wait();
    EXPECT_TRUE(s.ok()) << s;
  }
  ios.clear();
  for (int i = 0; i < kBlocks; ++i) {
    auto io = store_->start_read("f" + std::to_string(i), std::span<std::byte>(dst[i].data(), 200000));
    ASSERT_TRUE(io.ok());
    ios.push_back(std::move(io).value());
  }
  for (auto& io : ios) {
    Status s = io.wait();
    EXPECT_TRUE(s.ok()) << s;
  }
  for (int i = 0; i < kBlocks; ++i) EXPECT_TRUE(same_bytes(src[i], dst[i], 200000)) << i;
  EXPECT_GT(faults_.total_hits(), 20u);
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultInjectionTest, ::testing::ValuesIn(testing_util::all_backends()),
                         testing_util::backend_name);

}  // namespace
}  // namespace strata::nvme
