// The engine's configuration: JSON in (DeepSpeed's keys with DeepSpeed's
// meaning, units and defaults, plus strata's own under "strata"), a typed,
// validated, fully resolved Config out. docs/config.md is the reference for
// every key. Config is a thread-compatible value type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace strata::nvme {
class FaultInjector;
}

namespace strata::engine {

enum class OffloadDevice { kNone, kCpu, kNvme };  // "none" (stays on the GPU), "cpu", "nvme"
enum class OptimizerType { kAdam, kAdamW, kAdagrad, kLion };
enum class SchedulerType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };  // "log", "linear"
enum class Precision { kFp32, kBf16, kFp16 };
enum class IoBackend { kAuto, kIoUring, kLibaio, kPsync };  // "auto", "io_uring", "libaio", "psync"
enum class CpuAdamIsa { kAuto, kAvx512Bf16, kAvx512, kAvx2, kScalar };
enum class CpuAdamBind { kAuto, kNuma, kCores, kNone };  // "auto", "numa", "cores", "none"
enum class OverlapMode { kExact, kDelayed, kNone, kSpeculative };  // "exact", "delayed", "none", "speculative"
enum class DeviceKind { kAuto, kCuda, kHost };       // "auto", "cuda", "host"
// bf16/fp32 non-finite gradients: "skip" (skip the step, count it), "error",
// or "apply" (no check, as DeepSpeed's bf16 without check_grad_overflow: the
// step is applied whatever the gradients hold, so that nothing found at
// step_end can change it and "exact" may update during the backward).
enum class NonfinitePolicy { kSkip, kError, kApply };
// How the optimizer's own arrays (not the fp32 master) are stored:
// "fp32" (4 bytes an element each), "bf16" (2: Adam and AdamW's moments),
// "int8_blockwise" (1, and an fp32 scale per block of 256: Adam and AdamW's
// moments; core/numerics.h).
enum class StateFormat { kFp32, kBf16, kInt8Blockwise };
// How bf16 moments are rounded after each update: "nearest_even", or
// "stochastic" (a counter-based draw per element, step and moment, seeded by
// strata.seed: reruns, placements and thread counts stay bit-identical).
enum class StateRounding { kNearestEven, kStochastic };
// Where frozen parameters' compute copies live when the parameters' home is
// nvme (zero_optimization.offload_param.device "nvme"): "swap" (a copy on
// the swap drive, written once), "files" (read straight from the
// safetensors files they were imported from: no copy, no write), or "auto"
// (the files wherever they can be, else the swap drive).
enum class FrozenBase { kAuto, kSwap, kFiles };
// A trainable parameter the framework says got no gradient in any
// micro-batch of a step (Engine::no_grads): "skip" leaves it as it is by that
// step (its weights, moments and step count, as torch's optimizers do), "zero"
// updates it with a zero gradient (its moments decay and weight decay
// applies, as DeepSpeed does).
enum class NoGradPolicy { kSkip, kZero };
// Several data-parallel ranks: where each micro-batch's gradients are summed
// over the ranks. "auto" and "on": on the device, by the device's collective
// library (NCCL on CUDA, Gloo on the host device), so that only the rank's
// fp32 shard of the sum comes down its link; "auto" falls back to the host
// where the build has no such library (CUDA without NCCL), "on" refuses
// then. "off": every rank's gradients come down whole and are summed on the
// host (Gloo over host buffers).
enum class DeviceCollectives { kAuto, kOn, kOff };


std::string_view to_string(OffloadDevice v);
std::string_view to_string(OptimizerType v);
std::string_view to_string(SchedulerType v);
std::string_view to_string(WarmupType v);
std::string_view to_string(Precision v);
std::string_view to_string(IoBackend v);
std::string_view to_string(CpuAdamIsa v);
std::string_view to_string(CpuAdamBind v);
std::string_view to_string(OverlapMode v);
std::string_view to_string(DeviceKind v);
std::string_view to_string(NonfinitePolicy v);
std::string_view to_string(StateFormat v);
std::string_view to_string(StateRounding v);
std::string_view to_string(FrozenBase v);
std::string_view to_string(NoGradPolicy v);
std::string_view to_string(DeviceCollectives v);

