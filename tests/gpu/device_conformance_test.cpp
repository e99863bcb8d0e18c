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

#include "core/aligned_buffer.h"
#include "core/host_allocator.h"
#include "core/memory_budget.h"
#include "core/numerics.h"
#include "core/str.h"
#include "gpu/cuda_device.h"
#include "gpu/device.h"
#include "gpu/host_device.h"
#include "gpu/host_numa.h"

namespace strata::gpu {
namespace {

namespace nx = core::numerics;
using core::StatusCode;
using core::str_cat;

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

// --- Adam with bf16 moments on the host: the oracle ------------------------------

// One step's settings besides the views (AdamStepBf16MomentsArgs' scalars).
struct Bf16MomentsStep {
  nx::AdamStepConstants constants;
  nx::Bf16Rounding rounding = nx::Bf16Rounding::kNearestEven;
  std::uint64_t seed = 0;
  std::int64_t step = 0;
  std::int64_t index_base = 0;
};

// The state of n elements: fp32 master, bf16 moments as bit patterns.
struct Bf16MomentsState {
  std::vector<float> master;
  std::vector<std::uint16_t> exp_avg;
  std::vector<std::uint16_t> exp_avg_sq;
};

// A gradient as the device reads it: its bytes in `type`.
struct StoredGrad {
  std::vector<std::byte> bytes;
  ElemType type = ElemType::kF32;
};

std::uint16_t to_16_bits(float x, ElemType type) {
  return type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(x) : nx::fp32_to_fp16_bits(x);
}

bool is_nan_16_bits(std::uint16_t h, ElemType type) {
  return (h & 0x7fffu) > (type == ElemType::kBf16 ? 0x7f80u : 0x7c00u);
}

// Equal 16-bit patterns, or both NaN (as same_float).
::testing::AssertionResult same_16_bits(std::uint16_t expected, std::uint16_t actual, ElemType type,
                                        std::int64_t i) {
  if (expected == actual || (is_nan_16_bits(expected, type) && is_nan_16_bits(actual, type))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "element " << i << ": expected 0x" << std::hex << expected
                                       << ", got 0x" << actual << " (" << elem_type_name(type) << ")";
}

// numerics::adam_step_bf16_moments applied to each element on the host, with
// the bits numerics::stochastic_rounding_bits gives element i's global index
// (step.index_base + i). Returns the compute copy as `copy_type` patterns.
std::vector<std::uint16_t> oracle_bf16_moments(const Bf16MomentsStep& step, const StoredGrad& grad,
                                               ElemType copy_type, Bf16MomentsState& state) {
  std::vector<std::uint16_t> copy(state.master.size());
  for (std::size_t i = 0; i < state.master.size(); ++i) {
    const std::int64_t index = step.index_base + static_cast<std::int64_t>(i);
    const std::uint32_t bits_m =
        nx::stochastic_rounding_bits(step.seed, step.step, index, nx::AdamMoment::kExpAvg);
    const std::uint32_t bits_v =
        nx::stochastic_rounding_bits(step.seed, step.step, index, nx::AdamMoment::kExpAvgSq);
    nx::adam_step_bf16_moments(step.constants, decode_at(grad.bytes, grad.type, i), state.master[i],
                               state.exp_avg[i], state.exp_avg_sq[i], step.rounding, bits_m, bits_v);
    copy[i] = to_16_bits(state.master[i], copy_type);
  }
  return copy;
}

// Element-wise equality of two states (NaN matches NaN); `what` names the case.
void expect_same_state(const Bf16MomentsState& want, const Bf16MomentsState& got, const std::string& what) {
  ASSERT_EQ(want.master.size(), got.master.size()) << what;
  for (std::size_t i = 0; i < want.master.size(); ++i) {
    const auto ii = static_cast<std::int64_t>(i);
    ASSERT_TRUE(same_float(want.master[i], got.master[i], ii)) << what << ": master";
    ASSERT_TRUE(same_16_bits(want.exp_avg[i], got.exp_avg[i], ElemType::kBf16, ii)) << what << ": exp_avg";
    ASSERT_TRUE(same_16_bits(want.exp_avg_sq[i], got.exp_avg_sq[i], ElemType::kBf16, ii))
        << what << ": exp_avg_sq";
  }
}

// --- Adam with 8-bit blockwise moments on the host: the oracle -----------------

// The state of n elements: fp32 master, one code byte per moment, one fp32
// scale per moment per block of kQuantBlockElems.
struct Int8State {
  std::vector<float> master;
  std::vector<std::uint8_t> exp_avg;
  std::vector<std::uint8_t> exp_avg_sq;
  std::vector<float> exp_avg_scale;
  std::vector<float> exp_avg_sq_scale;
};

// One step: its constants and its gradient (n elements).
struct Int8Step {
  nx::AdamStepConstants constants;
  StoredGrad grad;
};

std::int64_t quant_blocks(std::int64_t n) { return (n + nx::kQuantBlockElems - 1) / nx::kQuantBlockElems; }

// numerics::adam_step_int8_block applied to each block of 256 elements on the
// host (the last one short), the gradient widened to fp32 first. Returns the
// compute copy as `copy_type` patterns.
std::vector<std::uint16_t> oracle_int8(const Int8Step& step, ElemType copy_type, Int8State& state) {
  const auto n = static_cast<std::int64_t>(state.master.size());
  std::vector<std::uint16_t> copy(state.master.size());
  float g[nx::kQuantBlockElems];
  for (std::int64_t b = 0; b < quant_blocks(n); ++b) {
    const std::int64_t begin = b * nx::kQuantBlockElems;
    const int len = static_cast<int>(std::min<std::int64_t>(nx::kQuantBlockElems, n - begin));
    for (int i = 0; i < len; ++i)
      g[i] = decode_at(step.grad.bytes, step.grad.type, static_cast<std::size_t>(begin + i));
    const auto k = static_cast<std::size_t>(begin);
    const auto bb = static_cast<std::size_t>(b);
    nx::adam_step_int8_block(step.constants, nx::kQuantTables, g, state.master.data() + k,
                             state.exp_avg.data() + k, state.exp_avg_sq.data() + k, state.exp_avg_scale[bb],
                             state.exp_avg_sq_scale[bb], len);
  }
  for (std::size_t i = 0; i < copy.size(); ++i) copy[i] = to_16_bits(state.master[i], copy_type);
  return copy;
}

::testing::AssertionResult same_code(std::uint8_t expected, std::uint8_t actual, std::int64_t i) {
  if (expected == actual) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "element " << i << ": expected code 0x" << std::hex << int{expected} << ", got 0x" << int{actual};
}

// Element-wise equality of two 8-bit states: codes exactly, master and scales
// bit for bit (NaN matches NaN); `what` names the case.
void expect_same_int8_state(const Int8State& want, const Int8State& got, const std::string& what) {
  ASSERT_EQ(want.master.size(), got.master.size()) << what;
  ASSERT_EQ(want.exp_avg_scale.size(), got.exp_avg_scale.size()) << what;
  for (std::size_t i = 0; i < want.master.size(); ++i) {
    const auto ii = static_cast<std::int64_t>(i);
    ASSERT_TRUE(same_float(want.master[i], got.master[i], ii)) << what << ": master";
    ASSERT_TRUE(same_code(want.exp_avg[i], got.exp_avg[i], ii)) << what << ": exp_avg";
    ASSERT_TRUE(same_code(want.exp_avg_sq[i], got.exp_avg_sq[i], ii)) << what << ": exp_avg_sq";
  }
  for (std::size_t b = 0; b < want.exp_avg_scale.size(); ++b) {
    const auto bb = static_cast<std::int64_t>(b);
    ASSERT_TRUE(same_float(want.exp_avg_scale[b], got.exp_avg_scale[b], bb))
        << what << ": exp_avg_scale (block)";
    ASSERT_TRUE(same_float(want.exp_avg_sq_scale[b], got.exp_avg_sq_scale[b], bb))
        << what << ": exp_avg_sq_scale (block)";
  }
}

class DeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  core::Result<std::unique_ptr<Device>> make_device() {
    const DeviceBudgets budgets{&device_budget_, &pinned_budget_};
    if (GetParam() == "host") {
      HostDeviceOptions options;
      options.budgets = budgets;
      options.arena = true;  // as the CUDA device's allocations (AFragmentedArenaIsRefusedAsTheBudgetIs)
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

  // Runs adam_step_bf16_moments over `state` on the device (uploaded, stepped,
  // downloaded back into it): one call per piece, a new piece starting at each
  // offset in `splits` (increasing), each call with index_base =
  // step.index_base + its first element. copy_type kF32 means no copy_out.
  // Returns the compute copy's patterns (empty without one).
  std::vector<std::uint16_t> step_bf16_moments_on_device(const Bf16MomentsStep& step, const StoredGrad& grad,
                                                         ElemType copy_type, Bf16MomentsState& state,
                                                         const std::vector<std::int64_t>& splits = {}) {
    const auto n = static_cast<std::int64_t>(state.master.size());
    DeviceBuffer master = upload(as_bytes(state.master));
    DeviceBuffer exp_avg = upload(as_bytes(state.exp_avg));
    DeviceBuffer exp_avg_sq = upload(as_bytes(state.exp_avg_sq));
    DeviceBuffer g = upload(grad.bytes);
    const bool has_copy = copy_type != ElemType::kF32;
    DeviceBuffer copy = has_copy ? alloc(2 * static_cast<std::uint64_t>(n)) : DeviceBuffer();
    std::vector<std::int64_t> bounds = {0};
    bounds.insert(bounds.end(), splits.begin(), splits.end());
    bounds.push_back(n);
    const std::uint64_t gsize = elem_size_bytes(grad.type);
    for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
      const auto begin = static_cast<std::uint64_t>(bounds[k]);
      const auto len = static_cast<std::uint64_t>(bounds[k + 1] - bounds[k]);
      AdamStepBf16MomentsArgs args;
      args.constants = step.constants;
      args.master = master.subspan(4 * begin, 4 * len);
      args.exp_avg = exp_avg.subspan(2 * begin, 2 * len);
      args.exp_avg_sq = exp_avg_sq.subspan(2 * begin, 2 * len);
      args.grad = typed(g.subspan(gsize * begin, gsize * len), grad.type);
      if (has_copy) args.copy_out = typed(copy.subspan(2 * begin, 2 * len), copy_type);
      args.rounding = step.rounding;
      args.seed = step.seed;
      args.step = step.step;
      args.index_base = step.index_base + bounds[k];
      const core::Status s = device_->adam_step_bf16_moments(stream_, args);
      EXPECT_TRUE(s.ok()) << s;
    }
    const auto pm = download(master.span());
    const auto mm = download(exp_avg.span());
    const auto vm = download(exp_avg_sq.span());
    std::memcpy(state.master.data(), pm.data(), pm.size());
    std::memcpy(state.exp_avg.data(), mm.data(), mm.size());
    std::memcpy(state.exp_avg_sq.data(), vm.data(), vm.size());
    std::vector<std::uint16_t> out;
    if (has_copy) {
      const auto cm = download(copy.span());
      out.resize(static_cast<std::size_t>(n));
      std::memcpy(out.data(), cm.data(), cm.size());
    }
    return out;
  }

  // Runs adam_step_int8_blockwise over `state` on the device: uploaded once,
  // each step in turn (the state staying on the device between them), then
  // downloaded back into it. Each step is one call per piece, a new piece
  // starting at each offset in `splits` (increasing multiples of 256, so
  // every piece starts a block). copy_type kF32 means no copy_out. Returns the
  // last step's compute copy (empty without one).
  std::vector<std::uint16_t> step_int8_on_device(const std::vector<Int8Step>& steps, ElemType copy_type,
                                                 Int8State& state,
                                                 const std::vector<std::int64_t>& splits = {}) {
    const auto n = static_cast<std::int64_t>(state.master.size());
    DeviceBuffer master = upload(as_bytes(state.master));
    DeviceBuffer exp_avg = upload(as_bytes(state.exp_avg));
    DeviceBuffer exp_avg_sq = upload(as_bytes(state.exp_avg_sq));
    DeviceBuffer exp_avg_scale = upload(as_bytes(state.exp_avg_scale));
    DeviceBuffer exp_avg_sq_scale = upload(as_bytes(state.exp_avg_sq_scale));
    const bool has_copy = copy_type != ElemType::kF32;
    DeviceBuffer copy = has_copy ? alloc(2 * static_cast<std::uint64_t>(n)) : DeviceBuffer();
    std::vector<std::int64_t> bounds = {0};
    bounds.insert(bounds.end(), splits.begin(), splits.end());
    bounds.push_back(n);
    for (const Int8Step& step : steps) {
      DeviceBuffer g = upload(step.grad.bytes);
      const std::uint64_t gsize = elem_size_bytes(step.grad.type);
      for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
        EXPECT_EQ(bounds[k] % nx::kQuantBlockElems, 0) << "a piece must start a block";
        const auto begin = static_cast<std::uint64_t>(bounds[k]);
        const auto len = static_cast<std::uint64_t>(bounds[k + 1] - bounds[k]);
        const auto first_block = begin / nx::kQuantBlockElems;
        const auto blocks = static_cast<std::uint64_t>(quant_blocks(static_cast<std::int64_t>(len)));
        AdamStepInt8Args args;
        args.constants = step.constants;
        args.master = master.subspan(4 * begin, 4 * len);
        args.exp_avg = exp_avg.subspan(begin, len);
        args.exp_avg_sq = exp_avg_sq.subspan(begin, len);
        args.exp_avg_scale = exp_avg_scale.subspan(4 * first_block, 4 * blocks);
        args.exp_avg_sq_scale = exp_avg_sq_scale.subspan(4 * first_block, 4 * blocks);
        args.grad = typed(g.subspan(gsize * begin, gsize * len), step.grad.type);
        if (has_copy) args.copy_out = typed(copy.subspan(2 * begin, 2 * len), copy_type);
        const core::Status s = device_->adam_step_int8_blockwise(stream_, args);
        EXPECT_TRUE(s.ok()) << s;
      }
      // g is freed when this iteration ends: the step must be done with it.
      const core::Status s = device_->synchronize(stream_);
      EXPECT_TRUE(s.ok()) << s;
    }
    auto fetch = [&](const DeviceBuffer& from, auto& into) {
      const auto bytes = download(from.span());
      std::memcpy(into.data(), bytes.data(), bytes.size());
    };
    fetch(master, state.master);
    fetch(exp_avg, state.exp_avg);
    fetch(exp_avg_sq, state.exp_avg_sq);
    fetch(exp_avg_scale, state.exp_avg_scale);
    fetch(exp_avg_sq_scale, state.exp_avg_sq_scale);
    std::vector<std::uint16_t> out;
    if (has_copy) {
      out.resize(static_cast<std::size_t>(n));
      fetch(copy, out);
    }
    return out;
  }

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

// Device memory is one arena as large as the budget: a request the budget allows can still find
// no free range that large (fragmented). That is refused as the budget is (kResourceExhausted,
// which the engine's caches answer by giving buffers back), on the host device as on CUDA.
TEST_P(DeviceTest, AFragmentedArenaIsRefusedAsTheBudgetIs) {
  std::vector<DeviceBuffer> quarters;
  for (int i = 0; i < 4; ++i) quarters.push_back(alloc(kBudgetBytes / 4));
  quarters[0].reset();
  quarters[2].reset();
  auto half = device_->allocate(kBudgetBytes / 2, "layer 3 gradients");
  ASSERT_FALSE(half.ok());
  EXPECT_EQ(half.status().code(), StatusCode::kResourceExhausted) << half.status();
  EXPECT_NE(half.status().message().find("no free range"), std::string_view::npos) << half.status();
  EXPECT_NE(half.status().message().find("layer 3 gradients"), std::string_view::npos) << half.status();
  EXPECT_EQ(device_budget_.used_bytes(), kBudgetBytes / 2);
  // Neighbours coalesce: with the second quarter freed too, the first half is one range.
  quarters[1].reset();
  DeviceBuffer again = alloc(kBudgetBytes / 2);
  EXPECT_FALSE(again.empty());
}

// The two ends (ArenaEnd): a buffer taken from the high end and given back leaves the low end's
// buffer at the bottom, so the rest of the arena is one range. Placed from the low end, the
// first buffer would have pushed the second up, leaving two ranges, neither three quarters.
TEST_P(DeviceTest, TheArenasTwoEndsKeepTheMiddleWhole) {
  auto high = device_->allocate(kBudgetBytes / 4, "gradients", ArenaEnd::kHigh);
  ASSERT_TRUE(high.ok()) << high.status();
  EXPECT_EQ(high->arena_end(), ArenaEnd::kHigh);
  DeviceBuffer low = alloc(kBudgetBytes / 4);
  EXPECT_EQ(low.arena_end(), ArenaEnd::kLow);
  high->reset();
  auto rest = device_->allocate(kBudgetBytes / 4 * 3, "the rest", ArenaEnd::kHigh);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(device_budget_.used_bytes(), kBudgetBytes);
  // High-end buffers stack down from the top: with the lower of two given back, it and the
  // free range below it (above a low-end buffer) make one half.
  low.reset();
  rest->reset();
  std::vector<DeviceBuffer> tops;
  for (int i = 0; i < 2; ++i) {
    auto t = device_->allocate(kBudgetBytes / 4, "update copies", ArenaEnd::kHigh);
    ASSERT_TRUE(t.ok()) << t.status();
    tops.push_back(std::move(*t));
  }
  DeviceBuffer bottom = alloc(kBudgetBytes / 4);
  tops[1].reset();  // the lower of the two
  auto half = device_->allocate(kBudgetBytes / 2, "fetched copies");
  EXPECT_TRUE(half.ok()) << half.status();
}

// The high end takes the highest free range that fits, not the top of the lowest: with the
// second and fourth quarters free, a high-end quarter goes in the fourth, so that once the first
// quarter and it are given back the free quarters are apart.
TEST_P(DeviceTest, TheHighEndTakesTheHighestRangeThatFits) {
  std::vector<DeviceBuffer> quarters;
  for (int i = 0; i < 4; ++i) quarters.push_back(alloc(kBudgetBytes / 4));
  quarters[1].reset();
  quarters[3].reset();
  auto high = device_->allocate(kBudgetBytes / 4, "gradients", ArenaEnd::kHigh);
  ASSERT_TRUE(high.ok()) << high.status();
  DeviceBuffer low = alloc(kBudgetBytes / 4);  // the second quarter
  quarters[0].reset();
  high->reset();
  auto half = device_->allocate(kBudgetBytes / 2, "fetched copies");
  ASSERT_FALSE(half.ok()) << "the high-end quarter went below the low one";
  EXPECT_NE(half.status().message().find("no free range"), std::string_view::npos) << half.status();
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

// A rank's pinned memory goes on its GPU's NUMA node (Device::set_pinned_numa_node): every page of
// a block, small or large, on the node asked for; a node the kernel refuses leaves the memory usable
// where it falls. Here the node is the one this thread's pages land on (the only one on a machine
// of one node), so the test holds on any machine whose kernel says where pages live.
TEST_P(DeviceTest, PinnedMemoryGoesOnTheNumaNodeAsked) {
  auto probe = core::AlignedBuffer::allocate(4096, 4096);
  ASSERT_TRUE(probe.ok());
  std::memset(probe->data(), 1, 4096);
  const int node = numa_node_of_page(probe->data());
  if (node < 0) GTEST_SKIP() << "the kernel does not say where pages live (move_pages refused)";
  EXPECT_EQ(device_->pinned_numa_node(), -1);
  device_->set_pinned_numa_node(node);
  EXPECT_EQ(device_->pinned_numa_node(), node);
  for (std::size_t size : {std::size_t{4097}, 3 * kMiB + 5}) {
    auto p = device_->allocate_pinned(size, "staging near the GPU");
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p->data()) % 4096, 0u);
    for (std::size_t i = 0; i < size; ++i) p->data()[i] = static_cast<std::byte>(i * 11);
    for (std::size_t at : {std::size_t{0}, (size / 2) & ~std::size_t{4095}, (size - 1) & ~std::size_t{4095}}) {
      EXPECT_EQ(numa_node_of_page(p->data() + at), node) << size << " bytes, page at " << at;
    }
    DeviceBuffer d = alloc(size);
    auto q = device_->allocate_pinned(size, "readback");
    ASSERT_TRUE(q.ok()) << q.status();
    ASSERT_TRUE(device_->copy_h2d(stream_, d.span(), p->bytes()).ok());
    ASSERT_TRUE(device_->copy_d2h(stream_, q->bytes(), d.span()).ok());
    ASSERT_TRUE(device_->synchronize(stream_).ok());
    EXPECT_EQ(std::memcmp(p->data(), q->data(), size), 0);
  }
  // The allocator handed to nvme/ places its blocks the same way.
  auto block = core::HostBlock::allocate(device_->pinned_allocator(), 2 * kMiB, 4096, -1);
  ASSERT_TRUE(block.ok()) << block.status();
  std::memset(block->data(), 3, 2 * kMiB);
  EXPECT_EQ(numa_node_of_page(block->data() + kMiB), node);
  // A node no machine has: the kernel refuses, the memory is still given (a warning says so once).
  device_->set_pinned_numa_node(1000);
  auto far = device_->allocate_pinned(kMiB, "staging on a node that is not there");
  ASSERT_TRUE(far.ok()) << far.status();
  std::memset(far->data(), 7, kMiB);
  far->reset();
  device_->set_pinned_numa_node(-1);
  EXPECT_EQ(device_->pinned_numa_node(), -1);
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

// allocate_pinned with a fill: the fill runs once, over the size asked for, before the memory is
// locked, and the buffer holds what it wrote; small blocks and large ones (CUDA maps those, lets the
// fill bring their pages in, then registers them), on the NUMA node asked for too. Errors as the
// plain form's, the fill never run for them.
TEST_P(DeviceTest, PinnedMemoryFilledBeforeLockingHoldsWhatTheFillWrote) {
  for (int node_pass = 0; node_pass < 2; ++node_pass) {
    if (node_pass == 1) {
      auto probe = core::AlignedBuffer::allocate(4096, 4096);
      ASSERT_TRUE(probe.ok());
      std::memset(probe->data(), 1, 4096);
      const int node = numa_node_of_page(probe->data());
      if (node < 0) break;  // the kernel does not say where pages live
      device_->set_pinned_numa_node(node);
    }
    for (std::size_t size : {std::size_t{4097}, 2 * kMiB, 5 * kMiB + 3}) {
      int calls = 0;
      std::size_t seen = 0;
      auto p = device_->allocate_pinned(size, "optimizer state", [&](std::span<std::byte> b) {
        ++calls;
        seen = b.size();
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>(i * 29 + size);
      });
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(calls, 1) << size;
      EXPECT_EQ(seen, size);
      EXPECT_EQ(p->size_bytes(), size);
      EXPECT_FALSE(p->registered());
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p->data()) % 4096, 0u);
      EXPECT_EQ(pinned_budget_.used_bytes(), size);
      bool kept = true;
      for (std::size_t i = 0; i < size && kept; ++i) kept = p->data()[i] == static_cast<std::byte>(i * 29 + size);
      EXPECT_TRUE(kept) << size << " bytes: the buffer does not hold what the fill wrote";
      if (node_pass == 1) {
        EXPECT_EQ(numa_node_of_page(p->data() + (size - 1) / 2 / 4096 * 4096), device_->pinned_numa_node()) << size;
      }
      // Usable for copies both ways.
      DeviceBuffer d = alloc(size);
      auto q = device_->allocate_pinned(size, "readback", [](std::span<std::byte> b) {
        std::memset(b.data(), 0, b.size());
      });
      ASSERT_TRUE(q.ok()) << q.status();
      ASSERT_TRUE(device_->copy_h2d(stream_, d.span(), p->bytes()).ok());
      ASSERT_TRUE(device_->copy_d2h(stream_, q->bytes(), d.span()).ok());
      ASSERT_TRUE(device_->synchronize(stream_).ok());
      EXPECT_EQ(std::memcmp(p->data(), q->data(), size), 0) << size;
    }
  }
  device_->set_pinned_numa_node(-1);
  EXPECT_EQ(pinned_budget_.used_bytes(), 0u);
  int calls = 0;
  const Device::PinnedFill counted = [&](std::span<std::byte>) { ++calls; };
  auto none = device_->allocate_pinned(0, "nothing", counted);
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument) << none.status();
  auto over = device_->allocate_pinned(pinned_budget_.limit_bytes() + 4096, "too much", counted);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_EQ(calls, 0);
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

// run_on_stream: another library's work in stream order over device memory.
// It gets the spans' device addresses in order and the stream's native handle
// (a cudaStream_t on CUDA, null on the host device); on the host device it
// runs after the stream's earlier work and before its later work, reading and
// writing the memory as a collective over host buffers would, and its failure
// is the stream's (sticky) error. Bad spans are refused before anything runs.
TEST_P(DeviceTest, RunOnStreamGetsTheSpansInStreamOrder) {
  DeviceBuffer a = alloc(4 * 256), b = alloc(4 * 64);
  ASSERT_TRUE(device_->fill(stream_, typed(a.span(), ElemType::kF32), 2.0f).ok());
  std::vector<void*> seen;
  void* native = reinterpret_cast<void*>(1);
  const DeviceSpan spans[] = {a.span(), b.subspan(0, 4 * 32)};
  const bool host = device_->kind() == DeviceKind::kHost;
  ASSERT_TRUE(device_
                  ->run_on_stream(stream_, spans,
                                  [&](void* stream, std::span<void* const> ptrs) -> core::Status {
                                    native = stream;
                                    seen.assign(ptrs.begin(), ptrs.end());
                                    if (host) {  // the host's memory while it runs: a collective's work
                                      const auto* src = static_cast<const float*>(ptrs[0]);
                                      auto* dst = static_cast<float*>(ptrs[1]);
                                      for (int i = 0; i < 32; ++i) dst[i] = src[i] + src[i + 32];
                                    }
                                    return core::Status();
                                  })
                  .ok());
  ASSERT_TRUE(device_->synchronize(stream_).ok());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], a.span().data());
  EXPECT_EQ(seen[1], b.span().data());
  EXPECT_EQ(native, stream_.native_handle());
  if (host) {
    EXPECT_EQ(native, nullptr);
    std::vector<float> out(32, 0.0f);
    ASSERT_TRUE(device_->copy_d2h(stream_, as_writable(out), b.subspan(0, 4 * 32)).ok());
    ASSERT_TRUE(device_->synchronize(stream_).ok());
    for (float v : out) ASSERT_EQ(v, 4.0f);  // after the fill before it
    // A failure is the stream's, sticky: the work queued after it does not run.
    auto s = device_->create_stream("failing");
    ASSERT_TRUE(s.ok());
    bool later = false;
    ASSERT_TRUE(device_->run_on_stream(*s, {}, [](void*, std::span<void* const>) {
                  return core::Status::unavailable("a peer left");
                }).ok());
    ASSERT_TRUE(device_->host_callback(*s, [&] { later = true; }).ok());
    const core::Status synced = device_->synchronize(*s);
    EXPECT_EQ(synced.code(), core::StatusCode::kUnavailable) << synced;
    EXPECT_NE(synced.message().find("a peer left"), std::string::npos) << synced;
    EXPECT_FALSE(later);
  }
  // Refused before anything runs: no function, too many spans, a freed buffer.
  EXPECT_EQ(device_->run_on_stream(stream_, spans, nullptr).code(), core::StatusCode::kInvalidArgument);
  const std::vector<DeviceSpan> nine(9, a.span());
  EXPECT_EQ(device_->run_on_stream(stream_, nine, [](void*, std::span<void* const>) { return core::Status(); }).code(),
            core::StatusCode::kInvalidArgument);
  const DeviceSpan gone = b.span();
  b.reset();
  const DeviceSpan dead[] = {gone};
  EXPECT_EQ(device_->run_on_stream(stream_, dead, [](void*, std::span<void* const>) { return core::Status(); }).code(),
            core::StatusCode::kFailedPrecondition);
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

