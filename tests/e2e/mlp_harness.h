// The e2e tests' model and framework: a two-layer MLP on a teacher-student
// regression task, computed in fp32 on the host the way a CPU framework
// drives the engine (fetch, copy the device view out, forward, backward,
// gradients into the engine's buffer, grads_ready).
#pragma once

#include <algorithm>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "core/numerics.h"
#include "engine/engine.h"
#include "tests/e2e/mlp_kernels.h"

namespace strata::engine::e2e {

namespace nx = core::numerics;

inline constexpr int kSteps = 20;

// --- The device the engine runs on -------------------------------------------
// The host device, unless the environment says STRATA_TEST_DEVICE=cuda
// (scripts/gpu-test.sh on a GPU machine): then every e2e case puts its engine
// on the CUDA device and keeps every assertion, bit-identity included (the
// numerics contract, DESIGN.md section 6: the same bits on either device), and
// skips, saying why, where no CUDA device is usable. Any other value fails
// every case, naming the variable.

// The device budget an engine on CUDA gets when its config leaves it derived:
// the CUDA device would otherwise reserve all free memory but 1 GiB at
// creation, and the suites' processes share one GPU. The MLP needs a few MiB.
inline constexpr std::uint64_t kCudaTestDeviceBytes = 1ull << 30;

// Whether an engine can run on the CUDA device here, probed once per process
// by creating one. Not usable and `absent`: a build without CUDA
// (kUnimplemented) or no driver or device (kUnavailable), a reason to skip.
// Not usable and not absent: a CUDA device that fails, an error.
struct CudaProbe {
  bool usable = false;
  bool absent = false;
  std::string status;  // Engine::create's error when not usable
};
inline const CudaProbe& probe_cuda() {
  static const CudaProbe probe = [] {
    CudaProbe p;
    Config c;
    c.strata.device = DeviceKind::kCuda;
    c.strata.budgets.device_bytes = kCudaTestDeviceBytes;
    auto e = Engine::create(c);
    p.usable = e.ok();
    if (!p.usable) {
      p.absent = e.status().code() == core::StatusCode::kUnimplemented ||
                 e.status().code() == core::StatusCode::kUnavailable;
      p.status = e.status().to_string();
    }
    return p;
  }();
  return probe;
}

// Why a case that needs the CUDA device cannot run: `skip` (no usable CUDA
// device) or `error` (it exists but fails); both empty when it can.
struct DeviceVerdict {
  std::string skip;
  std::string error;
};
inline DeviceVerdict cuda_verdict(const std::string& who) {
  const CudaProbe& p = probe_cuda();
  DeviceVerdict v;
  if (p.usable) return v;
  const char* what = p.absent ? "no usable CUDA device: " : "cannot create an engine on the CUDA device: ";
  (p.absent ? v.skip : v.error) = who + what + p.status;
  return v;
}

// The device the cases run on (STRATA_TEST_DEVICE), and whether they can.
struct TestDevice {
  DeviceKind kind = DeviceKind::kHost;
  DeviceVerdict verdict;
};
inline TestDevice test_device() {
  TestDevice d;
  const char* env = std::getenv("STRATA_TEST_DEVICE");
  const std::string name = env != nullptr ? env : "";
  if (name.empty() || name == "host") return d;
  if (name != "cuda") {
    d.verdict.error = "STRATA_TEST_DEVICE is \"" + name + "\"; it takes host or cuda (unset: host)";
    return d;
  }
  d.kind = DeviceKind::kCuda;
  d.verdict = cuda_verdict("STRATA_TEST_DEVICE=cuda: ");
  return d;
}

// Puts `c` on `kind`: on CUDA with the bounded device budget when `c` leaves
// it derived.
inline void put_on_device(Config& c, DeviceKind kind) {
  c.strata.device = kind;
  if (kind == DeviceKind::kCuda && c.strata.budgets.device_bytes == 0) {
    c.strata.budgets.device_bytes = kCudaTestDeviceBytes;
  }
}

// Work that keeps `stream` busy, so that what is queued after it runs late:
// `flops` of declared compute on the host device (its timing model; the tests
// that use it set strata.host_device.tflops 1, so 2e10 is 20 ms). The CUDA
// device has no declared compute: there, one copy of 64 MiB within device
// memory per 5e7 FLOPs (400 for 2e10, about 20 ms on an H100), between the
// two buffers of `scratch` (allocated on first use; they must outlive the
// work).
struct BusyScratch {
  gpu::DeviceBuffer a, b;
};
inline core::Status queue_busy_work(gpu::Device& dev, gpu::Stream& stream, double flops, BusyScratch& scratch,
                                    std::string_view what) {
  if (dev.kind() != gpu::DeviceKind::kCuda) return dev.declare_compute(stream, flops, what);
  constexpr std::uint64_t kCopyBytes = 64ull << 20;
  for (gpu::DeviceBuffer* b : {&scratch.a, &scratch.b}) {
    if (b->empty()) {
      STRATA_ASSIGN_OR_RETURN(*b, dev.allocate(kCopyBytes, "busy work"));
    }
  }
  const auto copies = static_cast<int>(std::ceil(flops / 5e7));
  for (int i = 0; i < copies; ++i) {
    STRATA_RETURN_IF_ERROR(i % 2 == 0 ? dev.copy_d2d(stream, scratch.b.span(), scratch.a.span())
                                      : dev.copy_d2d(stream, scratch.a.span(), scratch.b.span()));
  }
  return core::Status();
}

struct Tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string group;
  float scale;
};
inline const std::vector<Tensor> kTensors = {
    {"l1.w", {kHidden, kIn}, "l1", 1.0f / 16.0f},
    {"l1.b", {kHidden}, "l1", 0.0f},
    {"l2.w", {kOut, kHidden}, "l2", 1.0f / 22.0f},
    {"l2.b", {kOut}, "l2", 0.0f},
};

