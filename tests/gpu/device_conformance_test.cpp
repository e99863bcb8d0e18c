// Device conformance: the same tests over every gpu::Device backend (host
// always; CUDA when built, skipped with the reason when no GPU is visible).
// Kernels are compared bit for bit with core/numerics.h evaluated here
// on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/host_allocator.h"
#include "core/memory_budget.h"
#include "core/numerics.h"
#include "gpu/cuda_device.h"
#include "gpu/device.h"
#include "gpu/host_device.h"

namespace strata::gpu {
namespace {

namespace nx = core::numerics;
using core::StatusCode;

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::uint64_t kBudgetBytes = 256 * kMiB;

std::uint32_t bits(float x) { return std::bit_cast<std::uint32_t>(x); }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

// Equal bit patterns, or both NaN (NaN sign and payload are not part of the
// numerics contract for arithmetic results).
::testing::AssertionResult same_float(float expected, float actual, std::int64_t i) {
  if (bits(expected) == bits(actual) || (std::isnan(expected) && std::isnan(actual))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "element " << i << ": expected " << expected << " (0x" << std::hex
                                       << bits(expected) << "), got " << actual << " (0x" << bits(actual) << ")";
}

// Test values: ordinary numbers over a wide exponent range, fp32 and fp16
// subnormals, zeros of both signs, rounding ties, and (when asked) inf and NaN.
std::vector<float> test_values(std::int64_t n, std::uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-30, 20);
  std::vector<float> v(static_cast<std::size_t>(n));
  const float fixed[] = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65520.0f, 6.0e-8f, 3.0e-8f, 6.1e-5f,
                         from_bits(0x00000001u), from_bits(0x807fffffu), from_bits(0x3f808000u),
                         from_bits(0x3f818000u), from_bits(0x33000000u), from_bits(0x387fe000u)};
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    if (i % 97 < static_cast<std::int64_t>(std::size(fixed))) {
      v[k] = fixed[i % 97];
    } else if (i % 13 == 0) {
      v[k] = from_bits(rng() & 0x807fffffu);  // fp32 subnormal
    } else {
      v[k] = std::ldexp(mant(rng), expo(rng));
    }
  }
  if (specials && n > 8) {
    v[3] = std::numeric_limits<float>::infinity();
    v[5] = -std::numeric_limits<float>::infinity();
    v[7] = std::numeric_limits<float>::quiet_NaN();
  }
  return v;
}

// Element storage on the host in a given type (fp32 values or 16-bit patterns).
std::vector<std::byte> encode(const std::vector<float>& v, ElemType type) {
  std::vector<std::byte> out(v.size() * elem_size_bytes(type));
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (type == ElemType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const std::uint16_t h = type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(v[i]) : nx::fp32_to_fp16_bits(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

float decode_at(const std::vector<std::byte>& bytes, ElemType type, std::size_t i) {
  if (type == ElemType::kF32) {
    float x;
    std::memcpy(&x, bytes.data() + 4 * i, 4);
    return x;
  }
  std::uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return type == ElemType::kBf16 ? nx::bf16_bits_to_fp32(h) : nx::fp16_bits_to_fp32(h);
}

std::uint16_t u16_at(const std::vector<std::byte>& bytes, std::size_t i) {
  std::uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return h;
}

template <typename T>
std::span<const std::byte> as_bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}
template <typename T>
std::span<std::byte> as_writable(std::vector<T>& v) {
  return std::as_writable_bytes(std::span<T>(v));
}

// Blocks a stream until open() (or 10 s, recorded as a timeout).
class Gate {
 public:
  std::function<void()> blocker() {
    return [this] {
      if (future_.wait_for(std::chrono::seconds(10)) != std::future_status::ready) timed_out_ = true;
    };
  }
  void open() {
    if (!opened_) promise_.set_value();
    opened_ = true;
  }
  bool timed_out() const { return timed_out_; }
  ~Gate() { open(); }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_ = promise_.get_future().share();
  std::atomic<bool> timed_out_{false};
  bool opened_ = false;
};

class DeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  core::Result<std::unique_ptr<Device>> make_device() {
    const DeviceBudgets budgets{&device_budget_, &pinned_budget_};
    if (GetParam() == "host") {
      HostDeviceOptions options;
      options.budgets = budgets;
      return make_host_device(options);
    }
    CudaDeviceOptions options;
    options.budgets = budgets;
    return make_cuda_device(options);
  }

  void SetUp() override {
    auto d = make_device();
    if (!d.ok()) {
      if (GetParam() == "cuda" &&
          (d.status().code() == StatusCode::kUnimplemented || d.status().code() == StatusCode::kUnavailable)) {
        GTEST_SKIP() << "no usable CUDA device: " << d.status();
      }
      FAIL() << "cannot create the " << GetParam() << " device: " << d.status();
    }
    device_ = std::move(d).value();
    auto s = device_->create_stream("main");
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = std::move(s).value();
  }

  DeviceBuffer alloc(std::uint64_t size_bytes) {
    auto b = device_->allocate(size_bytes, "test buffer");
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(b).value() : DeviceBuffer();
  }

  Stream new_stream(const char* name) {
    auto s = device_->create_stream(name);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(s).value() : Stream();
  }

  Event new_event() {
    auto e = device_->create_event();
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(e).value() : Event();
  }

  // A buffer holding `bytes` (synchronous).
  DeviceBuffer upload(std::span<const std::byte> bytes) {
    DeviceBuffer b = alloc(bytes.size());
    EXPECT_TRUE(device_->copy_h2d(stream_, b.span(), bytes).ok());
    EXPECT_TRUE(device_->synchronize(stream_).ok());
    return b;
  }

  std::vector<std::byte> download(DeviceSpan span) {
    std::vector<std::byte> out(span.size_bytes());
    const core::Status s = device_->copy_d2h(stream_, out, span);
    EXPECT_TRUE(s.ok()) << s;
    const core::Status t = device_->synchronize(stream_);
    EXPECT_TRUE(t.ok()) << t;
    return out;
  }

  bool strict() const { return device_->caps().strict; }

  // Budgets first: they outlive the device, which outlives its streams.
  core::MemoryBudget device_budget_{"device memory", kBudgetBytes, "strata.budgets.device"};
  core::MemoryBudget pinned_budget_{"pinned host memory", kBudgetBytes, "strata.budgets.pinned"};
  std::unique_ptr<Device> device_;
  Stream stream_;
};

// --- memory and budgets ---------------------------------------------------------

TEST_P(DeviceTest, AllocationChargesTheBudgetUntilFreed) {
  {
    DeviceBuffer a = alloc(3 * kMiB);
    DeviceBuffer b = alloc(1000);
    // Each buffer charged as the memory it takes: whole allocation units.
    const std::uint64_t unit = device_->caps().allocation_alignment_bytes;
    EXPECT_EQ(device_budget_.used_bytes(), 3 * kMiB + (1000 + unit - 1) / unit * unit);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % device_->caps().allocation_alignment_bytes, 0u);
    EXPECT_NE(a.id(), b.id());
  }
  EXPECT_EQ(device_budget_.used_bytes(), 0u);
}

