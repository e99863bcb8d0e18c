// step_bench: how close a training step comes to its bound (DESIGN.md
// section 1). The host device with its timing model stands in for a GPU: the
// framework's forward and backward are declared FLOPs (no real math, so the
// CPU stays free for the engine), the disk I/O and cpu_adam are real. Each
// scenario drives the public Engine API under both schedules
// (strata.overlap "exact" and "none") in interleaved repetitions, and in the
// same run measures every resource of the step in isolation: device compute,
// the host->device and device->host links, the disk, and the CPU. The bound is
// the busiest of them; ratio_to_bound = step time / bound.
// With --device cuda the engines and the isolated link copies run on the CUDA
// device instead (a GPU machine: real links; the declared FLOPs take no time
// there, and the timing model is not used).
//
//   step_bench [--scenarios LIST] [--small] [--layers L] [--layer-elems N]
//              [--reps R] [--steps S] [--balance B] [--disk-mixed] [--overlap exact|speculative|delayed]
//              [--device host|cuda] [--dir DIR]
//              [--json FILE] [--trace-dir DIR] [--list]
//
// docs/benchmarks.md ("step") describes the scenarios, the calibration that
// sizes the timing model, how each resource is measured, and every column.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "benchmarks/bench_json.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/config.h"
#include "core/aligned_buffer.h"
#include "core/clock.h"
#include "core/logging.h"
#include "core/memory_budget.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/engine.h"
#include "gpu/cuda_device.h"
#include "gpu/device.h"
#include "gpu/host_device.h"
#include "nvme/crc64.h"
#include "nvme/swap_store.h"

namespace strata::bench {
namespace {

namespace eng = strata::engine;
namespace nx = strata::core::numerics;
using core::Result;
using core::Status;
using core::str_cat;

// ---------------------------------------------------------------------------
// Resources, scenarios, options.

enum Res : int { kDevice = 0, kH2d, kD2h, kDisk, kCpu, kResCount };
constexpr std::array<const char*, kResCount> kResName = {"device", "h2d", "d2h", "disk", "cpu"};
using ResTimes = std::array<double, kResCount>;

// The fastest link rate the host device honours here: its copies are real
// memcpys (about 10 GB/s on one core), so a modeled rate must stay below
// that (docs/benchmarks.md, gpu section). Links a scenario does not target
// run at this rate.
constexpr double kLinkGbps = 6.0;
// Resources a scenario does not target are sized to at most this fraction of
// the busiest one: below a half, so that the CPU optimizer, which the exact
// schedule runs during the next forward (a third of the device's time),
// fits there (docs/benchmarks.md, "feasible").
constexpr double kOtherFraction = 0.45;
// Tokens per step of the synthetic model: forward FLOPs of a layer =
// 2 x its parameters x tokens; backward twice that.
constexpr double kTokens = 2048.0;
// Norm of the synthetic gradient (unscaled): below any clipping threshold,
// and above it on the "high" steps of a clipping scenario.
constexpr double kNormLow = 0.5;
constexpr double kNormHigh = 2.0;

enum class Placement { kNvme, kCpu };  // where the optimizer state lives
enum class GradPlan {
  kSteady,         // every step the same gradient (norm kNormLow)
  kAlternateNorm,  // even steps kNormHigh, odd steps kNormLow (clipping fires on half)
  kOverflow,       // every 3rd step has an inf in one group's gradient
};

struct Scenario {
  const char* name;
  Placement placement;
  eng::Precision precision;
  Res busiest;  // the resource the timing model is sized to make busiest
  Res second;   // and the one sized to balance-target x busiest
  double clipping;
  GradPlan grads;
  int layers;  // default layer count for full-size runs
  const char* about;
  // The overlapped schedule's strata.overlap (--overlap overrides it), and
  // the balance the calibration aims for (0: --balance).
  eng::OverlapMode overlap = eng::OverlapMode::kExact;
  double balance = 0.0;
  // strata.nonfinite: "apply" (no overflow check) in the bf16 scenarios
  // without clipping, so that nothing step_end learns can change a step and
  // "exact" updates each group during the backward (docs/config.md).
  eng::NonfinitePolicy nonfinite = eng::NonfinitePolicy::kSkip;
};

// Every scenario keeps the compute copies in pinned CPU memory
// (offload_param "cpu"), as ZeRO-Infinity does for models larger than the GPU.
const Scenario kScenarios[] = {
    {"nvme_disk", Placement::kNvme, eng::Precision::kBf16, kDisk, kDevice, 0.0, GradPlan::kSteady, 12,
     "optimizer state on nvme, updated speculatively during the backward: the disk busiest, device compute "
     "second",
     eng::OverlapMode::kSpeculative},
    {"nvme_fp16", Placement::kNvme, eng::Precision::kFp16, kDisk, kDevice, 0.0, GradPlan::kOverflow, 12,
     "as nvme_disk in fp16 with the dynamic loss scaler; every 3rd step has an inf gradient (overflow: the "
     "step is skipped and the speculative updates thrown away)",
     eng::OverlapMode::kSpeculative},
    {"cpu_cpu", Placement::kCpu, eng::Precision::kBf16, kCpu, kDevice, 0.0, GradPlan::kSteady, 12,
     "optimizer state in pinned CPU memory: the CPU busiest, device compute second (no clipping, "
     "nonfinite \"apply\": Adam on each group during the backward)",
     eng::OverlapMode::kExact, 0.0, eng::NonfinitePolicy::kApply},
    {"cpu_clip", Placement::kCpu, eng::Precision::kBf16, kCpu, kDevice, 1.0, GradPlan::kAlternateNorm, 12,
     "as cpu_cpu with gradient_clipping 1.0; the gradient norm alternates 2.0 / 0.5, so clipping fires on "
     "half the steps"},
    {"device_h2d", Placement::kCpu, eng::Precision::kBf16, kDevice, kH2d, 0.0, GradPlan::kSteady, 12,
     "optimizer on the CPU: device compute busiest, the host->device link second",
     eng::OverlapMode::kExact, 0.8, eng::NonfinitePolicy::kApply},
    {"device_clip", Placement::kCpu, eng::Precision::kBf16, kDevice, kH2d, 1.0, GradPlan::kAlternateNorm, 12,
     "as device_h2d with gradient_clipping 1.0; the gradient norm alternates 2.0 / 0.5, so clipping fires "
     "on half the steps",
     eng::OverlapMode::kExact, 0.8},
    {"h2d_device", Placement::kCpu, eng::Precision::kBf16, kH2d, kDevice, 0.0, GradPlan::kSteady, 12,
     "optimizer on the CPU: the host->device link busiest, device compute second",
     eng::OverlapMode::kExact, 0.8, eng::NonfinitePolicy::kApply},
    {"d2h_device", Placement::kCpu, eng::Precision::kBf16, kD2h, kDevice, 0.0, GradPlan::kSteady, 12,
     "optimizer on the CPU: the device->host link busiest, device compute second (its traffic is the "
     "backward's, which step_end waits for: see docs/benchmarks.md)",
     eng::OverlapMode::kExact, 0.0, eng::NonfinitePolicy::kApply},
};

struct Options {
  std::vector<const Scenario*> scenarios;
  bool small = false;
  int layers = 0;                // 0: the scenario's default (4 with --small)
  std::int64_t layer_elems = 0;  // 0: 4096 x 4096 (512 x 512 with --small)
  int reps = 3;                  // interleaved repetitions
  int steps = 2;                 // timed steps per block (after one warm-up step)
  double balance = 0.9;          // second-busiest / busiest the calibration aims for
  bool disk_mixed = false;       // also time the disk with reads and writes in flight together
  eng::OverlapMode overlap = eng::OverlapMode::kExact;  // the overlapped schedule's strata.overlap
  bool overlap_given = false;                           // --overlap: for every scenario
  bool balance_given = false;                           // --balance: for every scenario
  eng::DeviceKind device = eng::DeviceKind::kHost;      // --device: the engines' and the isolated copies'
  std::string dir;               // root for the swap directories
  std::string json_path;
  std::string trace_dir;
  std::string command;  // the command line, for the JSON
};

const char* schedule_name(eng::OverlapMode m) {
  if (m == eng::OverlapMode::kSpeculative) return "speculative";
  if (m == eng::OverlapMode::kDelayed) return "delayed";
  return m == eng::OverlapMode::kNone ? "sequential" : "overlapped";
}
const char* placement_name(Placement p) { return p == Placement::kNvme ? "nvme" : "cpu"; }

// The balance the calibration aims for: --balance when given, else the
// scenario's own, else the default.
double balance_of(const Scenario& sc, const Options& opt) {
  return opt.balance_given || sc.balance <= 0.0 ? opt.balance : sc.balance;
}

// The framework's declared compute: modeled time on the host device; nothing
// on a CUDA device, which does not model it (--device cuda).
Status declare(gpu::Device& dev, gpu::Stream& stream, double flops, std::string_view what) {
  if (dev.kind() == gpu::DeviceKind::kCuda) return Status();
  return dev.declare_compute(stream, flops, what);
}

[[noreturn]] void die(const Status& s, std::string_view what) {
  std::fprintf(stderr, "step_bench: %.*s: %s\n", static_cast<int>(what.size()), what.data(),
               s.to_string().c_str());
  std::exit(1);
}

// ---------------------------------------------------------------------------
// The synthetic model and its gradients.

struct Model {
  int layers = 0;
  std::int64_t layer_elems = 0;  // one parameter per layer (fetch group), a multiple of the norm block
  eng::Precision precision = eng::Precision::kBf16;
  std::int64_t params() const { return layers * layer_elems; }
  int compute_bytes() const { return precision == eng::Precision::kFp32 ? 4 : 2; }
  std::uint64_t group_bytes() const { return static_cast<std::uint64_t>(layer_elems * compute_bytes()); }
  double forward_flops() const { return 2.0 * static_cast<double>(layer_elems) * kTokens; }  // per layer
  double step_flops() const { return 3.0 * forward_flops() * layers; }                       // fwd + bwd (2x)
  std::string group(int g) const { return str_cat("layer", g); }
};

// What the framework writes as gradients in one step.
struct GradKind {
  double norm = kNormLow;  // global norm of the unscaled gradient
  bool inf = false;        // an inf in the first backward group's gradient
};

GradKind grad_kind(GradPlan plan, std::int64_t step) {
  switch (plan) {
    case GradPlan::kSteady:
      return {};
    case GradPlan::kAlternateNorm:
      return {step % 2 == 0 ? kNormHigh : kNormLow, false};
    case GradPlan::kOverflow:
      return {kNormLow, step % 3 == 2};
  }
  return {};
}

// The gradient of one group as compute-dtype bits: every value +-a with a
// fixed pseudo-random sign, a = kind.norm / sqrt(params) x loss scale, so the
// whole model's gradient has that norm; with kind.inf, element 0 is +inf.
std::vector<std::uint16_t> gradient_bits(const Model& m, const GradKind& kind, double loss_scale) {
  const float a = static_cast<float>(kind.norm / std::sqrt(static_cast<double>(m.params())) * loss_scale);
  const bool fp16 = m.precision == eng::Precision::kFp16;
  const std::uint16_t pos = fp16 ? nx::fp32_to_fp16_bits(a) : nx::fp32_to_bf16_bits(a);
  const std::uint16_t neg = fp16 ? nx::fp32_to_fp16_bits(-a) : nx::fp32_to_bf16_bits(-a);
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(m.layer_elems));
  std::uint32_t x = 2463534242u;
  for (std::uint16_t& b : bits) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = (x & 1) != 0 ? pos : neg;
  }
  if (kind.inf) bits[0] = fp16 ? nx::fp32_to_fp16_bits(INFINITY) : nx::fp32_to_bf16_bits(INFINITY);
  return bits;
}

