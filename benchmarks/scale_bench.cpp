// scale_bench: a model whose training state is larger than this machine's
// memory, trained for real, held to its bound (DESIGN.md section 1) and to
// the planner (`strata plan`). The host device with its timing model stands
// in for the GPU (declared compute, modeled links); the disk I/O and
// cpu_adam are real, and so is the loss: each layer's compute copy w is
// pulled towards a fixed target t (a PRNG pattern, rotated per layer); the
// loss reported is 0.5 mean (w - t)^2, and the gradient the framework
// computes on the device from the copy the engine hands it is that of the
// sum, w - t. Before training the tool
// runs the planner for the same model and config; after it, it prints
// planned against measured for every tier and link and checks them (5% for
// memory and disk, equality for the bytes moved per step), and that the
// loss fell. Exit status 1 when a check fails or the run cannot start, 2
// for a bad flag.
//
//   scale_bench [--params N] [--layers L] [--placement nvme|cpu|device] [--steps S]
//               [--pinned-budget SIZE] [--device-budget SIZE] [--dir DIR] [--max-disk SIZE]
//               [--max-in-cpu ELEMENTS|auto] [--accum N]
//               [--overlap exact|delayed|none] [--optimizer AdamW|Lion|Adagrad] [--tflops T] [--link-gbps G] [--lr LR]
//               [--sample-params N] [--grad-buffers N] [--no-bound] [--plan-only]
//               [--ranks N] [--json FILE] [--save-config FILE]
//
// With --ranks N the model trains on N data-parallel ranks, threads of this
// process meeting over Gloo (a file store under --dir), each with its own
// host device and its shard of the state (docs/distributed.md), and every
// rank's tiers and bytes per step are held to the plan of one rank of N
// (`strata plan --ranks N`). Each rank's bound takes its isolated resources
// measured with every rank's at once (the ranks share the disk and the
// cores, as their steps do; a barrier starts each phase together), its Adam
// over its shard, and the collectives of a step (the reduce-scatter of each
// layer's fp32 gradients and the all-gather of its compute copies, timed on
// N threads over Gloo) added to the CPU's time, which they take on loopback.
//
// docs/benchmarks.md ("scale") describes the run, the checks and every column.
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "benchmarks/bench_json.h"
#include "benchmarks/step_resources.h"
#include "core/clock.h"
#include "core/logging.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/plan/machine.h"
#include "engine/plan/plan.h"
#include "nvme/swap_store.h"

namespace strata::bench {
namespace {

namespace eng = strata::engine;
namespace nx = strata::core::numerics;
using core::Result;
using core::Status;
using core::str_cat;

// How far a tier's planned bytes may be from its measured peak, as a
// fraction of the measured peak.
constexpr double kTierTolerance = 0.05;

enum class Placement { kNvme, kCpu, kDevice };

struct Options {
  std::int64_t params = 4'200'000'000;  // asked for; the model has layers x layer_elems
  int layers = 64;
  Placement placement = Placement::kNvme;
  int steps = 4;
  std::uint64_t pinned_budget = 12ull << 30;  // strata.budgets.pinned
  std::uint64_t device_budget = 8ull << 30;   // strata.budgets.device (the host device's memory)
  std::uint64_t max_disk = 65'000'000'000;    // refuse a run whose swap would be larger
  std::int64_t max_in_cpu = 0;  // zero_optimization.offload_param.max_in_cpu (placement nvme): elements
  bool max_in_cpu_auto = false;  // --max-in-cpu auto
  int accum = 1;  // gradient_accumulation_steps: micro-batches a step (the same batch each)
  eng::OverlapMode overlap = eng::OverlapMode::kExact;
  std::string optimizer = "AdamW";  // optimizer.type: AdamW, Lion or Adagrad
  // strata.optimizer_state of each run, in order (--optimizer-state: fp32,
  // bf16, bf16_stochastic); `state` is the one a run uses.
  std::vector<std::string> states{"fp32"};
  std::string state = "fp32";
  double tflops = 100.0;   // declared compute
  double link_gbps = 6.0;  // each link direction (below the host's memcpy: docs/benchmarks.md, gpu)
  double lr = 2e-3;
  std::int64_t sample_params = 128'000'000;  // the isolated measurements' sample (whole layers)
  int grad_buffers = 2;                      // reduce_bucket_size in layers: gradient buffers on the device
  bool bound = true;
  bool plan_only = false;  // the plan and the disk check, no training
  int ranks = 1;           // data-parallel ranks, threads of this process
  std::string dir;
  std::string json_path;
  std::string save_config;
  std::string command;
};

// Each placement's name (--placement) and its offload_param.device and
// offload_optimizer.device, indexed by Placement.
struct PlacementKeys {
  const char* name;
  const char* offload;
};
constexpr PlacementKeys kPlacementKeys[] = {{"nvme", "nvme"}, {"cpu", "cpu"}, {"device", "none"}};
const PlacementKeys& keys_of(Placement p) { return kPlacementKeys[static_cast<int>(p)]; }

[[noreturn]] void die(const Status& s, std::string_view what) {
  std::fprintf(stderr, "scale_bench: %.*s: %s\n", static_cast<int>(what.size()), what.data(),
               s.to_string().c_str());
  std::exit(1);
}

// ---------------------------------------------------------------------------
// The learnable task.

// The target pattern, negated (fp32, one layer): -t[i] uniform in
// [-kTargetScale, kTargetScale] from a xorshift PRNG. Layer g's target is the
// pattern rotated by target_offset(g) elements.
constexpr float kTargetScale = 0.1f;
constexpr float kInitScale = 0.02f;  // initial weights: uniform in [-kInitScale, kInitScale]

std::vector<float> negated_target(std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  std::uint32_t x = 0x2545f491u;
  for (float& f : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    f = -kTargetScale * (static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
  return v;
}

std::int64_t target_offset(int g, std::int64_t n) {
  return (static_cast<std::int64_t>(g) * 7919 * 1024) % n;  // whole 1024-element runs
}

// The framework's side of the loss on the device: for layer g with compute
// copy w, scratch = w - t_g (fp32), the norm partials of scratch (its blocks'
// sums of squares) into the layer's slot of `partials`, and the gradient
// bf16(scratch) into the engine's gradient buffer. loss = 0.5 x (sum of every
// partial) / parameters. Owns its device buffers (allocated on `device`,
// which must outlive it).
class QuadraticTask {
 public:
  static Result<std::unique_ptr<QuadraticTask>> create(gpu::Device& device, gpu::Stream& stream,
                                                       const Model& m, const std::vector<float>& pattern) {
    std::unique_ptr<QuadraticTask> t(new QuadraticTask(m));
    const auto n = static_cast<std::uint64_t>(m.layer_elems);
    STRATA_ASSIGN_OR_RETURN(t->pattern_, device.allocate(4 * n, "task target pattern"));
    STRATA_ASSIGN_OR_RETURN(t->scratch_, device.allocate(4 * n, "task scratch"));
    STRATA_ASSIGN_OR_RETURN(
        t->partials_,
        device.allocate(8 * t->blocks() * static_cast<std::uint64_t>(m.layers), "task norm partials"));
    t->host_partials_.assign(t->blocks() * static_cast<std::size_t>(m.layers), 0.0);
    STRATA_RETURN_IF_ERROR(device.copy_h2d(stream, t->pattern_.span(), std::as_bytes(std::span(pattern))));
    STRATA_RETURN_IF_ERROR(device.synchronize(stream));
    return t;
  }

  // Bytes of device memory the task holds (the framework's, not the engine's).
  std::uint64_t device_bytes() const {
    return pattern_.span().size_bytes() + scratch_.span().size_bytes() + partials_.span().size_bytes();
  }

  Status backward(gpu::Device& dev, gpu::Stream& s, int g, gpu::DeviceSpan weights, gpu::DeviceSpan grad) {
    const std::uint64_t n = static_cast<std::uint64_t>(m_.layer_elems);
    const std::uint64_t off = static_cast<std::uint64_t>(target_offset(g, m_.layer_elems));
    const gpu::DeviceSpan scratch = scratch_.span(), pattern = pattern_.span();
    if (off > 0)
      STRATA_RETURN_IF_ERROR(
          dev.copy_d2d(s, scratch.subspan(4 * (n - off), 4 * off), pattern.subspan(0, 4 * off)));
    STRATA_RETURN_IF_ERROR(
        dev.copy_d2d(s, scratch.subspan(0, 4 * (n - off)), pattern.subspan(4 * off, 4 * (n - off))));
    STRATA_RETURN_IF_ERROR(dev.accumulate(s, scratch, gpu::typed(weights, gpu::ElemType::kBf16)));
    gpu::NormPartialsArgs a;
    a.src = gpu::typed(scratch, gpu::ElemType::kF32);
    a.partials = partials_.span().subspan(8 * blocks() * static_cast<std::uint64_t>(g), 8 * blocks());
    STRATA_RETURN_IF_ERROR(dev.norm_partials(s, a));
    return dev.convert(s, gpu::typed(grad, gpu::ElemType::kBf16), gpu::typed(scratch, gpu::ElemType::kF32));
  }

  // Enqueues the partials' copy to the host; loss() is valid once `s` is synchronized.
  Status fetch_loss(gpu::Device& dev, gpu::Stream& s) {
    return dev.copy_d2h(s, std::as_writable_bytes(std::span(host_partials_)), partials_.span());
  }
  double loss() const {
    double sum = 0.0;
    for (double p : host_partials_) sum += p;
    return 0.5 * sum / static_cast<double>(m_.params());
  }

 private:
  explicit QuadraticTask(const Model& m) : m_(m) {}
  std::size_t blocks() const { return static_cast<std::size_t>(m_.layer_elems / nx::kNormBlockElems); }

  Model m_;
  gpu::DeviceBuffer pattern_, scratch_, partials_;
  std::vector<double> host_partials_;
};

// The task's device work of a step (DeviceWorkFn) on a device of its own:
// one layer's weights and gradient buffers stand in for every layer's.
Result<double> task_device_time(gpu::Device& dev, gpu::Stream& s, DeviceWork work, const Model& m,
                                const std::vector<float>& pattern) {
  STRATA_ASSIGN_OR_RETURN(auto task, QuadraticTask::create(dev, s, m, pattern));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer weights, dev.allocate(m.group_bytes(), "isolated weights"));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer grad, dev.allocate(m.group_bytes(), "isolated gradient"));
  STRATA_RETURN_IF_ERROR(dev.fill(s, gpu::typed(weights.span(), gpu::ElemType::kBf16), 0.01f));
  STRATA_RETURN_IF_ERROR(dev.fill(s, gpu::typed(grad.span(), gpu::ElemType::kBf16), 0.0f));
  STRATA_RETURN_IF_ERROR(dev.synchronize(s));
  const bool with_compute = work == DeviceWork::kComputeAndGradients;
  core::Stopwatch sw;
  if (with_compute) {
    for (int g = 0; g < m.layers; ++g)
      STRATA_RETURN_IF_ERROR(dev.declare_compute(s, m.forward_flops(), "forward"));
  }
  for (int g = 0; g < m.layers; ++g) {
    if (with_compute) STRATA_RETURN_IF_ERROR(dev.declare_compute(s, 2.0 * m.forward_flops(), "backward"));
    STRATA_RETURN_IF_ERROR(task->backward(dev, s, g, weights.span(), grad.span()));
  }
  STRATA_RETURN_IF_ERROR(dev.synchronize(s));
  return sw.elapsed_s();
}

// ---------------------------------------------------------------------------
// Measurements of the process and the disk.

// VmRSS and VmHWM (the peak) of /proc/self/status, in bytes.
struct Rss {
  std::uint64_t now = 0, peak = 0;
  static Rss read() {
    Rss r;
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line)) {
      std::uint64_t kib = 0;
      if (std::sscanf(line.c_str(), "VmRSS: %lu kB", &kib) == 1) r.now = kib << 10;
      if (std::sscanf(line.c_str(), "VmHWM: %lu kB", &kib) == 1) r.peak = kib << 10;
    }
    return r;
  }
};