// --- Adam with bf16 moments ----------------------------------------------------
// The device's step is numerics::adam_step_bf16_moments applied per element on
// the host, bit for bit, for both roundings.

// Finite in every gradient type (fp16 overflows at 65520).
std::vector<float> finite_values(std::int64_t n, std::uint32_t seed) {
  std::vector<float> v = test_values(n, seed, /*specials=*/false);
  for (float& x : v) x = std::fmod(x, 60000.0f);
  return v;
}

// bf16 bit patterns of test values (fp32 subnormals among them give bf16
// subnormal moments); `nonnegative` for exp_avg_sq.
std::vector<std::uint16_t> bf16_values(std::int64_t n, std::uint32_t seed, bool nonnegative) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(n));
  const std::vector<float> v = finite_values(n, seed);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = nx::fp32_to_bf16_bits(nonnegative ? std::fabs(v[i]) : v[i]);
  return out;
}

Bf16MomentsState bf16_moments_state(std::int64_t n, std::uint32_t seed) {
  return {finite_values(n, seed), bf16_values(n, seed + 1, /*nonnegative=*/false),
          bf16_values(n, seed + 2, /*nonnegative=*/true)};
}

StoredGrad stored_grad(const std::vector<float>& g, ElemType type) { return {encode(g, type), type}; }