// The step's traffic (StepStats::bytes), whether the optimizer ran, and the
// elements of speculative updates thrown away (overlap "speculative": Adam's
// work that counts in the CPU's time although nothing is applied).
struct Shape {
  eng::StepBytes bytes;
  bool applied = true;
  std::int64_t discarded = 0;
  std::uint64_t disk_bytes() const { return bytes.nvme_read + bytes.nvme_write; }
  friend bool operator==(const Shape&, const Shape&) = default;
};

// CPU time and page faults of the whole process so far (getrusage).
struct Usage {
  double user_s = 0, sys_s = 0;
  std::int64_t minor_faults = 0;
  static Usage now() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return {static_cast<double>(u.ru_utime.tv_sec) + 1e-6 * static_cast<double>(u.ru_utime.tv_usec),
            static_cast<double>(u.ru_stime.tv_sec) + 1e-6 * static_cast<double>(u.ru_stime.tv_usec),
            static_cast<std::int64_t>(u.ru_minflt)};
  }
  Usage operator-(const Usage& o) const {
    return {user_s - o.user_s, sys_s - o.sys_s, minor_faults - o.minor_faults};
  }
};

enum class StepKind { kWarmUp, kTimed };

struct StepRecord {
  double seconds = 0.0;
  Usage usage;  // the process's CPU time and page faults during the step
  eng::StepStats stats;
  bool clipped = false;  // the norm exceeded gradient_clipping (and the step applied)
  Shape shape() const { return {stats.bytes, !stats.skipped, stats.speculative_discarded}; }
};

// ---------------------------------------------------------------------------
// The framework side: one engine, driven through the public API.

class Driver {
 public:
  static Result<std::unique_ptr<Driver>> create(const eng::Config& config, const Model& model,
                                                GradPlan plan) {
    std::unique_ptr<Driver> d(new Driver(model, plan, config.gradient_clipping));
    STRATA_ASSIGN_OR_RETURN(d->engine_, eng::Engine::create(config));
    for (int g = 0; g < model.layers; ++g) {
      eng::ParamDesc p;
      p.name = str_cat("layer", g, ".weight");
      p.shape = {model.layer_elems};
      p.group = model.group(g);
      STRATA_RETURN_IF_ERROR(d->engine_->register_param(p, [g](std::span<float> out) {
        // Small deterministic values: normal floats, no subnormals.
        std::uint32_t x = 0x9e3779b9u * static_cast<std::uint32_t>(g + 1);
        for (float& v : out) {
          x = x * 1664525u + 1013904223u;
          v = static_cast<float>(static_cast<int>(x >> 20) - 2048) * 1e-5f;
        }
        return Status();
      }));
    }
    STRATA_RETURN_IF_ERROR(d->engine_->finalize());
    STRATA_ASSIGN_OR_RETURN(d->stream_, d->engine_->device().create_stream("framework"));
    return d;
  }

  ~Driver() {
    // Everything on the framework stream is done before its buffers go.
    if (engine_ != nullptr && !stream_.empty())
      engine_->device().synchronize(stream_).ignore_error();  // at exit
  }

  // One training step: forward over every group, backward in reverse with
  // synthetic gradients, step_end. Timed from the first fetch to the return
  // of step_end. The gradient for this step is prepared before the clock.
  // The gradient plan counts timed steps only; warm-up steps get the steady
  // gradient. With an inf planned, only the first backward group gets it.
  Result<StepRecord> step(StepKind step_kind) {
    const bool timed = step_kind == StepKind::kTimed;
    const GradKind kind = timed ? grad_kind(plan_, index_) : GradKind{};
    const double scale = engine_->loss_scale();
    STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan good, pattern({kind.norm, false}, scale));
    gpu::DeviceSpan bad = good;
    if (kind.inf) {
      STRATA_ASSIGN_OR_RETURN(bad, pattern(kind, scale));
    }
    gpu::Device& dev = engine_->device();
    const double fwd = model_.forward_flops();
    const Usage before = Usage::now();
    core::Stopwatch sw;
    for (int g = 0; g < model_.layers; ++g) {
      const std::string name = model_.group(g);
      STRATA_RETURN_IF_ERROR(engine_->fetch(name).status());
      STRATA_RETURN_IF_ERROR(declare(dev, stream_, fwd, "forward"));
      STRATA_RETURN_IF_ERROR(engine_->release(name, &stream_));  // its buffer is reused after this work
    }
    for (int g = model_.layers - 1; g >= 0; --g) {
      const std::string name = model_.group(g);
      STRATA_RETURN_IF_ERROR(engine_->fetch(name).status());
      STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan grad, engine_->grad_buffer(name));
      STRATA_RETURN_IF_ERROR(declare(dev, stream_, 2.0 * fwd, "backward"));
      STRATA_RETURN_IF_ERROR(dev.copy_d2d(stream_, grad, g == model_.layers - 1 ? bad : good));
      // The engine's copy waits for the framework's stream; the host goes on.
      STRATA_RETURN_IF_ERROR(engine_->grads_ready(name, &stream_));
      STRATA_RETURN_IF_ERROR(engine_->release(name, &stream_));
    }
    STRATA_ASSIGN_OR_RETURN(eng::StepStats stats, engine_->step_end());
    StepRecord r;
    r.seconds = sw.elapsed_s();
    r.usage = Usage::now() - before;
    r.stats = stats;
    r.clipped = clipping_ > 0.0 && !stats.skipped && stats.grad_norm > clipping_;
    if (timed) ++index_;
    return r;
  }

  // Lets the work the engine left running after the last step_end (the
  // optimizer behind it, its writes behind, prefetches) finish before
  // something else is measured: an evaluation pass (fetch and release of
  // every group: each waits for its group's new compute copies), a
  // read_compute (which waits for the whole optimizer job, its last writes
  // included), and a device synchronize. The engine has no call that just
  // waits for its background work.
  Status settle() {
    for (int g = 0; g < model_.layers; ++g) {
      const std::string name = model_.group(g);
      STRATA_RETURN_IF_ERROR(engine_->fetch(name).status());
      STRATA_RETURN_IF_ERROR(engine_->release(name));
    }
    settle_values_.resize(static_cast<std::size_t>(model_.layer_elems));
    STRATA_RETURN_IF_ERROR(engine_->read_compute("layer0.weight", settle_values_));
    return engine_->device().synchronize();
  }

 private:
  Driver(const Model& model, GradPlan plan, double clipping)
      : model_(model), plan_(plan), clipping_(clipping) {}

  // The device buffer holding one group's gradient of this kind at this loss
  // scale, made on first use (outside any timed step).
  Result<gpu::DeviceSpan> pattern(const GradKind& kind, double loss_scale) {
    const auto key = std::make_tuple(kind.norm, loss_scale, kind.inf);
    auto it = patterns_.find(key);
    if (it != patterns_.end()) return it->second.span();
    const std::vector<std::uint16_t> bits = gradient_bits(model_, kind, loss_scale);
    gpu::Device& dev = engine_->device();
    STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer buf, dev.allocate(model_.group_bytes(), "synthetic gradient"));
    STRATA_RETURN_IF_ERROR(dev.copy_h2d(stream_, buf.span(), std::as_bytes(std::span(bits))));
    STRATA_RETURN_IF_ERROR(dev.synchronize(stream_));
    return patterns_.emplace(key, std::move(buf)).first->second.span();
  }

  Model model_;
  GradPlan plan_;
  double clipping_;
  std::int64_t index_ = 0;            // timed steps taken (the gradient plan's clock)
  std::vector<float> settle_values_;  // read_compute's output in settle()
  // Destruction order: buffers and the stream before the engine (their device).
  std::unique_ptr<eng::Engine> engine_;
  gpu::Stream stream_;
  std::map<std::tuple<double, double, bool>, gpu::DeviceBuffer> patterns_;
};

// ---------------------------------------------------------------------------
// The configuration of one engine.

struct TimingPlan {
  double tflops = 0.0;
  double h2d_gbps = 0.0;
  double d2h_gbps = 0.0;
};

std::string config_json(const Scenario& sc, const Model& m, eng::OverlapMode overlap, const TimingPlan& t,
                        const std::string& swap_dir, const std::string& trace) {
  const bool fp16 = sc.precision == eng::Precision::kFp16;
  std::string j = "{\n";
  j += "  \"train_micro_batch_size_per_gpu\": 1,\n  \"gradient_accumulation_steps\": 1,\n";
  j += str_cat("  \"gradient_clipping\": ", sc.clipping, ",\n");
  j += fp16 ? "  \"fp16\": {\"enabled\": true, \"initial_scale_power\": 16},\n"
            : "  \"bf16\": {\"enabled\": true},\n";
  j += "  \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4, \"betas\": [0.9, 0.95], \"eps\": "
       "1e-8, "
       "\"weight_decay\": 0.01}},\n";
  // The prefetch window holds a few layers, as in a model far larger than the device.
  j += str_cat("  \"zero_optimization\": {\"stage\": 3,\n    \"offload_optimizer\": {\"device\": \"",
               placement_name(sc.placement), "\", \"pin_memory\": true},\n",
               "    \"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true},\n",
               "    \"stage3_prefetch_bucket_size\": ", m.layer_elems, ",\n",
               "    \"stage3_max_live_parameters\": ", 3 * m.layer_elems, "},\n");
  j += "  \"strata\": {\"device\": \"host\", ";
  j += str_cat("\"overlap\": \"", eng::to_string(overlap), "\", \"nonfinite\": \"", eng::to_string(sc.nonfinite),
               "\",\n");
  if (sc.placement == Placement::kNvme) j += str_cat("    \"io\": {\"paths\": [\"", swap_dir, "\"]},\n");
  if (!trace.empty()) j += str_cat("    \"trace\": \"", trace, "\",\n");
  j += str_cat("    \"host_device\": {\"h2d_gbps\": ", t.h2d_gbps, ", \"d2h_gbps\": ", t.d2h_gbps,
               ", \"tflops\": ", t.tflops, "}}\n}\n");
  return j;
}