// Bytes the swap files take on disk (allocated blocks, st_blocks x 512) in
// the engine's swap directories (with ranks, each rank's own).
std::uint64_t swap_disk_bytes(const std::vector<std::string>& dirs) {
  std::uint64_t total = 0;
  for (const std::string& dir : dirs) {
    struct stat st;
    if (::stat(str_cat(dir, "/", nvme::SwapStore::kSwapFileName).c_str(), &st) == 0) {
      total += static_cast<std::uint64_t>(st.st_blocks) * 512;
    }
  }
  return total;
}

std::uint64_t free_bytes(const std::string& dir) {
  struct statvfs v;
  if (::statvfs(dir.c_str(), &v) != 0) return 0;
  return static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
}

// ---------------------------------------------------------------------------
// The configuration.

std::string config_json(const Options& o, const Model& m, const std::string& swap_dir) {
  std::string j = "{\n";
  j += str_cat("  \"train_micro_batch_size_per_gpu\": 1,\n  \"gradient_accumulation_steps\": ", o.accum, ",\n");
  j += "  \"gradient_clipping\": 0,\n  \"bf16\": {\"enabled\": true},\n";
  if (o.optimizer == "Lion") {
    j += str_cat("  \"optimizer\": {\"type\": \"Lion\", \"params\": {\"lr\": ", o.lr / 10,
                 ", \"betas\": [0.9, 0.99], \"weight_decay\": 0}},\n");
  } else if (o.optimizer == "Adagrad") {
    j += str_cat("  \"optimizer\": {\"type\": \"Adagrad\", \"params\": {\"lr\": ", o.lr,
                 ", \"eps\": 1e-10, \"weight_decay\": 0}},\n");
  } else {
    j += str_cat("  \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": ", o.lr,
                 ", \"betas\": [0.9, 0.999], \"eps\": 1e-8, \"weight_decay\": 0}},\n");
  }
  // The prefetch window holds a few layers, as in a model far larger than the
  // device, and no layer stays there for being small.
  j += str_cat("  \"zero_optimization\": {\"stage\": 3,\n    \"offload_optimizer\": {\"device\": \"",
               keys_of(o.placement).offload, "\", \"pin_memory\": true},\n",
               "    \"offload_param\": {\"device\": \"", keys_of(o.placement).offload, "\", \"pin_memory\": true",
               o.max_in_cpu_auto ? std::string(", \"max_in_cpu\": \"auto\"")
               : o.max_in_cpu > 0 ? str_cat(", \"max_in_cpu\": ", o.max_in_cpu)
                                  : std::string(),
               "},\n", "    \"stage3_prefetch_bucket_size\": ", m.layer_elems, ",\n",
               "    \"stage3_max_live_parameters\": ", 3 * m.layer_elems, ",\n",
               "    \"stage3_param_persistence_threshold\": 0,\n",
               "    \"reduce_bucket_size\": ", static_cast<std::int64_t>(o.grad_buffers) * m.layer_elems,
               "},\n");
  j += str_cat("  \"strata\": {\"device\": \"host\", \"overlap\": \"", eng::to_string(o.overlap),
               "\", \"nonfinite\": \"apply\",\n");
  j += str_cat("    \"optimizer_state\": {\"format\": \"", o.state == "bf16_stochastic" ? "bf16" : o.state,
               "\", \"rounding\": \"",
               o.state == "bf16_stochastic" ? "stochastic" : "nearest_even", "\"},\n");
  j += str_cat("    \"budgets\": {\"pinned\": ", o.pinned_budget, ", \"device\": ", o.device_budget, "},\n");
  j += str_cat("    \"io\": {\"paths\": [\"", swap_dir, "\"]},\n");
  j += str_cat("    \"host_device\": {\"h2d_gbps\": ", o.link_gbps, ", \"d2h_gbps\": ", o.link_gbps,
               ", \"tflops\": ", o.tflops, "}}\n}\n");
  return j;
}

// ---------------------------------------------------------------------------
// The framework: one engine driven through the public API.

