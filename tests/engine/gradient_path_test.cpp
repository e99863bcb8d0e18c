// The gradient path (engine/step/gradient_path.h) on the host device: the
// host gradients and the norm do not depend on the order groups arrive in or
// on the threads; a group's gradients of two micro-batches add up; the first
// failure is sticky and reaches every waiter; markers take the norm behind
// the passes submitted before them; grad_buffer's wait keeps the gradients on
// their way down within reduce_bucket_size.
#include "engine/step/gradient_path.h"

#include <gtest/gtest.h>

#include <cmath>
#include <chrono>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <vector>

#include "core/memory_budget.h"
#include "core/numerics.h"
#include "engine/trace.h"
#include "gpu/host_device.h"

namespace strata::engine {
namespace {

namespace nx = core::numerics;

class GradientPathTest : public ::testing::Test {
 protected:
  // Three groups; group 1 has a frozen parameter between trainable ones.
  void build(int gas, Precision precision = Precision::kBf16) {
    config_.precision = precision;
    config_.gradient_accumulation_steps = gas;
    std::vector<ParamDesc> params = {
        {"a", {1000}, "g0", true, 0},   {"b", {70000}, "g1", true, 0}, {"frozen", {300}, "g1", false, 0},
        {"c", {500}, "g1", true, 0},    {"d", {4096}, "g2", true, 0},
    };
    auto l = plan_layout(params, {{"default", 0.0, 1.0}}, config_);
    ASSERT_TRUE(l.ok()) << l.status();
    layout_ = std::move(l).value();
    gpu::HostDeviceOptions o;
    o.budgets = {&device_budget_, &pinned_budget_};
    auto d = gpu::make_host_device(o);
    ASSERT_TRUE(d.ok());
    device_ = std::move(d).value();
    adam::CpuAdamOptions ao;
    ao.threads = 1;
    ao.bind = adam::BindMode::kNone;
    auto a = adam::CpuAdam::create(ao);
    ASSERT_TRUE(a.ok()) << a.status();
    cpu_adam_ = std::move(a).value();
    gpu::Device* dev = device_.get();
    device_cache_ = std::make_unique<BufferCache<gpu::DeviceBuffer>>(
        [dev](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end) { return dev->allocate(bytes, what, end); });
    pinned_cache_ = std::make_unique<BufferCache<gpu::PinnedBuffer>>(
        [dev](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd) { return dev->allocate_pinned(bytes, what); });
    auto s = device_->create_stream("test");
    ASSERT_TRUE(s.ok());
    stream_ = std::move(s).value();
  }

  std::unique_ptr<GradientPath> make(bool threaded) {
    GradientPath::Parts parts{.layout = layout_,
                              .precision = config_.precision,
                              .device = *device_,
                              .cpu_adam = *cpu_adam_,
                              .turns = turns_,
                              .device_cache = *device_cache_,
                              .pinned_cache = *pinned_cache_,
                              .trace = trace_,
                              .inline_lane = {&stream_, &bytes_, TraceTrack::kDevice}};
    auto p = GradientPath::create(parts, threaded);
    EXPECT_TRUE(p.ok()) << p.status();
    return std::move(p).value();
  }

  // Group g's gradients for micro-batch `mb` (compute dtype, compute layout
  // from the group's first trainable slot on, as Step::grad_buffer's: the
  // frozen parameters, first in the group, have no slots), in a device
  // buffer, the value of compute slot c a function of c; `poison` puts a NaN
  // in a trainable parameter's slot.
  gpu::DeviceBuffer grads_of(std::size_t g, int mb, bool poison = false) {
    const GroupPlace& gp = layout_.groups[g];
    const int cb = layout_.compute_bytes;
    std::vector<std::byte> host(static_cast<std::size_t>(gp.gradient_elems()) * cb);
    for (std::int64_t i = 0; i < gp.gradient_elems(); ++i) {
      const std::int64_t c = gp.trainable_compute_begin + i;
      const float v = std::sin(0.001f * static_cast<float>(c) + static_cast<float>(g) + 0.5f * mb);
      const float x = poison && i == 7 ? std::numeric_limits<float>::quiet_NaN() : v;
      if (cb == 2) {
        const std::uint16_t b = nx::fp32_to_bf16_bits(x);
        std::memcpy(host.data() + i * 2, &b, 2);
      } else {
        std::memcpy(host.data() + i * 4, &x, 4);
      }
    }
    auto buf = device_->allocate(host.size(), "grads");
    EXPECT_TRUE(buf.ok());
    EXPECT_TRUE(device_->copy_h2d(stream_, buf->span(), host).ok());
    EXPECT_TRUE(device_->synchronize(stream_).ok());
    return std::move(buf).value();
  }