// "optimizer": {"type": ..., "params": {...}}. Absent: AdamW with these defaults.
// Adagrad's defaults are DeepSpeed's CPU Adagrad's instead: lr 1e-2, eps 1e-10.
// Adagrad takes no betas and Lion no eps: those fields keep their defaults.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;            // params.lr
  double beta1 = 0.9;          // params.betas[0]
  double beta2 = 0.999;        // params.betas[1]
  double eps = 1e-8;           // params.eps
  double weight_decay = 0.0;   // params.weight_decay
  // params.adam_w_mode (DeepSpeed default true: type "Adam" is AdamW unless
  // this is false). Resolved: true for AdamW, and for Adam unless disabled.
  // Unused by Adagrad and Lion.
  bool adam_w_mode = true;
  bool bias_correction = true;  // params.bias_correction (Adam, AdamW)

  friend bool operator==(const OptimizerConfig&, const OptimizerConfig&) = default;
};

// "scheduler": {"type": ..., "params": {...}} (DeepSpeed's lr_schedules).
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  double warmup_min_lr = 0.0;         // WarmupLR, WarmupDecayLR
  // WarmupLR, WarmupDecayLR. When not given: WarmupLR warms up to the
  // optimizer's lr (current DeepSpeed), WarmupDecayLR to 1e-3 (its default).
  double warmup_max_lr = 1e-3;
  std::int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  std::int64_t total_num_steps = 0;   // WarmupDecayLR, WarmupCosineLR (required there)
  double warmup_min_ratio = 0.0;      // WarmupCosineLR: start lr = ratio x optimizer lr
  double cos_min_ratio = 1e-4;        // WarmupCosineLR: final lr = ratio x optimizer lr

  friend bool operator==(const SchedulerConfig&, const SchedulerConfig&) = default;
};

// The rule a schedule's numbers keep beyond each key's own range: DeepSpeed's
// WarmupCosineLR needs more steps than its warmup (at least 2). The key under
// scheduler.params and what it needs, or nullopt. One rule for the parser
// (strata config, the C API's create, the Python adapter) and LrSchedule.
struct ScheduleRuleBroken {
  std::string_view key;
  std::string expected;
};
std::optional<ScheduleRuleBroken> broken_schedule_rule(const SchedulerConfig& c);

// "fp16": {...}: DeepSpeed's dynamic loss scaler.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;             // 0: dynamic; > 0: static scale
  int initial_scale_power = 16;        // dynamic scale starts at 2^power
  std::int64_t loss_scale_window = 1000;  // steps without overflow before the scale doubles
  int hysteresis = 2;                  // overflows tolerated before the scale halves
  bool consecutive_hysteresis = false; // refill hysteresis after a good step
  double min_loss_scale = 1.0;

  friend bool operator==(const Fp16Config&, const Fp16Config&) = default;
};

// "zero_optimization.offload_optimizer".
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path = "/local_nvme";
  bool pin_memory = false;
  std::int64_t buffer_count = 4;
  bool fast_init = false;
  // DeepSpeed's meaning: the share of the optimizer (by parameters) updated on
  // the CPU; the rest stays and is updated on the GPU. 0 < ratio <= 1.
  double ratio = 1.0;

  friend bool operator==(const OffloadOptimizerConfig&, const OffloadOptimizerConfig&) = default;
};

// "zero_optimization.offload_param".
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path = "/local_nvme";
  bool pin_memory = false;
  std::int64_t buffer_count = 5;
  std::int64_t buffer_size = 100'000'000;  // elements
  // With device nvme: the compute copies' elements kept in CPU memory, whole
  // groups in registration order (plan_layout). DeepSpeed's default is 1e9;
  // strata's 0 keeps every group where `device` says unless a value is written.
  std::int64_t max_in_cpu = 0;  // elements
  // "auto" (strata's): as many groups as strata.budgets.pinned leaves room
  // for, beside everything else it holds and the disk pipeline's ring at its
  // depth (Engine::finalize); needs strata.budgets.pinned.
  bool max_in_cpu_auto = false;

  friend bool operator==(const OffloadParamConfig&, const OffloadParamConfig&) = default;
};