struct StepRecord {
  double seconds = 0.0;
  double loss = 0.0;  // at the weights this step's backward saw
  Usage usage;
  eng::StepStats stats;
  Rss rss;
  std::uint64_t device_used = 0, pinned_used = 0, staging_used = 0;  // budgets at step_end's return
  std::uint64_t disk_used = 0;                                       // swap files' allocated bytes
  double bound_s = 0.0;                                              // 0 without --bound
  Shape shape() const { return {stats.bytes, !stats.skipped, stats.speculative_discarded}; }
};

class Driver {
 public:
  static Result<std::unique_ptr<Driver>> create(const eng::Config& config, const Model& model,
                                                const std::vector<float>& pattern,
                                                const partition::CommunicatorOptions& ranks = {}) {
    std::unique_ptr<Driver> d(new Driver(model));
    d->accum_ = config.gradient_accumulation_steps;
    STRATA_ASSIGN_OR_RETURN(d->engine_, eng::Engine::create(config, ranks));
    gpu::Device& dev = d->engine_->device();
    STRATA_ASSIGN_OR_RETURN(d->stream_, dev.create_stream("framework"));
    // Before finalize, so that the device budget's peak holds the task's
    // buffers all along and the engine's share is the peak less them.
    STRATA_ASSIGN_OR_RETURN(d->task_, QuadraticTask::create(dev, d->stream_, model, pattern));
    for (int g = 0; g < model.layers; ++g) {
      eng::ParamDesc p;
      p.name = str_cat(model.group(g), ".weight");
      p.shape = {model.layer_elems};
      p.group = model.group(g);
      STRATA_RETURN_IF_ERROR(d->engine_->register_param(p, [g](std::span<float> out) {
        std::uint32_t x = 0x9e3779b9u * static_cast<std::uint32_t>(g + 1);
        for (float& v : out) {
          x = x * 1664525u + 1013904223u;
          v = kInitScale * (static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f);
        }
        return Status();
      }));
    }
    core::Stopwatch sw;
    STRATA_RETURN_IF_ERROR(d->engine_->finalize());
    d->finalize_s_ = sw.elapsed_s();
    return d;
  }

  ~Driver() {
    if (engine_ != nullptr && !stream_.empty())
      engine_->device().synchronize(stream_).ignore_error();  // at exit
  }

  // One step: per micro-batch (--accum, the same batch each), forward over
  // every layer (declared compute), backward in reverse (declared compute
  // and the task's loss and gradient), micro_step_end between them;
  // step_end, then the loss read back. Timed from the first fetch to the
  // loss on the host (a trainer reads its loss).
  Result<StepRecord> step() {
    gpu::Device& dev = engine_->device();
    const double fwd = model_.forward_flops();
    const Usage before = Usage::now();
    core::Stopwatch sw;
    for (int micro = 0; micro < accum_; ++micro) {
      if (micro > 0) STRATA_RETURN_IF_ERROR(engine_->micro_step_end());
      STRATA_RETURN_IF_ERROR(run_forward(*engine_, stream_, model_));
      for (int g = model_.layers - 1; g >= 0; --g) {
        const std::string name = model_.group(g);
        STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan weights, engine_->fetch(name));
        STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan grad, engine_->grad_buffer(name));
        STRATA_RETURN_IF_ERROR(dev.declare_compute(stream_, 2.0 * fwd, "backward"));
        STRATA_RETURN_IF_ERROR(task_->backward(dev, stream_, g, weights, grad));
        STRATA_RETURN_IF_ERROR(engine_->grads_ready(name, &stream_));
        STRATA_RETURN_IF_ERROR(engine_->release(name, &stream_));
      }
    }
    STRATA_RETURN_IF_ERROR(task_->fetch_loss(dev, stream_));
    StepRecord r;
    STRATA_ASSIGN_OR_RETURN(r.stats, engine_->step_end());
    STRATA_RETURN_IF_ERROR(dev.synchronize(stream_));
    r.seconds = sw.elapsed_s();
    r.usage = Usage::now() - before;
    r.loss = task_->loss();
    r.rss = Rss::read();
    r.device_used = engine_->device_budget().used_bytes();
    r.pinned_used = engine_->pinned_budget().used_bytes();
    r.staging_used = engine_->staging_budget().used_bytes();
    r.disk_used = swap_disk_bytes(engine_->swap_paths());
    return r;
  }

  // Lets the work behind the last step_end finish: an evaluation pass
  // (fetch and release of every group: each waits for its group's new
  // compute copies and takes its prefetch), then a read_compute (which waits
  // for the optimizer's whole job, its last writes included).
  Status settle() {
    for (int g = 0; g < model_.layers; ++g) {
      STRATA_RETURN_IF_ERROR(engine_->fetch(model_.group(g)).status());
      STRATA_RETURN_IF_ERROR(engine_->release(model_.group(g)));
    }
    std::vector<float> v(static_cast<std::size_t>(model_.layer_elems));
    STRATA_RETURN_IF_ERROR(engine_->read_compute(str_cat(model_.group(0), ".weight"), v));
    return engine_->device().synchronize();
  }

  eng::Engine& engine() { return *engine_; }
  std::uint64_t task_device_bytes() const { return task_->device_bytes(); }
  double finalize_s() const { return finalize_s_; }

 private:
  explicit Driver(const Model& m) : model_(m) {}
  Model model_;
  int accum_ = 1;  // micro-batches a step
  double finalize_s_ = 0.0;
  // Destruction order: the task's buffers and the stream before the engine (their device).
  std::unique_ptr<eng::Engine> engine_;
  gpu::Stream stream_;
  std::unique_ptr<QuadraticTask> task_;
};

// ---------------------------------------------------------------------------
// Planned against measured.

struct Check {
  std::string what;
  std::uint64_t planned = 0;
  std::uint64_t measured = 0;
  bool exact = false;  // bytes moved: must be equal; tiers: within kTierTolerance
  // A tier's plan that is a bound the run may stay this far below (within
  // kTierTolerance above it, or up to `below` under it).
  std::uint64_t below = 0;
  bool ok() const {
    if (exact || measured == 0) return planned == measured;
    const double p = static_cast<double>(planned), m = static_cast<double>(measured);
    if (m < p && below > 0) return p - m <= static_cast<double>(below) + kTierTolerance * m;
    return std::fabs(p - m) <= kTierTolerance * m;
  }
  double ratio() const {
    return measured > 0 ? static_cast<double>(planned) / static_cast<double>(measured)
                        : (planned == 0 ? 1.0 : 0.0);
  }
};

struct Peaks {
  std::uint64_t device = 0, pinned = 0, staging = 0, disk = 0;
};

// Every tier against its peak; every link against the steady steps' bytes
// (each must equal the plan: the first one that does not is shown).
std::vector<Check> compare(const eng::PlacementPlan& plan, const Peaks& peaks,
                           const std::vector<eng::StepBytes>& steady) {
  const eng::StepTraffic& t = plan.traffic;
  auto moved = [&steady](std::uint64_t planned, std::uint64_t eng::StepBytes::*link) {
    std::uint64_t measured = steady.empty() ? 0 : steady.front().*link;
    for (const eng::StepBytes& b : steady) {
      if (b.*link != planned) return b.*link;
    }
    return measured;
  };
  return {
      {"device memory", plan.tier(eng::Tier::kDevice).needed_bytes, peaks.device, false},
      {"pinned memory", plan.tier(eng::Tier::kPinned).needed_bytes, peaks.pinned, false},
      {"staging (of pinned)", plan.item_bytes(eng::Tier::kPinned, "optimizer_staging"), peaks.staging, false},
      {"disk (swap files)", plan.tier(eng::Tier::kNvme).needed_bytes, peaks.disk, false},
      {"moved host->device", t.host_to_device_bytes, moved(t.host_to_device_bytes, &eng::StepBytes::h2d),
       true},
      {"moved device->host", t.device_to_host_bytes, moved(t.device_to_host_bytes, &eng::StepBytes::d2h),
       true},
      {"moved disk read", t.disk_read_bytes, moved(t.disk_read_bytes, &eng::StepBytes::nvme_read), true},
      {"moved disk write", t.disk_write_bytes, moved(t.disk_write_bytes, &eng::StepBytes::nvme_write), true},
  };
}