TEST_P(DeviceTest, AllocationOverTheBudgetNamesIt) {
  DeviceBuffer a = alloc(200 * kMiB);
  auto b = device_->allocate(100 * kMiB, "layer 7 params");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("device memory"), std::string_view::npos) << b.status();
  EXPECT_NE(b.status().message().find("strata.budgets.device"), std::string_view::npos) << b.status();
  EXPECT_NE(b.status().message().find("layer 7 params"), std::string_view::npos) << b.status();

  auto p = device_->allocate_pinned(300 * kMiB, "staging");
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("strata.budgets.pinned"), std::string_view::npos) << p.status();
  EXPECT_EQ(pinned_budget_.used_bytes(), 0u);
}

TEST_P(DeviceTest, ZeroByteAllocationIsInvalid) {
  EXPECT_EQ(device_->allocate(0, "nothing").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->allocate_pinned(0, "nothing").status().code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, FreedMemoryIsReusable) {
  // Allocate and free more than the budget in total: memory comes back.
  for (int i = 0; i < 8; ++i) {
    DeviceBuffer b = alloc(100 * kMiB);
    ASSERT_FALSE(b.empty());
  }
  EXPECT_EQ(device_budget_.used_bytes(), 0u);
}

// O_DIRECT reads and writes land in pinned buffers of every size, small ones too (a test model's
// state chunk is a few KiB): each must start on a page. CUDA's cudaHostAlloc hands small requests
// out of a shared pool off page boundaries; the device must not pass that on.
TEST_P(DeviceTest, PinnedBuffersOfEverySizeStartOnAPage) {
  std::vector<PinnedBuffer> live;  // kept alive together, as the engine keeps them
  for (std::size_t size : {std::size_t{1}, std::size_t{100}, std::size_t{256}, std::size_t{4095}, std::size_t{4096},
                           std::size_t{4097}, std::size_t{12345}, std::size_t{65543}, std::size_t{kMiB + 3}}) {
    for (int i = 0; i < 4; ++i) {
      auto p = device_->allocate_pinned(size, "small staging");
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p->data()) % 4096, 0u)
          << size << " bytes at " << static_cast<const void*>(p->data());
      std::memset(p->data(), 0x5a, size);  // the whole size is writable
      live.push_back(std::move(*p));
    }
  }
  // Usable for copies: the last small one round trip through the device.
  PinnedBuffer& src = live[4 * 6];  // 12345 bytes
  for (std::size_t i = 0; i < src.size_bytes(); ++i) src.data()[i] = static_cast<std::byte>(i * 13);
  DeviceBuffer d = alloc(src.size_bytes());
  PinnedBuffer& dst = live[4 * 6 + 1];
  ASSERT_TRUE(device_->copy_h2d(stream_, d.span(), src.bytes()).ok());
  ASSERT_TRUE(device_->copy_d2h(stream_, dst.bytes(), d.span()).ok());
  ASSERT_TRUE(device_->synchronize(stream_).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size_bytes()), 0);
  live.clear();
  EXPECT_EQ(pinned_budget_.used_bytes(), 0u);
}

TEST_P(DeviceTest, PinnedMemoryIsChargedAndUsableForCopies) {
  auto p = device_->allocate_pinned(kMiB + 3, "staging");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(pinned_budget_.used_bytes(), kMiB + 3);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p->data()) % 4096, 0u);
  EXPECT_FALSE(p->registered());
  for (std::size_t i = 0; i < p->size_bytes(); ++i) p->data()[i] = static_cast<std::byte>(i * 7);
  DeviceBuffer d = alloc(p->size_bytes());
  ASSERT_TRUE(device_->copy_h2d(stream_, d.span(), p->bytes()).ok());
  auto q = device_->allocate_pinned(kMiB + 3, "readback");
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_TRUE(device_->copy_d2h(stream_, q->bytes(), d.span()).ok());
  ASSERT_TRUE(device_->synchronize(stream_).ok());
  EXPECT_EQ(std::memcmp(p->data(), q->data(), p->size_bytes()), 0);
  p->reset();
  q->reset();
  EXPECT_EQ(pinned_budget_.used_bytes(), 0u);
}

TEST_P(DeviceTest, RegisteredHostMemoryIsChargedAndRegisteredOnce) {
  std::vector<std::byte> host(2 * kMiB);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::byte>(i * 13 + 1);
  auto r = device_->register_host(host, "swap buffer");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->registered());
  EXPECT_EQ(pinned_budget_.used_bytes(), 2 * kMiB);
  auto again = device_->register_host(std::span(host).subspan(kMiB, 4096), "swap buffer again");
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists) << again.status();
  EXPECT_EQ(pinned_budget_.used_bytes(), 2 * kMiB);

  DeviceBuffer d = alloc(host.size());
  ASSERT_TRUE(device_->copy_h2d(stream_, d.span(), host).ok());
  EXPECT_EQ(download(d.span()), host);
  r->reset();
  EXPECT_EQ(pinned_budget_.used_bytes(), 0u);
  // Unregistered: it can be registered again.
  auto r2 = device_->register_host(host, "swap buffer");
  EXPECT_TRUE(r2.ok()) << r2.status();
}