// On `device` kCuda: strata.device "cuda", with the host device's default
// memory as the device budget (the same room as on the host device, and
// engines that share the GPU: the CUDA device would reserve all free memory
// but 1 GiB); the timing model is then unused.
Result<eng::Config> make_config(const Scenario& sc, const Model& m, eng::OverlapMode overlap,
                                const TimingPlan& t, const std::string& swap_dir, const std::string& trace,
                                eng::DeviceKind device) {
  STRATA_ASSIGN_OR_RETURN(eng::Config c, eng::parse_config(config_json(sc, m, overlap, t, swap_dir, trace)));
  if (device == eng::DeviceKind::kCuda) {
    c.strata.device = eng::DeviceKind::kCuda;
    c.strata.budgets.device_bytes = c.strata.host_device.memory_bytes;
  }
  return c;
}

nvme::BackendKind backend_of(eng::IoBackend b) {
  switch (b) {
    case eng::IoBackend::kAuto:
      return nvme::BackendKind::kAuto;
    case eng::IoBackend::kIoUring:
      return nvme::BackendKind::kIoUring;
    case eng::IoBackend::kLibaio:
      return nvme::BackendKind::kLibaio;
    case eng::IoBackend::kPsync:
      return nvme::BackendKind::kPsync;
  }
  return nvme::BackendKind::kAuto;
}

// ---------------------------------------------------------------------------
// Resources in isolation.

// One isolated measurement of every resource at one step shape.
struct IsoSample {
  Shape shape;
  double device_s = 0;     // declared compute of the step plus the gradient writes, on one stream
  double h2d_s = 0;        // shape.h2d bytes of host->device copies at the modeled rate
  double d2h_s = 0;        // shape.d2h bytes of device->host copies
  double read_s = 0;       // the step's swap reads alone
  double write_s = 0;      // then its swap writes alone
  double mixed_s = 0;      // reads and writes in flight together
  double grad_pass_s = 0;  // the gradient pass over every trainable element
  double adam_s = 0;       // cpu_adam over every trainable element (0 for a skipped step)
  double crc_s = 0;        // CRC64 of the disk bytes
  double copy_s = 0;       // the memcpys of the host device's copies (links and gradient writes)
  double disk_s() const {
    if (shape.disk_bytes() == 0) return 0.0;
    return mixed_s > 0 ? std::min(read_s + write_s, mixed_s) : read_s + write_s;
  }
  double cpu_s() const { return grad_pass_s + adam_s + crc_s + copy_s; }
};

// Times every resource of a step alone, on buffers of the step's sizes:
// device compute and the links on a host device of its own with the same
// timing model; the disk through a SwapStore of its own on the same file
// system with the engine's I/O settings; the CPU work through one CpuAdam
// (the engine's threads and kernels) and crc64. Owner-thread-only.
class Isolated {
 public:
  struct Options {
    Model model;
    std::int64_t chunk_elems = 0;  // the engine's optimizer chunk (elements)
    bool disk_mixed = false;       // also time reads and writes in flight together
    std::string swap_dir;
    eng::Config config;  // for the I/O settings and dtypes
  };

  static Result<std::unique_ptr<Isolated>> create(const Options& o, adam::CpuAdam& cpu) {
    std::unique_ptr<Isolated> iso(new Isolated(o, cpu));
    STRATA_RETURN_IF_ERROR(iso->allocate());
    return iso;
  }

  ~Isolated() {
    if (store_ != nullptr) store_->close().ignore_error();          // the swap files go; nothing to keep
    if (device_ != nullptr) device_->synchronize().ignore_error();  // before the buffers go
  }

  // (Re)creates the isolated device with this timing model (on the engines'
  // device kind: with strata.device "cuda", a CUDA device whose arena holds
  // the three buffers below, and no timing model).
  Status set_timing(const TimingPlan& t) {
    hlink_.reset();
    dlink_.reset();
    dgrad_.reset();
    dpattern_.reset();
    stream_.reset();
    device_.reset();
    const std::uint64_t gbytes = o_.model.group_bytes();
    if (o_.config.strata.device == eng::DeviceKind::kCuda) {
      gpu::CudaDeviceOptions co;
      co.budgets = {&device_budget_, &pinned_budget_};
      co.arena_bytes = 3 * core::align_up(gbytes, 1ull << 20);
      STRATA_ASSIGN_OR_RETURN(device_, gpu::make_cuda_device(co));
    } else {
      gpu::HostDeviceOptions ho;
      ho.budgets = {&device_budget_, &pinned_budget_};
      ho.timing.compute_tflops = t.tflops;
      ho.timing.h2d_gb_per_s = t.h2d_gbps;
      ho.timing.d2h_gb_per_s = t.d2h_gbps;
      STRATA_ASSIGN_OR_RETURN(device_, gpu::make_host_device(ho));
    }
    STRATA_ASSIGN_OR_RETURN(stream_, device_->create_stream("isolated"));
    STRATA_ASSIGN_OR_RETURN(dpattern_, device_->allocate(gbytes, "isolated gradient pattern"));
    STRATA_ASSIGN_OR_RETURN(dgrad_, device_->allocate(gbytes, "isolated gradient"));
    STRATA_ASSIGN_OR_RETURN(dlink_, device_->allocate(gbytes, "isolated link target"));
    STRATA_ASSIGN_OR_RETURN(hlink_, device_->allocate_pinned(gbytes, "isolated link source"));
    std::memcpy(hlink_.data(), src_.data(), gbytes);
    STRATA_RETURN_IF_ERROR(device_->copy_h2d(stream_, dpattern_.span(), hlink_.bytes()));
    STRATA_RETURN_IF_ERROR(device_->copy_h2d(stream_, dgrad_.span(), hlink_.bytes()));
    STRATA_RETURN_IF_ERROR(device_->copy_h2d(stream_, dlink_.span(), hlink_.bytes()));
    return device_->synchronize(stream_);
  }

  enum class DeviceWork { kComputeAndGradients, kGradientsOnly };
  // The device work of a step (the declared compute unless kGradientsOnly,
  // and the framework's gradient writes), enqueued as the framework enqueues it.
  Result<double> device_time(DeviceWork work) {
    const Model& m = o_.model;
    const bool with_compute = work == DeviceWork::kComputeAndGradients;
    core::Stopwatch sw;
    if (with_compute) {
      for (int g = 0; g < m.layers; ++g) {
        STRATA_RETURN_IF_ERROR(declare(*device_, stream_, m.forward_flops(), "forward"));
      }
    }
    for (int g = 0; g < m.layers; ++g) {
      if (with_compute)
        STRATA_RETURN_IF_ERROR(declare(*device_, stream_, 2.0 * m.forward_flops(), "backward"));
      STRATA_RETURN_IF_ERROR(device_->copy_d2d(stream_, dgrad_.span(), dpattern_.span()));
    }
    STRATA_RETURN_IF_ERROR(device_->synchronize(stream_));
    return sw.elapsed_s();
  }

  Result<IsoSample> measure(const Shape& shape) {
    IsoSample s;
    s.shape = shape;
    STRATA_ASSIGN_OR_RETURN(s.device_s, device_time(DeviceWork::kComputeAndGradients));
    STRATA_ASSIGN_OR_RETURN(s.h2d_s, link_time(Direction::kH2d, shape.bytes.h2d));
    STRATA_ASSIGN_OR_RETURN(s.d2h_s, link_time(Direction::kD2h, shape.bytes.d2h));
    if (shape.disk_bytes() > 0) STRATA_RETURN_IF_ERROR(disk_times(shape, s));
    STRATA_RETURN_IF_ERROR(cpu_times(shape, s));
    return s;
  }

  // The bytes the host device copies with memcpy in a step of this shape:
  // both links' and the framework's gradient writes (the compute copies' size).
  std::uint64_t copy_bytes_of(const Shape& shape) const {
    return shape.bytes.h2d + shape.bytes.d2h +
           static_cast<std::uint64_t>(o_.model.params() * o_.model.compute_bytes());
  }

 private:
  Isolated(const Options& o, adam::CpuAdam& cpu)
      : o_(o),
        cpu_(cpu),
        device_budget_("step_bench isolated device", core::MemoryBudget::kUnlimited),
        pinned_budget_("step_bench isolated pinned", core::MemoryBudget::kUnlimited) {}

  adam::ElemType compute_type() const {
    return o_.model.precision == eng::Precision::kFp16 ? adam::ElemType::kF16 : adam::ElemType::kBf16;
  }
  std::uint64_t state_block_bytes() const { return 12ull * static_cast<std::uint64_t>(o_.chunk_elems); }