// One rank's training (the only one without ranks): its steps and peaks.
struct Trained {
  std::vector<StepRecord> steps;
  Peaks peaks;
  std::uint64_t task_device_bytes = 0;
  double finalize_s = 0.0;
};

// Trains `steps` steps on one engine (one rank of `ranks` when given), printing
// a line per step when `print`.
Result<Trained> train(const eng::Config& config, const Model& m, const std::vector<float>& pattern,
                      const partition::CommunicatorOptions& ranks, int steps, bool print) {
  Trained t;
  STRATA_ASSIGN_OR_RETURN(auto driver, Driver::create(config, m, pattern, ranks));
  t.finalize_s = driver->finalize_s();
  t.task_device_bytes = driver->task_device_bytes();
  if (print) {
    std::printf("finalize: %.1f s (initial values written to their tiers)\n", t.finalize_s);
    std::printf("%5s %9s %12s %10s %10s %10s %10s %10s %10s %10s %10s\n", "step", "step s", "loss", "h2d", "d2h",
                "disk rd", "disk wr", "rss", "rss peak", "pinned", "disk");
    std::fflush(stdout);
  }
  for (int k = 0; k < steps; ++k) {
    STRATA_ASSIGN_OR_RETURN(StepRecord s, driver->step());
    if (print) {
      std::printf("%5d %9.3f %12.6g %10s %10s %10s %10s %10s %10s %10s %10s\n", k + 1, s.seconds, s.loss,
                  core::format_bytes(s.stats.bytes.h2d).c_str(), core::format_bytes(s.stats.bytes.d2h).c_str(),
                  core::format_bytes(s.stats.bytes.nvme_read).c_str(),
                  core::format_bytes(s.stats.bytes.nvme_write).c_str(), core::format_bytes(s.rss.now).c_str(),
                  core::format_bytes(s.rss.peak).c_str(), core::format_bytes(s.pinned_used).c_str(),
                  core::format_bytes(s.disk_used).c_str());
      std::fflush(stdout);
    }
    t.peaks.disk = std::max(t.peaks.disk, s.disk_used);
    t.steps.push_back(s);
  }
  STRATA_RETURN_IF_ERROR(driver->settle());
  const eng::Engine& e = driver->engine();
  const std::uint64_t dpeak = e.device_budget().peak_bytes();
  t.peaks.device = dpeak > t.task_device_bytes ? dpeak - t.task_device_bytes : 0;
  t.peaks.pinned = e.pinned_budget().peak_bytes();
  t.peaks.staging = e.staging_budget().peak_bytes();
  return t;
}

// The collectives of a step on `n` ranks (threads over Gloo meeting under
// `store`), over `layers` layers of `layer_elems` (a multiple of n norm
// blocks): per layer the reduce-scatter of its fp32 gradients and the
// all-gather of its compute copies (`cb` bytes each), as the ranks' steps run
// them, after one untimed round; the slowest rank's seconds.
Result<double> collectives_time(int n, const std::string& store, int layers, std::int64_t layer_elems, int cb) {
  std::vector<double> secs(static_cast<std::size_t>(n), 0.0);
  std::vector<Status> failed(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      failed[static_cast<std::size_t>(k)] = [&]() -> Status {
        partition::CommunicatorOptions c;
        c.backend = "gloo";
        c.rank = k;
        c.size = n;
        c.store_dir = store;
        c.prefix = "scale_bench-collectives";
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<partition::Communicator> comm, partition::make_communicator(c));
        const auto whole = static_cast<std::size_t>(layer_elems), shard = whole / static_cast<std::size_t>(n);
        std::vector<float> send(whole, 1.0f), sum(shard);
        std::vector<std::byte> mine(shard * static_cast<std::size_t>(cb)), all(whole * static_cast<std::size_t>(cb));
        const partition::DType copy_type = cb == 4 ? partition::DType::kF32 : partition::DType::kBf16;
        for (int round = 0; round < 2; ++round) {
          core::Stopwatch sw;
          for (int g = 0; g < (round == 0 ? 1 : layers); ++g) {
            STRATA_RETURN_IF_ERROR(
                comm->reduce_scatter(send.data(), sum.data(), shard, partition::DType::kF32, partition::ReduceOp::kSum));
            STRATA_RETURN_IF_ERROR(comm->all_gather(mine.data(), all.data(), shard, copy_type));
          }
          secs[static_cast<std::size_t>(k)] = sw.elapsed_s();
        }
        return Status();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (Status& s : failed) STRATA_RETURN_IF_ERROR(std::move(s));
  return *std::max_element(secs.begin(), secs.end());
}

// ---------------------------------------------------------------------------
// The run.

struct RankBound {
  double step_s = 0, bound_s = 0, ratio = 0;
};

struct RunResult {
  Model model;
  std::string config_text;
  std::string plan_command;
  eng::Plan plan;
  double finalize_s = 0.0;
  std::vector<StepRecord> steps;
  std::uint64_t task_device_bytes = 0;
  Peaks peaks;
  Shape typical;
  std::vector<Check> checks;
  bool loss_falls = false;
  // The bound (empty samples without it).
  int sample_layers = 0;
  std::vector<IsoSample> samples;  // scaled to the model
  RateModel rates;
  ResTimes resources{};                       // at the typical step
  double step_s = 0, bound_s = 0, ratio = 0;  // medians over the steps after the first
  std::uint64_t state_bytes = 16;             // training state per parameter (master, moments, copy, gradient)
  std::string no_bound_why;
  // With ranks: the collectives of a step (added to each rank's CPU time),
  // and each rank's median step, bound and ratio.
  double collectives_s = 0.0;
  std::vector<RankBound> rank_bounds;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) o.command += str_cat(i ? " " : "", argv[i]);
  auto bad = [](const std::string& flag, const std::string& v, const char* expected) {
    std::fprintf(stderr, "scale_bench: %s: cannot use '%s' (expected %s)\n", flag.c_str(), v.c_str(),
                 expected);
    std::exit(2);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "scale_bench: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    auto count = [&](std::int64_t* out) {
      const std::string v = value();
      if (!eng::parse_count(v, out) || *out <= 0) bad(arg, v, "a positive count such as 4.2e9, 50M");
    };
    auto size = [&](std::uint64_t* out) {
      const std::string v = value();
      if (!core::parse_bytes(v, out) || *out == 0) bad(arg, v, "a positive size such as 12GiB, 65e9");
    };
    auto number = [&](double* out) {
      const std::string v = value();
      char* end = nullptr;
      *out = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(*out > 0) || !std::isfinite(*out)) bad(arg, v, "a positive number");
    };
    if (arg == "--params") {
      count(&o.params);
    } else if (arg == "--layers") {
      std::int64_t n = 0;
      count(&n);
      if (n > 1'000'000) bad(arg, std::to_string(n), "at most 1000000 layers");
      o.layers = static_cast<int>(n);
    } else if (arg == "--placement") {
      const std::string v = value();
      const auto* k = std::find_if(std::begin(kPlacementKeys), std::end(kPlacementKeys),
                                   [&v](const PlacementKeys& p) { return v == p.name; });
      if (k == std::end(kPlacementKeys)) bad(arg, v, "nvme, cpu or device");
      o.placement = static_cast<Placement>(k - std::begin(kPlacementKeys));
    } else if (arg == "--steps") {
      std::int64_t n = 0;
      count(&n);
      if (n < 3 || n > 1000) bad(arg, std::to_string(n), "3 to 1000 steps (the loss must be seen to fall over steady steps)");
      o.steps = static_cast<int>(n);
    } else if (arg == "--grad-buffers") {
      std::int64_t n = 0;
      count(&n);
      if (n > 1'000'000) bad(arg, std::to_string(n), "at most 1000000");
      o.grad_buffers = static_cast<int>(n);
    } else if (arg == "--pinned-budget") {
      size(&o.pinned_budget);
    } else if (arg == "--device-budget") {
      size(&o.device_budget);
    } else if (arg == "--max-disk") {
      size(&o.max_disk);
    } else if (arg == "--accum") {
      std::int64_t n = 0;
      count(&n);
      if (n > 1024) bad(arg, std::to_string(n), "at most 1024");
      o.accum = static_cast<int>(n);
    } else if (arg == "--max-in-cpu") {
      if (i + 1 < argc && std::string_view(argv[i + 1]) == "auto") {
        o.max_in_cpu_auto = true;
        ++i;
      } else {
        count(&o.max_in_cpu);
      }
    } else if (arg == "--overlap") {
      const std::string v = value();
      if (v == "exact") {
        o.overlap = eng::OverlapMode::kExact;
      } else if (v == "delayed") {
        o.overlap = eng::OverlapMode::kDelayed;
      } else if (v == "none") {
        o.overlap = eng::OverlapMode::kNone;
      } else {
        bad(arg, v, "exact, delayed or none (speculative keeps a second copy of the state on disk)");
      }
    } else if (arg == "--optimizer") {
      o.optimizer = value();
      if (o.optimizer != "AdamW" && o.optimizer != "Lion" && o.optimizer != "Adagrad") {
        bad(arg, o.optimizer, "AdamW, Lion or Adagrad");
      }
    } else if (arg == "--optimizer-state") {
      const std::string v = value();
      o.states.clear();
      for (std::size_t at = 0; at <= v.size();) {
        const std::size_t comma = std::min(v.find(',', at), v.size());
        const std::string f = v.substr(at, comma - at);
        if (f != "fp32" && f != "bf16" && f != "bf16_stochastic" && f != "int8_blockwise") {
          bad(arg, v, "a comma-separated list of fp32, bf16, bf16_stochastic, int8_blockwise");
        }
        o.states.push_back(f);
        at = comma + 1;
      }
    } else if (arg == "--tflops") {
      number(&o.tflops);
    } else if (arg == "--link-gbps") {
      number(&o.link_gbps);
    } else if (arg == "--lr") {
      number(&o.lr);
    } else if (arg == "--sample-params") {
      count(&o.sample_params);
    } else if (arg == "--no-bound") {
      o.bound = false;
    } else if (arg == "--plan-only") {
      o.plan_only = true;
    } else if (arg == "--ranks") {
      std::int64_t n = 0;
      count(&n);
      if (n > 64) bad(arg, std::to_string(n), "1 to 64 ranks");
      o.ranks = static_cast<int>(n);
    } else if (arg == "--dir") {
      o.dir = value();
    } else if (arg == "--json") {
      o.json_path = value();
    } else if (arg == "--save-config") {
      o.save_config = value();
    } else {
      std::fprintf(
          stderr,
          "usage: scale_bench [--params N] [--layers L] [--placement nvme|cpu|device] [--steps S]\n"
          "                   [--pinned-budget SIZE] [--device-budget SIZE] [--dir DIR] [--max-disk SIZE]\n"
          "                   [--max-in-cpu ELEMENTS|auto] [--accum N]\n"
          "                   [--overlap exact|delayed|none] [--optimizer AdamW|Lion|Adagrad] [--tflops T] [--link-gbps G] [--lr LR]\n"
          "                   [--optimizer-state fp32,bf16,bf16_stochastic,int8_blockwise]\n"
          "                   [--sample-params N] [--grad-buffers N] [--no-bound] [--plan-only]\n"
          "                   [--ranks N] [--json FILE] [--save-config FILE]\n");
      std::exit(2);
    }
  }
  if (o.optimizer != "AdamW" && o.states != std::vector<std::string>{"fp32"}) {
    bad("--optimizer-state", "bf16", "fp32 alone with Lion or Adagrad (compressed moments are Adam's)");
  }
  o.state = o.states.front();
  if (o.dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    o.dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  return o;
}