TEST_P(DeviceTest, PinnedAllocatorServesHostBlocks) {
  core::HostAllocator& a = device_->pinned_allocator();
  EXPECT_NE(a.name().find("pinned"), std::string_view::npos);
  auto block = core::HostBlock::allocate(a, 256 * 1024 + 5, 4096);
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block->data()) % 4096, 0u);
  std::memset(block->data(), 0x5a, block->size_bytes());
  DeviceBuffer d = alloc(block->size_bytes());
  ASSERT_TRUE(device_->copy_h2d(stream_, d.span(), std::span<const std::byte>(block->data(), block->size_bytes())).ok());
  const auto back = download(d.span());
  EXPECT_EQ(std::memcmp(back.data(), block->data(), back.size()), 0);
  EXPECT_EQ(pinned_budget_.used_bytes(), 0u);  // the allocator does not charge: its caller does
  EXPECT_EQ(a.allocate(0, 64, -1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.allocate(64, 3, -1).status().code(), StatusCode::kInvalidArgument);
}

// --- copies ---------------------------------------------------------------------

TEST_P(DeviceTest, CopiesRoundTripForManySizesAndOffsets) {
  const std::uint64_t sizes[] = {1, 2, 3, 7, 31, 64, 255, 256, 257, 4095, 4096, 65537, (1u << 20) + 13};
  const std::uint64_t offsets[] = {0, 1, 7, 256, 4099};
  std::mt19937 rng(42);
  for (std::uint64_t size : sizes) {
    DeviceBuffer a = alloc(size + 5000);
    DeviceBuffer b = alloc(size + 5000);
    for (std::uint64_t off_a : offsets) {
      for (std::uint64_t off_b : offsets) {
        std::vector<std::byte> src(size);
        for (auto& x : src) x = static_cast<std::byte>(rng());
        std::vector<std::byte> dst(size, std::byte{0});
        // One stream, no synchronisation in between: FIFO order makes it right.
        ASSERT_TRUE(device_->copy_h2d(stream_, a.subspan(off_a, size), src).ok());
        ASSERT_TRUE(device_->copy_d2d(stream_, b.subspan(off_b, size), a.subspan(off_a, size)).ok());
        ASSERT_TRUE(device_->copy_d2h(stream_, dst, b.subspan(off_b, size)).ok());
        ASSERT_TRUE(device_->synchronize(stream_).ok());
        ASSERT_EQ(dst, src) << "size " << size << ", offsets " << off_a << " -> " << off_b;
      }
    }
  }
}

TEST_P(DeviceTest, CopyLeavesBytesOutsideItsRangeAlone) {
  std::vector<std::byte> zeros(1000, std::byte{0});
  std::vector<std::byte> ones(10, std::byte{1});
  DeviceBuffer a = upload(zeros);
  ASSERT_TRUE(device_->copy_h2d(stream_, a.subspan(500, 10), ones).ok());
  const auto back = download(a.span());
  for (std::size_t i = 0; i < back.size(); ++i) {
    ASSERT_EQ(back[i], (i >= 500 && i < 510) ? std::byte{1} : std::byte{0}) << i;
  }
}

TEST_P(DeviceTest, ZeroByteCopiesAreNoOps) {
  DeviceBuffer a = alloc(64);
  std::vector<std::byte> none;
  EXPECT_TRUE(device_->copy_h2d(stream_, a.subspan(64, 0), none).ok());
  EXPECT_TRUE(device_->copy_d2h(stream_, none, a.subspan(0, 0)).ok());
  EXPECT_TRUE(device_->synchronize(stream_).ok());
}

// --- streams, events, callbacks --------------------------------------------------

TEST_P(DeviceTest, StreamRunsItsWorkInOrder) {
  std::vector<int> order;
  DeviceBuffer x = alloc(4 * 1001);
  const DeviceTypedSpan xs = typed(x.span(), ElemType::kF32);
  // fill, then scales: the result depends on the order (((1 * 2) + 1) * 3 = 9).
  ASSERT_TRUE(device_->fill(stream_, xs, 1.0f).ok());
  ASSERT_TRUE(device_->host_callback(stream_, [&] { order.push_back(0); }).ok());
  ASSERT_TRUE(device_->scale(stream_, xs, 2.0f).ok());
  DeviceBuffer one = alloc(4 * 1001);
  ASSERT_TRUE(device_->fill(stream_, typed(one.span(), ElemType::kF32), 1.0f).ok());
  ASSERT_TRUE(device_->accumulate(stream_, x.span(), typed(one.span(), ElemType::kF32)).ok());
  for (int i = 1; i < 100; ++i) ASSERT_TRUE(device_->host_callback(stream_, [&order, i] { order.push_back(i); }).ok());
  ASSERT_TRUE(device_->scale(stream_, xs, 3.0f).ok());
  std::vector<float> host(1001, 0.0f);
  ASSERT_TRUE(device_->copy_d2h(stream_, as_writable(host), x.span()).ok());
  float seen_by_callback = 0.0f;
  // The callback runs after the copy before it has completed.
  ASSERT_TRUE(device_->host_callback(stream_, [&] { seen_by_callback = host[1000]; }).ok());
  ASSERT_TRUE(device_->synchronize(stream_).ok());
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
  for (float v : host) ASSERT_EQ(v, 9.0f);
  EXPECT_EQ(seen_by_callback, 9.0f);
}

TEST_P(DeviceTest, StreamsRunIndependentlyWithoutEvents) {
  // Stream A is blocked by a host callback; stream B still finishes its work.
  Stream a = new_stream("a");
  Stream b = new_stream("b");
  Gate gate;
  ASSERT_TRUE(device_->host_callback(a, gate.blocker()).ok());
  DeviceBuffer x = alloc(4096);
  ASSERT_TRUE(device_->fill(b, typed(x.span(), ElemType::kF32), 5.0f).ok());
  std::vector<float> host(1024, 0.0f);
  ASSERT_TRUE(device_->copy_d2h(b, as_writable(host), x.span()).ok());
  ASSERT_TRUE(device_->synchronize(b).ok());
  EXPECT_EQ(host[1023], 5.0f);
  gate.open();
  ASSERT_TRUE(device_->synchronize(a).ok());
  EXPECT_FALSE(gate.timed_out()) << "stream b waited for stream a without an event";
}