// "zero_optimization". Size keys count elements, as in DeepSpeed.
struct ZeroConfig {
  int stage = 0;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  std::int64_t sub_group_size = 1'000'000'000;               // elements
  std::int64_t stage3_prefetch_bucket_size = 50'000'000;     // elements
  std::int64_t stage3_max_live_parameters = 1'000'000'000;   // elements
  std::int64_t stage3_max_reuse_distance = 1'000'000'000;    // elements
  std::int64_t stage3_param_persistence_threshold = 100'000; // elements
  std::int64_t reduce_bucket_size = 500'000'000;             // elements
  std::int64_t allgather_bucket_size = 500'000'000;          // elements
  bool overlap_comm = false;  // when not given: true at stage 3, else false (DeepSpeed)
  bool contiguous_gradients = true;
  bool stage3_gather_16bit_weights_on_model_save = false;

  friend bool operator==(const ZeroConfig&, const ZeroConfig&) = default;
};

// "aio" (DeepSpeed's async I/O settings).
struct AioConfig {
  std::int64_t block_size = 1'048'576;  // bytes
  std::int64_t queue_depth = 8;
  std::int64_t intra_op_parallelism = 1;  // old name: thread_count
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;

  friend bool operator==(const AioConfig&, const AioConfig&) = default;
};

// "strata.budgets": hard limits in bytes. 0 means "derive": the probed
// capacity of the tier less a safety margin (see docs/config.md).
struct BudgetsConfig {
  std::uint64_t device_bytes = 0;   // device memory the engine may hold
  std::uint64_t pinned_bytes = 0;   // pinned host memory (state, gradients, staging)
  std::uint64_t staging_bytes = 0;  // of pinned: the I/O staging ring
  std::uint64_t disk_bytes = 0;     // swap space over all paths

  friend bool operator==(const BudgetsConfig&, const BudgetsConfig&) = default;
};

// "strata.io".
struct IoConfig {
  IoBackend backend = IoBackend::kAuto;
  // Swap directories. When empty, the DeepSpeed nvme_path(s) of offload_optimizer
  // and offload_param are used; when set, these win (a warning says so if a
  // DeepSpeed nvme_path of an nvme placement differs).
  std::vector<std::string> paths;
  std::uint64_t stripe_bytes = 8ull << 20;  // blocks larger than this are striped over paths
  std::int64_t queue_depth = 32;            // requests in flight per ring
  std::uint64_t block_bytes = 1ull << 20;   // request size; default from aio.block_size
  int rings = 1;                            // io_uring rings (one per I/O thread)
  bool sqpoll = false;
  bool keep_files = false;                  // keep swap files after close
  // Test hook, C++ only (no config key; the JSON parser never sets it): when
  // set, every file the engine reads or writes (swap, checkpoints, export,
  // safetensors import, manifests, `latest`) goes through this injector
  // (nvme/fault_injection.h). Borrowed: it must outlive the engine. Default none.
  nvme::FaultInjector* fault_injector = nullptr;

  friend bool operator==(const IoConfig&, const IoConfig&) = default;
};

// "strata.checkpoint": retention, applied after each save has become `latest`
// (docs/checkpoints.md), and what a checkpoint holds.
struct CheckpointConfig {
  std::int64_t keep_last = 0;   // keep the newest K checkpoints (by step); 0: keep all
  std::int64_t keep_every = 0;  // also keep every checkpoint whose step is a multiple of M; 0: none
  bool keep_base = false;       // save a frozen base read from its files too (else left out, named)

  friend bool operator==(const CheckpointConfig&, const CheckpointConfig&) = default;
};

