// The host device's timing model, tested only by what cannot be flaky: with
// operations of 250 ms, a modeled operation never completes before its
// modeled time, work on one resource from two streams takes at least the sum
// of its times, and work on two resources from two streams overlaps.
// How close to the model it runs is measured by benchmarks/gpu_bench, not here.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/memory_budget.h"
#include "gpu/device.h"
#include "gpu/host_device.h"

namespace strata::gpu {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kModeledS = 0.25;
constexpr std::uint64_t kBytes = 2'500'000;  // 250 ms at 0.01 GB/s

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

class HostTiming : public ::testing::Test {
 protected:
  void SetUp() override {
    TimingModel timing;
    timing.h2d_gb_per_s = 0.01;
    timing.d2h_gb_per_s = 0.01;
    timing.device_memory_gb_per_s = 0.02;  // a fill of kBytes takes 125 ms, a d2d copy 250 ms
    timing.compute_tflops = 1.0;           // 2.5e11 FLOPs take 250 ms
    auto d = make_host_device(HostDeviceOptions{.budgets = {&device_budget_, &pinned_budget_}, .timing = timing});
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(d).value();
  }

  Stream stream(const char* name) {
    auto s = device_->create_stream(name);
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(s).value();
  }

  DeviceBuffer alloc(std::uint64_t n) {
    auto b = device_->allocate(n, "timing test");
    EXPECT_TRUE(b.ok()) << b.status();
    return std::move(b).value();
  }

  core::MemoryBudget device_budget_{"device memory", 64ull << 20};
  core::MemoryBudget pinned_budget_{"pinned host memory", 64ull << 20};
  std::unique_ptr<Device> device_;
};

TEST_F(HostTiming, CapsReportTheModel) {
  EXPECT_TRUE(device_->caps().timing_model);
  EXPECT_TRUE(device_->caps().declared_compute);
}

TEST_F(HostTiming, CopiesNeverCompleteBeforeTheirModeledTime) {
  Stream s = stream("copies");
  DeviceBuffer d = alloc(kBytes);
  DeviceBuffer d2 = alloc(kBytes);
  std::vector<std::byte> host(kBytes, std::byte{3});

  auto t0 = Clock::now();
  ASSERT_TRUE(device_->copy_h2d(s, d.span(), host).ok());
  ASSERT_TRUE(device_->synchronize(s).ok());
  EXPECT_GE(seconds_since(t0), kModeledS) << "h2d";

  t0 = Clock::now();
  ASSERT_TRUE(device_->copy_d2h(s, host, d.span()).ok());
  ASSERT_TRUE(device_->synchronize(s).ok());
  EXPECT_GE(seconds_since(t0), kModeledS) << "d2h";

  t0 = Clock::now();
  ASSERT_TRUE(device_->copy_d2d(s, d2.span(), d.span()).ok());  // 2 x kBytes at 0.02 GB/s
  ASSERT_TRUE(device_->synchronize(s).ok());
  EXPECT_GE(seconds_since(t0), kModeledS) << "d2d";
}

TEST_F(HostTiming, DeclaredComputeAndKernelsTakeTheirModeledTime) {
  Stream s = stream("compute");
  auto t0 = Clock::now();
  ASSERT_TRUE(device_->declare_compute(s, 2.5e11, "matmul").ok());
  ASSERT_TRUE(device_->synchronize(s).ok());
  EXPECT_GE(seconds_since(t0), kModeledS);

  DeviceBuffer d = alloc(2 * kBytes);
  t0 = Clock::now();
  ASSERT_TRUE(device_->fill(s, typed(d.span(), ElemType::kF32), 1.0f).ok());  // 5e6 bytes at 0.02 GB/s
  Event e = std::move(device_->create_event()).value();
  ASSERT_TRUE(device_->record(e, s).ok());
  ASSERT_TRUE(device_->synchronize(e).ok());
  EXPECT_GE(seconds_since(t0), kModeledS);
}

TEST_F(HostTiming, OneLinkServesTwoStreamsOneAtATime) {
  Stream a = stream("a");
  Stream b = stream("b");
  DeviceBuffer da = alloc(kBytes);
  DeviceBuffer db = alloc(kBytes);
  std::vector<std::byte> host(kBytes, std::byte{1});
  const auto t0 = Clock::now();
  ASSERT_TRUE(device_->copy_h2d(a, da.span(), host).ok());
  ASSERT_TRUE(device_->copy_h2d(b, db.span(), host).ok());
  ASSERT_TRUE(device_->synchronize(a).ok());
  ASSERT_TRUE(device_->synchronize(b).ok());
  EXPECT_GE(seconds_since(t0), 2 * kModeledS);
}

TEST_F(HostTiming, WorkOnTwoStreamsOverlaps) {
  Stream a = stream("a");
  Stream b = stream("b");
  DeviceBuffer d = alloc(kBytes);
  std::vector<std::byte> host(kBytes, std::byte{1});
  Clock::time_point a_begin, a_end, b_begin, b_end;
  ASSERT_TRUE(device_->host_callback(a, [&] { a_begin = Clock::now(); }).ok());
  ASSERT_TRUE(device_->copy_h2d(a, d.span(), host).ok());
  ASSERT_TRUE(device_->host_callback(a, [&] { a_end = Clock::now(); }).ok());
  ASSERT_TRUE(device_->host_callback(b, [&] { b_begin = Clock::now(); }).ok());
  ASSERT_TRUE(device_->declare_compute(b, 2.5e11, "matmul").ok());
  ASSERT_TRUE(device_->host_callback(b, [&] { b_end = Clock::now(); }).ok());
  ASSERT_TRUE(device_->synchronize().ok());
  EXPECT_GE(std::chrono::duration<double>(a_end - a_begin).count(), kModeledS);
  EXPECT_GE(std::chrono::duration<double>(b_end - b_begin).count(), kModeledS);
  EXPECT_LT(a_begin, b_end) << "the copy and the compute did not overlap";
  EXPECT_LT(b_begin, a_end) << "the copy and the compute did not overlap";
}

TEST_F(HostTiming, NegativeOrNonFiniteRatesAreInvalid) {
  TimingModel bad;
  bad.h2d_gb_per_s = -1.0;
  EXPECT_EQ(make_host_device(HostDeviceOptions{.budgets = {&device_budget_, &pinned_budget_}, .timing = bad})
                .status()
                .code(),
            core::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::gpu