  std::vector<std::byte> host_grads(GradientPath& p) {
    const auto n = static_cast<std::size_t>(layout_.trainable_elems) * static_cast<std::size_t>(layout_.grad_bytes);
    return {p.host_grads(), p.host_grads() + n};
  }

  Config config_;
  Layout layout_;
  core::MemoryBudget device_budget_{"device", core::MemoryBudget::kUnlimited, "test"};
  core::MemoryBudget pinned_budget_{"pinned", core::MemoryBudget::kUnlimited, "test"};
  std::unique_ptr<gpu::Device> device_;
  std::unique_ptr<adam::CpuAdam> cpu_adam_;
  CpuTurns turns_;
  std::unique_ptr<BufferCache<gpu::DeviceBuffer>> device_cache_;
  std::unique_ptr<BufferCache<gpu::PinnedBuffer>> pinned_cache_;
  Trace trace_{""};
  gpu::Stream stream_;
  StepBytes bytes_;
};

TEST_F(GradientPathTest, SameGradientsAndNormWhateverTheArrivalOrderAndThreads) {
  build(1);
  auto reference = make(/*threaded=*/false);
  for (std::size_t g : {0, 1, 2}) ASSERT_TRUE(reference->submit(g, grads_of(g, 0), nullptr, 0, nullptr, nullptr).ok());
  const std::vector<std::byte> want = host_grads(*reference);
  const double norm = reference->raw_norm();
  EXPECT_GT(norm, 0.0);
  EXPECT_FALSE(reference->take_nonfinite());
  // In line (the step's lane): each group's trainable part alone comes down; group 1's frozen
  // parameter, first in its buffer, has no gradient.
  std::int64_t down = 0;
  for (const GroupPlace& gp : layout_.groups) down += gp.gradient_elems();
  EXPECT_GT(layout_.groups[1].trainable_compute_begin, 0);
  EXPECT_EQ(bytes_.d2h, static_cast<std::uint64_t>(down) * 2u);
  for (const std::vector<std::size_t>& order : {std::vector<std::size_t>{2, 1, 0}, {1, 2, 0}}) {
    auto p = make(/*threaded=*/true);
    for (std::size_t g : order) ASSERT_TRUE(p->submit(g, grads_of(g, 0), nullptr, 0, nullptr, nullptr).ok());
    ASSERT_TRUE(p->wait("test").ok());
    EXPECT_EQ(host_grads(*p), want);
    EXPECT_EQ(p->raw_norm(), norm);  // bit for bit: block order, not arrival order
    const GradientPath::Totals t = p->take_totals();
    EXPECT_EQ(t.bytes.d2h, bytes_.d2h);  // threaded: the path's own lane
    EXPECT_EQ(p->take_totals().bytes.d2h, 0u);
  }
}

TEST_F(GradientPathTest, AGroupArrivingTwiceAddsUpItsMicroBatches) {
  build(2);  // two micro-batches: fp32 accumulation
  ASSERT_EQ(layout_.grad_bytes, 4);
  auto p = make(true);
  auto once = make(false);
  for (std::size_t g : {0, 1, 2}) ASSERT_TRUE(p->submit(g, grads_of(g, 0), nullptr, 0, nullptr, nullptr).ok());
  for (std::size_t g : {2, 1, 0}) ASSERT_TRUE(p->submit(g, grads_of(g, 1), nullptr, 1, nullptr, nullptr).ok());
  ASSERT_TRUE(p->wait("test").ok());
  for (std::size_t g : {0, 1, 2}) ASSERT_TRUE(once->submit(g, grads_of(g, 0), nullptr, 0, nullptr, nullptr).ok());
  const std::vector<std::byte> first = host_grads(*once);
  const std::vector<std::byte> both = host_grads(*p);
  // Element by element: micro-batch 0's value plus micro-batch 1's.
  const ParamPlace& d = layout_.places[4];
  for (std::int64_t i = 0; i < 100; ++i) {
    float v0, v01;
    std::memcpy(&v0, first.data() + (d.trainable_offset + i) * 4, 4);
    std::memcpy(&v01, both.data() + (d.trainable_offset + i) * 4, 4);
    const float v1 = nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(
        std::sin(0.001f * static_cast<float>(d.compute_offset + i) + 2.0f + 0.5f)));
    EXPECT_EQ(v01, v0 + v1) << i;
  }
  // A frozen parameter's slot never reaches the host gradients.
  EXPECT_LT(layout_.places[2].trainable_offset, 0);
}

TEST_F(GradientPathTest, TheFirstFailureIsStickyAndReachesEveryWaiter) {
  build(1);
  auto p = make(true);
  ASSERT_TRUE(p->submit(0, grads_of(0, 0), nullptr, 0, nullptr, nullptr).ok());
  bool after_ran = false;
  ASSERT_TRUE(p->submit(1, grads_of(1, 0), nullptr, 0, [] { return core::Status::io_error("the optimizer failed"); },
                        [&] { after_ran = true; })
                  .ok());
  bool later_ran = false;
  ASSERT_TRUE(p->submit(2, grads_of(2, 0), nullptr, 0, [&] {
                  later_ran = true;
                  return core::Status();
                }, nullptr).ok());
  p->post_marker(1);
  const core::Status s = p->wait("step_end");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("step_end: a gradient pass failed"), std::string::npos) << s;
  EXPECT_NE(s.message().find("the optimizer failed"), std::string::npos) << s;
  EXPECT_FALSE(after_ran);
  EXPECT_FALSE(later_ran);  // skipped after the failure
  EXPECT_FALSE(p->wait("again").ok());
  const core::Status down = p->wait_down(1, "g1");
  ASSERT_FALSE(down.ok());
  EXPECT_NE(down.message().find("grad_buffer('g1')"), std::string::npos) << down;
  auto m = p->wait_marker(1, 7);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("the gradients of step 7"), std::string::npos) << m.status();
}