// "strata.cpu_adam".
struct CpuAdamConfig {
  CpuAdamIsa isa = CpuAdamIsa::kAuto;
  int threads = 0;              // 0: one per physical core of the NUMA node (bind none, cores: of the machine)
  std::int64_t tile_elems = 0;  // 0: chosen by the kernel (a multiple of the norm block)
  // Where the threads run: one per physical core of the NUMA node the
  // optimizer's pinned memory lives on (numa), of every node (cores), or not
  // pinned (none); auto is numa, unpinned where that cannot be done.
  CpuAdamBind bind = CpuAdamBind::kAuto;
  int numa_node = -1;           // bind auto/numa: this node (the OS's number); -1: the memory's node

  friend bool operator==(const CpuAdamConfig&, const CpuAdamConfig&) = default;
};

// "strata.optimizer_state": the format of the optimizer's arrays (the master
// stays fp32). bf16 and int8_blockwise are for Adam and AdamW; rounding
// applies to bf16 only.
struct OptimizerStateConfig {
  StateFormat format = StateFormat::kFp32;
  StateRounding rounding = StateRounding::kNearestEven;

  friend bool operator==(const OptimizerStateConfig&, const OptimizerStateConfig&) = default;
};

// "strata.host_device": the emulated device and its timing model. A rate of 0
// means "instantaneous" (no modelled time).
struct HostDeviceConfig {
  std::uint64_t memory_bytes = 16ull << 30;  // emulated device memory
  double h2d_gbps = 0.0;    // host -> device copies, GB/s (1e9 bytes/s)
  double d2h_gbps = 0.0;    // device -> host copies
  double d2d_gbps = 0.0;    // device -> device copies
  double tflops = 0.0;      // declared compute, 1e12 FLOP/s

  friend bool operator==(const HostDeviceConfig&, const HostDeviceConfig&) = default;
};

// "strata": everything that is not DeepSpeed's.
struct StrataConfig {
  std::uint64_t seed = 0;
  BudgetsConfig budgets;
  std::uint64_t chunk_bytes = 64ull << 20;  // optimizer-state chunk (fp32 master bytes)
  // With offload_optimizer.device = nvme: the share (0..1) of the optimizer
  // state kept in pinned CPU memory; the rest lives on NVMe. Key:
  // "strata.optimizer_cpu_fraction".
  double optimizer_cpu_fraction = 0.0;
  OptimizerStateConfig optimizer_state;
  IoConfig io;
  CheckpointConfig checkpoint;
  bool crc = true;
  // Key "strata.frozen_base" (the enum's comment).
  FrozenBase frozen_base = FrozenBase::kAuto;
  // Key "strata.no_grad" (the enum's comment).
  NoGradPolicy no_grad = NoGradPolicy::kSkip;
  CpuAdamConfig cpu_adam;
  OverlapMode overlap = OverlapMode::kExact;
  DeviceKind device = DeviceKind::kAuto;
  // Key "strata.device_collectives" (the enum's comment).
  DeviceCollectives device_collectives = DeviceCollectives::kAuto;
  HostDeviceConfig host_device;
  NonfinitePolicy nonfinite = NonfinitePolicy::kSkip;  // bf16 / fp32 non-finite gradients
  std::string trace;  // path of a Chrome trace JSON to write; empty: no trace
  bool strict = false;  // unknown keys are errors instead of warnings

  friend bool operator==(const StrataConfig&, const StrataConfig&) = default;
};

// A warning found while parsing: the key path and what strata does about it.
struct ConfigWarning {
  std::string key_path;  // "zero_optimization.offload_optimizer.fast_init"
  std::string message;

  friend bool operator==(const ConfigWarning&, const ConfigWarning&) = default;
};

struct Config {
  // Batch sizes, resolved as DeepSpeed does: train_batch_size = micro_batch
  // x gradient_accumulation_steps x world_size (ParseOptions::world_size).
  std::int64_t train_batch_size = 1;
  std::int64_t train_micro_batch_size_per_gpu = 1;
  std::int64_t gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;  // max global norm; 0: off
  // Data-parallel ranks: ParseOptions::world_size's (no config key), then
  // Engine::create's. A step's gradient is the mean over
  // micro_batches_per_step() micro-batches.
  int world_size = 1;
  std::int64_t micro_batches_per_step() const { return gradient_accumulation_steps * world_size; }