std::string rounding_name(nx::Bf16Rounding r) {
  return r == nx::Bf16Rounding::kStochastic ? "stochastic" : "nearest-even";
}

TEST_P(DeviceTest, AdamStepBf16MomentsMatchesNumerics) {
  struct Case {
    std::int64_t n;
    nx::Bf16Rounding rounding;
    ElemType grad;
    ElemType copy;  // kF32: no copy_out
    bool adamw;
    std::int64_t index_base;
  };
  std::vector<Case> cases;
  // Every rounding, gradient type and copy_out, at an odd length (a partial
  // last block on CUDA), with index bases below and above 2^32.
  const std::int64_t bases[] = {0, 1, 65535, 5'000'000'123};
  int k = 0;
  for (nx::Bf16Rounding r : {nx::Bf16Rounding::kNearestEven, nx::Bf16Rounding::kStochastic}) {
    for (ElemType g : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
      for (ElemType c : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
        cases.push_back({100003, r, g, c, k % 2 == 0, bases[k % 4]});
        ++k;
      }
    }
  }
  // Lengths of a few elements, and one past what one CUDA grid covers
  // (8192 blocks of 256 threads), so its grid-stride loop goes round.
  cases.push_back({1, nx::Bf16Rounding::kStochastic, ElemType::kF32, ElemType::kBf16, true, 3});
  cases.push_back({7, nx::Bf16Rounding::kNearestEven, ElemType::kBf16, ElemType::kF16, false, 0});
  cases.push_back(
      {8192 * 256 + 4099, nx::Bf16Rounding::kStochastic, ElemType::kBf16, ElemType::kBf16, true, 17});
  for (const Case& c : cases) {
    nx::AdamHyperparams h;
    h.lr = 1e-3;
    h.weight_decay = 0.01;
    h.adamw_mode = c.adamw;
    Bf16MomentsStep step;
    step.constants = nx::make_adam_constants(h, 7, 1.0 / 1024.0);
    step.rounding = c.rounding;
    step.seed = 0x5eed0000u + static_cast<std::uint64_t>(c.n);
    step.step = 7;
    step.index_base = c.index_base;
    const std::string what = str_cat(rounding_name(c.rounding), " n ", c.n, " grad ", elem_type_name(c.grad),
                                     " copy ", c.copy == ElemType::kF32 ? "none" : elem_type_name(c.copy),
                                     c.adamw ? " adamw" : " adam", " index_base ", c.index_base);
    const Bf16MomentsState initial = bf16_moments_state(c.n, 31);
    const StoredGrad grad = stored_grad(finite_values(c.n, 41), c.grad);
    Bf16MomentsState want = initial;
    const std::vector<std::uint16_t> want_copy = oracle_bf16_moments(step, grad, c.copy, want);
    Bf16MomentsState got = initial;
    const std::vector<std::uint16_t> got_copy = step_bf16_moments_on_device(step, grad, c.copy, got);
    expect_same_state(want, got, what);
    if (c.copy != ElemType::kF32) {
      ASSERT_EQ(got_copy.size(), want_copy.size());
      for (std::size_t i = 0; i < want_copy.size(); ++i) {
        ASSERT_TRUE(same_16_bits(want_copy[i], got_copy[i], c.copy, static_cast<std::int64_t>(i)))
            << what << ": copy_out";
      }
    }
    if (c.rounding == nx::Bf16Rounding::kStochastic && c.n > 1000) {
      // The test can tell the roundings apart: stochastic rounding moves many
      // moments off their nearest-even bf16.
      Bf16MomentsState nearest = initial;
      Bf16MomentsStep ne = step;
      ne.rounding = nx::Bf16Rounding::kNearestEven;
      oracle_bf16_moments(ne, grad, c.copy, nearest);
      std::int64_t differ = 0;
      for (std::size_t i = 0; i < initial.exp_avg.size(); ++i)
        differ += nearest.exp_avg[i] != want.exp_avg[i];
      EXPECT_GT(differ, c.n / 10) << what;
    }
  }
}

TEST_P(DeviceTest, AdamStepBf16MomentsInPiecesEqualsOneCall) {
  const std::int64_t n = 70001;
  const Bf16MomentsState initial = bf16_moments_state(n, 51);
  const StoredGrad grad = stored_grad(finite_values(n, 61), ElemType::kBf16);
  for (nx::Bf16Rounding r : {nx::Bf16Rounding::kNearestEven, nx::Bf16Rounding::kStochastic}) {
    Bf16MomentsStep step;
    step.constants = nx::make_adam_constants({.lr = 2e-3, .weight_decay = 0.1}, 3, 1.0 / 64.0);
    step.rounding = r;
    step.seed = 99;
    step.step = 3;
    step.index_base = 1'000'000;
    Bf16MomentsState whole = initial;
    const auto whole_copy = step_bf16_moments_on_device(step, grad, ElemType::kBf16, whole);
    Bf16MomentsState want = initial;
    const auto want_copy = oracle_bf16_moments(step, grad, ElemType::kBf16, want);
    expect_same_state(want, whole, str_cat(rounding_name(r), " in one call"));
    EXPECT_EQ(whole_copy, want_copy);
    // A range split in two calls, and in pieces starting at odd elements and
    // at a 65536 boundary, each call with its own index_base.
    const std::vector<std::vector<std::int64_t>> splits = {{12345}, {1, 333, 65536, 70000}};
    for (const auto& split : splits) {
      Bf16MomentsState pieces = initial;
      const auto pieces_copy = step_bf16_moments_on_device(step, grad, ElemType::kBf16, pieces, split);
      expect_same_state(whole, pieces, str_cat(rounding_name(r), " in ", split.size() + 1, " calls"));
      EXPECT_EQ(pieces_copy, whole_copy);
    }
    if (r == nx::Bf16Rounding::kStochastic) {
      // index_base feeds the bits: the same elements one index further on round differently.
      Bf16MomentsStep shifted = step;
      shifted.index_base += 1;
      Bf16MomentsState other = initial;
      step_bf16_moments_on_device(shifted, grad, ElemType::kF32, other);
      std::int64_t differ = 0;
      for (std::size_t i = 0; i < other.exp_avg_sq.size(); ++i)
        differ += other.exp_avg_sq[i] != whole.exp_avg_sq[i];
      EXPECT_GT(differ, n / 10);
    }
  }
}

// Zeros, inf and NaN gradients, gradients whose square overflows, subnormal,
// infinite and NaN moments, in every gradient type and both roundings.
TEST_P(DeviceTest, AdamStepBf16MomentsSpecialValuesMatchNumerics) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float grads[] = {0.0f, -0.0f, inf, -inf, nan, 1e30f, -1e-40f, -3.5f, 65504.0f};
  const std::uint16_t ms[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x0080,
                              0x3f80, 0xbf80, 0x7f7f, 0xff7f, 0x7f80, 0x7fc1};
  const std::uint16_t vs[] = {0x0000, 0x0001, 0x0003, 0x007f, 0x0080, 0x3f80, 0x7f7f, 0x7f80};
  const float masters[] = {0.0f, -0.0f, 1.0f, -1e-40f, 3e38f};
  Bf16MomentsState initial;
  std::vector<float> g;
  for (float gv : grads) {
    for (std::uint16_t m : ms) {
      for (std::uint16_t v : vs) {
        for (float p : masters) {
          initial.master.push_back(p);
          initial.exp_avg.push_back(m);
          initial.exp_avg_sq.push_back(v);
          g.push_back(gv);
        }
      }
    }
  }
  int k = 0;
  for (nx::Bf16Rounding r : {nx::Bf16Rounding::kNearestEven, nx::Bf16Rounding::kStochastic}) {
    for (ElemType gt : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
      const bool adamw = k % 2 == 0;
      const ElemType ct = k % 2 == 0 ? ElemType::kBf16 : ElemType::kF16;
      ++k;
      Bf16MomentsStep step;
      step.constants = nx::make_adam_constants(
          {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.05, .adamw_mode = adamw}, 2, 1.0);
      step.rounding = r;
      step.seed = 7;
      step.step = 2;
      step.index_base = 12;
      const StoredGrad grad = stored_grad(g, gt);
      Bf16MomentsState want = initial;
      const auto want_copy = oracle_bf16_moments(step, grad, ct, want);
      Bf16MomentsState got = initial;
      const auto got_copy = step_bf16_moments_on_device(step, grad, ct, got);
      const std::string what =
          str_cat(rounding_name(r), " grad ", elem_type_name(gt), adamw ? " adamw" : " adam");
      expect_same_state(want, got, what);
      for (std::size_t i = 0; i < want_copy.size(); ++i) {
        ASSERT_TRUE(same_16_bits(want_copy[i], got_copy[i], ct, static_cast<std::int64_t>(i)))
            << what << ": copy_out";
      }
    }
  }
  // All zeros stay zeros (+0 master, +0 moments) under both roundings.
  const std::int64_t z = 1001;
  for (nx::Bf16Rounding r : {nx::Bf16Rounding::kNearestEven, nx::Bf16Rounding::kStochastic}) {
    Bf16MomentsState zeros{std::vector<float>(z, 0.0f), std::vector<std::uint16_t>(z, 0),
                           std::vector<std::uint16_t>(z, 0)};
    Bf16MomentsStep step;
    step.constants = nx::make_adam_constants({.weight_decay = 0.01}, 1, 1.0);
    step.rounding = r;
    step.seed = 1;
    step.step = 1;
    const auto copy = step_bf16_moments_on_device(
        step, stored_grad(std::vector<float>(z, 0.0f), ElemType::kF16), ElemType::kBf16, zeros);
    for (std::int64_t i = 0; i < z; ++i) {
      const auto ii = static_cast<std::size_t>(i);
      ASSERT_EQ(bits(zeros.master[ii]), 0u) << rounding_name(r) << " element " << i;
      ASSERT_EQ(zeros.exp_avg[ii], 0u) << rounding_name(r) << " element " << i;
      ASSERT_EQ(zeros.exp_avg_sq[ii], 0u) << rounding_name(r) << " element " << i;
      ASSERT_EQ(copy[ii], 0u) << rounding_name(r) << " element " << i;
    }
  }
}

