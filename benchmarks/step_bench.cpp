// step_bench: how close a training step comes to its bound (DESIGN.md
// section 1). The host device with its timing model stands in for a GPU: the
// framework's forward and backward are declared FLOPs (no real math, so the
// CPU stays free for the engine), the disk I/O and cpu_adam are real. Each
// scenario drives the public Engine API under both schedules
// (strata.overlap "exact" and "none") in interleaved repetitions, and in the
// same run measures every resource of the step in isolation: device compute,
// the host->device and device->host links, the disk, and the CPU (with the host
// device's copies and kernels, the CPU's work there, at the rate the host device
// really does them). The bound is the busiest of them; ratio_to_bound = step
// time / bound. The measurements live in step_resources.h, shared with
// scale_bench. With --device cuda the engines and the isolated link copies run
// on the CUDA device instead (a GPU machine: real links; the declared FLOPs
// take no time there, and the timing model is not used).
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
#include "benchmarks/step_resources.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/config.h"
#include "core/aligned_buffer.h"
#include "core/clock.h"
#include "core/logging.h"
#include "core/memory_budget.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/engine.h"
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
// Scenarios, options.

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

[[noreturn]] void die(const Status& s, std::string_view what) {
  std::fprintf(stderr, "step_bench: %.*s: %s\n", static_cast<int>(what.size()), what.data(),
               s.to_string().c_str());
  std::exit(1);
}

// ---------------------------------------------------------------------------
// The synthetic gradients (the model is step_resources.h's).

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
    STRATA_RETURN_IF_ERROR(run_forward(*engine_, stream_, model_));
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
  // The bound with the CPU counted as before (the copies at cpu_adam's
  // two-thread memcpy rate), and the step over it (medians).
  double bound_tiled_s = 0, ratio_tiled = 0;
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

std::vector<Shape> shapes_of(const std::vector<StepRecord>& steps) {
  std::vector<Shape> out;
  for (const StepRecord& r : steps) out.push_back(r.shape());
  return out;
}

void summarize(ScheduleResult& r, std::uint64_t fixed_copy_bytes, std::int64_t trainable) {
  r.rates = RateModel::from(r.samples, fixed_copy_bytes, trainable);
  r.resources = r.rates.resources(r.typical);
  double skipped = 0, clipped = 0;
  std::vector<double> fetch, grads, opt, prefetched, resident, user, sys, faults, bound_tiled;
  for (const StepRecord& s : r.steps) {
    const ResTimes t = r.rates.resources(s.shape());
    r.step_s_all.push_back(s.seconds);
    r.bound_s_all.push_back(RateModel::bound(t));
    bound_tiled.push_back(RateModel::bound(r.rates.resources_tiled(s.shape())));
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
  r.bound_tiled_s = median(bound_tiled);
  r.ratio_tiled = r.bound_tiled_s > 0 ? r.step_s / r.bound_tiled_s : 0;
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
    STRATA_ASSIGN_OR_RETURN(eng::Config cc, make_config(sc, small, overlapped, {}, dir + "/calibration", "", opt.device));
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
  io.cuda = opt.device == eng::DeviceKind::kCuda;
  io.host_device = !io.cuda;
  STRATA_ASSIGN_OR_RETURN(auto iso, Isolated::create(io, cpu));
  res.fixed_copy_bytes = iso->copy_bytes_of(Shape{});
  STRATA_RETURN_IF_ERROR(iso->set_timing({}));
  STRATA_ASSIGN_OR_RETURN(const double grad_write_s, iso->device_time(DeviceWork::kGradientsOnly));
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
    res.calib_sample.host_h2d_s = first.host_h2d_s;
    res.calib_sample.host_d2h_s = first.host_d2h_s;
    res.calib_sample.host_kernel_s = first.host_kernel_s;
  }
  res.calib = calibrate(sc, m, res.predicted, res.calib_sample, grad_write_s, balance_of(sc, opt));
  const Calibration& cal = res.calib;
  std::printf(
      "   calibration (predicted step: h2d %s, d2h %s, disk %s read + %s written): disk %.3f s, "
      "cpu %.3f s (grad pass %.3f + adam %.3f + crc %.3f + host device %.3f; memcpy on both threads %.3f)\n",
      core::format_bytes(res.predicted.bytes.h2d).c_str(),
      core::format_bytes(res.predicted.bytes.d2h).c_str(),
      core::format_bytes(res.predicted.bytes.nvme_read).c_str(),
      core::format_bytes(res.predicted.bytes.nvme_write).c_str(), cal.fixed[kDisk], cal.fixed[kCpu],
      res.calib_sample.grad_pass_s, res.calib_sample.adam_s, res.calib_sample.crc_s, res.calib_sample.cpu_copy_s(),
      res.calib_sample.copy_s);
  STRATA_RETURN_IF_ERROR(iso->set_timing(cal.timing));
  // The declared operations cost a little more than their FLOPs (waking the
  // stream, timer slack): measure it once at this rate and take it off.
  {
    std::vector<double> t;
    for (int i = 0; i < 3; ++i) {
      STRATA_ASSIGN_OR_RETURN(const double s, iso->device_time(DeviceWork::kComputeAndGradients));
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
      const Shape shape = typical_shape(shapes_of(this_rep));
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
    sr.typical = typical_shape(shapes_of(sr.steps));
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
  std::printf("\n%-11s %-11s %9s %9s %7s %8s %8s %-16s %-16s %7s %8s %7s %7s\n", "scenario", "schedule",
              "step s", "bound s", "ratio", "r(mean)", "r(tiled)", "busiest", "second", "2nd/1st", "dev idle",
              "skipped", "clipped");
  for (const ScenarioResult& sr : results) {
    for (const ScheduleResult& r : sr.schedules) {
      char bb[64], ss[64];
      std::snprintf(bb, sizeof bb, "%s %.3f", kResName[r.busiest], r.resources[r.busiest]);
      std::snprintf(ss, sizeof ss, "%s %.3f", kResName[r.second], r.resources[r.second]);
      std::printf("%-11s %-11s %9.3f %9.3f %7.3f %8.3f %8.3f %-16s %-16s %7.3f %8.3f %7.2f %7.2f\n",
                  sr.sc->name, schedule_name(r.overlap), r.step_s, r.bound_s, r.ratio, r.ratio_mean, r.ratio_tiled,
                  bb, ss,
                  r.resources[r.busiest] > 0 ? r.resources[r.second] / r.resources[r.busiest] : 0.0,
                  r.device_idle, r.skipped_fraction, r.clipped_fraction);
    }
  }
  std::printf("\nResources in isolation, seconds per step at each schedule's typical step:\n");
  std::printf("%-11s %-11s %s\n", "scenario", "schedule", kResourcesHeader);
  for (const ScenarioResult& sr : results) {
    for (const ScheduleResult& r : sr.schedules) {
      std::printf("%-11s %-11s %s\n", sr.sc->name, schedule_name(r.overlap),
                  resources_row(r.resources, r.rates.at(r.typical)).c_str());
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
  std::printf("%-11s %s\n", "scenario", kRatesHeader);
  for (const ScenarioResult& sr : results) {
    const ScheduleResult& r = sr.schedules.front();
    std::printf("%-11s %s\n", sr.sc->name,
                rates_row(r.rates.at(r.typical), sr.model.params(), r.rates.fixed_copy_bytes).c_str());
  }
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
      j.num("bound_tiled_s", r.bound_tiled_s).num("ratio_to_bound_tiled", r.ratio_tiled);
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