  // The CPU buffers, sized for the whole model and touched once (first touch
  // is slow here): the optimizer state (laid out chunk by chunk as the
  // engine's staging is: master, exp_avg, exp_avg_sq), the host gradients,
  // the gradients as they come down, the new compute copies.
  Status allocate() {
    const auto n = static_cast<std::size_t>(o_.model.params());
    const auto cb = static_cast<std::size_t>(o_.model.compute_bytes());
    STRATA_ASSIGN_OR_RETURN(state_, core::AlignedBuffer::allocate(12 * n, core::kDirectIoAlignment));
    STRATA_ASSIGN_OR_RETURN(grads_, core::AlignedBuffer::allocate(cb * n, core::kDirectIoAlignment));
    STRATA_ASSIGN_OR_RETURN(src_, core::AlignedBuffer::allocate(cb * n, core::kDirectIoAlignment));
    STRATA_ASSIGN_OR_RETURN(copyout_, core::AlignedBuffer::allocate(cb * n, core::kDirectIoAlignment));
    partials_.assign(n / static_cast<std::size_t>(nx::kNormBlockElems), 0.0);
    auto* st = state_.as<float>().data();
    for (std::int64_t b = 0; b < o_.model.params(); b += o_.chunk_elems) {
      const std::int64_t len = std::min(o_.chunk_elems, o_.model.params() - b);
      float* master = st + 3 * b;
      std::uint32_t x = 12345u + static_cast<std::uint32_t>(b);
      for (std::int64_t i = 0; i < len; ++i) {
        x = x * 1664525u + 1013904223u;
        master[i] = static_cast<float>(static_cast<int>(x >> 20) - 2048) * 1e-5f;
      }
      std::memset(master + len, 0, static_cast<std::size_t>(2 * len) * 4);
    }
    const std::vector<std::uint16_t> g = gradient_bits(o_.model, GradKind{}, 1.0);
    auto* s16 = src_.as<std::uint16_t>().data();
    for (std::size_t i = 0; i < n; i += g.size()) std::memcpy(s16 + i, g.data(), g.size() * 2);
    std::memset(grads_.data(), 0, grads_.size_bytes());
    std::memset(copyout_.data(), 0, copyout_.size_bytes());
    return Status();
  }

  enum class Direction { kH2d, kD2h };
  Result<double> link_time(Direction dir, std::uint64_t bytes) {
    if (bytes == 0) return 0.0;
    const std::uint64_t piece = o_.model.group_bytes();
    core::Stopwatch sw;
    for (std::uint64_t done = 0; done < bytes;) {
      const std::uint64_t n = std::min(piece, bytes - done);
      if (dir == Direction::kH2d) {
        STRATA_RETURN_IF_ERROR(device_->copy_h2d(stream_, dlink_.subspan(0, n), hlink_.bytes().first(n)));
      } else {
        STRATA_RETURN_IF_ERROR(device_->copy_d2h(stream_, hlink_.bytes().first(n), dlink_.subspan(0, n)));
      }
      done += n;
    }
    STRATA_RETURN_IF_ERROR(device_->synchronize(stream_));
    return sw.elapsed_s();
  }

  // --- the disk ---
  struct Block {
    std::string id;
    std::uint64_t bytes;
    std::byte* data;
  };

  // Blocks of the engine's state-chunk size (the last one shorter) covering
  // `bytes`, over the state buffer in order (region `shift` blocks on).
  std::vector<Block> blocks(const char* prefix, std::uint64_t bytes, std::size_t shift) const {
    const std::uint64_t bb = state_block_bytes();
    const std::size_t regions = std::max<std::size_t>(1, state_.size_bytes() / bb);
    std::vector<Block> out;
    for (std::uint64_t off = 0, j = 0; off < bytes; off += bb, ++j) {
      out.push_back(
          {str_cat(prefix, j), std::min(bb, bytes - off), state_.data() + ((j + shift) % regions) * bb});
    }
    return out;
  }

  // Makes the read set (written once, untimed) and the write set for this
  // shape, reopening the store when it is too small.
  Status prepare_disk(const Shape& shape) {
    const std::uint64_t r = shape.bytes.nvme_read, w = shape.bytes.nvme_write;
    if (store_ != nullptr && r == reads_bytes_ && w == writes_bytes_) return Status();
    const std::uint64_t need = core::align_up(r + w + (r + w) / 4 + (64ull << 20), 1ull << 20);
    if (store_ != nullptr) {
      for (const Block& b : reads_) STRATA_RETURN_IF_ERROR(store_->remove(b.id));
      for (const Block& b : writes_) STRATA_RETURN_IF_ERROR(store_->remove(b.id));
      reads_.clear();
      writes_.clear();
      if (store_->capacity_bytes() < need) {
        STRATA_RETURN_IF_ERROR(store_->close());
        store_.reset();
      }
    }
    if (store_ == nullptr) {
      const eng::Config& c = o_.config;
      nvme::SwapStoreOptions so;
      so.paths = {o_.swap_dir};
      so.capacity_bytes = need;
      so.stripe_bytes = c.strata.io.stripe_bytes;
      so.request_bytes = c.strata.io.block_bytes;
      so.crc = c.strata.crc;
      so.io.kind = backend_of(c.strata.io.backend);
      so.io.queue_depth = static_cast<unsigned>(c.strata.io.queue_depth);
      so.io.rings = static_cast<unsigned>(c.strata.io.rings);
      so.io.sqpoll = c.strata.io.sqpoll;
      STRATA_ASSIGN_OR_RETURN(store_, nvme::SwapStore::create(so));
    }
    const std::size_t regions = std::max<std::size_t>(1, state_.size_bytes() / state_block_bytes());
    reads_ = blocks("read", r, 0);
    writes_ = blocks("write", w, regions / 2);
    for (const Block& b : reads_) STRATA_RETURN_IF_ERROR(store_->allocate(b.id, b.bytes));
    for (const Block& b : writes_) STRATA_RETURN_IF_ERROR(store_->allocate(b.id, b.bytes));
    reads_bytes_ = r;
    writes_bytes_ = w;
    return run_disk({}, reads_).status();  // the read set's contents (and CRCs)
  }

  // Reads `reads` and writes `writes` with up to kWindow blocks of each kind
  // in flight (each block is split into the engine's requests, with its
  // queue depth); returns the seconds.
  static constexpr std::size_t kWindow = 2;
  Result<double> run_disk(const std::vector<Block>& reads, const std::vector<Block>& writes) {
    struct InFlight {
      bool write;
      nvme::SwapIo io;
    };
    std::deque<InFlight> flight;
    std::size_t nr = 0, nw = 0, r_in = 0, w_in = 0;
    auto start_more = [&]() -> Status {
      while (r_in < kWindow && nr < reads.size()) {
        const Block& b = reads[nr++];
        STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, store_->start_read(b.id, {b.data, b.bytes}));
        flight.push_back({false, std::move(io)});
        ++r_in;
      }
      while (w_in < kWindow && nw < writes.size()) {
        const Block& b = writes[nw++];
        STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, store_->start_write(b.id, {b.data, b.bytes}));
        flight.push_back({true, std::move(io)});
        ++w_in;
      }
      return Status();
    };
    core::Stopwatch sw;
    STRATA_RETURN_IF_ERROR(start_more());
    while (!flight.empty()) {
      InFlight f = std::move(flight.front());
      flight.pop_front();
      STRATA_RETURN_IF_ERROR(f.io.wait());
      --(f.write ? w_in : r_in);
      STRATA_RETURN_IF_ERROR(start_more());
    }
    return sw.elapsed_s();
  }

  Status disk_times(const Shape& shape, IsoSample& s) {
    STRATA_RETURN_IF_ERROR(prepare_disk(shape));
    STRATA_ASSIGN_OR_RETURN(s.read_s, run_disk(reads_, {}));
    STRATA_ASSIGN_OR_RETURN(s.write_s, run_disk({}, writes_));
    if (o_.disk_mixed && !reads_.empty() && !writes_.empty()) {
      STRATA_ASSIGN_OR_RETURN(s.mixed_s, run_disk(reads_, writes_));
    }
    return Status();
  }

  // --- the CPU ---
  Status cpu_times(const Shape& shape, IsoSample& s) {
    const Model& m = o_.model;
    const adam::ElemType ct = compute_type();
    const int cb = m.compute_bytes();
    // Untimed: a short pass first, so that oneTBB's worker (shared with the
    // engines' arenas) has joined this arena before the clock starts.
    const auto warm =
        std::min<std::int64_t>(4 * cpu_.tile_elems(), static_cast<std::int64_t>(src_.size_bytes()));
    cpu_.for_each_tile(warm, [&](std::int64_t begin, std::int64_t len) {
      std::memcpy(copyout_.data() + begin, src_.data() + begin, static_cast<std::size_t>(len));
    });
    core::Stopwatch sw;
    for (int g = 0; g < m.layers; ++g) {
      const std::int64_t b = g * m.layer_elems;
      adam::GradPassArgs a;
      a.src = {src_.data() + b * cb, ct, m.layer_elems};
      a.dst = {grads_.data() + b * cb, ct, m.layer_elems};
      a.norm_partials =
          std::span<double>(partials_).subspan(static_cast<std::size_t>(b / nx::kNormBlockElems),
                                               static_cast<std::size_t>(m.layer_elems / nx::kNormBlockElems));
      STRATA_RETURN_IF_ERROR(cpu_.grad_pass(a).status());
    }
    s.grad_pass_s = sw.elapsed_s();
    if (shape.applied) {
      const nx::AdamHyperparams hyper{.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.01};
      const double grad_scale = m.precision == eng::Precision::kFp16 ? 1.0 / 65536.0 : 1.0;
      ++adam_steps_;
      sw.restart();
      auto* st = state_.as<float>().data();
      for (int g = 0; g < m.layers; ++g) {
        for (std::int64_t off = 0; off < m.layer_elems; off += o_.chunk_elems) {
          const std::int64_t b = g * m.layer_elems + off;
          const std::int64_t n = std::min(o_.chunk_elems, m.layer_elems - off);
          const auto un = static_cast<std::size_t>(n);
          adam::AdamStepArgs a;
          a.constants = nx::make_adam_constants(hyper, adam_steps_, grad_scale);
          a.master = {st + 3 * b, un};
          a.exp_avg = {st + 3 * b + n, un};
          a.exp_avg_sq = {st + 3 * b + 2 * n, un};
          a.grad = {grads_.data() + b * cb, ct, n};
          a.copy_out = {copyout_.data() + b * cb, ct, n};
          STRATA_RETURN_IF_ERROR(cpu_.step(a));
        }
      }
      s.adam_s = sw.elapsed_s();
    }
    // CRC64 of every byte read from or written to the disk, on the same threads.
    const std::span<const std::byte> crc_src(state_.data(), state_.size_bytes());
    std::atomic<std::uint64_t> sink{0};
    sw.restart();
    cpu_.for_each_tile(
        static_cast<std::int64_t>(shape.disk_bytes()), [&](std::int64_t begin, std::int64_t len) {
          std::uint64_t crc = 0;
          for (std::uint64_t done = 0; done < static_cast<std::uint64_t>(len);) {
            const std::uint64_t at = (static_cast<std::uint64_t>(begin) + done) % crc_src.size();
            const std::uint64_t n =
                std::min<std::uint64_t>(static_cast<std::uint64_t>(len) - done, crc_src.size() - at);
            crc = nvme::crc64(crc, crc_src.subspan(at, n));
            done += n;
          }
          sink.fetch_xor(crc, std::memory_order_relaxed);
        });
    s.crc_s = shape.disk_bytes() > 0 ? sw.elapsed_s() : 0.0;
    // The host device's copies are memcpys on this machine.
    const std::uint64_t copy_bytes = copy_bytes_of(shape);
    const std::size_t span = src_.size_bytes();
    sw.restart();
    cpu_.for_each_tile(static_cast<std::int64_t>(copy_bytes), [&](std::int64_t begin, std::int64_t len) {
      for (std::uint64_t done = 0; done < static_cast<std::uint64_t>(len);) {
        const std::uint64_t at = (static_cast<std::uint64_t>(begin) + done) % span;
        const std::uint64_t n = std::min<std::uint64_t>(static_cast<std::uint64_t>(len) - done, span - at);
        std::memcpy(copyout_.data() + at, src_.data() + at, n);
        done += n;
      }
    });
    s.copy_s = sw.elapsed_s();
    crc_sink_ ^= sink.load();
    return Status();
  }

 private:
  Options o_;
  adam::CpuAdam& cpu_;
  core::AlignedBuffer state_, grads_, src_, copyout_;
  std::vector<double> partials_;
  std::int64_t adam_steps_ = 0;
  std::uint64_t crc_sink_ = 0;
  std::unique_ptr<nvme::SwapStore> store_;
  std::vector<Block> reads_, writes_;
  std::uint64_t reads_bytes_ = 0, writes_bytes_ = 0;
  // Destruction order: buffers and the stream before the device, the device
  // before its budgets.
  core::MemoryBudget device_budget_;
  core::MemoryBudget pinned_budget_;
  std::unique_ptr<gpu::Device> device_;
  gpu::Stream stream_;
  gpu::DeviceBuffer dpattern_, dgrad_, dlink_;
  gpu::PinnedBuffer hlink_;
};