// The model: `layers` layers of params / layers elements, rounded to the
// nearest whole norm block (at least one).
Model make_model(const Options& o) {
  Model m;
  m.layers = o.layers;
  const std::int64_t per_layer = o.params / o.layers;
  const std::int64_t blocks = (per_layer + nx::kNormBlockElems / 2) / nx::kNormBlockElems;
  m.layer_elems = std::max<std::int64_t>(1, blocks) * nx::kNormBlockElems;
  return m;
}

void print_plan(const RunResult& r) {
  const eng::PlacementPlan& p = r.plan.configured;
  std::printf("plan (%s):\n", r.plan_command.c_str());
  for (const eng::PlanItem& item : p.items) {
    std::printf("  %-9s %-28s %12s  %s\n", std::string(eng::tier_label(item.tier)).c_str(), item.name.c_str(),
                core::format_bytes(item.size_bytes).c_str(), item.detail.c_str());
  }
  std::printf("  moved per step: host->device %s, device->host %s, disk read %s, disk write %s\n",
              core::format_bytes(p.traffic.host_to_device_bytes).c_str(),
              core::format_bytes(p.traffic.device_to_host_bytes).c_str(),
              core::format_bytes(p.traffic.disk_read_bytes).c_str(),
              core::format_bytes(p.traffic.disk_write_bytes).c_str());
  std::fflush(stdout);
}

// The isolated resources on a sample of whole layers, scaled to the model.
Result<IsoSample> measure_sample(Isolated& iso, const Shape& full, int sample_layers, int layers) {
  const double down = static_cast<double>(sample_layers) / static_cast<double>(layers);
  IsoSample probe;
  probe.shape = full;
  const Shape sample = probe.scaled(down).shape;
  STRATA_ASSIGN_OR_RETURN(IsoSample s, iso.measure(sample));
  STRATA_RETURN_IF_ERROR(iso.close_disk());
  IsoSample up = s.scaled(1.0 / down);
  up.shape = full;  // exact bytes (the scaling rounds)
  return up;
}