TEST_P(DeviceTest, AdamStepBf16MomentsBadArgumentsAreInvalid) {
  const std::int64_t n = 64;
  const Bf16MomentsState initial = bf16_moments_state(n, 71);
  DeviceBuffer master = upload(as_bytes(initial.master));
  DeviceBuffer exp_avg = upload(as_bytes(initial.exp_avg));
  DeviceBuffer exp_avg_sq = upload(as_bytes(initial.exp_avg_sq));
  DeviceBuffer grad = alloc(4 * n);
  ASSERT_TRUE(device_->fill(stream_, typed(grad.span(), ElemType::kF32), 0.5f).ok());
  DeviceBuffer copy = alloc(4 * n);
  AdamStepBf16MomentsArgs good;
  good.constants = nx::make_adam_constants({}, 1, 1.0);
  good.master = master.span();
  good.exp_avg = exp_avg.span();
  good.exp_avg_sq = exp_avg_sq.span();
  good.grad = typed(grad.span(), ElemType::kF32);
  good.rounding = nx::Bf16Rounding::kStochastic;
  // kInvalidArgument with a message that names `field`.
  auto expect_invalid = [&](const AdamStepBf16MomentsArgs& args, std::string_view field, const char* why) {
    const core::Status s = device_->adam_step_bf16_moments(stream_, args);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << why << ": " << s;
    EXPECT_NE(s.message().find(field), std::string_view::npos) << why << ": " << s;
  };
  AdamStepBf16MomentsArgs a = good;
  a.exp_avg = exp_avg.subspan(0, 2 * (n - 1));
  expect_invalid(a, "element counts differ", "exp_avg one element short");
  a = good;
  a.grad = typed(grad.subspan(0, 2 * n), ElemType::kF32);
  expect_invalid(a, "element counts differ", "grad half as long");
  a = good;
  a.exp_avg_sq = grad.span();  // 4 bytes per element: twice the bf16 count
  expect_invalid(a, "exp_avg_sq 128", "exp_avg_sq sized as fp32");
  a = good;
  a.master = exp_avg.span();  // 2 bytes per element: half the fp32 count
  a.exp_avg = copy.subspan(0, 2 * n);
  expect_invalid(a, "master 32", "master sized as bf16");
  a = good;
  a.exp_avg = exp_avg.subspan(0, 2 * n - 1);
  expect_invalid(a, "exp_avg", "exp_avg of an odd byte count");
  a = good;
  a.exp_avg_sq = exp_avg_sq.subspan(1, 2 * n - 2);
  expect_invalid(a, "exp_avg_sq", "exp_avg_sq misaligned");
  a = good;
  a.master = master.subspan(2, 4 * n - 4);
  expect_invalid(a, "master", "master misaligned");
  a = good;
  a.copy_out = typed(copy.span(), ElemType::kF32);
  expect_invalid(a, "copy_out", "copy_out fp32");
  a = good;
  a.copy_out = typed(copy.subspan(0, 2 * n - 2), ElemType::kBf16);
  expect_invalid(a, "copy_out 63", "copy_out one element short");
  a = good;
  a.exp_avg_sq = exp_avg.span();
  expect_invalid(a, "overlap", "exp_avg and exp_avg_sq the same");
  a = good;
  a.copy_out = typed(master.subspan(0, 2 * n), ElemType::kBf16);
  expect_invalid(a, "overlap", "copy_out over master");
  a = good;
  a.index_base = -1;
  expect_invalid(a, "index_base", "negative index_base");
  a = good;
  a.index_base = std::numeric_limits<std::int64_t>::max() - n + 1;
  expect_invalid(a, "index_base", "index_base + n past INT64_MAX");
  a = good;
  a.rounding = static_cast<nx::Bf16Rounding>(2);
  expect_invalid(a, "rounding", "unknown rounding");
  a = good;
  a.constants.beta2 = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(a, "beta2", "a constant that is not finite");
  // Nothing ran.
  auto after_master = download(master.span());
  EXPECT_EQ(std::memcmp(after_master.data(), initial.master.data(), after_master.size()), 0);
  auto after_m = download(exp_avg.span());
  EXPECT_EQ(std::memcmp(after_m.data(), initial.exp_avg.data(), after_m.size()), 0);
  auto after_v = download(exp_avg_sq.span());
  EXPECT_EQ(std::memcmp(after_v.data(), initial.exp_avg_sq.data(), after_v.size()), 0);
  // Zero elements: nothing to do, and not an error.
  a = good;
  a.master = master.subspan(0, 0);
  a.exp_avg = exp_avg.subspan(0, 0);
  a.exp_avg_sq = exp_avg_sq.subspan(0, 0);
  a.grad = typed(grad.subspan(0, 0), ElemType::kF32);
  EXPECT_TRUE(device_->adam_step_bf16_moments(stream_, a).ok());
  // The last indices there are: index_base + n = INT64_MAX runs, and matches numerics.
  Bf16MomentsStep top;
  top.constants = good.constants;
  top.rounding = nx::Bf16Rounding::kStochastic;
  top.seed = 5;
  top.step = 11;
  top.index_base = std::numeric_limits<std::int64_t>::max() - n;
  const StoredGrad g = stored_grad(finite_values(n, 81), ElemType::kF32);
  Bf16MomentsState want = initial;
  oracle_bf16_moments(top, g, ElemType::kBf16, want);
  Bf16MomentsState got = initial;
  step_bf16_moments_on_device(top, g, ElemType::kF32, got);
  expect_same_state(want, got, "index_base + n = INT64_MAX");
}