// The isolated samples of a schedule (one per repetition, each at that
// repetition's typical shape) as per-byte rates, medians over the samples,
// so that any step's resources follow from its own bytes.
struct RateModel {
  // Seconds per step whatever the bytes.
  double device_s = 0, grad_pass_s = 0, adam_s = 0;
  // Seconds per byte.
  double h2d = 0, d2h = 0, read = 0, write = 0, mixed = 0, crc = 0, copy = 0;
  std::uint64_t fixed_copy_bytes = 0;  // the gradient writes' memcpy bytes (every step)
  double trainable = 0;                // elements one Adam pass updates

  static RateModel from(const std::vector<IsoSample>& samples, std::uint64_t fixed_copy_bytes,
                        std::int64_t trainable) {
    RateModel r;
    r.fixed_copy_bytes = fixed_copy_bytes;
    r.trainable = static_cast<double>(trainable);
    auto med = [&](auto per_sample) {
      std::vector<double> v;
      for (const IsoSample& s : samples) v.push_back(per_sample(s));
      return median(v);
    };
    auto per = [](double s, std::uint64_t bytes) { return bytes > 0 ? s / static_cast<double>(bytes) : 0.0; };
    r.device_s = med([](const IsoSample& s) { return s.device_s; });
    r.grad_pass_s = med([](const IsoSample& s) { return s.grad_pass_s; });
    r.adam_s = med([](const IsoSample& s) { return s.adam_s; });
    r.h2d = med([&](const IsoSample& s) { return per(s.h2d_s, s.shape.bytes.h2d); });
    r.d2h = med([&](const IsoSample& s) { return per(s.d2h_s, s.shape.bytes.d2h); });
    r.read = med([&](const IsoSample& s) { return per(s.read_s, s.shape.bytes.nvme_read); });
    r.write = med([&](const IsoSample& s) { return per(s.write_s, s.shape.bytes.nvme_write); });
    r.mixed = med([&](const IsoSample& s) { return per(s.mixed_s, s.shape.disk_bytes()); });
    r.crc = med([&](const IsoSample& s) { return per(s.crc_s, s.shape.disk_bytes()); });
    r.copy = med([&](const IsoSample& s) {
      return per(s.copy_s, s.shape.bytes.h2d + s.shape.bytes.d2h + fixed_copy_bytes);
    });
    return r;
  }

  // Every isolated figure at this shape.
  IsoSample at(const Shape& s) const {
    const eng::StepBytes& b = s.bytes;
    const auto d = [](std::uint64_t x) { return static_cast<double>(x); };
    IsoSample x;
    x.shape = s;
    x.device_s = device_s;
    x.h2d_s = h2d * d(b.h2d);
    x.d2h_s = d2h * d(b.d2h);
    x.read_s = read * d(b.nvme_read);
    x.write_s = write * d(b.nvme_write);
    x.mixed_s = mixed * d(s.disk_bytes());
    x.grad_pass_s = grad_pass_s;
    x.adam_s = adam_s * ((s.applied ? 1.0 : 0.0) +
                         (trainable > 0 ? static_cast<double>(s.discarded) / trainable : 0.0));
    x.crc_s = crc * d(s.disk_bytes());
    x.copy_s = copy * d(b.h2d + b.d2h + fixed_copy_bytes);
    return x;
  }

  ResTimes resources(const Shape& s) const {
    const IsoSample x = at(s);
    return {x.device_s, x.h2d_s, x.d2h_s, x.disk_s(), x.cpu_s()};
  }
};

// The busiest and second-busiest resources.
std::pair<int, int> top_two(const ResTimes& t) {
  int a = 0;
  for (int r = 1; r < kResCount; ++r) {
    if (t[r] > t[a]) a = r;
  }
  int b = a == 0 ? 1 : 0;
  for (int r = 0; r < kResCount; ++r) {
    if (r != a && t[r] > t[b]) b = r;
  }
  return {a, b};
}

// ---------------------------------------------------------------------------
// Calibration: size the timing model from the isolated CPU and disk times.

struct Calibration {
  ResTimes fixed{};   // measured: disk and CPU at the predicted shape (others 0)
  ResTimes target{};  // what the timing model is sized to give each resource
  TimingPlan timing;
  double grad_write_s = 0;       // the device's gradient writes alone (memcpys)
  double device_overhead_s = 0;  // measured device time less declared FLOPs / rate, at the chosen rate
  std::string note;              // empty, or why the intended order could not be met
};

Calibration calibrate(const Scenario& sc, const Model& m, const Shape& predicted, const IsoSample& iso,
                      double grad_write_s, double balance) {
  Calibration c;
  c.grad_write_s = grad_write_s;
  c.fixed[kDisk] = iso.disk_s();
  c.fixed[kCpu] = iso.cpu_s();
  // The least time each free resource can take: links at kLinkGbps, the device
  // its gradient writes.
  ResTimes least{};
  least[kDevice] = grad_write_s;
  least[kH2d] = static_cast<double>(predicted.bytes.h2d) / (kLinkGbps * 1e9);
  least[kD2h] = static_cast<double>(predicted.bytes.d2h) / (kLinkGbps * 1e9);
  auto is_fixed = [](int r) { return r == kDisk || r == kCpu; };
  double top = 0.0;
  if (is_fixed(sc.busiest)) {
    top = c.fixed[sc.busiest];
  } else {
    top = least[sc.busiest];
    for (int r = 0; r < kResCount; ++r) {
      if (r == sc.busiest) continue;
      const double t = is_fixed(r) ? c.fixed[r] : least[r];
      top = std::max(top, t / (r == sc.second ? balance : kOtherFraction));
    }
  }
  for (int r = 0; r < kResCount; ++r) {
    if (is_fixed(r)) {
      c.target[r] = c.fixed[r];
    } else if (r == sc.busiest) {
      c.target[r] = top;
    } else if (r == sc.second) {
      c.target[r] = balance * top;
    } else {
      c.target[r] = r == kDevice ? kOtherFraction * top : least[r];
    }
  }
  const double compute_s = c.target[kDevice] - grad_write_s;
  c.timing.tflops = compute_s > 0 ? m.step_flops() / compute_s / 1e12 : 1e6;
  auto rate = [](std::uint64_t bytes, double s) {
    return bytes > 0 && s > 0 ? static_cast<double>(bytes) / s / 1e9 : kLinkGbps;
  };
  c.timing.h2d_gbps = rate(predicted.bytes.h2d, c.target[kH2d]);
  c.timing.d2h_gbps = rate(predicted.bytes.d2h, c.target[kD2h]);
  const auto [a, b] = top_two(c.target);
  if (a != sc.busiest || b != sc.second) {
    c.note = str_cat("intended ", kResName[sc.busiest], " > ", kResName[sc.second],
                     ", but the calibration gives ", kResName[a], " > ", kResName[b]);
  }
  return c;
}

// ---------------------------------------------------------------------------
// One scenario.

struct ScheduleResult {
  eng::OverlapMode overlap = eng::OverlapMode::kExact;
  std::vector<StepRecord> steps;       // timed steps, in order
  std::vector<IsoSample> samples;      // isolated, one per repetition, at this schedule's typical shape
  std::vector<IsoSample> all_samples;  // every repetition's, whatever its shape
  Shape typical;
  // Summary.
  RateModel rates;
  ResTimes resources{};  // at the typical shape
  std::vector<double> step_s_all, bound_s_all;
  double step_s = 0, step_s_mean = 0, bound_s = 0, bound_s_mean = 0, ratio = 0, ratio_mean = 0;
  int busiest = 0, second = 0;
  double device_idle = 0, skipped_fraction = 0, clipped_fraction = 0;
  double fetch_s = 0, grads_s = 0, optimizer_s = 0, prefetched = 0, resident = 0;
  double user_s = 0, sys_s = 0, minor_faults = 0;  // per step, medians
};

struct ScenarioResult {
  const Scenario* sc = nullptr;
  Model model;
  std::int64_t chunk_elems = 0;
  Shape predicted;
  IsoSample calib_sample;
  Calibration calib;
  std::vector<ScheduleResult> schedules;
  int threads = 0;
  std::uint64_t fixed_copy_bytes = 0;  // the gradient writes' memcpy bytes per step
};

// The most common shape among the applied steps (all steps when none applied).
Shape typical_shape(const std::vector<StepRecord>& steps) {
  std::vector<std::pair<Shape, int>> counts;
  for (bool need_applied : {true, false}) {
    for (const StepRecord& r : steps) {
      if (need_applied && r.stats.skipped) continue;
      const Shape s = r.shape();
      auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& p) { return p.first == s; });
      if (it == counts.end()) {
        counts.push_back({s, 1});
      } else {
        ++it->second;
      }
    }
    if (!counts.empty()) break;
  }
  if (counts.empty()) return {};
  return std::max_element(counts.begin(), counts.end(),
                          [](const auto& x, const auto& y) { return x.second < y.second; })
      ->first;
}