Result<RunResult> run(const Options& o) {
  RunResult r;
  r.model = make_model(o);
  const Model& m = r.model;
  // The run's directories, gone however it ends (declared first: the swap
  // stores that use them are closed before).
  struct Dirs {
    std::string root, swap, isolated, store, collectives;
    int ranks = 1;
    ~Dirs() {
      for (int k = 0; k < ranks && ranks > 1; ++k) {
        const std::string d = str_cat(swap, "/rank-", k);
        ::unlink(str_cat(d, "/", nvme::SwapStore::kLockFileName).c_str());
        ::rmdir(d.c_str());
      }
      for (int k = 0; k < ranks && ranks > 1 && !isolated.empty(); ++k) {
        const std::string d = str_cat(isolated, "/rank-", k);
        ::unlink(str_cat(d, "/", nvme::SwapStore::kLockFileName).c_str());
        ::rmdir(d.c_str());
      }
      for (const std::string* d : {&swap, &isolated}) {
        ::unlink(str_cat(*d, "/", nvme::SwapStore::kLockFileName).c_str());
        ::rmdir(d->c_str());
      }
      for (const std::string* d : {&store, &collectives}) {
        if (!d->empty()) std::filesystem::remove_all(*d);
      }
      ::rmdir(root.c_str());
    }
  } dirs;
  dirs.ranks = o.ranks;
  dirs.root = str_cat(o.dir, "/scale_bench.", ::getpid());
  STRATA_RETURN_IF_ERROR(make_dir(dirs.root));
  const std::string& root = dirs.root;
  dirs.swap = str_cat(root, "/swap");
  STRATA_RETURN_IF_ERROR(make_dir(dirs.swap));
  const std::string& swap_dir = dirs.swap;
  r.config_text = config_json(o, m, swap_dir);
  STRATA_ASSIGN_OR_RETURN(const eng::Config config, eng::parse_config(r.config_text));
  const std::string config_file = o.save_config.empty() ? "CONFIG.json" : o.save_config;
  if (!o.save_config.empty()) {
    std::ofstream f(o.save_config);
    f << r.config_text;
    if (!f) return Status::io_error(str_cat("cannot write ", o.save_config));
  }

  // The plan, as `strata plan` makes it.
  eng::ModelSpec spec;
  spec.num_params = m.params();
  spec.num_layers = m.layers;
  eng::MachineOverrides over;
  over.gpu_bytes = o.device_budget;
  STRATA_ASSIGN_OR_RETURN(const eng::MachineSpec machine,
                          eng::probe_machine(eng::plan_swap_paths(config), over));
  eng::PlanOptions popt;
  popt.include_checkpoint = false;
  popt.ranks = o.ranks;
  STRATA_ASSIGN_OR_RETURN(r.plan, eng::make_plan(config, spec, machine, popt));
  r.plan_command = str_cat("strata plan --config ", config_file, " --params ", m.params(), " --layers ",
                           m.layers, " --gpu-memory ", o.device_budget, " --no-checkpoint",
                           o.ranks > 1 ? str_cat(" --ranks ", o.ranks) : std::string());
  r.state_bytes = 4 + static_cast<std::uint64_t>(r.plan.state.moment_bytes) + r.plan.state.compute_bytes +
                  r.plan.state.gradient_bytes;
  std::printf(
      "scale_bench: %d layers x %lld = %.4g parameters (%s of training state at %llu B each), placement %s, "
      "overlap %s, optimizer state %s; swap under %s\n",
      m.layers, static_cast<long long>(m.layer_elems), static_cast<double>(m.params()),
      core::format_bytes(r.state_bytes * static_cast<std::uint64_t>(m.params())).c_str(),
      static_cast<unsigned long long>(r.state_bytes), keys_of(o.placement).name,
      std::string(eng::to_string(o.overlap)).c_str(), o.state.c_str(), root.c_str());
  print_plan(r);
  if (!r.plan.configured.fits) {
    std::string why;
    for (const std::string& s : r.plan.configured.reasons) why += str_cat("\n  ", s);
    return Status::resource_exhausted(str_cat("the planner says this run does not fit:", why));
  }

  // Room on the disk: the engine's swap files, or the isolated measurement's
  // (they never exist together), and the limit given.
  const std::uint64_t swap = r.plan.configured.tier(eng::Tier::kNvme).needed_bytes;
  const int sample_layers =
      static_cast<int>(std::clamp<std::int64_t>(o.sample_params / m.layer_elems, 1, m.layers));
  const double sample_fraction = static_cast<double>(sample_layers) / m.layers;
  const std::uint64_t iso_disk =
      static_cast<std::uint64_t>(static_cast<double>(r.plan.configured.traffic.disk_bytes()) *
                                 sample_fraction * 1.25) +
      (64ull << 20);
  const std::uint64_t need = std::max(swap, o.bound ? iso_disk : 0);
  const std::uint64_t avail = free_bytes(root);
  if (swap > o.max_disk) {
    return Status::resource_exhausted(str_cat("the run's swap files would take ", core::format_bytes(swap),
                                              " (", swap, " B) under ", o.dir, ", above --max-disk ",
                                              core::format_bytes(o.max_disk), ": lower --params"));
  }
  if (need + (1ull << 30) > avail) {
    return Status::resource_exhausted(
        str_cat("the run needs ", core::format_bytes(need), " of swap space (and 1 GiB to spare) under ",
                o.dir, " but only ", core::format_bytes(avail), " is free: lower --params or free space"));
  }
  std::printf("disk: %s of swap files planned, %s free under %s\n", core::format_bytes(swap).c_str(),
              core::format_bytes(avail).c_str(), o.dir.c_str());
  if (o.plan_only) return r;

  // The isolated resources before training (the bound): a sample of whole layers.
  const std::vector<float> pattern = negated_target(m.layer_elems);
  if (o.bound && o.placement == Placement::kDevice) {
    r.no_bound_why = "the optimizer runs on the device: the host device's Adam stands in for no real machine";
  }
  if (o.bound && o.state != "fp32") {
    r.no_bound_why = "the isolated sample's Adam and disk blocks are fp32 state's (12 B per parameter)";
  }
  const bool bound = o.bound && r.no_bound_why.empty();
  Shape planned;
  planned.bytes = {r.plan.configured.traffic.host_to_device_bytes,
                   r.plan.configured.traffic.device_to_host_bytes, r.plan.configured.traffic.disk_read_bytes,
                   r.plan.configured.traffic.disk_write_bytes};
  // Each rank's isolated resources (one rank's without ranks), measured
  // with every rank's at once; the step's collectives with ranks.
  struct Probe {
    std::unique_ptr<adam::CpuAdam> cpu;
    std::unique_ptr<Isolated> iso;
    std::vector<IsoSample> samples;
  };
  std::vector<Probe> probes(static_cast<std::size_t>(o.ranks));
  std::optional<std::barrier<>> phase(std::in_place, o.ranks);
  // Measures every rank's probe at `shape` (their threads side by side), keeping the samples.
  auto measure_all = [&](const Shape& shape, bool keep) -> Status {
    std::vector<Status> failed(probes.size());
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < probes.size(); ++k) {
      threads.emplace_back([&, k] {
        auto s = measure_sample(*probes[k].iso, shape, r.sample_layers, m.layers);
        if (!s.ok()) {
          failed[k] = std::move(s).status();
          if (o.ranks > 1) phase->arrive_and_drop();  // the others' phases go on without it (the run fails)
          return;
        }
        if (keep) probes[k].samples.push_back(*std::move(s));
      });
    }
    for (std::thread& t : threads) t.join();
    for (Status& s : failed) STRATA_RETURN_IF_ERROR(std::move(s));
    return Status();
  };
  if (bound) {
    r.sample_layers = sample_layers;
    Model sample = m;
    sample.layers = sample_layers;
    dirs.isolated = str_cat(root, "/isolated");
    STRATA_RETURN_IF_ERROR(make_dir(dirs.isolated));
    for (std::size_t k = 0; k < probes.size(); ++k) {
      // The cores split among the ranks as the trained ranks' are (cpu_adam's local ranks).
      adam::CpuAdamOptions ao;
      ao.local_rank = static_cast<int>(k);
      ao.local_ranks = o.ranks;
      STRATA_ASSIGN_OR_RETURN(probes[k].cpu, adam::CpuAdam::create(ao));
      Isolated::Options io;
      io.model = sample;
      io.chunk_elems = std::min<std::int64_t>(
          static_cast<std::int64_t>(config.strata.chunk_bytes / 4) / nx::kNormBlockElems * nx::kNormBlockElems,
          m.layer_elems / o.ranks);
      io.swap_dir = o.ranks == 1 ? dirs.isolated : str_cat(dirs.isolated, "/rank-", k);
      if (o.ranks > 1) {
        STRATA_RETURN_IF_ERROR(make_dir(io.swap_dir));
        io.adam_layer_elems = m.layer_elems / o.ranks;
        io.phase_sync = [&phase] { phase->arrive_and_wait(); };
      }
      io.config = config;
      io.disk_mixed = true;  // the engine keeps reads and writes in flight together
      io.device_work = [sample, &pattern](gpu::Device& dev, gpu::Stream& s, DeviceWork work) {
        return task_device_time(dev, s, work, sample, pattern);
      };
      STRATA_ASSIGN_OR_RETURN(probes[k].iso, Isolated::create(io, *probes[k].cpu));
      STRATA_RETURN_IF_ERROR(probes[k].iso->set_timing({o.tflops, o.link_gbps, o.link_gbps}));
    }
    std::printf("isolated resources on %d of %d layers (scaled up)%s, before training ...\n", sample_layers, m.layers,
                o.ranks > 1 ? str_cat(", ", o.ranks, " ranks at once").c_str() : "");
    std::fflush(stdout);
    STRATA_RETURN_IF_ERROR(measure_all(planned, false));  // warms up
    STRATA_RETURN_IF_ERROR(measure_all(planned, true));
    if (o.ranks > 1) {
      dirs.collectives = str_cat(root, "/collectives");
      STRATA_RETURN_IF_ERROR(make_dir(dirs.collectives));
      STRATA_ASSIGN_OR_RETURN(const double sample_s,
                              collectives_time(o.ranks, dirs.collectives, sample_layers, m.layer_elems,
                                               m.compute_bytes()));
      r.collectives_s = sample_s * m.layers / sample_layers;
      std::printf("collectives of a step (timed on %d layers, scaled): %.3f s\n", sample_layers, r.collectives_s);
    }
    r.samples = probes[0].samples;
  }

  // Training: one engine, or one per rank (threads meeting over Gloo, rank
  // 0's steps printed), each held to the plan.
  std::vector<Trained> ranks(static_cast<std::size_t>(o.ranks));
  if (o.ranks == 1) {
    STRATA_ASSIGN_OR_RETURN(ranks[0], train(config, m, pattern, {}, o.steps, true));
  } else {
    const std::string store = str_cat(root, "/rendezvous");
    STRATA_RETURN_IF_ERROR(make_dir(store));
    dirs.store = store;
    std::vector<Status> failed(ranks.size());
    std::vector<std::thread> threads;
    for (int k = 0; k < o.ranks; ++k) {
      threads.emplace_back([&, k] {
        partition::CommunicatorOptions c;
        c.backend = "gloo";
        c.rank = k;
        c.size = o.ranks;
        c.store_dir = store;
        c.prefix = "scale_bench";
        auto t = train(config, m, pattern, c, o.steps, k == 0);
        if (t.ok()) {
          ranks[static_cast<std::size_t>(k)] = *std::move(t);
        } else {
          failed[static_cast<std::size_t>(k)] = std::move(t).status().annotate(str_cat("rank ", k));
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (Status& s : failed) STRATA_RETURN_IF_ERROR(std::move(s));
  }
  r.steps = ranks[0].steps;
  r.peaks = ranks[0].peaks;
  r.finalize_s = ranks[0].finalize_s;
  r.task_device_bytes = ranks[0].task_device_bytes;

  // The steps after the first (the engine's learning step, which has no
  // prefetches and no kept copies yet) are the steady ones, with overlap
  // "delayed" those after the second (the first to commit a pending update,
  // whose forward finds two groups' copies still kept); every rank's tiers
  // and bytes are held to the plan.
  const std::size_t first_steady = o.overlap == eng::OverlapMode::kDelayed ? 2 : 1;
  std::vector<Shape> steady;
  for (std::size_t k = first_steady; k < r.steps.size(); ++k) steady.push_back(r.steps[k].shape());
  r.typical = typical_shape(steady);
  // Device memory with ranks at stage 3: a rank waits in each fetch's
  // gather for the others, and its gradient copies down drain meanwhile:
  // its peak may stay up to one gradient buffer (a group's compute copies)
  // below the plan, which counts the buffers the engine allows in flight.
  const std::uint64_t device_below =
      o.ranks > 1 && config.zero.stage == 3 ? static_cast<std::uint64_t>(m.layer_elems * m.compute_bytes()) : 0;
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    std::vector<eng::StepBytes> steady_bytes;
    for (std::size_t s = first_steady; s < ranks[k].steps.size(); ++s) {
      steady_bytes.push_back(ranks[k].steps[s].stats.bytes);
    }
    for (Check c : compare(r.plan.configured, ranks[k].peaks, steady_bytes)) {
      if (c.what == "device memory") c.below = device_below;
      if (o.ranks > 1) c.what = str_cat("rank ", k, ": ", c.what);
      r.checks.push_back(std::move(c));
    }
  }
  r.loss_falls = r.steps.back().loss < r.steps.front().loss;
  for (std::size_t k = 1; k < r.steps.size(); ++k) {
    r.loss_falls = r.loss_falls && r.steps[k].loss <= r.steps[k - 1].loss;
  }

  if (bound) {
    std::printf("isolated resources after training ...\n");
    std::fflush(stdout);
    STRATA_RETURN_IF_ERROR(measure_all(r.typical, true));
    const std::uint64_t fixed = static_cast<std::uint64_t>(m.params() * m.compute_bytes());
    // Each rank's bound from its own samples, the collectives on the CPU's
    // time; rank 0's figures are the run's, and each rank's ratio is kept.
    for (std::size_t k = 0; k < probes.size(); ++k) {
      const RateModel rates = RateModel::from(probes[k].samples, fixed, m.params() / o.ranks);
      auto resources = [&](const Shape& shape) {
        ResTimes t = rates.resources(shape);
        t[kCpu] += r.collectives_s;
        return t;
      };
      std::vector<double> steps_s, bounds_s;
      for (std::size_t i = 0; i < ranks[k].steps.size(); ++i) {
        StepRecord& s = ranks[k].steps[i];
        s.bound_s = RateModel::bound(resources(s.shape()));
        if (i < first_steady) continue;
        steps_s.push_back(s.seconds);
        bounds_s.push_back(s.bound_s);
      }
      RankBound b{.step_s = median(steps_s), .bound_s = median(bounds_s)};
      b.ratio = b.bound_s > 0 ? b.step_s / b.bound_s : 0.0;
      r.rank_bounds.push_back(b);
      if (k == 0) {
        r.samples = probes[0].samples;
        r.rates = rates;
        r.resources = resources(r.typical);
        r.steps = ranks[0].steps;
        r.step_s = b.step_s;
        r.bound_s = b.bound_s;
        r.ratio = b.ratio;
      }
    }
  } else {
    std::vector<double> steps_s;
    for (std::size_t k = first_steady; k < r.steps.size(); ++k) steps_s.push_back(r.steps[k].seconds);
    r.step_s = median(steps_s);
  }
  return r;
}

void print_summary(const RunResult& r) {
  std::printf(
      "\nplanned against measured (tiers: the plan's bytes within %.0f%% of the measured peak; bytes moved "
      "per step: equal, steady steps):\n",
      100 * kTierTolerance);
  std::printf("%-22s %16s %16s %8s  %s\n", "", "planned", "measured", "ratio", "check");
  for (const Check& c : r.checks) {
    std::printf("%-22s %16s %16s %8.4f  %s\n", c.what.c_str(), core::format_bytes(c.planned).c_str(),
                core::format_bytes(c.measured).c_str(), c.ratio(), c.ok() ? "ok" : "FAILED");
  }
  std::printf("(device memory: the engine's peak, the framework's %s of task buffers taken off; with ranks at stage 3 "
              "up to one gradient buffer under the plan, drained while a fetch's gather waits for the other ranks)\n",
              core::format_bytes(r.task_device_bytes).c_str());
  for (std::size_t k = 1; k < r.steps.size(); ++k) {
    if (!(r.steps[k].shape() == r.typical)) {
      std::printf(
          "note: step %zu moved other bytes than the typical step (h2d %llu, d2h %llu, read %llu, write "
          "%llu)\n",
          k + 1, static_cast<unsigned long long>(r.steps[k].stats.bytes.h2d),
          static_cast<unsigned long long>(r.steps[k].stats.bytes.d2h),
          static_cast<unsigned long long>(r.steps[k].stats.bytes.nvme_read),
          static_cast<unsigned long long>(r.steps[k].stats.bytes.nvme_write));
    }
  }
  std::printf(
      "\nloss: %.6g -> %.6g over %zu steps: %s\n", r.steps.front().loss, r.steps.back().loss, r.steps.size(),
      r.loss_falls ? "falls (no step above the one before, the last below the first)" : "FAILED to fall");
  if (!r.no_bound_why.empty()) std::printf("bound: not measured (%s)\n", r.no_bound_why.c_str());
  if (r.samples.empty()) return;
  const auto [a, b] = top_two(r.resources);
  std::printf(
      "\nbound (isolated on %d of %d layers, scaled; the steady steps): step %.3f s, bound %.3f s, "
      "ratio %.3f; busiest %s %.3f s, second %s %.3f s\n",
      r.sample_layers, r.model.layers, r.step_s, r.bound_s, r.ratio, kResName[a], r.resources[a], kResName[b],
      r.resources[b]);
  std::printf("%s\n%s\n", kResourcesHeader, resources_row(r.resources, r.rates.at(r.typical)).c_str());
  std::printf("%s\n%s\n", kRatesHeader,
              rates_row(r.rates.at(r.typical), r.model.params(), r.rates.fixed_copy_bytes).c_str());
  if (r.rank_bounds.size() > 1) {
    std::printf("ranks (the figures above are rank 0's; collectives %.3f s of a step on the CPU's time):\n",
                r.collectives_s);
    for (std::size_t k = 0; k < r.rank_bounds.size(); ++k) {
      const RankBound& b = r.rank_bounds[k];
      std::printf("  rank %zu: step %.3f s, bound %.3f s, ratio %.3f\n", k, b.step_s, b.bound_s, b.ratio);
    }
  }
}

JsonWriter to_json(const Options& o, const RunResult& r) {
  const Model& m = r.model;
  JsonWriter j;
  j.begin_object();
  j.str("bench", "scale_bench").str("command", o.command);
  j.integer("hardware_threads", static_cast<std::int64_t>(std::thread::hardware_concurrency()));
  j.integer("ram_bytes", static_cast<std::int64_t>(r.plan.machine.ram_bytes));
  j.str("placement", keys_of(o.placement).name).str("overlap", eng::to_string(o.overlap)).str("optimizer", o.optimizer);
  j.str("optimizer_state", o.state);
  j.integer("ranks", o.ranks);
  j.integer("layers", m.layers).integer("layer_elems", m.layer_elems).integer("params", m.params());
  j.integer("training_state_bytes", static_cast<std::int64_t>(r.state_bytes) * m.params());
  j.num("median_step_s", r.step_s);
  j.num("tokens_per_step", m.tokens).num("step_flops", m.step_flops());
  j.begin_object("timing_model")
      .num("tflops", o.tflops)
      .num("h2d_gbps", o.link_gbps)
      .num("d2h_gbps", o.link_gbps);
  j.end_object();
  j.integer("pinned_budget", static_cast<std::int64_t>(o.pinned_budget));
  j.integer("device_budget", static_cast<std::int64_t>(o.device_budget));
  j.str("config", r.config_text).str("plan_command", r.plan_command);
  j.num("finalize_s", r.finalize_s);
  j.begin_array("plan_items");
  for (const eng::PlanItem& item : r.plan.configured.items) {
    j.begin_object().str("name", item.name).str("tier", eng::tier_label(item.tier));
    j.integer("bytes", static_cast<std::int64_t>(item.size_bytes)).str("detail", item.detail).end_object();
  }
  j.end_array();
  j.begin_array("checks");
  for (const Check& c : r.checks) {
    j.begin_object().str("what", c.what).integer("planned", static_cast<std::int64_t>(c.planned));
    j.integer("measured", static_cast<std::int64_t>(c.measured))
        .boolean("exact", c.exact)
        .integer("below", static_cast<std::int64_t>(c.below))
        .boolean("ok", c.ok());
    j.end_object();
  }
  j.end_array();
  j.integer("task_device_bytes", static_cast<std::int64_t>(r.task_device_bytes));
  j.boolean("loss_falls", r.loss_falls);
  j.begin_array("steps");
  for (const StepRecord& s : r.steps) {
    j.begin_object().num("step_s", s.seconds).num("loss", s.loss).num("bound_s", s.bound_s);
    json_bytes(j, "bytes", s.stats.bytes);
    j.integer("rss_bytes", static_cast<std::int64_t>(s.rss.now))
        .integer("rss_peak_bytes", static_cast<std::int64_t>(s.rss.peak));
    j.integer("device_used", static_cast<std::int64_t>(s.device_used))
        .integer("pinned_used", static_cast<std::int64_t>(s.pinned_used))
        .integer("staging_used", static_cast<std::int64_t>(s.staging_used))
        .integer("disk_used", static_cast<std::int64_t>(s.disk_used));
    j.num("user_s", s.usage.user_s).num("sys_s", s.usage.sys_s).num("grad_norm", s.stats.grad_norm);
    j.num("fetch_s", s.stats.fetch_s).num("grads_s", s.stats.grads_s).num("optimizer_s", s.stats.optimizer_s);
    j.end_object();
  }
  j.end_array();
  if (!r.samples.empty()) {
    j.begin_object("bound");
    j.integer("sample_layers", r.sample_layers);
    j.num("step_s", r.step_s).num("bound_s", r.bound_s).num("ratio_to_bound", r.ratio);
    j.num("collectives_s", r.collectives_s);
    j.begin_array("ranks");
    for (const RankBound& b : r.rank_bounds) {
      j.begin_object().num("step_s", b.step_s).num("bound_s", b.bound_s).num("ratio_to_bound", b.ratio).end_object();
    }
    j.end_array();
    json_resources(j, "resources", r.resources);
    json_sample(j, "isolated", r.rates.at(r.typical), m.params(), r.rates.fixed_copy_bytes);
    j.begin_array("isolated_runs");
    for (const IsoSample& s : r.samples) json_sample(j, {}, s, m.params(), r.rates.fixed_copy_bytes);
    j.end_array();
    j.end_object();
  } else {
    j.str("no_bound", r.no_bound_why.empty() ? "--no-bound" : r.no_bound_why);
  }
  j.end_object();
  return j;
}

// The runs of several optimizer state formats side by side: the median step,
// the disk bytes of a steady step, and the step's speed against the first run's.
void print_comparison(const std::vector<RunResult>& runs, const std::vector<std::string>& states, JsonWriter& j) {
  std::printf("\noptimizer state formats, one run each (steady steps: the median after the first):\n");
  std::printf("%-16s %10s %12s %12s %12s %10s\n", "format", "state B", "step s", "disk read", "disk write",
              "speed-up");
  // (state B: per parameter, the compute copy and gradient included, scales rounded away)
  j.begin_array("comparison");
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const RunResult& r = runs[i];
    const eng::StepBytes& b = r.steps.back().stats.bytes;
    const double speedup = r.step_s > 0 ? runs.front().step_s / r.step_s : 0.0;
    std::printf("%-16s %10llu %12.3f %12s %12s %9.3fx\n", states[i].c_str(),
                static_cast<unsigned long long>(r.state_bytes), r.step_s, core::format_bytes(b.nvme_read).c_str(),
                core::format_bytes(b.nvme_write).c_str(), speedup);
    j.begin_object().str("optimizer_state", states[i]).integer("state_bytes_per_param", static_cast<std::int64_t>(r.state_bytes));
    j.num("median_step_s", r.step_s).integer("disk_read_bytes", static_cast<std::int64_t>(b.nvme_read));
    j.integer("disk_write_bytes", static_cast<std::int64_t>(b.nvme_write)).num("speedup_vs_first", speedup);
    j.end_object();
  }
  j.end_array();
}

int main_impl(int argc, char** argv) {
  if (std::getenv("STRATA_LOG_LEVEL") == nullptr) core::set_log_level(core::LogLevel::kWarn);
  const Options base = parse(argc, argv);
  bool ok = true;
  int rc = 0;
  std::vector<RunResult> runs;
  std::vector<JsonWriter> docs;
  for (const std::string& state : base.states) {
    Options o = base;
    o.state = state;
    if (base.states.size() > 1) std::printf("\n=== optimizer state %s ===\n", state.c_str());
    Result<RunResult> r = run(o);
    if (!r.ok()) die(r.status(), "run");
    if (o.plan_only) {
      std::printf("scale_bench: --plan-only: the plan fits and the disk has room\n");
      continue;
    }
    print_summary(*r);
    ok = ok && r->loss_falls;
    for (const Check& c : r->checks) ok = ok && c.ok();
    docs.push_back(to_json(o, *r));
    runs.push_back(std::move(r).value());
  }
  if (base.plan_only) return 0;
  JsonWriter all;
  if (runs.size() > 1) {
    all.begin_object().str("bench", "scale_bench").str("command", base.command);
    print_comparison(runs, base.states, all);
    all.begin_array("runs");
    all.end_array();
    all.end_object();
  }
  if (!base.json_path.empty()) {
    bool written = false;
    if (runs.size() == 1) {
      written = docs.front().write_file(base.json_path);
    } else {
      nlohmann::ordered_json doc = all.doc();
      for (const JsonWriter& d : docs) doc["runs"].push_back(d.doc());
      std::ofstream f(base.json_path);
      f << doc.dump(2) << "\n";
      written = static_cast<bool>(f);
    }
    if (!written) {
      std::fprintf(stderr, "scale_bench: cannot write %s\n", base.json_path.c_str());
      rc = 1;
    }
  }
  std::printf("\nscale_bench: %s\n", ok ? "every check passed" : "CHECKS FAILED");
  return ok ? rc : 1;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::main_impl(argc, argv); }