// --- Adam with 8-bit blockwise moments -------------------------------------------
// The device's step is numerics::adam_step_int8_block applied per block of 256
// on the host, bit for bit (codes exactly, master and scales as floats, NaN
// matching NaN).

// A state in use: random codes, scales over a wide range (fp32 subnormals
// among them), some blocks with zero scales.
Int8State int8_state(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  Int8State s;
  s.master = finite_values(n, seed);
  s.exp_avg.resize(static_cast<std::size_t>(n));
  s.exp_avg_sq.resize(static_cast<std::size_t>(n));
  for (std::uint8_t& c : s.exp_avg) c = static_cast<std::uint8_t>(rng());
  for (std::uint8_t& c : s.exp_avg_sq) c = static_cast<std::uint8_t>(rng());
  const auto blocks = static_cast<std::size_t>(quant_blocks(n));
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> m_expo(-40, 0);
  std::uniform_int_distribution<int> v_expo(-80, 0);
  for (std::size_t b = 0; b < blocks; ++b) {
    float ms = std::ldexp(mant(rng), m_expo(rng));
    float vs = std::ldexp(mant(rng), v_expo(rng));
    if (b % 13 == 7) {
      ms = from_bits((static_cast<std::uint32_t>(rng()) & 0x007fffffu) | 1u);  // subnormal
      vs = from_bits((static_cast<std::uint32_t>(rng()) & 0x007fffffu) | 1u);
    }
    if (b % 17 == 3) ms = vs = 0.0f;
    s.exp_avg_scale.push_back(ms);
    s.exp_avg_sq_scale.push_back(vs);
  }
  return s;
}