void summarize(ScheduleResult& r, std::uint64_t fixed_copy_bytes, std::int64_t trainable) {
  r.rates = RateModel::from(r.samples, fixed_copy_bytes, trainable);
  r.resources = r.rates.resources(r.typical);
  double skipped = 0, clipped = 0;
  std::vector<double> fetch, grads, opt, prefetched, resident, user, sys, faults;
  for (const StepRecord& s : r.steps) {
    const ResTimes t = r.rates.resources(s.shape());
    r.step_s_all.push_back(s.seconds);
    r.bound_s_all.push_back(*std::max_element(t.begin(), t.end()));
    skipped += s.stats.skipped ? 1 : 0;
    clipped += s.clipped ? 1 : 0;
    fetch.push_back(s.stats.fetch_s);
    grads.push_back(s.stats.grads_s);
    opt.push_back(s.stats.optimizer_s);
    prefetched.push_back(static_cast<double>(s.stats.prefetched));
    resident.push_back(static_cast<double>(s.stats.resident));
    user.push_back(s.usage.user_s);
    sys.push_back(s.usage.sys_s);
    faults.push_back(static_cast<double>(s.usage.minor_faults));
  }
  const double n = static_cast<double>(std::max<std::size_t>(1, r.steps.size()));
  r.step_s = median(r.step_s_all);
  r.step_s_mean = mean(r.step_s_all);
  r.bound_s = median(r.bound_s_all);
  r.bound_s_mean = mean(r.bound_s_all);
  r.ratio = r.bound_s > 0 ? r.step_s / r.bound_s : 0;
  r.ratio_mean = r.bound_s_mean > 0 ? r.step_s_mean / r.bound_s_mean : 0;
  std::tie(r.busiest, r.second) = top_two(r.resources);
  r.device_idle = r.step_s > 0 ? 1.0 - r.resources[kDevice] / r.step_s : 0;
  r.skipped_fraction = skipped / n;
  r.clipped_fraction = clipped / n;
  r.fetch_s = median(fetch);
  r.grads_s = median(grads);
  r.optimizer_s = median(opt);
  r.prefetched = median(prefetched);
  r.resident = median(resident);
  r.user_s = median(user);
  r.sys_s = median(sys);
  r.minor_faults = median(faults);
}

Status make_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST)
    return Status::from_errno(errno, str_cat("mkdir ", path));
  return Status();
}

Result<ScenarioResult> run_scenario(const Scenario& sc, const Options& opt, adam::CpuAdam& cpu,
                                    const std::string& root) {
  ScenarioResult res;
  res.sc = &sc;
  res.threads = cpu.threads();
  Model& m = res.model;
  m.layers = opt.layers > 0 ? opt.layers : (opt.small ? 4 : sc.layers);
  m.layer_elems = opt.layer_elems > 0 ? opt.layer_elems : (opt.small ? 512 * 512 : 4096 * 4096);
  m.precision = sc.precision;
  const std::string dir = str_cat(root, "/", sc.name);
  STRATA_RETURN_IF_ERROR(make_dir(dir));
  for (const char* sub : {"calibration", "sequential", "overlapped", "speculative", "delayed", "isolated"}) {
    STRATA_RETURN_IF_ERROR(make_dir(str_cat(dir, "/", sub)));
  }
  std::printf("\n== %s: %s\n   %d layers x %lld parameters = %.1fM parameters, optimizer state %s on %s\n",
              sc.name, sc.about, m.layers, static_cast<long long>(m.layer_elems),
              static_cast<double>(m.params()) / 1e6,
              core::format_bytes(12ull * static_cast<std::uint64_t>(m.params())).c_str(),
              placement_name(sc.placement));
  std::fflush(stdout);

  // 1. Bytes per parameter and step, from a small engine of the same shape
  //    (same layer count, small layers; every count is linear in the size)
  //    under the overlapped schedule, so that the balance holds for the
  //    traffic of the schedule judged (resident copies move fewer bytes).
  {
    Model small = m;
    small.layer_elems = 4 * nx::kNormBlockElems;
    const eng::OverlapMode overlapped = opt.overlap_given ? opt.overlap : sc.overlap;
    STRATA_ASSIGN_OR_RETURN(eng::Config cc,
                            make_config(sc, small, overlapped, {}, dir + "/calibration", "", opt.device));
    STRATA_ASSIGN_OR_RETURN(auto d, Driver::create(cc, small, GradPlan::kSteady));
    StepRecord last;
    for (int i = 0; i < 3; ++i) {
      STRATA_ASSIGN_OR_RETURN(last, d->step(StepKind::kWarmUp));
    }
    const double scale = static_cast<double>(m.params()) / static_cast<double>(small.params());
    auto grow = [&](std::uint64_t b) {
      return static_cast<std::uint64_t>(std::llround(static_cast<double>(b) * scale));
    };
    res.predicted.bytes = {grow(last.stats.bytes.h2d), grow(last.stats.bytes.d2h),
                           grow(last.stats.bytes.nvme_read), grow(last.stats.bytes.nvme_write)};
    res.predicted.applied = true;
  }

  // 2. The isolated resources at the predicted shape, without a timing model.
  STRATA_ASSIGN_OR_RETURN(eng::Config base,
                          make_config(sc, m, eng::OverlapMode::kExact, {}, dir + "/sequential", "", opt.device));
  const std::uint64_t chunk_elems_cfg = base.strata.chunk_bytes / 4;
  res.chunk_elems = std::min<std::int64_t>(static_cast<std::int64_t>(chunk_elems_cfg), m.layer_elems);
  Isolated::Options io;
  io.model = m;
  io.chunk_elems = res.chunk_elems;
  io.disk_mixed = opt.disk_mixed;
  io.swap_dir = dir + "/isolated";
  io.config = base;
  STRATA_ASSIGN_OR_RETURN(auto iso, Isolated::create(io, cpu));
  res.fixed_copy_bytes = iso->copy_bytes_of(Shape{});
  STRATA_RETURN_IF_ERROR(iso->set_timing({}));
  STRATA_ASSIGN_OR_RETURN(const double grad_write_s, iso->device_time(Isolated::DeviceWork::kGradientsOnly));
  // Twice: the first pass also warms the buffers and gets the disk into the
  // state a run keeps it in (writes behind); the disk and the CPU each from
  // the slower of the two (this machine's noise mostly makes things slower).
  STRATA_ASSIGN_OR_RETURN(const IsoSample first, iso->measure(res.predicted));
  STRATA_ASSIGN_OR_RETURN(res.calib_sample, iso->measure(res.predicted));
  if (first.disk_s() > res.calib_sample.disk_s()) {
    res.calib_sample.read_s = first.read_s;
    res.calib_sample.write_s = first.write_s;
    res.calib_sample.mixed_s = first.mixed_s;
  }
  if (first.cpu_s() > res.calib_sample.cpu_s()) {
    res.calib_sample.grad_pass_s = first.grad_pass_s;
    res.calib_sample.adam_s = first.adam_s;
    res.calib_sample.crc_s = first.crc_s;
    res.calib_sample.copy_s = first.copy_s;
  }
  res.calib = calibrate(sc, m, res.predicted, res.calib_sample, grad_write_s, balance_of(sc, opt));
  const Calibration& cal = res.calib;
  std::printf(
      "   calibration (predicted step: h2d %s, d2h %s, disk %s read + %s written): disk %.3f s, "
      "cpu %.3f s (grad pass %.3f + adam %.3f + crc %.3f + memcpy %.3f)\n",
      core::format_bytes(res.predicted.bytes.h2d).c_str(),
      core::format_bytes(res.predicted.bytes.d2h).c_str(),
      core::format_bytes(res.predicted.bytes.nvme_read).c_str(),
      core::format_bytes(res.predicted.bytes.nvme_write).c_str(), cal.fixed[kDisk], cal.fixed[kCpu],
      res.calib_sample.grad_pass_s, res.calib_sample.adam_s, res.calib_sample.crc_s, res.calib_sample.copy_s);
  STRATA_RETURN_IF_ERROR(iso->set_timing(cal.timing));
  // The declared operations cost a little more than their FLOPs (waking the
  // stream, timer slack): measure it once at this rate and take it off.
  {
    std::vector<double> t;
    for (int i = 0; i < 3; ++i) {
      STRATA_ASSIGN_OR_RETURN(const double s, iso->device_time(Isolated::DeviceWork::kComputeAndGradients));
      t.push_back(s);
    }
    const double overhead = median(t) - m.step_flops() / (cal.timing.tflops * 1e12);
    const double compute_s = cal.target[kDevice] - overhead;
    if (compute_s > 0) {
      res.calib.device_overhead_s = overhead;
      res.calib.timing.tflops = m.step_flops() / compute_s / 1e12;
      STRATA_RETURN_IF_ERROR(iso->set_timing(cal.timing));
    }
  }
  std::printf(
      "   timing model: %.4g TFLOP/s (device %.3f s), h2d %.3f GB/s (%.3f s), d2h %.3f GB/s (%.3f s)%s%s\n",
      cal.timing.tflops, cal.target[kDevice], cal.timing.h2d_gbps, cal.target[kH2d], cal.timing.d2h_gbps,
      cal.target[kD2h], cal.note.empty() ? "" : "\n   NOTE: ", cal.note.c_str());
  std::fflush(stdout);

  // 3. The two engines, alive together, driven in interleaved blocks.
  const eng::OverlapMode modes[2] = {eng::OverlapMode::kNone, opt.overlap_given ? opt.overlap : sc.overlap};
  std::unique_ptr<Driver> drivers[2];
  res.schedules.resize(2);
  for (int k = 0; k < 2; ++k) {
    res.schedules[k].overlap = modes[k];
    const std::string trace = opt.trace_dir.empty() ? ""
                                                    : str_cat(opt.trace_dir, "/", sc.name, "_",
                                                              schedule_name(modes[k]), ".trace.json");
    STRATA_ASSIGN_OR_RETURN(eng::Config c, make_config(sc, m, modes[k], cal.timing,
                                                       str_cat(dir, "/", schedule_name(modes[k])), trace,
                                                       opt.device));
    STRATA_ASSIGN_OR_RETURN(drivers[k], Driver::create(c, m, sc.grads));
  }
  for (int rep = 0; rep < opt.reps; ++rep) {
    for (int i = 0; i < 2; ++i) {
      const int k = (rep % 2 == 0) ? i : 1 - i;  // ABBA
      Driver& d = *drivers[k];
      STRATA_RETURN_IF_ERROR(d.settle());
      // The engine's first step learns the fetch order; its first block gets
      // a second warm-up step (the first optimizer steps after finalize meet
      // a cold disk: reads and writes several times slower than later).
      for (int w = 0; w < (rep == 0 ? 2 : 1); ++w) STRATA_RETURN_IF_ERROR(d.step(StepKind::kWarmUp).status());
      for (int s = 0; s < opt.steps; ++s) {
        STRATA_ASSIGN_OR_RETURN(StepRecord r, d.step(StepKind::kTimed));
        res.schedules[k].steps.push_back(r);
      }
      STRATA_RETURN_IF_ERROR(d.settle());
    }
    // The isolated resources at each schedule's typical shape of this repetition.
    std::vector<std::pair<Shape, IsoSample>> measured;
    for (int k = 0; k < 2; ++k) {
      ScheduleResult& sr = res.schedules[k];
      const std::size_t per_rep = static_cast<std::size_t>(opt.steps);
      const std::vector<StepRecord> this_rep(sr.steps.end() - static_cast<std::ptrdiff_t>(per_rep),
                                             sr.steps.end());
      const Shape shape = typical_shape(this_rep);
      auto it =
          std::find_if(measured.begin(), measured.end(), [&](const auto& p) { return p.first == shape; });
      if (it == measured.end()) {
        STRATA_ASSIGN_OR_RETURN(IsoSample s, iso->measure(shape));
        measured.push_back({shape, s});
        it = measured.end() - 1;
      }
      sr.samples.push_back(it->second);
    }
    std::printf("   repetition %d of %d done\n", rep + 1, opt.reps);
    std::fflush(stdout);
  }
  for (auto& d : drivers) d.reset();
  for (ScheduleResult& sr : res.schedules) {
    sr.typical = typical_shape(sr.steps);
    // Samples were taken at each repetition's typical shape; keep those at the
    // overall one (all of them, when the shape moved between repetitions).
    std::vector<IsoSample> same;
    for (const IsoSample& s : sr.samples) {
      if (s.shape == sr.typical) same.push_back(s);
    }
    sr.all_samples = sr.samples;
    if (!same.empty()) sr.samples = same;
    summarize(sr, res.fixed_copy_bytes, m.params());
  }
  return res;
}