// Deterministic initial values from the tensor's name (FNV-1a seeds splitmix64).
inline void init_values(const Tensor& t, std::span<float> out) {
  std::uint64_t seed = 1469598103934665603ull;
  for (char ch : t.name) seed = (seed ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  Rng r{seed};
  for (float& v : out) v = t.scale * r.uniform();
}

// The framework side: host copies of the weights, forward and backward in fp32.
struct Framework {
  std::map<std::string, std::vector<float>> w;  // current compute weights, fp32
  std::vector<float> x, y, h, pre, out;         // one batch and its activations
  int cb = 2;
  Precision precision = Precision::kBf16;

  // Takes the engine's compute dtype.
  void bind(const Engine& e) {
    cb = e.layout().compute_bytes;
    precision = e.config().precision;
  }

  void batch(int step) {
    x.resize(kBatch * kIn);
    y.resize(kBatch * kOut);
    mlp_batch(static_cast<std::uint64_t>(step) * 7919 + 1, x.data(), y.data());
  }
  // As a GPU framework: fetch passes the framework's stream (the copy is
  // queued, the stream waits for it), and the reads below are queued on it.
  // `keep`: the group stays fetched (its compute copies held) until the
  // caller releases it, as a backward holds them while its gradients arrive.
  void load(Engine& e, const std::string& group, bool keep = false) {
    auto span = e.fetch(group, fetch_on_stream ? &stream(e) : nullptr);
    ASSERT_TRUE(span.ok()) << span.status();
    const std::span<std::byte> host = staging(span->size_bytes());
    ASSERT_TRUE(e.device().copy_d2h(stream(e), host, *span).ok());
    ASSERT_TRUE(e.device().synchronize(stream(e)).ok());
    const GroupPlace* g = e.layout().find_group(group);
    for (std::size_t pi : g->params) {
      const ParamDesc& p = e.layout().params[pi];
      std::vector<float>& dst = w[p.name];
      dst.resize(static_cast<std::size_t>(p.numel()));
      copies_to_fp32(host.data() + e.layout().places[pi].compute_offset * cb, dst.size(), cb,
                     precision == Precision::kFp16, dst.data());
    }
    if (!keep) {
      ASSERT_TRUE(e.release(group).ok());
    }
  }
  double forward() {
    pre.resize(kBatch * kHidden);  // all written by mlp_forward
    h.resize(kBatch * kHidden);
    out.resize(kBatch * kOut);
    mlp_forward(w["l1.w"].data(), w["l1.b"].data(), w["l2.w"].data(), w["l2.b"].data(), x.data(), pre.data(),
                h.data(), out.data());
    double loss = 0.0;
    for (int k = 0; k < kBatch * kOut; ++k) loss += 0.5 * double(out[k] - y[k]) * double(out[k] - y[k]);
    return loss / kBatch;
  }
  // Gradients of loss * scale, per parameter: the framework's buffers, which
  // the next backward overwrites (reused: under the sanitizers a fresh
  // buffer per call was most of the e2e suites' time).
  std::map<std::string, std::vector<float>>& backward(float scale) {
    if (grads_.empty()) {
      grads_["l1.w"].resize(kHidden * kIn);
      grads_["l1.b"].resize(kHidden);
      grads_["l2.w"].resize(kOut * kHidden);
      grads_["l2.b"].resize(kOut);
      dh_.resize(kBatch * kHidden);
    }
    mlp_backward(scale, w["l2.w"].data(), x.data(), pre.data(), h.data(), out.data(), y.data(), dh_.data(),
                 grads_["l1.w"].data(), grads_["l1.b"].data(), grads_["l2.w"].data(), grads_["l2.b"].data());
    return grads_;
  }

  // The framework's word that `absent`'s parameters of `group` got no
  // gradient in this micro-batch: their gradients in `g` zeroed and said so
  // (Engine::no_grads, when there are any). Returns their names.
  template <class Names>
  std::vector<std::string_view> drop_grads(Engine& e, const std::string& group,
                                           std::map<std::string, std::vector<float>>& g, const Names& absent) {
    std::vector<std::string_view> names;
    for (const std::string& name : absent) {
      if (!name.starts_with(group + ".")) continue;
      std::fill(g.at(name).begin(), g.at(name).end(), 0.0f);
      names.push_back(name);
    }
    if (!names.empty()) {
      const core::Status said = e.no_grads(group, names);
      EXPECT_TRUE(said.ok()) << said;
    }
    return names;
  }
  void give_grads(Engine& e, const std::string& group, const std::map<std::string, std::vector<float>>& g) {
    auto span = e.grad_buffer(group);
    ASSERT_TRUE(span.ok()) << span.status();
    const std::span<std::byte> host = staging(span->size_bytes());
    zero_bytes(host.data(), host.size());  // the padding between parameters
    const GroupPlace* gp = e.layout().find_group(group);
    ASSERT_EQ(span->size_bytes(), static_cast<std::uint64_t>(gp->gradient_elems()) * static_cast<std::uint64_t>(cb));
    for (std::size_t pi : gp->params) {
      const ParamDesc& p = e.layout().params[pi];
      const ParamPlace& pl = e.layout().places[pi];
      if (pl.trainable_offset < 0) continue;  // frozen: no slot (the buffer begins at the first trainable one)
      const auto& src = g.at(p.name);
      fp32_to_copies(src.data(), src.size(), cb, precision == Precision::kFp16,
                     host.data() + (pl.compute_offset - gp->trainable_compute_begin) * cb);
    }
    if (async_grads_flops > 0) {
      // As a GPU framework: the backward's work and the gradient writes are
      // queued on the framework's stream, and grads_ready gets that stream.
      // The writes come from pinned memory, so that they are queued too (CUDA
      // copies pageable memory only after the stream's earlier work).
      auto pinned = e.device().allocate_pinned(host.size(), "framework gradients");
      ASSERT_TRUE(pinned.ok()) << pinned.status();
      std::memcpy(pinned->data(), host.data(), host.size());
      ASSERT_TRUE(queue_busy_work(e.device(), stream(e), async_grads_flops, busy, "backward").ok());
      ASSERT_TRUE(e.device().copy_h2d(stream(e), *span, pinned->bytes()).ok());
      ASSERT_TRUE(e.grads_ready(group, &stream(e)).ok());
      in_flight.push_back(std::move(pinned).value());  // read by the queued copy
      return;
    }
    ASSERT_TRUE(e.device().copy_h2d(stream(e), *span, host).ok());
    ASSERT_TRUE(e.device().synchronize(stream(e)).ok());
    ASSERT_TRUE(e.grads_ready(group).ok());
  }
  // > 0: give_grads does not wait for its writes (see there), after this much
  // declared compute on the framework's stream.
  double async_grads_flops = 0.0;
  // load's fetch takes the framework's stream (false: the blocking fetch).
  bool fetch_on_stream = true;
  BusyScratch busy;  // of queue_busy_work on the CUDA device
  std::vector<gpu::PinnedBuffer> in_flight;
  gpu::Stream& stream(Engine& e) {
    if (s.empty()) s = std::move(e.device().create_stream("framework")).value();
    return s;
  }
  gpu::Stream s;

 private:
  // The first n bytes of a host buffer kept between calls (load, give_grads).
  std::span<std::byte> staging(std::size_t n) {
    if (host_.size() < n) host_.resize(n);
    return std::span<std::byte>(host_).first(n);
  }
  std::map<std::string, std::vector<float>> grads_;  // backward's
  std::vector<float> dh_;
  std::vector<std::byte> host_;
};


// An engine with the MLP's parameters registered (biases in a no-decay
// group) and finalized; null (with a test failure) on error.
// `ranks`: the engine is one of several data-parallel ranks (Engine::create).
// `frozen`: the tensors registered frozen (the others are trained).
// `weights_dir`: the frozen parameters' values from the safetensors files
// there (init_from_safetensors), not from init_values.
// The MLP's parameters registered, not finalized. `init_calls` (may be
// null) counts the init callbacks' calls, by parameter name.
inline std::unique_ptr<Engine> register_mlp(const Config& c, const partition::CommunicatorOptions& ranks = {},
                                            const std::vector<std::string>& frozen = {},
                                            const std::string& weights_dir = "",
                                            std::map<std::string, int>* init_calls = nullptr) {
  auto created = Engine::create(c, ranks);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return nullptr;
  std::unique_ptr<Engine> e = std::move(created).value();
  auto no_decay = e->add_optimizer_group({"no_decay", 0.0, 1.0});
  EXPECT_TRUE(no_decay.ok());
  for (const Tensor& t : kTensors) {
    const bool trains = std::find(frozen.begin(), frozen.end(), t.name) == frozen.end();
    ParamDesc d{t.name, t.shape, t.group, trains, t.name.back() == 'b' ? *no_decay : 0};
    InitFn init = [t, init_calls](std::span<float> out) {
      if (init_calls != nullptr) ++(*init_calls)[t.name];
      init_values(t, out);
      return core::Status();
    };
    if (!weights_dir.empty() && !trains) init = nullptr;  // from the files
    EXPECT_TRUE(e->register_param(d, init).ok());
  }
  if (!weights_dir.empty()) {
    EXPECT_TRUE(e->init_from_safetensors(weights_dir, "").ok());
  }
  return e;
}

inline std::unique_ptr<Engine> make_mlp_engine(const Config& c, const partition::CommunicatorOptions& ranks = {},
                                               const std::vector<std::string>& frozen = {},
                                               const std::string& weights_dir = "") {
  std::unique_ptr<Engine> e = register_mlp(c, ranks, frozen, weights_dir);
  if (e == nullptr) return nullptr;
  const core::Status s = e->finalize();
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? std::move(e) : nullptr;
}

// One micro-batch on batch `b`: forward, backward, and each group's
// gradients handed over (l2's, then l1's), no step_end. Returns the loss.
inline double forward_backward(Engine& e, Framework& f, int b) {
  f.bind(e);
  f.batch(b);
  f.load(e, "l1");
  f.load(e, "l2");
  const double l = f.forward();
  const auto& g = f.backward(static_cast<float>(e.loss_scale()));
  f.load(e, "l2");
  f.give_grads(e, "l2", g);
  f.load(e, "l1");
  f.give_grads(e, "l1", g);
  return l;
}

// One training step (one micro-batch) on batch `step`: forward, backward,
// gradients, step_end. Returns step_end's result; the loss goes to *loss.
inline core::Result<StepStats> run_step(Engine& e, Framework& f, int step, double* loss = nullptr) {
  const double l = forward_backward(e, f, step * 16);
  if (loss != nullptr) *loss = l;
  return e.step_end();
}

// run_step, expecting success; returns the loss.
inline double train_one_step(Engine& e, Framework& f, int step) {
  double loss = 0.0;
  const auto st = run_step(e, f, step, &loss);
  EXPECT_TRUE(st.ok()) << st.status();
  return loss;
}

// A test with a swap directory of its own, and the e2e tests' config: bf16,
// clipping at 1, one norm block per chunk (several chunks per group), psync,
// one cpu_adam thread, everything on the device until a test offloads it; the
// engine on test_device() (a case skips where that device is not usable).
class MlpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const DeviceVerdict v = test_device().verdict;
    if (!v.error.empty()) FAIL() << v.error;
    if (!v.skip.empty()) GTEST_SKIP() << v.skip;
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_e2e_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  Config base() const {
    Config c;
    c.train_batch_size = kBatch;
    c.train_micro_batch_size_per_gpu = kBatch;
    c.precision = Precision::kBf16;
    c.zero.stage = 3;
    c.optimizer.lr = 3e-3;
    c.optimizer.weight_decay = 0.01;
    c.gradient_clipping = 1.0;
    put_on_device(c, test_device().kind);
    c.strata.chunk_bytes = 65536 * 4;
    c.strata.io.paths = {dir_.string()};
    c.strata.io.backend = IoBackend::kPsync;
    c.strata.cpu_adam.threads = 1;
    return c;
  }

  std::filesystem::path dir_;
};

inline std::map<std::string, std::vector<float>> read_masters(Engine& e) {
  std::map<std::string, std::vector<float>> out;
  for (const Tensor& t : kTensors) {
    std::vector<float> v(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
    EXPECT_TRUE(e.read_master(t.name, v).ok());
    out[t.name] = std::move(v);
  }
  return out;
}

inline bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace strata::engine::e2e