  Precision precision = Precision::kFp32;  // from bf16.enabled / fp16.enabled
  // "communication_data_type": what several ranks' gradients are summed in
  // on the device (strata.device_collectives): fp32, what one rank
  // accumulating forms bit for bit, or bf16 (half the bytes over the links,
  // each sum rounded to bf16 once). On the host they are summed in fp32.
  Precision communication_data_type = Precision::kFp32;
  Fp16Config fp16;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  AioConfig aio;
  StrataConfig strata;

  // Everything the parser warned about (also logged at warn level).
  std::vector<ConfigWarning> warnings;

  // The swap directories the engine uses: strata.io.paths, else the distinct
  // nvme_paths of the placements that use nvme. Empty when nothing is on nvme.
  std::vector<std::string> swap_paths() const;
  // Bytes of one compute-copy element: 2 for bf16/fp16, 4 for fp32.
  int compute_bytes() const { return precision == Precision::kFp32 ? 4 : 2; }

  // Field by field, warnings included.
  friend bool operator==(const Config&, const Config&) = default;
};

struct ParseOptions {
  // Hidden size of the model, when the caller knows it: resolves DeepSpeed's
  // "auto" for reduce_bucket_size (h^2), stage3_prefetch_bucket_size
  // (0.9 h^2) and stage3_param_persistence_threshold (10 h) the way the
  // Hugging Face integration does. 0: unknown (the DeepSpeed defaults apply).
  std::int64_t hidden_size = 0;
  // Number of optimizer steps of the run, when the caller knows it: resolves
  // "auto" for scheduler.params.total_num_steps. 0: unknown ("auto" there is
  // then an error).
  std::int64_t total_num_steps = 0;
  // Overrides "strata.strict" when true.
  bool strict = false;
  // The data-parallel ranks the config is for (DeepSpeed's world size):
  // train_batch_size = train_micro_batch_size_per_gpu x
  // gradient_accumulation_steps x world_size, each rank taking
  // micro-batches of train_micro_batch_size_per_gpu. Sets Config::world_size.
  // The C API and strata.torch pass the engine's ranks.
  int world_size = 1;
};

// Parses and validates a JSON document (comments // and /* */ are allowed, as
// DeepSpeed's hjson loader allows them; duplicate keys are an error, as in
// DeepSpeed). Errors are kInvalidArgument and name the key path, the value and
// what was expected, e.g.
//   zero_optimization.offload_optimizer.device: "gpu" is not one of none, cpu, nvme
// Unknown keys are warnings (errors under strict). Warnings are logged at warn
// level and returned in Config::warnings; "auto" resolutions and keys accepted
// without effect are logged at info level. Thread-safe (no shared state
// besides the logger).
core::Result<Config> parse_config(std::string_view json_text, const ParseOptions& options = {});

// Reads and parses a file; errors name the file (a missing file is kNotFound,
// other read failures follow errno; parse errors keep kInvalidArgument).
core::Result<Config> load_config_file(const std::string& path, const ParseOptions& options = {});

// The resolved configuration as JSON (every key, defaults filled in), the form
// checkpoints store and `strata config` prints. parse_config(to_json(c)),
// with c.world_size as ParseOptions::world_size (train_batch_size counts the
// ranks), gives back c (warnings aside) and warns only where c's values themselves
// warrant it (a non-default value of a key without effect, an nvme_path that
// strata.io.paths overrides): old names and old forms are never written.
// Three keys are written only when they differ from their defaults so that the
// re-parse adds no warning: pin_memory (when true), nvme_path (when not
// "/local_nvme") and strata.optimizer_cpu_fraction (when offload_optimizer
// is on nvme). Returns an empty string only if memory runs out.
std::string to_json(const Config& config);

}  // namespace strata::engine