// ---------------------------------------------------------------------------
// Report.

void print_table(const std::vector<ScenarioResult>& results) {
  std::printf("\n%-11s %-11s %9s %9s %7s %8s %-16s %-16s %7s %8s %7s %7s\n", "scenario", "schedule", "step s",
              "bound s", "ratio", "r(mean)", "busiest", "second", "2nd/1st", "dev idle", "skipped",
              "clipped");
  for (const ScenarioResult& sr : results) {
    for (const ScheduleResult& r : sr.schedules) {
      char bb[64], ss[64];
      std::snprintf(bb, sizeof bb, "%s %.3f", kResName[r.busiest], r.resources[r.busiest]);
      std::snprintf(ss, sizeof ss, "%s %.3f", kResName[r.second], r.resources[r.second]);
      std::printf("%-11s %-11s %9.3f %9.3f %7.3f %8.3f %-16s %-16s %7.3f %8.3f %7.2f %7.2f\n", sr.sc->name,
                  schedule_name(r.overlap), r.step_s, r.bound_s, r.ratio, r.ratio_mean, bb, ss,
                  r.resources[r.busiest] > 0 ? r.resources[r.second] / r.resources[r.busiest] : 0.0,
                  r.device_idle, r.skipped_fraction, r.clipped_fraction);
    }
  }
  std::printf("\nResources in isolation, seconds per step at each schedule's typical step:\n");
  std::printf("%-11s %-11s %8s %8s %8s %8s %8s   %s\n", "scenario", "schedule", "device", "h2d", "d2h",
              "disk", "cpu", "cpu = grad pass + adam + crc + memcpy");
  for (const ScenarioResult& sr : results) {
    for (const ScheduleResult& r : sr.schedules) {
      const IsoSample m = r.rates.at(r.typical);
      std::printf("%-11s %-11s %8.3f %8.3f %8.3f %8.3f %8.3f   %.3f + %.3f + %.3f + %.3f\n", sr.sc->name,
                  schedule_name(r.overlap), r.resources[kDevice], r.resources[kH2d], r.resources[kD2h],
                  r.resources[kDisk], r.resources[kCpu], m.grad_pass_s, m.adam_s, m.crc_s, m.copy_s);
    }
  }
  std::printf(
      "\nWhere the step went (medians per step): the engine's stage seconds, fetches served by a prefetched\n"
      "or a resident copy (StepStats) and the process's CPU seconds and minor page faults (getrusage):\n");
  std::printf("%-11s %-11s %8s %8s %8s %10s %8s %8s %8s %10s\n", "scenario", "schedule", "fetch", "grads",
              "optim", "prefetched", "resident", "user", "sys", "faults");
  for (const ScenarioResult& sr : results) {
    for (const ScheduleResult& r : sr.schedules) {
      std::printf("%-11s %-11s %8.3f %8.3f %8.3f %10.0f %8.0f %8.3f %8.3f %10.0f\n", sr.sc->name,
                  schedule_name(r.overlap), r.fetch_s, r.grads_s, r.optimizer_s, r.prefetched, r.resident,
                  r.user_s, r.sys_s, r.minor_faults);
    }
  }
  std::printf(
      "\nIsolated rates (medians; compare with nvme_bench and cpu_adam_bench from the same session):\n");
  std::printf("%-11s %9s %9s %9s %12s %9s %9s %9s\n", "scenario", "read GB/s", "write GB/s", "mixed",
              "adam param/s", "adam GB/s", "crc GB/s", "copy GB/s");
  for (const ScenarioResult& sr : results) {
    const ScheduleResult& r = sr.schedules.front();
    const IsoSample m = r.rates.at(r.typical);
    const double n = static_cast<double>(sr.model.params());
    const double g = 1e-9;
    const eng::StepBytes& b = m.shape.bytes;
    std::printf(
        "%-11s %9.3f %9.3f %9.3f %12.4g %9.2f %9.2f %9.2f\n", sr.sc->name,
        m.read_s > 0 ? static_cast<double>(b.nvme_read) / m.read_s * g : 0.0,
        m.write_s > 0 ? static_cast<double>(b.nvme_write) / m.write_s * g : 0.0,
        m.mixed_s > 0 ? static_cast<double>(m.shape.disk_bytes()) / m.mixed_s * g : 0.0,
        m.adam_s > 0 ? n / m.adam_s : 0.0, m.adam_s > 0 ? 28.0 * n / m.adam_s * g : 0.0,
        m.crc_s > 0 ? static_cast<double>(m.shape.disk_bytes()) / m.crc_s * g : 0.0,
        m.copy_s > 0 ? static_cast<double>(b.h2d + b.d2h + r.rates.fixed_copy_bytes) / m.copy_s * g : 0.0);
  }
}

void json_resources(JsonWriter& j, std::string_view key, const ResTimes& t) {
  j.begin_object(key);
  for (int r = 0; r < kResCount; ++r) j.num(str_cat(kResName[r], "_s"), t[r]);
  j.end_object();
}

void json_bytes(JsonWriter& j, std::string_view key, const eng::StepBytes& b) {
  j.begin_object(key)
      .integer("h2d", static_cast<std::int64_t>(b.h2d))
      .integer("d2h", static_cast<std::int64_t>(b.d2h))
      .integer("nvme_read", static_cast<std::int64_t>(b.nvme_read))
      .integer("nvme_write", static_cast<std::int64_t>(b.nvme_write))
      .end_object();
}

void json_sample(JsonWriter& j, std::string_view key, const IsoSample& s, std::int64_t params,
                 std::uint64_t fixed_copy_bytes) {
  const double g = 1e-9, n = static_cast<double>(params);
  const eng::StepBytes& b = s.shape.bytes;
  j.begin_object(key);
  json_bytes(j, "bytes", b);
  j.num("device_s", s.device_s).num("h2d_s", s.h2d_s).num("d2h_s", s.d2h_s);
  j.num("disk_s", s.disk_s())
      .num("disk_read_s", s.read_s)
      .num("disk_write_s", s.write_s)
      .num("disk_mixed_s", s.mixed_s);
  j.num("disk_read_gbps", s.read_s > 0 ? static_cast<double>(b.nvme_read) / s.read_s * g : 0.0);
  j.num("disk_write_gbps", s.write_s > 0 ? static_cast<double>(b.nvme_write) / s.write_s * g : 0.0);
  j.num("disk_mixed_gbps", s.mixed_s > 0 ? static_cast<double>(s.shape.disk_bytes()) / s.mixed_s * g : 0.0);
  j.num("cpu_s", s.cpu_s()).num("grad_pass_s", s.grad_pass_s).num("adam_s", s.adam_s).num("crc_s", s.crc_s);
  j.num("copy_s", s.copy_s);
  j.num("adam_params_per_s", s.adam_s > 0 ? n / s.adam_s : 0.0);
  j.num("adam_gbps", s.adam_s > 0 ? 28.0 * n / s.adam_s * g : 0.0);
  j.num("crc_gbps", s.crc_s > 0 ? static_cast<double>(s.shape.disk_bytes()) / s.crc_s * g : 0.0);
  j.num("copy_gbps",
        s.copy_s > 0 ? static_cast<double>(b.h2d + b.d2h + fixed_copy_bytes) / s.copy_s * g : 0.0);
  j.end_object();
}