// The zero state: zero codes and scales are zero moments.
Int8State int8_zero_state(std::int64_t n) {
  const auto blocks = static_cast<std::size_t>(quant_blocks(n));
  return {finite_values(n, 5), std::vector<std::uint8_t>(static_cast<std::size_t>(n), 0),
          std::vector<std::uint8_t>(static_cast<std::size_t>(n), 0), std::vector<float>(blocks, 0.0f),
          std::vector<float>(blocks, 0.0f)};
}

// `count` steps from step number `first`, AdamW or Adam+L2, each with its own
// finite gradient in `type`.
std::vector<Int8Step> int8_steps(std::int64_t n, ElemType type, bool adamw, int count, std::int64_t first,
                                 std::uint32_t seed) {
  std::vector<Int8Step> steps;
  for (int k = 0; k < count; ++k) {
    nx::AdamHyperparams h;
    h.lr = 1e-3;
    h.weight_decay = 0.01;
    h.adamw_mode = adamw;
    steps.push_back({nx::make_adam_constants(h, first + k, 1.0 / 1024.0),
                     stored_grad(finite_values(n, seed + static_cast<std::uint32_t>(k)), type)});
  }
  return steps;
}

std::string copy_name(ElemType c) { return c == ElemType::kF32 ? "none" : std::string(elem_type_name(c)); }

void expect_same_copy(const std::vector<std::uint16_t>& want, const std::vector<std::uint16_t>& got,
                      ElemType type, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(same_16_bits(want[i], got[i], type, static_cast<std::int64_t>(i))) << what << ": copy_out";
  }
}

