// The resources of a training step measured in isolation (DESIGN.md section
// 1), shared by step_bench and scale_bench: a synthetic model of equal
// layers, a step's shape (its bytes per link and tier), one isolated
// measurement of every resource at a shape (device compute, the two links,
// the disk, the CPU), and the rates that turn such measurements into any
// step's bound. docs/benchmarks.md ("step", "How each resource is measured")
// describes each figure. Owner-thread-only unless a type says otherwise.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "benchmarks/bench_json.h"
#include "core/aligned_buffer.h"
#include "core/memory_budget.h"
#include "core/result.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/step_stats.h"
#include "gpu/device.h"
#include "nvme/swap_store.h"

namespace strata::bench {

// The resources of DESIGN.md section 1.
enum Res : int { kDevice = 0, kH2d, kD2h, kDisk, kCpu, kResCount };
inline constexpr std::array<const char*, kResCount> kResName = {"device", "h2d", "d2h", "disk", "cpu"};
using ResTimes = std::array<double, kResCount>;

// Tokens per step of the synthetic model (default): forward FLOPs of a layer
// = 2 x its parameters x tokens; backward twice that.
inline constexpr double kTokens = 2048.0;
// Norm of step_bench's synthetic gradient (unscaled): below any clipping
// threshold, and above it on the "high" steps of a clipping scenario.
inline constexpr double kNormLow = 0.5;
inline constexpr double kNormHigh = 2.0;

// The synthetic model: `layers` fetch groups of one parameter each.
struct Model {
  int layers = 0;
  std::int64_t layer_elems = 0;  // a multiple of the norm block
  engine::Precision precision = engine::Precision::kBf16;
  double tokens = kTokens;  // per step
  std::int64_t params() const { return layers * layer_elems; }
  int compute_bytes() const { return precision == engine::Precision::kFp32 ? 4 : 2; }
  std::uint64_t group_bytes() const { return static_cast<std::uint64_t>(layer_elems * compute_bytes()); }
  double forward_flops() const { return 2.0 * static_cast<double>(layer_elems) * tokens; }  // per layer
  double step_flops() const { return 3.0 * forward_flops() * layers; }                      // fwd + bwd (2x)
  std::string group(int g) const;                                                           // "layer<g>"
};

// The synthetic model's forward, as its framework runs it: for every layer,
// fetch, the declared compute on `stream`, and release with that stream (the
// engine reuses the buffer only after this work). The host does not wait for
// the device.
core::Status run_forward(engine::Engine& engine, gpu::Stream& stream, const Model& m);

// The framework's declared compute: modeled time on the host device; nothing
// on a CUDA device, which does not model it (step_bench --device cuda).
core::Status declare(gpu::Device& dev, gpu::Stream& stream, double flops, std::string_view what);

// What step_bench's framework writes as gradients in one step.
struct GradKind {
  double norm = kNormLow;  // global norm of the unscaled gradient
  bool inf = false;        // an inf in the first backward group's gradient
};

// The gradient of one group as compute-dtype bits: every value +-a with a
// fixed pseudo-random sign, a = kind.norm / sqrt(params) x loss scale, so the
// whole model's gradient has that norm; with kind.inf, element 0 is +inf.
std::vector<std::uint16_t> gradient_bits(const Model& m, const GradKind& kind, double loss_scale);

// The step's traffic (StepStats::bytes), whether the optimizer ran, and the
// elements of speculative updates thrown away (overlap "speculative": Adam's
// work that counts in the CPU's time although nothing is applied).
struct Shape {
  engine::StepBytes bytes;
  bool applied = true;
  std::int64_t discarded = 0;
  std::uint64_t disk_bytes() const { return bytes.nvme_read + bytes.nvme_write; }
  friend bool operator==(const Shape&, const Shape&) = default;
};

// CPU time and page faults of the whole process so far (getrusage).
struct Usage {
  double user_s = 0, sys_s = 0;
  std::int64_t minor_faults = 0;
  static Usage now();
  Usage operator-(const Usage& o) const {
    return {user_s - o.user_s, sys_s - o.sys_s, minor_faults - o.minor_faults};
  }
};

// The host device's timing model (0: not modeled).
struct TimingPlan {
  double tflops = 0.0;
  double h2d_gbps = 0.0;
  double d2h_gbps = 0.0;
};

// One isolated measurement of every resource at one step shape.
struct IsoSample {
  Shape shape;
  double device_s = 0;     // declared compute of the step plus the framework's device work, on one stream
  double h2d_s = 0;        // shape.h2d bytes of host->device copies at the modeled rate
  double d2h_s = 0;        // shape.d2h bytes of device->host copies
  double read_s = 0;       // the step's swap reads alone
  double write_s = 0;      // then its swap writes alone
  double mixed_s = 0;      // reads and writes in flight together
  double grad_pass_s = 0;  // the gradient pass over every trainable element
  double adam_s = 0;       // cpu_adam over every trainable element (0 for a skipped step)
  double crc_s = 0;        // CRC64 of the disk bytes
  double copy_s = 0;       // the host device's copy bytes memcpy'd on cpu_adam's threads (the old CPU figure)
  // The host device's own CPU work, on a host device without a timing model
  // (its copies are memcpys on its stream threads): the step's h2d and d2h
  // bytes copied as the engine copies them, and the framework's device work
  // without declared compute (its gradient writes). 0 on a real GPU, whose
  // links are DMA engines (Isolated::Options::host_device).
  double host_h2d_s = 0;
  double host_d2h_s = 0;
  double host_kernel_s = 0;
  double disk_s() const;
  double cpu_copy_s() const { return host_h2d_s + host_d2h_s + host_kernel_s; }
  double cpu_work_s() const { return grad_pass_s + adam_s + crc_s; }
  // The bound's CPU resource: its work and the host device's copies and
  // kernels at the rate the host device does them.
  double cpu_s() const { return cpu_work_s() + cpu_copy_s(); }
  // The CPU resource as it was counted before: the copies at cpu_adam's
  // two-thread memcpy rate (old results compare with this).
  double cpu_tiled_s() const { return cpu_work_s() + copy_s; }
  // Every time (and every byte of the shape) times `factor`: a measurement of
  // a sample of whole layers scaled to the model.
  IsoSample scaled(double factor) const;
};

// What the framework enqueues on the device in a step, measured alone.
enum class DeviceWork { kComputeAndGradients, kGradientsOnly };
// The framework's device work of a step on `device` (declared compute unless
// kGradientsOnly, and what it writes as gradients), enqueued on `stream` as
// the framework enqueues it and waited for; returns the seconds from the
// first enqueue to the end. Buffers it needs are its own (set up before its
// clock starts).
using DeviceWorkFn =
    std::function<core::Result<double>(gpu::Device& device, gpu::Stream& stream, DeviceWork work)>;

// Times every resource of a step alone, on buffers of the step's sizes:
// device compute and the links on a host device of its own with the same
// timing model; the disk through a SwapStore of its own on the same file
// system with the engine's I/O settings; the CPU work through one CpuAdam
// (the engine's threads and kernels) and crc64; the host device's CPU work on
// a host device without a timing model. Owner-thread-only.
class Isolated {
 public:
  struct Options {
    Model model;                   // the buffers' sizes (a sample of the real model's layers is fine)
    std::int64_t chunk_elems = 0;  // the engine's optimizer chunk (elements)
    bool disk_mixed = false;       // also time reads and writes in flight together
    std::string swap_dir;
    engine::Config config;  // for the I/O settings and dtypes
    // The device is the host device: its link copies and kernels are the
    // CPU's work (host_*_s measured); false for a real GPU.
    bool host_device = true;
    // The engines run on a CUDA device (step_bench --device cuda): the timed
    // rig is a CUDA device whose arena holds its three buffers, without a
    // timing model (real links; declared compute takes no time there).
    bool cuda = false;
    // The framework's device work; empty: a declare_compute per layer
    // (forward, then backward) and one device-to-device copy of a gradient
    // pattern per layer, as step_bench's framework does.
    DeviceWorkFn device_work;
    // One rank of several (scale_bench --ranks): the elements of each layer
    // its Adam updates (its shard; 0: the whole layer), and a call every
    // rank's measurement makes before its disk and before its CPU phase (a
    // barrier over the ranks' threads), so that the ranks share the disk and
    // the cores in those phases as their steps do.
    std::int64_t adam_layer_elems = 0;
    std::function<void()> phase_sync;
  };