JsonWriter to_json(const Options& opt, const std::vector<ScenarioResult>& results) {
  JsonWriter j;
  j.begin_object();
  j.str("bench", "step_bench").str("command", opt.command).str("device", eng::to_string(opt.device));
  j.integer("reps", opt.reps).integer("steps_per_block", opt.steps).num("balance_target", opt.balance);
  j.integer("hardware_threads", static_cast<std::int64_t>(std::thread::hardware_concurrency()));
  j.begin_array("scenarios");
  for (const ScenarioResult& sr : results) {
    const Scenario& sc = *sr.sc;
    const Model& m = sr.model;
    j.begin_object();
    j.str("scenario", sc.name).str("about", sc.about).str("placement", placement_name(sc.placement));
    j.str("precision", eng::to_string(sc.precision)).num("gradient_clipping", sc.clipping);
    j.str("nonfinite", eng::to_string(sc.nonfinite));
    j.str("intended_busiest", kResName[sc.busiest]).str("intended_second", kResName[sc.second]);
    j.num("balance_target", balance_of(sc, opt)).str("overlap", eng::to_string(sr.schedules.back().overlap));
    j.integer("layers", m.layers).integer("layer_elems", m.layer_elems).integer("params", m.params());
    j.integer("optimizer_state_bytes", 12 * m.params()).integer("chunk_elems", sr.chunk_elems);
    j.integer("cpu_threads", sr.threads).num("tokens_per_step", kTokens).num("step_flops", m.step_flops());
    j.begin_object("timing_model")
        .num("tflops", sr.calib.timing.tflops)
        .num("h2d_gbps", sr.calib.timing.h2d_gbps)
        .num("d2h_gbps", sr.calib.timing.d2h_gbps)
        .end_object();
    j.begin_object("calibration");
    json_bytes(j, "predicted_bytes", sr.predicted.bytes);
    json_sample(j, "isolated", sr.calib_sample, m.params(), sr.fixed_copy_bytes);
    json_resources(j, "target", sr.calib.target);
    j.num("grad_write_s", sr.calib.grad_write_s).num("device_overhead_s", sr.calib.device_overhead_s);
    j.str("note", sr.calib.note);
    j.end_object();
    j.begin_array("schedules");
    for (const ScheduleResult& r : sr.schedules) {
      j.begin_object();
      j.str("schedule", schedule_name(r.overlap)).str("overlap", eng::to_string(r.overlap));
      j.num("step_s", r.step_s).num("bound_s", r.bound_s).num("ratio_to_bound", r.ratio);
      j.num("step_s_mean", r.step_s_mean)
          .num("bound_s_mean", r.bound_s_mean)
          .num("ratio_to_bound_mean", r.ratio_mean);
      j.str("busiest", kResName[r.busiest]).num("busiest_s", r.resources[r.busiest]);
      j.str("second", kResName[r.second]).num("second_s", r.resources[r.second]);
      j.num("second_to_busiest",
            r.resources[r.busiest] > 0 ? r.resources[r.second] / r.resources[r.busiest] : 0.0);
      j.boolean("balanced",
                r.resources[r.busiest] > 0 && r.resources[r.second] >= 0.8 * r.resources[r.busiest]);
      j.num("device_idle", r.device_idle);
      json_resources(j, "resources", r.resources);
      json_bytes(j, "bytes", r.typical.bytes);
      j.integer("steps_timed", static_cast<std::int64_t>(r.steps.size()));
      j.num("skipped_fraction", r.skipped_fraction).num("clipped_fraction", r.clipped_fraction);
      j.begin_object("engine_stage_s")
          .num("fetch_s", r.fetch_s)
          .num("grads_s", r.grads_s)
          .num("optimizer_s", r.optimizer_s)
          .num("prefetched", r.prefetched)
          .num("resident", r.resident)
          .end_object();
      j.begin_object("process_per_step")
          .num("user_s", r.user_s)
          .num("sys_s", r.sys_s)
          .num("minor_faults", r.minor_faults)
          .end_object();
      j.nums("step_s_all", r.step_s_all).nums("bound_s_all", r.bound_s_all);
      json_sample(j, "isolated", r.rates.at(r.typical), m.params(), r.rates.fixed_copy_bytes);
      j.begin_array("isolated_reps");
      for (const IsoSample& s : r.all_samples) json_sample(j, {}, s, m.params(), r.rates.fixed_copy_bytes);
      j.end_array();
      j.end_object();
    }
    j.end_array();
    j.end_object();
  }
  j.end_array();
  j.end_object();
  return j;
}

// ---------------------------------------------------------------------------

void usage() {
  std::fprintf(stderr,
               "usage: step_bench [--scenarios LIST] [--small] [--layers L] [--layer-elems N] [--reps R]\n"
               "                  [--steps S] [--balance B] [--disk-mixed] [--overlap exact|speculative|delayed] "
               "[--device host|cuda] [--dir DIR] [--json FILE] [--trace-dir DIR]\n"
               "                  [--list]\n");
}

int run(int argc, char** argv) {
  // The engine's info lines (backend choices) would interleave with the
  // table; STRATA_LOG_LEVEL still wins.
  if (std::getenv("STRATA_LOG_LEVEL") == nullptr) core::set_log_level(core::LogLevel::kWarn);
  Options opt;
  for (int i = 0; i < argc; ++i) opt.command += str_cat(i ? " " : "", argv[i]);
  std::string scenario_list;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "step_bench: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--scenarios") {
      scenario_list = value();
    } else if (arg == "--small") {
      opt.small = true;
    } else if (arg == "--layers") {
      opt.layers = std::atoi(value().c_str());
    } else if (arg == "--layer-elems") {
      std::uint64_t v = 0;
      if (!core::parse_bytes(value(), &v) || v == 0 ||
          v % static_cast<std::uint64_t>(nx::kNormBlockElems) != 0) {
        std::fprintf(stderr, "step_bench: --layer-elems must be a positive multiple of %lld\n",
                     static_cast<long long>(nx::kNormBlockElems));
        return 2;
      }
      opt.layer_elems = static_cast<std::int64_t>(v);
    } else if (arg == "--reps") {
      opt.reps = std::max(1, std::atoi(value().c_str()));
    } else if (arg == "--steps") {
      opt.steps = std::max(1, std::atoi(value().c_str()));
    } else if (arg == "--balance") {
      opt.balance = std::atof(value().c_str());
      opt.balance_given = true;
      if (!(opt.balance > 0.0 && opt.balance <= 1.0)) {
        std::fprintf(stderr, "step_bench: --balance must be in (0, 1]\n");
        return 2;
      }
    } else if (arg == "--disk-mixed") {
      opt.disk_mixed = true;
    } else if (arg == "--overlap") {
      const std::string v = value();
      opt.overlap_given = true;
      if (v == "exact") {
        opt.overlap = eng::OverlapMode::kExact;
      } else if (v == "speculative") {
        opt.overlap = eng::OverlapMode::kSpeculative;
      } else if (v == "delayed") {
        opt.overlap = eng::OverlapMode::kDelayed;
      } else {
        std::fprintf(stderr, "step_bench: --overlap is exact, speculative or delayed\n");
        return 2;
      }
    } else if (arg == "--device") {
      const std::string v = value();
      if (v == "host") {
        opt.device = eng::DeviceKind::kHost;
      } else if (v == "cuda") {
        opt.device = eng::DeviceKind::kCuda;
      } else {
        std::fprintf(stderr, "step_bench: --device is host or cuda, not '%s'\n", v.c_str());
        return 2;
      }
    } else if (arg == "--dir") {
      opt.dir = value();
    } else if (arg == "--json") {
      opt.json_path = value();
    } else if (arg == "--trace-dir") {
      opt.trace_dir = value();
    } else if (arg == "--list") {
      for (const Scenario& s : kScenarios) std::printf("%-11s %s\n", s.name, s.about);
      return 0;
    } else {
      usage();
      return 2;
    }
  }
  if (opt.layers < 0) {
    usage();
    return 2;
  }
  if (scenario_list.empty()) {
    for (const Scenario& s : kScenarios) opt.scenarios.push_back(&s);
  } else {
    std::size_t start = 0;
    while (start <= scenario_list.size()) {
      std::size_t end = scenario_list.find(',', start);
      if (end == std::string::npos) end = scenario_list.size();
      const std::string name = scenario_list.substr(start, end - start);
      const Scenario* found = nullptr;
      for (const Scenario& s : kScenarios) {
        if (name == s.name) found = &s;
      }
      if (found == nullptr) {
        std::fprintf(stderr, "step_bench: unknown scenario '%s' (--list shows them)\n", name.c_str());
        return 2;
      }
      opt.scenarios.push_back(found);
      start = end + 1;
    }
  }
  if (opt.dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    opt.dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  const std::string root = str_cat(opt.dir, "/step_bench.", ::getpid());
  if (Status s = make_dir(root); !s.ok()) die(s, "swap directory");
  if (!opt.trace_dir.empty()) {
    if (Status s = make_dir(opt.trace_dir); !s.ok()) die(s, "trace directory");
  }

  // One CpuAdam for the isolated measurements, with the engine's defaults
  // (every core, the best kernel).
  auto cpu_or = adam::CpuAdam::create({});
  if (!cpu_or.ok()) die(cpu_or.status(), "cpu_adam");
  adam::CpuAdam& cpu = **cpu_or;
  std::printf(
      "step_bench: %zu scenario(s), %d repetitions x (1 warm-up + %d timed steps) per schedule, "
      "balance target %.2f; cpu_adam %s on %d threads; CRC64 %s; swap under %s\n",
      opt.scenarios.size(), opt.reps, opt.steps, opt.balance, std::string(adam::isa_name(cpu.isa())).c_str(),
      cpu.threads(), nvme::crc64_accelerated() ? "ISA-L" : "portable", root.c_str());
  if (opt.device == eng::DeviceKind::kCuda) {
    std::printf(
        "device: cuda (the engines and the isolated link copies; the declared FLOPs take no time there, so\n"
        "the device resource is the gradient writes, and the timing model below is not used)\n");
  }

  std::vector<ScenarioResult> results;
  for (const Scenario* sc : opt.scenarios) {
    auto r = run_scenario(*sc, opt, cpu, root);
    if (!r.ok()) die(r.status(), sc->name);
    results.push_back(std::move(r).value());
  }
  print_table(results);
  int rc = 0;
  if (!opt.json_path.empty() && !to_json(opt, results).write_file(opt.json_path)) {
    std::fprintf(stderr, "step_bench: cannot write %s\n", opt.json_path.c_str());
    rc = 1;
  }
  // The swap directories: the swap files went with their stores; the lock
  // files stay (a store never removes its lock file) and go here.
  for (const ScenarioResult& sr : results) {
    const std::string dir = str_cat(root, "/", sr.sc->name);
    for (const char* sub : {"calibration", "sequential", "overlapped", "speculative", "delayed", "isolated"}) {
      ::unlink(str_cat(dir, "/", sub, "/", nvme::SwapStore::kLockFileName).c_str());
      ::rmdir(str_cat(dir, "/", sub).c_str());
    }
    ::rmdir(dir.c_str());
  }
  ::rmdir(root.c_str());
  return rc;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::run(argc, argv); }