TEST_P(DeviceTest, EventOrdersWorkAcrossStreams) {
  Stream a = new_stream("producer");
  Stream b = new_stream("consumer");
  Event ready = new_event();
  DeviceBuffer x = alloc(4 * 65536);
  // Pinned: CUDA's copy into pageable memory blocks the calling thread, which
  // here would wait for the gate it has not opened yet.
  auto pinned = device_->allocate_pinned(4 * 65536, "readback");
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  std::span<float> host(reinterpret_cast<float*>(pinned->data()), 65536);
  std::fill(host.begin(), host.end(), -1.0f);
  Gate gate;
  ASSERT_TRUE(device_->host_callback(a, gate.blocker()).ok());
  ASSERT_TRUE(device_->fill(a, typed(x.span(), ElemType::kF32), 7.0f).ok());
  ASSERT_TRUE(device_->record(ready, a).ok());
  ASSERT_TRUE(device_->wait(b, ready).ok());
  ASSERT_TRUE(device_->copy_d2h(b, pinned->bytes(), x.span()).ok());
  Event copied = new_event();
  ASSERT_TRUE(device_->record(copied, b).ok());
  auto q = device_->query(ready);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(*q) << "the event completed while its stream was blocked";
  auto q2 = device_->query(copied);
  ASSERT_TRUE(q2.ok()) << q2.status();
  EXPECT_FALSE(*q2) << "the waiting stream ran past its wait";
  gate.open();
  ASSERT_TRUE(device_->synchronize(copied).ok());
  auto q3 = device_->query(ready);
  ASSERT_TRUE(q3.ok());
  EXPECT_TRUE(*q3);
  for (float v : host) ASSERT_EQ(v, 7.0f);
  EXPECT_FALSE(gate.timed_out());
}

TEST_P(DeviceTest, RecordingAgainMovesTheEvent) {
  Stream a = new_stream("a");
  Event e = new_event();
  ASSERT_TRUE(device_->record(e, a).ok());
  ASSERT_TRUE(device_->synchronize(e).ok());
  Gate gate;
  ASSERT_TRUE(device_->host_callback(a, gate.blocker()).ok());
  ASSERT_TRUE(device_->record(e, a).ok());
  auto q = device_->query(e);
  ASSERT_TRUE(q.ok());
  EXPECT_FALSE(*q);
  gate.open();
  ASSERT_TRUE(device_->synchronize(e).ok());
  EXPECT_TRUE(*device_->query(e));
}

TEST_P(DeviceTest, EventNeverRecordedIsComplete) {
  Event e = new_event();
  auto q = device_->query(e);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(*q);
  EXPECT_TRUE(device_->synchronize(e).ok());
}

TEST_P(DeviceTest, WaitOnAnEventNeverRecordedIsAnErrorOnStrictDevices) {
  if (!strict()) GTEST_SKIP() << device_->caps().name << " is not strict (CUDA treats this wait as a no-op)";
  Event e = new_event();
  const core::Status s = device_->wait(stream_, e);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("never recorded"), std::string_view::npos) << s;
}

TEST_P(DeviceTest, DeviceSynchronizeWaitsForEveryStream) {
  Stream a = new_stream("a");
  Stream b = new_stream("b");
  DeviceBuffer x = alloc(4 << 20);
  DeviceBuffer y = alloc(4 << 20);
  std::vector<float> hx(1 << 20), hy(1 << 20);
  ASSERT_TRUE(device_->fill(a, typed(x.span(), ElemType::kF32), 1.5f).ok());
  ASSERT_TRUE(device_->copy_d2h(a, as_writable(hx), x.span()).ok());
  ASSERT_TRUE(device_->fill(b, typed(y.span(), ElemType::kF32), 2.5f).ok());
  ASSERT_TRUE(device_->copy_d2h(b, as_writable(hy), y.span()).ok());
  ASSERT_TRUE(device_->synchronize().ok());
  EXPECT_EQ(hx.back(), 1.5f);
  EXPECT_EQ(hy.back(), 2.5f);
}

// --- errors ---------------------------------------------------------------------