TEST_P(DeviceTest, AdamStepInt8BlockwiseMatchesNumerics) {
  struct Case {
    std::int64_t n;
    ElemType grad;
    ElemType copy;  // kF32: no copy_out
    bool adamw;
    int steps;
    bool from_zero;  // start from the zero state (else a state in use)
  };
  std::vector<Case> cases;
  // Every gradient type and copy_out at a length whose last block is short.
  int k = 0;
  for (ElemType g : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
    for (ElemType c : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
      cases.push_back({100003, g, c, k % 2 == 0, 2, k % 3 == 0});
      ++k;
    }
  }
  // Tails around one block, and a length past what one CUDA grid covers
  // (8192 blocks of 256 threads), so its grid-stride loop goes round.
  cases.push_back({1, ElemType::kF32, ElemType::kBf16, true, 3, false});
  cases.push_back({1, ElemType::kF16, ElemType::kF32, false, 3, false});
  cases.push_back({255, ElemType::kBf16, ElemType::kF16, true, 3, true});
  cases.push_back({256, ElemType::kF32, ElemType::kF32, true, 3, true});
  cases.push_back({257, ElemType::kF16, ElemType::kBf16, false, 3, false});
  cases.push_back({8192 * 256 + 4099, ElemType::kBf16, ElemType::kBf16, true, 2, false});
  for (const Case& c : cases) {
    const std::string what = str_cat("n ", c.n, " grad ", elem_type_name(c.grad), " copy ", copy_name(c.copy),
                                     c.adamw ? " adamw" : " adam", c.from_zero ? " from zero" : "");
    const Int8State initial = c.from_zero ? int8_zero_state(c.n) : int8_state(c.n, 31);
    const std::vector<Int8Step> steps = int8_steps(c.n, c.grad, c.adamw, c.steps, c.from_zero ? 1 : 7, 41);
    Int8State want = initial;
    std::vector<std::uint16_t> want_copy;
    for (const Int8Step& step : steps) want_copy = oracle_int8(step, c.copy, want);
    Int8State got = initial;
    const std::vector<std::uint16_t> got_copy = step_int8_on_device(steps, c.copy, got);
    expect_same_int8_state(want, got, what);
    if (c.copy != ElemType::kF32) expect_same_copy(want_copy, got_copy, c.copy, what);
    if (c.n < 255) continue;
    // The steps did something the comparison could see: most codes changed and
    // are not zero, every block's scales are positive and finite.
    std::int64_t nonzero_m = 0, nonzero_v = 0, changed = 0;
    for (std::size_t i = 0; i < want.exp_avg.size(); ++i) {
      nonzero_m += want.exp_avg[i] != 0;
      nonzero_v += want.exp_avg_sq[i] != 0;
      changed += want.exp_avg[i] != initial.exp_avg[i] || want.exp_avg_sq[i] != initial.exp_avg_sq[i];
    }
    EXPECT_GT(nonzero_m, c.n / 2) << what;
    EXPECT_GT(nonzero_v, c.n / 3) << what;
    EXPECT_GT(changed, c.n / 2) << what;
    for (std::size_t b = 0; b < want.exp_avg_scale.size(); ++b) {
      ASSERT_TRUE(std::isfinite(want.exp_avg_scale[b]) && want.exp_avg_scale[b] > 0.0f)
          << what << " block " << b;
      ASSERT_TRUE(std::isfinite(want.exp_avg_sq_scale[b]) && want.exp_avg_sq_scale[b] > 0.0f)
          << what << " block " << b;
    }
  }
}

TEST_P(DeviceTest, AdamStepInt8BlockwiseInPiecesEqualsOneCall) {
  const std::int64_t n = 70001;  // 274 blocks, the last of 113 elements
  const Int8State initial = int8_state(n, 51);
  const std::vector<Int8Step> steps = int8_steps(n, ElemType::kBf16, true, 2, 3, 61);
  Int8State want = initial;
  std::vector<std::uint16_t> want_copy;
  for (const Int8Step& step : steps) want_copy = oracle_int8(step, ElemType::kF16, want);
  Int8State whole = initial;
  const auto whole_copy = step_int8_on_device(steps, ElemType::kF16, whole);
  expect_same_int8_state(want, whole, "in one call");
  expect_same_copy(want_copy, whole_copy, ElemType::kF16, "in one call");
  // Split at block boundaries: one block off the front; pieces of one, many
  // and the short last block alone.
  const std::vector<std::vector<std::int64_t>> splits = {{256}, {256, 512, 65536, 69888}};
  for (const auto& split : splits) {
    Int8State pieces = initial;
    const auto pieces_copy = step_int8_on_device(steps, ElemType::kF16, pieces, split);
    const std::string what = str_cat("in ", split.size() + 1, " calls");
    expect_same_int8_state(whole, pieces, what);
    expect_same_copy(whole_copy, pieces_copy, ElemType::kF16, what);
  }
}

// Block by block: zeros, inf and NaN gradients (their block's scales become
// NaN and stay NaN), a gradient whose square overflows, subnormal gradients
// and scales, blocks poisoned before the call, a short last block with a NaN;
// in every gradient type, two steps in a row.
TEST_P(DeviceTest, AdamStepInt8BlockwiseSpecialValuesMatchNumerics) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr std::int64_t kB = nx::kQuantBlockElems;
  enum Block : std::int64_t {
    kZero,
    kPosInf,
    kNan,
    kNegInf,
    kSquareOverflows,
    kSubnormalGrads,
    kSubnormalScales,
    kNanScale,
    kInfScale,
    kOrdinary,
    kShortWithNan,
    kBlocks
  };
  const std::int64_t n = (kBlocks - 1) * kB + 77;
  Int8State initial = int8_zero_state(n);
  std::vector<float> g(static_cast<std::size_t>(n), 0.0f);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  auto at = [](std::int64_t block, std::int64_t i) { return static_cast<std::size_t>(block * kB + i); };
  for (std::int64_t i = 0; i < kB; ++i) {
    initial.master[at(kZero, i)] = 0.0f;  // +0 master and moments, zero gradient
    for (Block b : {kPosInf, kNan, kNegInf, kSquareOverflows, kOrdinary}) g[at(b, i)] = unit(rng);
    g[at(kSubnormalGrads, i)] = from_bits(static_cast<std::uint32_t>(rng()) & 0x807fffffu);
    g[at(kSubnormalScales, i)] = unit(rng) * 1e-30f;
    g[at(kNanScale, i)] = unit(rng);
    g[at(kInfScale, i)] = unit(rng);
    for (Block b : {kSubnormalScales, kNanScale, kInfScale, kOrdinary}) {
      initial.exp_avg[at(b, i)] = static_cast<std::uint8_t>(rng());
      initial.exp_avg_sq[at(b, i)] = static_cast<std::uint8_t>(rng());
    }
  }
  for (std::int64_t i = 0; i < 77; ++i) g[at(kShortWithNan, i)] = unit(rng);
  g[at(kPosInf, 17)] = inf;
  g[at(kNan, 200)] = nan;
  g[at(kNegInf, 0)] = -inf;
  g[at(kSquareOverflows, 255)] = 1e30f;  // fp16: inf; bf16: g * g overflows
  g[at(kShortWithNan, 76)] = nan;
  initial.exp_avg_scale[kSubnormalScales] = from_bits(0x00000003u);
  initial.exp_avg_sq_scale[kSubnormalScales] = from_bits(0x00400000u);
  initial.exp_avg_scale[kNanScale] = nan;
  initial.exp_avg_sq_scale[kNanScale] = 0.5f;
  initial.exp_avg_scale[kInfScale] = 0.25f;
  initial.exp_avg_sq_scale[kInfScale] = inf;
  initial.exp_avg_scale[kOrdinary] = 0.125f;
  initial.exp_avg_sq_scale[kOrdinary] = 0.0625f;
  // A non-finite gradient poisons both moments of its block; a stored NaN or
  // inf scale, its own moment.
  const Block poisoned[] = {kPosInf, kNan, kNegInf, kShortWithNan};
  int k = 0;
  for (ElemType gt : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
    const bool adamw = k % 2 == 0;
    const ElemType ct = k % 2 == 0 ? ElemType::kBf16 : ElemType::kF16;
    ++k;
    const std::string what = str_cat("grad ", elem_type_name(gt), adamw ? " adamw" : " adam");
    std::vector<Int8Step> steps;
    for (std::int64_t step = 1; step <= 2; ++step) {
      steps.push_back(
          {nx::make_adam_constants(
               {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.05, .adamw_mode = adamw}, step,
               1.0),
           stored_grad(g, gt)});
    }
    Int8State want = initial;
    std::vector<std::uint16_t> want_copy;
    for (const Int8Step& step : steps) want_copy = oracle_int8(step, ct, want);
    Int8State got = initial;
    const auto got_copy = step_int8_on_device(steps, ct, got);
    expect_same_int8_state(want, got, what);
    expect_same_copy(want_copy, got_copy, ct, what);
    // What the contract says of these blocks, beyond agreeing with it.
    for (Block b : poisoned) {
      EXPECT_TRUE(std::isnan(got.exp_avg_scale[b]) && std::isnan(got.exp_avg_sq_scale[b]))
          << what << " block " << b;
    }
    EXPECT_TRUE(std::isnan(got.exp_avg_scale[kNanScale])) << what;
    EXPECT_TRUE(std::isnan(got.exp_avg_sq_scale[kInfScale])) << what;
    EXPECT_TRUE(std::isnan(got.exp_avg_sq_scale[kSquareOverflows])) << what;
    EXPECT_EQ(std::isnan(got.exp_avg_scale[kSquareOverflows]), gt == ElemType::kF16)
        << what;  // fp16 1e30 is inf
    for (std::int64_t i = 0; i < kB; ++i) {
      ASSERT_EQ(bits(got.master[at(kZero, i)]), 0u) << what << " element " << i;
      ASSERT_EQ(got.exp_avg[at(kZero, i)] | got.exp_avg_sq[at(kZero, i)], 0) << what << " element " << i;
    }
    EXPECT_EQ(bits(got.exp_avg_scale[kZero]) | bits(got.exp_avg_sq_scale[kZero]), 0u) << what;
    for (Block b : {kSubnormalScales, kOrdinary}) {
      EXPECT_TRUE(std::isfinite(got.exp_avg_scale[b]) && got.exp_avg_scale[b] > 0.0f)
          << what << " block " << b;
    }
    if (gt == ElemType::kF32) {
      // Subnormal gradients give subnormal moments, and so subnormal scales.
      EXPECT_EQ(std::fpclassify(got.exp_avg_scale[kSubnormalGrads]), FP_SUBNORMAL) << what;
    }
  }
}