  static core::Result<std::unique_ptr<Isolated>> create(const Options& o, adam::CpuAdam& cpu);
  ~Isolated();

  // (Re)creates the timed device with this timing model.
  core::Status set_timing(const TimingPlan& t);
  // The framework's device work of a step on the timed device.
  core::Result<double> device_time(DeviceWork work);
  // Every resource at `shape` (set_timing first).
  core::Result<IsoSample> measure(const Shape& shape);
  // Closes the disk's swap store (its files go); the next measure reopens it.
  core::Status close_disk();

  // The bytes the host device copies with memcpy in a step of this shape:
  // both links' and step_bench's gradient writes (the compute copies' size).
  std::uint64_t copy_bytes_of(const Shape& shape) const;

 private:
  // A host device with its stream and the buffers the links and step_bench's
  // gradient writes use (one layer's compute copies each).
  struct Rig {
    // Destruction order: buffers and the stream before the device.
    std::unique_ptr<gpu::Device> device;
    gpu::Stream stream;
    gpu::DeviceBuffer dpattern, dgrad, dlink;
    gpu::PinnedBuffer hlink;
    void reset();
  };
  enum class Direction { kH2d, kD2h };
  struct Block {
    std::string id;
    std::uint64_t bytes;
    std::byte* data;
  };