TEST_P(DeviceTest, CopyPastTheEndIsOutOfRange) {
  DeviceBuffer a = alloc(1000);
  std::vector<std::byte> host(20);
  const core::Status s = device_->copy_h2d(stream_, a.subspan(990, 20), host);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_EQ(device_->copy_d2h(stream_, host, a.subspan(1001, 20)).code(), StatusCode::kOutOfRange);
  DeviceBuffer b = alloc(1000);
  EXPECT_EQ(device_->copy_d2d(stream_, b.subspan(0, 20), a.subspan(985, 20)).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(device_->fill(stream_, typed(a.subspan(996, 8), ElemType::kF32), 0.0f).code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(device_->synchronize(stream_).ok());
}

TEST_P(DeviceTest, SizesThatDifferAreInvalid) {
  DeviceBuffer a = alloc(1000);
  DeviceBuffer b = alloc(1000);
  std::vector<std::byte> host(20);
  EXPECT_EQ(device_->copy_h2d(stream_, a.subspan(0, 10), host).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->copy_d2d(stream_, a.subspan(0, 10), b.subspan(0, 11)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->convert(stream_, typed(a.subspan(0, 40), ElemType::kF32), typed(b.subspan(0, 40), ElemType::kBf16))
                .code(),
            StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, OverlappingViewsAreInvalid) {
  DeviceBuffer a = alloc(1000);
  EXPECT_EQ(device_->copy_d2d(stream_, a.subspan(0, 100), a.subspan(50, 100)).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(device_->copy_d2d(stream_, a.subspan(0, 100), a.subspan(100, 100)).ok());
  EXPECT_EQ(device_->accumulate(stream_, a.subspan(0, 400), typed(a.subspan(200, 200), ElemType::kBf16)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(device_->synchronize(stream_).ok());
}

TEST_P(DeviceTest, MisalignedOrRaggedTypedViewsAreInvalid) {
  DeviceBuffer a = alloc(1000);
  EXPECT_EQ(device_->fill(stream_, typed(a.subspan(2, 40), ElemType::kF32), 1.0f).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->fill(stream_, typed(a.subspan(1, 40), ElemType::kBf16), 1.0f).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->fill(stream_, typed(a.subspan(0, 41), ElemType::kF32), 1.0f).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(device_->fill(stream_, typed(a.subspan(2, 40), ElemType::kF16), 1.0f).ok());
  EXPECT_TRUE(device_->synchronize(stream_).ok());
}

TEST_P(DeviceTest, ViewOfAFreedBufferIsAnError) {
  DeviceBuffer a = alloc(1000);
  const DeviceSpan view = a.span();
  a.reset();
  std::vector<std::byte> host(1000);
  const core::Status s = device_->copy_d2h(stream_, host, view);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("freed"), std::string_view::npos) << s;
  EXPECT_TRUE(device_->synchronize(stream_).ok());
}

TEST_P(DeviceTest, ViewOfAnotherDeviceIsInvalid) {
  auto other = make_device();
  ASSERT_TRUE(other.ok()) << other.status();
  {
    auto b = (*other)->allocate(1000, "other");
    ASSERT_TRUE(b.ok());
    std::vector<std::byte> host(1000);
    EXPECT_EQ(device_->copy_d2h(stream_, host, b->span()).code(), StatusCode::kInvalidArgument);
    auto s = (*other)->create_stream("other");
    ASSERT_TRUE(s.ok());
    DeviceBuffer mine = alloc(1000);
    EXPECT_EQ(device_->copy_d2h(*s, host, mine.span()).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(device_->copy_d2h(stream_, {}, DeviceSpan()).code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, BufferFreedUnderQueuedWorkFailsItsStreamOnStrictDevices) {
  if (!strict()) GTEST_SKIP() << device_->caps().name << " does not check buffers at run time";
  Stream a = new_stream("a");
  Stream b = new_stream("b");
  Event e = new_event();
  DeviceBuffer x = alloc(4096);
  Gate gate;
  ASSERT_TRUE(device_->host_callback(a, gate.blocker()).ok());
  ASSERT_TRUE(device_->fill(a, typed(x.span(), ElemType::kF32), 1.0f).ok());
  bool later_ran = false;
  ASSERT_TRUE(device_->host_callback(a, [&] { later_ran = true; }).ok());
  ASSERT_TRUE(device_->record(e, a).ok());
  ASSERT_TRUE(device_->wait(b, e).ok());
  x.reset();  // freed while the fill is queued
  gate.open();
  const core::Status s = device_->synchronize(a);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("freed"), std::string_view::npos) << s;
  EXPECT_FALSE(later_ran) << "a failed stream ran later work";
  EXPECT_EQ(device_->synchronize(a).code(), StatusCode::kFailedPrecondition) << "the error is sticky";
  EXPECT_EQ(device_->synchronize(e).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(device_->synchronize(b).code(), StatusCode::kFailedPrecondition) << "the waiter fails too";
}

TEST_P(DeviceTest, HostMemoryInsideDeviceMemoryIsInvalidOnStrictDevices) {
  if (!strict() || device_->kind() != DeviceKind::kHost) GTEST_SKIP() << "host device only";
  DeviceBuffer a = alloc(1000);
  DeviceBuffer b = alloc(1000);
  std::span<std::byte> fake_host(static_cast<std::byte*>(a.data()), 100);
  EXPECT_EQ(device_->copy_d2h(stream_, fake_host, b.subspan(0, 100)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->copy_h2d(stream_, b.subspan(0, 100), fake_host).code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, BadAdamConstantsAreInvalid) {
  DeviceBuffer a = alloc(4 * 4 * 16);
  AdamStepArgs args;
  args.constants.eps = std::numeric_limits<float>::infinity();
  args.master = a.subspan(0, 64);
  args.exp_avg = a.subspan(64, 64);
  args.exp_avg_sq = a.subspan(128, 64);
  args.grad = typed(a.subspan(192, 64), ElemType::kF32);
  EXPECT_EQ(device_->adam_step(stream_, args).code(), StatusCode::kInvalidArgument);
  args.constants.eps = 1e-8f;
  args.copy_out = typed(a.subspan(192, 32), ElemType::kBf16);  // overlaps grad
  EXPECT_EQ(device_->adam_step(stream_, args).code(), StatusCode::kInvalidArgument);
}

// --- kernels --------------------------------------------------------------------

TEST_P(DeviceTest, ConvertFromFp32MatchesNumerics) {
  const std::int64_t n = 100003;
  const std::vector<float> v = test_values(n, 1, /*specials=*/true);
  DeviceBuffer src = upload(as_bytes(v));
  for (ElemType t : {ElemType::kBf16, ElemType::kF16}) {
    DeviceBuffer dst = alloc(2 * n);
    ASSERT_TRUE(device_->convert(stream_, typed(dst.span(), t), typed(src.span(), ElemType::kF32)).ok());
    const auto out = download(dst.span());
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const std::uint16_t want = t == ElemType::kBf16 ? nx::fp32_to_bf16_bits(v[k]) : nx::fp32_to_fp16_bits(v[k]);
      ASSERT_EQ(u16_at(out, k), want) << elem_type_name(t) << " element " << i << " value " << v[k];
    }
  }
}

TEST_P(DeviceTest, ConvertEverySixteenBitPatternMatchesNumerics) {
  const std::int64_t n = 65536;
  std::vector<std::uint16_t> all(n);
  for (std::int64_t i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(i);
  DeviceBuffer src = upload(as_bytes(all));
  for (ElemType from : {ElemType::kBf16, ElemType::kF16}) {
    DeviceBuffer wide = alloc(4 * n);
    ASSERT_TRUE(device_->convert(stream_, typed(wide.span(), ElemType::kF32), typed(src.span(), from)).ok());
    const auto out = download(wide.span());
    for (std::size_t i = 0; i < all.size(); ++i) {
      const float want = from == ElemType::kBf16 ? nx::bf16_bits_to_fp32(all[i]) : nx::fp16_bits_to_fp32(all[i]);
      ASSERT_EQ(bits(decode_at(out, ElemType::kF32, i)), bits(want)) << elem_type_name(from) << " pattern " << i;
    }
    const ElemType to = from == ElemType::kBf16 ? ElemType::kF16 : ElemType::kBf16;
    DeviceBuffer narrow = alloc(2 * n);
    ASSERT_TRUE(device_->convert(stream_, typed(narrow.span(), to), typed(src.span(), from)).ok());
    const auto out16 = download(narrow.span());
    for (std::size_t i = 0; i < all.size(); ++i) {
      const float x = from == ElemType::kBf16 ? nx::bf16_bits_to_fp32(all[i]) : nx::fp16_bits_to_fp32(all[i]);
      const std::uint16_t want = to == ElemType::kBf16 ? nx::fp32_to_bf16_bits(x) : nx::fp32_to_fp16_bits(x);
      ASSERT_EQ(u16_at(out16, i), want) << elem_type_name(from) << " -> " << elem_type_name(to) << " pattern " << i;
    }
    // The same type copies bit patterns.
    DeviceBuffer same = alloc(2 * n);
    ASSERT_TRUE(device_->convert(stream_, typed(same.span(), from), typed(src.span(), from)).ok());
    EXPECT_EQ(download(same.span()), download(src.span()));
  }
}

TEST_P(DeviceTest, AccumulateMatchesNumerics) {
  const std::int64_t n = 70001;
  const std::vector<float> base = test_values(n, 2, /*specials=*/true);
  const std::vector<float> add = test_values(n, 3, /*specials=*/false);
  for (ElemType t : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
    DeviceBuffer dst = upload(as_bytes(base));
    const auto src_bytes = encode(add, t);
    DeviceBuffer src = upload(src_bytes);
    ASSERT_TRUE(device_->accumulate(stream_, dst.span(), typed(src.span(), t)).ok());
    // Twice: accumulation reads what the first pass wrote.
    ASSERT_TRUE(device_->accumulate(stream_, dst.span(), typed(src.span(), t)).ok());
    const auto out = download(dst.span());
    for (std::size_t i = 0; i < base.size(); ++i) {
      const float x = decode_at(src_bytes, t, i);
      const float want = (base[i] + x) + x;
      ASSERT_TRUE(same_float(want, decode_at(out, ElemType::kF32, i), static_cast<std::int64_t>(i)))
          << elem_type_name(t);
    }
  }
}

TEST_P(DeviceTest, NormPartialsMatchNumericsInBlockOrder) {
  const std::int64_t sizes[] = {1, 31, 33, 65535, 65536, 65537, 2 * 65536 + 1001};
  for (std::int64_t n : sizes) {
    const std::vector<float> v = test_values(n, static_cast<std::uint32_t>(n), /*specials=*/false);
    for (ElemType t : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
      const auto src_bytes = encode(v, t);
      DeviceBuffer src = upload(src_bytes);
      const std::int64_t blocks = nx::norm_block_count(n);
      DeviceBuffer partials = alloc(8 * static_cast<std::uint64_t>(blocks) + 8);
      DeviceBuffer flag = alloc(4);
      ASSERT_TRUE(device_->fill(stream_, typed(flag.span(), ElemType::kF32), 0.0f).ok());
      ASSERT_TRUE(device_->norm_partials(stream_, {typed(src.span(), t), partials.span(), flag.span()}).ok());
      const auto out = download(partials.span());
      const auto flag_out = download(flag.span());
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::int64_t begin = b * nx::kNormBlockElems;
        const std::int64_t len = std::min<std::int64_t>(nx::kNormBlockElems, n - begin);
        std::vector<float> block(v.begin() + begin, v.begin() + begin + len);
        // Reference over the values as stored in type t.
        for (std::int64_t i = 0; i < len; ++i) {
          block[static_cast<std::size_t>(i)] = decode_at(src_bytes, t, static_cast<std::size_t>(begin + i));
        }
        const double want = nx::norm_block_partial(block.data(), len, [](float x) { return x; });
        double got;
        std::memcpy(&got, out.data() + 8 * b, 8);
        ASSERT_EQ(std::bit_cast<std::uint64_t>(got), std::bit_cast<std::uint64_t>(want))
            << "n " << n << " " << elem_type_name(t) << " block " << b << ": " << got << " vs " << want;
      }
      // 65520 and above round to inf in fp16: the flag must say so.
      bool any_nonfinite = false;
      for (std::int64_t i = 0; i < n; ++i) {
        any_nonfinite |= !std::isfinite(decode_at(src_bytes, t, static_cast<std::size_t>(i)));
      }
      std::uint32_t f;
      std::memcpy(&f, flag_out.data(), 4);
      EXPECT_EQ(f, any_nonfinite ? 1u : 0u) << "n " << n << " " << elem_type_name(t);
    }
  }
}

TEST_P(DeviceTest, NormPartialsFlagInfAndNan) {
  const std::int64_t n = 3 * 65536;
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    for (ElemType t : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
      std::vector<float> v = test_values(n, 9, /*specials=*/false);
      for (float& x : v) x = std::fmod(x, 60000.0f);  // finite in every type
      v[65536 + 777] = bad;
      DeviceBuffer src = upload(encode(v, t));
      DeviceBuffer partials = alloc(8 * 3);
      DeviceBuffer flag = alloc(4);
      ASSERT_TRUE(device_->fill(stream_, typed(flag.span(), ElemType::kF32), 0.0f).ok());
      ASSERT_TRUE(device_->norm_partials(stream_, {typed(src.span(), t), partials.span(), flag.span()}).ok());
      const auto out = download(partials.span());
      const auto flag_out = download(flag.span());
      double p[3];
      std::memcpy(p, out.data(), sizeof(p));
      EXPECT_TRUE(std::isfinite(p[0]));
      EXPECT_FALSE(std::isfinite(p[1])) << elem_type_name(t);
      EXPECT_TRUE(std::isfinite(p[2]));
      std::uint32_t f;
      std::memcpy(&f, flag_out.data(), 4);
      EXPECT_EQ(f, 1u) << elem_type_name(t) << " " << bad;
    }
  }
  // Without a flag buffer the partials are still written.
  std::vector<float> v(100, 2.0f);
  DeviceBuffer src = upload(as_bytes(v));
  DeviceBuffer partials = alloc(8);
  ASSERT_TRUE(device_->norm_partials(stream_, {typed(src.span(), ElemType::kF32), partials.span(), {}}).ok());
  const auto out = download(partials.span());
  double p;
  std::memcpy(&p, out.data(), 8);
  EXPECT_EQ(p, 400.0);
}

TEST_P(DeviceTest, ScaleAndFillMatchNumerics) {
  const std::int64_t n = 4099;
  const std::vector<float> v = test_values(n, 4, /*specials=*/true);
  for (ElemType t : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
    const auto bytes = encode(v, t);
    DeviceBuffer x = upload(bytes);
    const float factor = 0.3f;
    ASSERT_TRUE(device_->scale(stream_, typed(x.span(), t), factor).ok());
    const auto out = download(x.span());
    for (std::size_t i = 0; i < v.size(); ++i) {
      const float want_f = nx::mul_f32(decode_at(bytes, t, i), factor);
      const std::vector<std::byte> want = encode({want_f}, t);
      const float got = decode_at(out, t, i);
      ASSERT_TRUE(same_float(decode_at(want, t, 0), got, static_cast<std::int64_t>(i))) << elem_type_name(t);
    }
    for (float value : {0.1f, -3.0e-6f, from_bits(0x00000005u), 70000.0f}) {
      ASSERT_TRUE(device_->fill(stream_, typed(x.span(), t), value).ok());
      const auto filled = download(x.span());
      const auto want = encode({value}, t);
      for (std::size_t i = 0; i < v.size(); ++i) {
        ASSERT_EQ(bits(decode_at(filled, t, i)), bits(decode_at(want, t, 0))) << elem_type_name(t) << " " << value;
      }
    }
  }
}

TEST_P(DeviceTest, AdamStepMatchesNumerics) {
  const std::int64_t n = 100003;
  // Finite in every type (fp16 overflows at 65520), so every result is finite
  // and compared bit for bit.
  auto finite = [](std::vector<float> v) {
    for (float& x : v) x = std::fmod(x, 60000.0f);
    return v;
  };
  const std::vector<float> p0 = finite(test_values(n, 5, /*specials=*/false));
  const std::vector<float> m0 = finite(test_values(n, 6, /*specials=*/false));
  std::vector<float> v0 = finite(test_values(n, 7, /*specials=*/false));
  for (auto& x : v0) x = std::fabs(x);
  const std::vector<float> g = finite(test_values(n, 8, /*specials=*/false));
  struct Case {
    bool adamw;
    ElemType grad;
    int copy;  // 0 none, 1 bf16, 2 fp16
  };
  const Case cases[] = {{true, ElemType::kF32, 0},  {true, ElemType::kBf16, 1}, {true, ElemType::kF16, 2},
                        {false, ElemType::kF32, 2}, {false, ElemType::kBf16, 0}, {true, ElemType::kF32, 1}};
  for (const Case& c : cases) {
    nx::AdamHyperparams h;
    h.lr = 1e-3;
    h.weight_decay = 0.01;
    h.adamw_mode = c.adamw;
    const nx::AdamStepConstants k = nx::make_adam_constants(h, 7, 1.0 / 1024.0);
    DeviceBuffer master = upload(as_bytes(p0));
    DeviceBuffer exp_avg = upload(as_bytes(m0));
    DeviceBuffer exp_avg_sq = upload(as_bytes(v0));
    const auto gb = encode(g, c.grad);
    DeviceBuffer grad = upload(gb);
    const ElemType copy_type = c.copy == 2 ? ElemType::kF16 : ElemType::kBf16;
    DeviceBuffer copy = c.copy != 0 ? alloc(2 * n) : DeviceBuffer();
    AdamStepArgs args;
    args.constants = k;
    args.master = master.span();
    args.exp_avg = exp_avg.span();
    args.exp_avg_sq = exp_avg_sq.span();
    args.grad = typed(grad.span(), c.grad);
    if (c.copy != 0) args.copy_out = typed(copy.span(), copy_type);
    ASSERT_TRUE(device_->adam_step(stream_, args).ok());
    const auto pm = download(master.span());
    const auto mm = download(exp_avg.span());
    const auto vm = download(exp_avg_sq.span());
    const auto cm = c.copy != 0 ? download(copy.span()) : std::vector<std::byte>();
    for (std::size_t i = 0; i < p0.size(); ++i) {
      float p = p0[i], m = m0[i], v = v0[i];
      nx::adam_step(k, decode_at(gb, c.grad, i), p, m, v);
      const auto ii = static_cast<std::int64_t>(i);
      ASSERT_EQ(bits(decode_at(pm, ElemType::kF32, i)), bits(p)) << "master " << ii << " adamw " << c.adamw;
      ASSERT_EQ(bits(decode_at(mm, ElemType::kF32, i)), bits(m)) << "exp_avg " << ii;
      ASSERT_EQ(bits(decode_at(vm, ElemType::kF32, i)), bits(v)) << "exp_avg_sq " << ii;
      if (c.copy != 0) {
        const std::uint16_t want = copy_type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(p) : nx::fp32_to_fp16_bits(p);
        ASSERT_EQ(u16_at(cm, i), want) << "copy_out " << ii;
      }
    }
  }
}

// Lion and Adagrad: the device's step is numerics.h's, bit for bit, for every
// gradient type, with and without the compute copy and the weight decay; bad
// views and constants are refused before anything runs.
TEST_P(DeviceTest, LionAndAdagradStepsMatchNumerics) {
  const std::int64_t n = 70001;
  auto finite = [](std::vector<float> v) {
    for (float& x : v) x = std::fmod(x, 60000.0f);
    return v;
  };
  const std::vector<float> p0 = finite(test_values(n, 15, /*specials=*/false));
  const std::vector<float> m0 = finite(test_values(n, 16, /*specials=*/false));
  std::vector<float> v0 = finite(test_values(n, 17, /*specials=*/false));
  for (auto& x : v0) x = std::fabs(x);
  const std::vector<float> g = finite(test_values(n, 18, /*specials=*/false));
  struct Case {
    ElemType grad;
    int copy;  // 0 none, 1 bf16, 2 fp16
    double weight_decay;
  };
  const Case cases[] = {{ElemType::kF32, 0, 0.01}, {ElemType::kBf16, 1, 0.0}, {ElemType::kF16, 2, 0.1}};
  for (const Case& c : cases) {
    const auto gb = encode(g, c.grad);
    const ElemType copy_type = c.copy == 2 ? ElemType::kF16 : ElemType::kBf16;
    auto check_copy = [&](const std::vector<std::byte>& cm, std::size_t i, float p) {
      const std::uint16_t want = copy_type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(p) : nx::fp32_to_fp16_bits(p);
      return u16_at(cm, i) == want;
    };
    {  // Lion
      const nx::LionStepConstants k =
          nx::make_lion_constants({.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = c.weight_decay}, 1.0 / 512);
      DeviceBuffer master = upload(as_bytes(p0));
      DeviceBuffer exp_avg = upload(as_bytes(m0));
      DeviceBuffer grad = upload(gb);
      DeviceBuffer copy = c.copy != 0 ? alloc(2 * n) : DeviceBuffer();
      LionStepArgs args{k, master.span(), exp_avg.span(), typed(grad.span(), c.grad), {}};
      if (c.copy != 0) args.copy_out = typed(copy.span(), copy_type);
      ASSERT_TRUE(device_->lion_step(stream_, args).ok());
      const auto pm = download(master.span());
      const auto mm = download(exp_avg.span());
      const auto cm = c.copy != 0 ? download(copy.span()) : std::vector<std::byte>();
      for (std::size_t i = 0; i < p0.size(); ++i) {
        float p = p0[i], m = m0[i];
        nx::lion_step(k, decode_at(gb, c.grad, i), p, m);
        ASSERT_EQ(bits(decode_at(pm, ElemType::kF32, i)), bits(p)) << "lion master " << i;
        ASSERT_EQ(bits(decode_at(mm, ElemType::kF32, i)), bits(m)) << "lion exp_avg " << i;
        if (c.copy != 0) {
          ASSERT_TRUE(check_copy(cm, i, p)) << "lion copy_out " << i;
        }
      }
    }
    {  // Adagrad
      const nx::AdagradStepConstants k =
          nx::make_adagrad_constants({.lr = 1e-2, .eps = 1e-10, .weight_decay = c.weight_decay}, 1.0 / 512);
      DeviceBuffer master = upload(as_bytes(p0));
      DeviceBuffer sum = upload(as_bytes(v0));
      DeviceBuffer grad = upload(gb);
      DeviceBuffer copy = c.copy != 0 ? alloc(2 * n) : DeviceBuffer();
      AdagradStepArgs args{k, master.span(), sum.span(), typed(grad.span(), c.grad), {}};
      if (c.copy != 0) args.copy_out = typed(copy.span(), copy_type);
      ASSERT_TRUE(device_->adagrad_step(stream_, args).ok());
      const auto pm = download(master.span());
      const auto vm = download(sum.span());
      const auto cm = c.copy != 0 ? download(copy.span()) : std::vector<std::byte>();
      for (std::size_t i = 0; i < p0.size(); ++i) {
        float p = p0[i], v = v0[i];
        nx::adagrad_step(k, decode_at(gb, c.grad, i), p, v);
        ASSERT_EQ(bits(decode_at(pm, ElemType::kF32, i)), bits(p)) << "adagrad master " << i;
        ASSERT_EQ(bits(decode_at(vm, ElemType::kF32, i)), bits(v)) << "adagrad sum " << i;
        if (c.copy != 0) {
          ASSERT_TRUE(check_copy(cm, i, p)) << "adagrad copy_out " << i;
        }
      }
    }
  }
  // Refused: counts that differ, overlapping views, an fp32 copy_out, a constant that is not finite.
  DeviceBuffer a = alloc(4 * 64), b = alloc(4 * 64), small = alloc(4 * 32), gr = alloc(4 * 64);
  const nx::LionStepConstants lk = nx::make_lion_constants({}, 1.0);
  EXPECT_EQ(device_->lion_step(stream_, {lk, a.span(), small.span(), typed(gr.span(), ElemType::kF32), {}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->lion_step(stream_, {lk, a.span(), a.span(), typed(gr.span(), ElemType::kF32), {}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->lion_step(stream_, {lk, a.span(), b.span(), typed(gr.span(), ElemType::kF32),
                                         typed(small.span(), ElemType::kF32)}).code(),
            StatusCode::kInvalidArgument);
  nx::AdagradStepConstants ak = nx::make_adagrad_constants({}, 1.0);
  ak.neg_lr = std::numeric_limits<float>::infinity();
  EXPECT_EQ(device_->adagrad_step(stream_, {ak, a.span(), b.span(), typed(gr.span(), ElemType::kF32), {}}).code(),
            StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, CapsDescribeTheBackend) {
  const DeviceCaps& caps = device_->caps();
  EXPECT_FALSE(caps.name.empty());
  EXPECT_GT(caps.device_memory_bytes, 0u);
  EXPECT_GE(caps.allocation_alignment_bytes, 256u);
  if (caps.kind == DeviceKind::kHost) {
    EXPECT_TRUE(caps.strict);
    EXPECT_FALSE(caps.page_locked_host_memory);
    EXPECT_EQ(device_->wrap_native_stream(this, "x").status().code(), StatusCode::kUnimplemented);
    EXPECT_EQ(stream_.native_handle(), nullptr);
  } else {
    EXPECT_TRUE(caps.page_locked_host_memory);
    EXPECT_TRUE(caps.native_streams);
    EXPECT_GE(caps.compute_capability, 75);
    EXPECT_NE(stream_.native_handle(), nullptr);
    auto wrapped = device_->wrap_native_stream(stream_.native_handle(), "framework");
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    EXPECT_EQ(wrapped->native_handle(), stream_.native_handle());
    EXPECT_EQ(device_->declare_compute(stream_, 1e9, "matmul").code(), StatusCode::kUnimplemented);
  }
}

#if defined(__SANITIZE_ADDRESS__)
// Host code that dereferences device memory would fault on a GPU; under ASan
// the host device makes it fault too.
TEST(HostDeviceUnderAsan, DirectAccessToDeviceMemoryIsCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  core::MemoryBudget device_budget("device memory", kMiB);
  core::MemoryBudget pinned_budget("pinned host memory", kMiB);
  HostDeviceOptions options;
  options.budgets = {&device_budget, &pinned_budget};
  auto device = make_host_device(options);
  ASSERT_TRUE(device.ok());
  auto buffer = (*device)->allocate(4096, "poisoned");
  ASSERT_TRUE(buffer.ok());
  EXPECT_DEATH(
      {
        volatile std::byte b = *static_cast<std::byte*>(buffer->data());
        (void)b;
      },
      "use-after-poison");
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, DeviceTest, ::testing::Values("host", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace strata::gpu