TEST_P(DeviceTest, AdamStepInt8BlockwiseBadArgumentsAreInvalid) {
  const std::int64_t n = 300;  // two blocks, the second short
  const Int8State initial = int8_state(n, 71);
  DeviceBuffer master = upload(as_bytes(initial.master));
  DeviceBuffer exp_avg = upload(as_bytes(initial.exp_avg));
  DeviceBuffer exp_avg_sq = upload(as_bytes(initial.exp_avg_sq));
  DeviceBuffer exp_avg_scale = upload(as_bytes(initial.exp_avg_scale));
  DeviceBuffer exp_avg_sq_scale = upload(as_bytes(initial.exp_avg_sq_scale));
  DeviceBuffer grad = alloc(4 * n);
  ASSERT_TRUE(device_->fill(stream_, typed(grad.span(), ElemType::kF32), 0.5f).ok());
  DeviceBuffer copy = alloc(4 * n);
  DeviceBuffer spare = alloc(4 * n + 16);
  AdamStepInt8Args good;
  good.constants = nx::make_adam_constants({}, 1, 1.0);
  good.master = master.span();
  good.exp_avg = exp_avg.span();
  good.exp_avg_sq = exp_avg_sq.span();
  good.exp_avg_scale = exp_avg_scale.span();
  good.exp_avg_sq_scale = exp_avg_sq_scale.span();
  good.grad = typed(grad.span(), ElemType::kF32);
  // kInvalidArgument with a message that names `field`.
  auto expect_invalid = [&](const AdamStepInt8Args& args, std::string_view field, const char* why) {
    const core::Status s = device_->adam_step_int8_blockwise(stream_, args);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << why << ": " << s;
    EXPECT_NE(s.message().find(field), std::string_view::npos) << why << ": " << s;
  };
  AdamStepInt8Args a = good;
  a.exp_avg = exp_avg.subspan(0, n - 1);
  expect_invalid(a, "exp_avg 299", "exp_avg one element short");
  a = good;
  a.exp_avg_sq = spare.subspan(0, n + 1);
  expect_invalid(a, "exp_avg_sq 301", "exp_avg_sq one element long");
  a = good;
  a.exp_avg_sq = grad.span();  // 4 bytes per element: sized as fp32
  expect_invalid(a, "exp_avg_sq 1200", "exp_avg_sq sized as fp32");
  a = good;
  a.grad = typed(grad.subspan(0, 2 * n), ElemType::kF32);
  expect_invalid(a, "grad 150", "grad half as long");
  a = good;
  a.master = master.subspan(0, 4 * 256);
  expect_invalid(a, "master 256", "master one block");
  a = good;
  a.exp_avg_scale = exp_avg_scale.subspan(0, 4);
  expect_invalid(a, "exp_avg_scale has 1", "one exp_avg_scale short");
  a = good;
  a.exp_avg_sq_scale = spare.subspan(0, 12);
  expect_invalid(a, "exp_avg_sq_scale has 3", "one exp_avg_sq_scale too many");
  a = good;
  a.exp_avg_sq_scale = spare.subspan(0, 0);
  expect_invalid(a, "exp_avg_sq_scale has 0", "no exp_avg_sq_scale");
  a = good;
  a.exp_avg_scale = spare.subspan(2, 8);
  expect_invalid(a, "exp_avg_scale", "exp_avg_scale misaligned");
  a = good;
  a.exp_avg_sq_scale = spare.subspan(0, 6);
  expect_invalid(a, "exp_avg_sq_scale", "exp_avg_sq_scale not whole fp32s");
  a = good;
  a.master = spare.subspan(2, 4 * n);
  expect_invalid(a, "master", "master misaligned");
  a = good;
  a.copy_out = typed(copy.span(), ElemType::kF32);
  expect_invalid(a, "copy_out", "copy_out fp32");
  a = good;
  a.copy_out = typed(copy.subspan(0, 2 * n - 2), ElemType::kBf16);
  expect_invalid(a, "copy_out 299", "copy_out one element short");
  a = good;
  a.exp_avg_sq = exp_avg.span();
  expect_invalid(a, "overlap", "exp_avg and exp_avg_sq the same");
  a = good;
  a.exp_avg_scale = master.subspan(0, 8);
  expect_invalid(a, "overlap", "exp_avg_scale inside master");
  a = good;
  a.exp_avg_sq_scale = exp_avg_scale.span();
  expect_invalid(a, "overlap", "the two scales the same");
  a = good;
  a.copy_out = typed(master.subspan(0, 2 * n), ElemType::kBf16);
  expect_invalid(a, "overlap", "copy_out over master");
  a = good;
  a.copy_out = typed(copy.subspan(0, 2 * n), ElemType::kF16);
  a.exp_avg_sq_scale = copy.subspan(2 * n - 4, 8);
  expect_invalid(a, "overlap", "exp_avg_sq_scale inside copy_out");
  a = good;
  a.constants.eps = std::numeric_limits<float>::infinity();
  expect_invalid(a, "eps", "a constant that is not finite");
  // Nothing ran.
  auto same_as = [&](const DeviceBuffer& b, const auto& v) {
    const auto after = download(b.span());
    return after.size() == v.size() * sizeof(v[0]) && std::memcmp(after.data(), v.data(), after.size()) == 0;
  };
  EXPECT_TRUE(same_as(master, initial.master));
  EXPECT_TRUE(same_as(exp_avg, initial.exp_avg));
  EXPECT_TRUE(same_as(exp_avg_sq, initial.exp_avg_sq));
  EXPECT_TRUE(same_as(exp_avg_scale, initial.exp_avg_scale));
  EXPECT_TRUE(same_as(exp_avg_sq_scale, initial.exp_avg_sq_scale));
  // Zero elements and zero scales: nothing to do, and not an error.
  a = good;
  a.master = master.subspan(0, 0);
  a.exp_avg = exp_avg.subspan(0, 0);
  a.exp_avg_sq = exp_avg_sq.subspan(0, 0);
  a.exp_avg_scale = exp_avg_scale.subspan(0, 0);
  a.exp_avg_sq_scale = exp_avg_sq_scale.subspan(0, 0);
  a.grad = typed(grad.subspan(0, 0), ElemType::kF32);
  EXPECT_TRUE(device_->adam_step_int8_blockwise(stream_, a).ok());
  // Codes are bytes: at odd offsets they run, and match numerics.
  DeviceBuffer m_odd = alloc(n + 1);
  DeviceBuffer v_odd = alloc(n + 3);
  ASSERT_TRUE(device_->copy_h2d(stream_, m_odd.subspan(1, n), as_bytes(initial.exp_avg)).ok());
  ASSERT_TRUE(device_->copy_h2d(stream_, v_odd.subspan(3, n), as_bytes(initial.exp_avg_sq)).ok());
  a = good;
  a.exp_avg = m_odd.subspan(1, n);
  a.exp_avg_sq = v_odd.subspan(3, n);
  ASSERT_TRUE(device_->adam_step_int8_blockwise(stream_, a).ok());
  Int8State want = initial;
  oracle_int8({good.constants, stored_grad(std::vector<float>(n, 0.5f), ElemType::kF32)}, ElemType::kBf16,
              want);
  Int8State got = initial;
  auto fetch = [&](DeviceSpan from, auto& into) {
    const auto bytes = download(from);
    std::memcpy(into.data(), bytes.data(), bytes.size());
  };
  fetch(master.span(), got.master);
  fetch(m_odd.subspan(1, n), got.exp_avg);
  fetch(v_odd.subspan(3, n), got.exp_avg_sq);
  fetch(exp_avg_scale.span(), got.exp_avg_scale);
  fetch(exp_avg_sq_scale.span(), got.exp_avg_sq_scale);
  expect_same_int8_state(want, got, "codes at odd offsets");
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