  Isolated(const Options& o, adam::CpuAdam& cpu);
  core::Status allocate();
  core::Status make_rig(Rig& rig, const TimingPlan& t);
  core::Result<double> device_time(Rig& rig, DeviceWork work);
  core::Result<double> link_time(Rig& rig, Direction dir, std::uint64_t bytes);
  adam::ElemType compute_type() const;
  std::uint64_t state_block_bytes() const { return 12ull * static_cast<std::uint64_t>(o_.chunk_elems); }
  std::vector<Block> blocks(const char* prefix, std::uint64_t bytes, std::size_t shift) const;
  core::Status prepare_disk(const Shape& shape);
  core::Result<double> run_disk(const std::vector<Block>& reads, const std::vector<Block>& writes);
  core::Status disk_times(const Shape& shape, IsoSample& s);
  core::Status cpu_times(const Shape& shape, IsoSample& s);

  Options o_;
  adam::CpuAdam& cpu_;
  core::AlignedBuffer state_, grads_, src_, copyout_;
  std::vector<double> partials_;
  std::int64_t adam_steps_ = 0;
  std::uint64_t crc_sink_ = 0;
  std::unique_ptr<nvme::SwapStore> store_;
  std::vector<Block> reads_, writes_;
  std::uint64_t reads_bytes_ = 0, writes_bytes_ = 0;
  // Destruction order: the rigs (their buffers and devices) before the budgets.
  core::MemoryBudget device_budget_;
  core::MemoryBudget pinned_budget_;
  Rig timed_;    // the timing model's device
  Rig untimed_;  // no timing model: what the host device's work costs the CPU
};

// The isolated samples of a schedule (one per repetition, each at that
// repetition's typical shape) as per-byte rates, medians over the samples,
// so that any step's resources follow from its own bytes.
struct RateModel {
  // Seconds per step whatever the bytes.
  double device_s = 0, grad_pass_s = 0, adam_s = 0, host_kernel_s = 0;
  // Seconds per byte.
  double h2d = 0, d2h = 0, read = 0, write = 0, mixed = 0, crc = 0, copy = 0, host_h2d = 0, host_d2h = 0;
  std::uint64_t fixed_copy_bytes = 0;  // the gradient writes' memcpy bytes (every step)
  double trainable = 0;                // elements one Adam pass updates

  static RateModel from(const std::vector<IsoSample>& samples, std::uint64_t fixed_copy_bytes,
                        std::int64_t trainable);
  // Every isolated figure at this shape.
  IsoSample at(const Shape& s) const;
  // Each resource's seconds at this shape: the bound's (IsoSample::cpu_s),
  // and with the CPU counted as before (IsoSample::cpu_tiled_s).
  ResTimes resources(const Shape& s) const;
  ResTimes resources_tiled(const Shape& s) const;
  // The busiest resource's seconds.
  static double bound(const ResTimes& t);
};

// The busiest and second-busiest resources.
std::pair<int, int> top_two(const ResTimes& t);

// The most common shape among the applied ones (all of them when none applied).
Shape typical_shape(const std::vector<Shape>& shapes);

// Table columns step_bench and scale_bench share: each resource's seconds
// with the CPU's parts, and the isolated rates.
inline constexpr const char* kResourcesHeader =
    "  device      h2d      d2h     disk      cpu   cpu(tiled)   cpu = grad pass + adam + crc + host device "
    "(h2d + d2h + kernels)";
std::string resources_row(const ResTimes& t, const IsoSample& m);
inline constexpr const char* kRatesHeader =
    "read GB/s write GB/s     mixed adam param/s adam GB/s  crc GB/s copy GB/s host h2d host d2h";
std::string rates_row(const IsoSample& m, std::int64_t params, std::uint64_t fixed_copy_bytes);

// JSON: the seconds of each resource (`<name>_s`), a step's bytes, and one
// isolated sample with its rates (params: the model's, for Adam's rates;
// fixed_copy_bytes: the gradient writes' bytes in copy_s).
void json_resources(JsonWriter& j, std::string_view key, const ResTimes& t);
void json_bytes(JsonWriter& j, std::string_view key, const engine::StepBytes& b);
void json_sample(JsonWriter& j, std::string_view key, const IsoSample& s, std::int64_t params,
                 std::uint64_t fixed_copy_bytes);

// mkdir that accepts an existing directory.
core::Status make_dir(const std::string& path);

}  // namespace strata::bench
