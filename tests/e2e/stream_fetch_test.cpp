// Fetch in stream order (DESIGN.md section 3): a fetch given the framework's
// stream queues its copy and makes the stream wait for it, and the host goes
// on; work queued on that stream afterwards sees the data; wait_fetched makes
// it visible to any reader; and training with stream-ordered fetches gives
// the blocking fetch's bits under every schedule and compute-copy home.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "tests/e2e/mlp_harness.h"

namespace strata::engine {
namespace {

using namespace e2e;  // NOLINT: the harness is this test's vocabulary

class StreamFetchTest : public MlpTest {
 protected:
  // The fetched group's bytes, read on `s` (ordered after the fetch's copy
  // only if the fetch was given `s`, or after wait_fetched).
  static std::vector<std::byte> read_on(Engine& e, gpu::Stream& s, gpu::DeviceSpan span) {
    std::vector<std::byte> host(span.size_bytes());
    EXPECT_TRUE(e.device().copy_d2h(s, host, span).ok());
    EXPECT_TRUE(e.device().synchronize(s).ok());
    return host;
  }
};

// On the host device with a slow modelled link (l1's 257 KiB take about half a
// second), a fetch given a stream returns while its copy is in flight: an event
// recorded on that stream right after it has not passed. A blocking fetch
// returns with its copy done: the same event has passed at once. Either way the
// stream reads the group's compute copies.
TEST_F(StreamFetchTest, AFetchWithAStreamReturnsBeforeItsCopyAndTheStreamReadsTheData) {
  if (test_device().kind != DeviceKind::kHost) GTEST_SKIP() << "uses the host device's timing model";
  Config c = base();
  c.zero.offload_param.device = OffloadDevice::kCpu;  // compute copies in pinned memory: fetch copies them
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;  // (no slow initial copies of the state)
  c.strata.overlap = OverlapMode::kNone;              // no prefetch: the fetch copies in line
  c.strata.host_device.h2d_gbps = 0.0005;
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  Framework f;
  gpu::Stream& s = f.stream(*e);

  // Blocking: the copy is done when fetch returns.
  auto blocking = e->fetch("l1");
  ASSERT_TRUE(blocking.ok()) << blocking.status();
  auto after_blocking = e->device().create_event();
  ASSERT_TRUE(after_blocking.ok());
  ASSERT_TRUE(e->device().record(*after_blocking, s).ok());
  auto passed = e->device().query(*after_blocking);
  ASSERT_TRUE(passed.ok());
  EXPECT_TRUE(*passed) << "a blocking fetch returned before its copy";
  const std::vector<std::byte> expected = read_on(*e, s, *blocking);
  ASSERT_TRUE(e->release("l1").ok());

  // With the stream: fetch returns with the copy queued; the stream waits for it.
  auto queued = e->fetch("l1", &s);
  ASSERT_TRUE(queued.ok()) << queued.status();
  auto after_queued = e->device().create_event();
  ASSERT_TRUE(after_queued.ok());
  ASSERT_TRUE(e->device().record(*after_queued, s).ok());
  passed = e->device().query(*after_queued);
  ASSERT_TRUE(passed.ok());
  EXPECT_FALSE(*passed) << "fetch(group, stream) waited for its copy";
  EXPECT_EQ(read_on(*e, s, *queued), expected);
  ASSERT_TRUE(e->release("l1", &s).ok());
}

// wait_fetched: after it, a reader on another stream (not ordered after the
// fetch's copy) sees the data; it refuses a group that is not fetched.
TEST_F(StreamFetchTest, WaitFetchedMakesTheCopyVisibleToAnyReader) {
  Config c = base();
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.strata.overlap = OverlapMode::kNone;
  if (test_device().kind == DeviceKind::kHost) c.strata.host_device.h2d_gbps = 0.002;
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  Framework f;
  auto other = e->device().create_stream("another reader");
  ASSERT_TRUE(other.ok());

  auto blocking = e->fetch("l2");
  ASSERT_TRUE(blocking.ok()) << blocking.status();
  const std::vector<std::byte> expected = read_on(*e, *other, *blocking);
  ASSERT_TRUE(e->release("l2").ok());

  EXPECT_EQ(e->wait_fetched("l2").code(), core::StatusCode::kFailedPrecondition);
  auto queued = e->fetch("l2", &f.stream(*e));
  ASSERT_TRUE(queued.ok()) << queued.status();
  ASSERT_TRUE(e->wait_fetched("l2").ok());
  EXPECT_EQ(read_on(*e, *other, *queued), expected);
  ASSERT_TRUE(e->release("l2").ok());  // no stream: the framework's work is done
}

// A copy kept on the device after a release on the framework's stream (the
// threaded schedules keep it) is handed to the next fetch only after its
// queued copy: a blocking fetch right after the release returns the group's
// compute copies, also to a reader on another stream.
TEST_F(StreamFetchTest, AKeptCopyIsHandedOnOnlyAfterItsQueuedCopy) {
  if (test_device().kind != DeviceKind::kHost) GTEST_SKIP() << "uses the host device's timing model";
  Config c = base();
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.overlap = OverlapMode::kExact;  // threaded: release keeps the copy
  c.strata.host_device.h2d_gbps = 0.0005;  // l1's copy takes about half a second
  std::vector<std::byte> expected;
  {
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    auto other = e->device().create_stream("another reader");
    ASSERT_TRUE(other.ok());
    auto span = e->fetch("l1");
    ASSERT_TRUE(span.ok()) << span.status();
    expected = read_on(*e, *other, *span);
    ASSERT_TRUE(e->release("l1").ok());
  }
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  Framework f;
  auto other = e->device().create_stream("another reader");
  ASSERT_TRUE(other.ok());
  auto queued = e->fetch("l1", &f.stream(*e));
  ASSERT_TRUE(queued.ok()) << queued.status();
  ASSERT_TRUE(e->release("l1", &f.stream(*e)).ok());  // kept, its copy still in flight
  auto again = e->fetch("l1");                         // blocking: the kept copy, once complete
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data(), queued->data()) << "the kept copy was not the one handed back";
  EXPECT_EQ(read_on(*e, *other, *again), expected);
  ASSERT_TRUE(e->release("l1").ok());
}

// Training with the framework's stream passed to every fetch gives the
// blocking fetch's bits, for compute copies on the device, in pinned memory
// and on nvme, under every schedule (prefetches included: their copies are
// queued too, and the fetch that takes one hands its event on).
TEST_F(StreamFetchTest, StreamOrderedFetchesGiveTheBlockingFetchesBits) {
  const OverlapMode modes[] = {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative,
                               OverlapMode::kDelayed};
  const OffloadDevice homes[] = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
  for (OverlapMode mode : modes) {
    for (OffloadDevice home : homes) {
      SCOPED_TRACE(std::string(to_string(mode)) + ", compute copies " + std::string(to_string(home)));
      std::map<std::string, std::vector<float>> masters[2];
      for (int on_stream = 0; on_stream < 2; ++on_stream) {
        Config c = base();
        c.strata.overlap = mode;
        c.zero.offload_param.device = home;
        c.zero.offload_optimizer.device = OffloadDevice::kCpu;
        auto e = make_mlp_engine(c);
        ASSERT_NE(e, nullptr);
        Framework f;
        f.fetch_on_stream = on_stream == 1;
        for (int step = 0; step < 4; ++step) train_one_step(*e, f, step);
        masters[on_stream] = read_masters(*e);
      }
      for (const Tensor& t : kTensors) {
        EXPECT_TRUE(bits_equal(masters[0][t.name], masters[1][t.name])) << t.name;
      }
    }
  }
}

}  // namespace
}  // namespace strata::engine