TEST_F(GradientPathTest, MarkersTakeTheNormAndFlagBehindThePassesBeforeThem) {
  build(1);
  auto ref = make(false);
  for (std::size_t g : {0, 1, 2}) ASSERT_TRUE(ref->submit(g, grads_of(g, 0), nullptr, 0, nullptr, nullptr).ok());
  auto p = make(true);
  for (std::size_t g : {0, 1, 2}) ASSERT_TRUE(p->submit(g, grads_of(g, 0), nullptr, 0, nullptr, nullptr).ok());
  p->post_marker(1);
  auto m = p->wait_marker(1, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->raw_norm, ref->raw_norm());
  EXPECT_FALSE(m->nonfinite);
  // The next step: a NaN in group 1.
  for (std::size_t g : {2, 1, 0}) ASSERT_TRUE(p->submit(g, grads_of(g, 0, g == 1), nullptr, 0, nullptr, nullptr).ok());
  p->post_marker(2);
  auto m2 = p->wait_marker(2, 2);
  ASSERT_TRUE(m2.ok());
  EXPECT_TRUE(m2->nonfinite);
  EXPECT_FALSE(p->take_nonfinite());  // the marker took it
  const GradientPath::Totals late = p->take_late_totals();
  EXPECT_EQ(late.bytes.d2h, 2 * bytes_.d2h);  // both steps' copies, behind the markers
  EXPECT_EQ(p->take_totals().bytes.d2h, 0u);
  // A marker that never comes: closing wakes its waiter.
  p->close();
  auto never = p->wait_marker(3, 3);
  ASSERT_FALSE(never.ok());
  EXPECT_EQ(never.status().code(), core::StatusCode::kCancelled);
}

// Copies held back by the framework's stream (a callback that waits for a
// gate, then the event the gradients were "written" before): with two
// groups on their way down, a third waits for room within `room_elems`
// unless it fits there; one other group always fits.
TEST_F(GradientPathTest, GradientsOnTheirWayDownStayWithinTheRoom) {
  build(1);
  auto p = make(true);
  auto framework = device_->create_stream("framework");
  ASSERT_TRUE(framework.ok());
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  ASSERT_TRUE(device_->host_callback(*framework, [opened] { opened.wait(); }).ok());
  auto ev = device_->create_event();
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE(device_->record(*ev, *framework).ok());
  auto written = std::make_shared<gpu::Event>(std::move(ev).value());
  const std::int64_t e0 = layout_.groups[0].gradient_elems(), e1 = layout_.groups[1].gradient_elems();
  const std::int64_t e2 = layout_.groups[2].gradient_elems();
  auto g0 = grads_of(0, 0);
  ASSERT_TRUE(p->submit(0, std::move(g0), written, 0, nullptr, nullptr).ok());
  // One group on its way: another always fits, whatever the room.
  EXPECT_TRUE(p->wait_down(2, "g2", 0).ok());
  auto g1 = grads_of(1, 0);
  ASSERT_TRUE(p->submit(1, std::move(g1), written, 0, nullptr, nullptr).ok());
  // Two on their way: room for all three, or no limit, does not wait.
  EXPECT_TRUE(p->wait_down(2, "g2", e0 + e1 + e2).ok());
  EXPECT_TRUE(p->wait_down(2, "g2").ok());
  // One element short: waits until the copies are down.
  auto waiting = std::async(std::launch::async, [&] { return p->wait_down(2, "g2", e0 + e1 + e2 - 1); });
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  gate.set_value();
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(waiting.get().ok());
  EXPECT_TRUE(p->wait("step_end").ok());
  EXPECT_TRUE(device_->synchronize(*framework).ok());
}

}  // namespace
}  // namespace strata::engine
