// Engine::finalize: the layout, the budgets checked up front (with each
// schedule's extra memory; counted from the layout's chunk runs), every state
// allocated in its home tier, the initial values streamed in group by group,
// and the step's rooms created.
#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/clock.h"
#include "core/logging.h"
#include "core/str.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/engine.h"
#include "engine/internal/engine_entry.h"
#include "engine/internal/engine_util.h"
#include "engine/internal/parallel_fill.h"
#include "engine/fetch/fetcher.h"
#include "engine/step/step.h"
#include "engine/io_options.h"
#include "engine/plan/machine.h"
#include "engine/checkpoint/pretrained.h"
#include "engine/state/compute_homes.h"
#include "engine/state/frozen_files.h"
#include "engine/state/state_store.h"
#include "engine/working_memory.h"
#include "nvme/crc64.h"
#include "nvme/io_backend.h"
#include "nvme/swap_store.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

namespace {

// offload_param.max_in_cpu as the config says it, for messages.
std::string max_in_cpu_text(const Config& c) {
  return c.zero.offload_param.max_in_cpu_auto ? std::string("\"auto\"") : str_cat(c.zero.offload_param.max_in_cpu);
}

// What a schedule's extra copies (Schedule::extra_memory) measure in this
// layout (ExtraShape: compute copies in whole groups).
ExtraShape extra_shape(const Layout& layout) {
  ExtraShape shape;
  shape.nvme_state_bytes = StateStore::nvme_bytes(layout, false);
  for (const GroupPlace& gp : layout.groups) {
    if (gp.chunk_count > 0) shape.trainable_group_compute_bytes += layout.home_bytes(gp);
  }
  // Each group with a chunk on nvme once (runs come in group order).
  std::size_t counted = layout.groups.size();
  for (const ChunkRun& r : layout.chunk_runs) {
    if (r.state_tier != Tier::kNvme || r.group == counted) continue;
    counted = r.group;
    shape.nvme_group_compute_bytes += layout.home_bytes(layout.groups[r.group]);
  }
  return shape;
}

// The swap space this layout's blocks take as the swap store places them
// (each block, a group's compute copies or a chunk's optimizer state in one or
// two versions, rounded up to the direct-I/O alignment): the smallest
// strata.budgets.disk that holds them on one swap path.
std::uint64_t swap_footprint(const Layout& layout, bool two_versions) {
  const auto aligned_state = [&layout](std::int64_t elems) {
    return core::align_up(layout.optimizer.state_bytes(elems), core::kDirectIoAlignment);
  };
  std::uint64_t bytes = 0;
  for (const GroupPlace& g : layout.groups) {
    if (g.compute_tier == Tier::kNvme) {
      bytes += core::align_up(layout.tier_home_bytes(g), core::kDirectIoAlignment);
    }
  }
  for (const ChunkRun& r : layout.chunk_runs) {
    if (r.state_tier == Tier::kNvme) {
      bytes += r.count * (two_versions ? 2 : 1) * aligned_state(r.elems);
    }
  }
  return bytes;
}

// The most device memory a step needs at once beyond the state the
// placement keeps there: a group's fetched compute copies with its gradient
// buffer (a backward on the device holds both; at stage 3 gathering on the
// device, every rank's home while it is unpacked), and beside them a
// device-resident chunk's optimizer step (its gradients and new compute
// copies), which an early job runs during the backward.
std::uint64_t device_working_bytes(const Layout& layout, std::uint64_t align) {
  const auto cb = static_cast<std::uint64_t>(layout.compute_bytes);
  const auto gb = static_cast<std::uint64_t>(layout.grad_bytes);
  const auto buffer = [align](std::uint64_t bytes) { return core::align_up(bytes, align); };
  std::uint64_t backward = 0;
  for (const GroupPlace& gp : layout.groups) {
    const auto elems = static_cast<std::uint64_t>(gp.compute_elems);
    const std::uint64_t fetched = layout.fetched_in_place(gp) ? 0 : buffer(elems * cb);
    const std::uint64_t grads =
        gp.trainable_elems > 0 ? buffer(static_cast<std::uint64_t>(gp.gradient_elems()) * cb) : 0;
    // Stage 3 over ranks gathering on the device: every rank's home beside
    // the fetch's buffer while it is unpacked.
    const std::uint64_t parts = layout.compute_sharded && layout.share.device_collectives
                                    ? buffer(layout.home_bytes(gp) * static_cast<std::uint64_t>(layout.share.ranks))
                                    : 0;
    backward = std::max(backward, fetched + grads + parts);
  }
  std::uint64_t chunk_step = 0;
  for (const ChunkRun& r : layout.chunk_runs) {
    if (r.state_tier != Tier::kDevice) continue;
    const auto elems = static_cast<std::uint64_t>(r.elems);
    chunk_step = std::max(chunk_step, buffer(elems * gb) + buffer(elems * cb));
  }
  return backward + chunk_step;
}

// The device memory the placement's state takes as the device allocates it:
// each compute home and chunk one buffer, charged rounded up to `align`
// (gpu::Device::allocate); with the ranks' gradients summed on the device,
// the gradient path's buffer for it too (held as long as the engine).
std::uint64_t device_state_bytes(const Layout& layout, std::uint64_t align) {
  std::uint64_t bytes = 0;
  for (const GroupPlace& gp : layout.groups) {
    if (gp.compute_tier != Tier::kDevice) continue;
    bytes += core::align_up(layout.home_bytes(gp), align);
  }
  for (const ChunkRun& r : layout.chunk_runs) {
    if (r.state_tier == Tier::kDevice) bytes += r.count * core::align_up(layout.state_bytes(r), align);
  }
  return bytes + device_sums_bytes(layout, align);
}

// A pinned chunk's optimizer state (zero-filled when the store was created,
// so its pages are placed): where CpuAdam looks for its NUMA node. Empty when
// no chunk lives in pinned memory (nvme chunks are updated in the staging
// ring, allocated later: the finalizing thread's node is used then).
std::span<const std::byte> pinned_state_memory(StateStore& state) {
  for (std::size_t i = 0; i < state.chunk_count(); ++i) {
    if (state.tier(i) != Tier::kPinned) continue;
    core::Result<ChunkState> views = state.load(i, {});
    if (views.ok()) return std::as_bytes(views->master());
  }
  return {};
}

// cpu_adam with strata.cpu_adam's ISA, threads, tile and binding; its
// threads near `near_memory` (bind auto/numa without a numa_node), or near
// the GPU of local rank `local_rank` of `local_ranks`, whose cores they
// share with the machine's other ranks on that node.
adam::CpuAdamOptions cpu_adam_options(const Config& config, std::span<const std::byte> near_memory, int local_rank,
                                      int local_ranks) {
  adam::CpuAdamOptions ao;
  switch (config.strata.cpu_adam.isa) {
    case CpuAdamIsa::kAuto: ao.auto_isa = true; break;
    case CpuAdamIsa::kAvx512Bf16: ao.auto_isa = false; ao.isa = adam::Isa::kAvx512Bf16; break;
    case CpuAdamIsa::kAvx512: ao.auto_isa = false; ao.isa = adam::Isa::kAvx512; break;
    case CpuAdamIsa::kAvx2: ao.auto_isa = false; ao.isa = adam::Isa::kAvx2; break;
    case CpuAdamIsa::kScalar: ao.auto_isa = false; ao.isa = adam::Isa::kScalar; break;
  }
  ao.threads = config.strata.cpu_adam.threads;
  ao.tile_elems = config.strata.cpu_adam.tile_elems;
  switch (config.strata.cpu_adam.bind) {
    case CpuAdamBind::kAuto: ao.bind = adam::BindMode::kAuto; break;
    case CpuAdamBind::kNuma: ao.bind = adam::BindMode::kNuma; break;
    case CpuAdamBind::kCores: ao.bind = adam::BindMode::kCores; break;
    case CpuAdamBind::kNone: ao.bind = adam::BindMode::kNone; break;
  }
  ao.numa_node = config.strata.cpu_adam.numa_node;
  ao.near_memory = near_memory;
  ao.local_rank = local_rank;
  ao.local_ranks = local_ranks;
  return ao;
}

core::Result<std::unique_ptr<adam::CpuAdam>> create_cpu_adam(const Config& config,
                                                             std::span<const std::byte> near_memory, int local_rank,
                                                             int local_ranks) {
  core::Result<std::unique_ptr<adam::CpuAdam>> created =
      adam::CpuAdam::create(cpu_adam_options(config, near_memory, local_rank, local_ranks));
  if (!created.ok()) {
    return Status(created.status()).annotate(
        str_cat("strata.cpu_adam (bind \"", to_string(config.strata.cpu_adam.bind), "\", numa_node ",
                config.strata.cpu_adam.numa_node, ", threads ", config.strata.cpu_adam.threads, ")"));
  }
  return created;
}

// What the engine reports of the CPU optimizer's threads.
CpuThreads cpu_threads_of(const adam::CoreBinding& b, int pinned_memory_node) {
  std::string description = b.describe();
  if (pinned_memory_node >= 0) description += str_cat("; pinned memory on NUMA node ", pinned_memory_node);
  return {.threads = b.threads,
          .pinned = b.bound,
          .numa_node = b.numa_node,
          .pinned_memory_node = pinned_memory_node,
          .description = std::move(description)};
}

// The NUMA node this rank's pinned memory goes on (CoreBinding::memory_node:
// its GPU's node with several local ranks, or strata.cpu_adam.numa_node, on a
// machine of several nodes), or -1 to leave it where first touched. The
// binding's errors are create_cpu_adam's to report.
int pinned_memory_node(const Config& config, int local_rank, int local_ranks) {
  core::Result<adam::CoreBinding> plan =
      adam::plan_core_binding(cpu_adam_options(config, {}, local_rank, local_ranks));
  return plan.ok() ? plan->memory_node : -1;
}

}  // namespace

core::Status Engine::finalize() {
  STRATA_ENGINE_ENTRY("finalize");
  if (finalized_) return Status::failed_precondition("finalize called twice");
  if (!finalize_failure_.empty()) {
    return Status::failed_precondition(
        str_cat("finalize after a failed finalize (", finalize_failure_, "): create a new engine"));
  }
  // With several ranks, every rank first says how it starts (a rank that
  // calls finalize_from_checkpoint instead is named, not waited for).
  Status s = ranks_.share.ranks > 1 ? agree_on_start("finalize", Status(), std::nullopt) : Status();
  if (s.ok()) s = finalize_locked();
  if (!s.ok()) {
    // One finalize per engine: what the failed one built goes now (the swap
    // files and their lock among it), not when the engine is destroyed.
    finalize_failure_ = std::string(s.message());
    release_after_failed_finalize();
  }
  return s;
}

void Engine::release_after_failed_finalize() {
  finalized_ = false;
  fetcher_.reset();
  homes_.reset();
  frozen_files_.reset();  // its open files (homes_ borrowed it)
  state_.reset();
  cpu_adam_.reset();
  cpu_threads_ = {};
  if (device_cache_ != nullptr) device_cache_->clear().ignore_error();  // errors were reported where they arose
  if (pinned_cache_ != nullptr) pinned_cache_->clear().ignore_error();
  swap_.reset();  // its files and the swap paths' locks
}

core::Status Engine::finalize_prepare(const core::Stopwatch& total, Prepared& out) {
  // The layout's chunks are counted from their runs until the budgets and
  // the swap space are known to hold them; only then are they listed (one
  // entry per chunk), so a model far over the budgets is refused from memory
  // bounded by its parameters and groups.
  STRATA_ASSIGN_OR_RETURN(layout_, plan_layout_runs(registry_.params, registry_.optimizer_groups, config_, ranks_.share));
  STRATA_RETURN_IF_ERROR(check_initial_values());
  // A frozen base's home may be the safetensors files it comes from
  // (strata.frozen_base), which the budgets then leave out.
  std::vector<bool> from_files(layout_.params.size());
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) from_files[pi] = !registry_.inits[pi];
  STRATA_RETURN_IF_ERROR(FrozenFiles::choose(layout_, config_.strata.frozen_base, registry_.pretrained != nullptr,
                                             from_files, config_.zero.offload_param.device));
  STRATA_ASSIGN_OR_RETURN(out.needs, check_budgets());
  const OffloadParamConfig& op = config_.zero.offload_param;
  if (op.device == OffloadDevice::kNvme && op.max_in_cpu_auto) {
    // "auto": the homes that fit in what the pinned budget leaves beside
    // everything else (the ring at its depth). Keeping them only lowers the
    // other pinned needs (no staging for them), so the budgets hold again;
    // the frozen bases are chosen anew (a kept group is not read from files).
    keep_compute_homes_in_pinned(layout_,
                                 static_cast<std::int64_t>(out.needs.pinned_spare /
                                                           static_cast<std::uint64_t>(layout_.compute_bytes)),
                                 /*without_frozen=*/config_.strata.frozen_base == FrozenBase::kFiles);
    STRATA_RETURN_IF_ERROR(FrozenFiles::choose(layout_, config_.strata.frozen_base, registry_.pretrained != nullptr,
                                               from_files, op.device));
    STRATA_ASSIGN_OR_RETURN(out.needs, check_budgets());
  }
  if (op.device == OffloadDevice::kNvme && (op.max_in_cpu > 0 || op.max_in_cpu_auto)) {
    std::size_t kept = 0;
    std::uint64_t kept_bytes = 0, nvme_bytes = 0;
    for (const GroupPlace& gp : layout_.groups) {
      if (gp.compute_tier == Tier::kPinned) {
        ++kept;
        kept_bytes += layout_.home_bytes(gp);
      } else {
        nvme_bytes += layout_.tier_home_bytes(gp);
      }
    }
    STRATA_LOG(kInfo) << "compute copies: " << kept << " of " << layout_.groups.size() << " groups ("
                      << core::format_bytes(kept_bytes) << ") in pinned memory by zero_optimization.offload_param."
                      << "max_in_cpu = " << max_in_cpu_text(config_) << ", the rest (" << core::format_bytes(nvme_bytes)
                      << ") on nvme";
  }
  // Every pinned buffer from here on (the swap's staging, the state, the
  // caches) on the node the optimizer's threads will run on, where that node
  // is known before the memory is (DESIGN.md section 10).
  const int memory_node = pinned_memory_node(config_, ranks_.local_rank, ranks_.local_ranks);
  dev().set_pinned_numa_node(memory_node);
  if (out.needs.tiers.nvme > 0) STRATA_RETURN_IF_ERROR(open_swap_store(out.needs));
  expand_chunks(layout_);
  out.planned_s = total.elapsed_s();
  STRATA_ASSIGN_OR_RETURN(state_, StateStore::create(layout_, dev(), swap_.get(),
                                                     {.two_versions = schedule_.second_state_version(),
                                                      .defer_pinned = true,
                                                      .nvme_unwritten = true}));
  out.state_s = total.elapsed_s() - out.planned_s;
  STRATA_ASSIGN_OR_RETURN(cpu_adam_, create_cpu_adam(config_, pinned_state_memory(*state_), ranks_.local_rank,
                                                     ranks_.local_ranks));
  // The rest of the pinned state allocated and zero-filled by CpuAdam's
  // threads, in parallel, where they run, before it is locked.
  const core::Stopwatch zeroing;
  STRATA_RETURN_IF_ERROR(state_->allocate_deferred(zero_fill(*cpu_adam_)));
  out.zero_s = zeroing.elapsed_s();
  cpu_threads_ = cpu_threads_of(cpu_adam_->binding(), memory_node);
  STRATA_LOG(kInfo) << "cpu_adam: " << cpu_threads_.description << " (strata.cpu_adam.bind \""
                    << to_string(config_.strata.cpu_adam.bind) << "\")";
  STRATA_ASSIGN_OR_RETURN(out.gradients,
                          GradientPath::create({.layout = layout_,
                                                .precision = config_.precision,
                                                .device = dev(),
                                                .cpu_adam = *cpu_adam_,
                                                .turns = *cpu_turns_,
                                                .device_cache = *device_cache_,
                                                .pinned_cache = *pinned_cache_,
                                                .trace = trace_,
                                                .inline_lane = step_lane(),
                                                .ranks = ranks_.grads.get(),
                                                .micro_steps = config_.gradient_accumulation_steps,
                                                .device_ranks = ranks_.device.get(),
                                                .launch_order = ranks_.launch_order.get()},
                                               schedule_.threaded()));

  // Compute homes, then the initial values group by group (the host holds one
  // group's fp32 values at a time).
  out.homes_t0 = total.elapsed_s();
  // A sharded home's gathers run on the caller's thread (fetch, read_compute,
  // export), over the communicator the caller's calls use.
  if (registry_.pretrained != nullptr) frozen_files_ = FrozenFiles::create(*registry_.pretrained, layout_, config_);
  STRATA_ASSIGN_OR_RETURN(homes_, ComputeHomes::create(layout_, dev(), swap_.get(), *pinned_cache_, trace_,
                                                       layout_.compute_sharded ? ranks_.weights.get() : nullptr,
                                                       frozen_files_.get(), zero_fill(*cpu_adam_)));
  return Status();
}

core::Status Engine::finalize_locked() {
  core::Stopwatch total;
  Prepared p;
  // With several ranks a failure before the initial values still takes part
  // in their vote (check_same_start), so that the others fail at once,
  // naming this rank, instead of waiting for it to the timeout.
  if (Status prepared = finalize_prepare(total, p); !prepared.ok()) {
    return ranks_.share.ranks > 1 ? check_same_start(std::move(prepared), 0) : prepared;
  }
  const double planned_s = p.planned_s, state_s = p.state_s, zero_s = p.zero_s, homes_t0 = p.homes_t0;
  const Needs& needs = p.needs;
  std::unique_ptr<GradientPath> gradients = std::move(p.gradients);
  const double values_t0 = total.elapsed_s();
  auto left_to_checkpoint = [&]() -> std::string {
    if (!values_from_checkpoint_) return "";
    std::size_t n = 0;
    for (std::size_t g = 0; g < layout_.groups.size(); ++g) n += values_left_to_checkpoint(g) ? 1 : 0;
    return str_cat("; ", n, " of ", layout_.groups.size(), " groups left to the checkpoint");
  };
  finalized_ = true;  // the loaders below use the finalized paths
  finalizing_ = true;
  double sources_s = 0.0;
  std::uint64_t fingerprint = 0;
  Status s = write_initial_values(&sources_s, &fingerprint);
  finalizing_ = false;
  // Where finalize's time went (minutes for billions of parameters): one line.
  std::int64_t elems = 0;
  for (const auto& p : layout_.params) elems += p.numel();
  std::uint64_t pinned = 0;
  for (const ChunkPlace& c : layout_.chunks) pinned += c.state_tier == Tier::kPinned ? layout_.state_bytes(c) : 0;
  auto secs = [](double t) {
    char b[32];
    std::snprintf(b, sizeof b, "%.2f s", t);
    return std::string(b);
  };
  STRATA_LOG(kInfo) << "finalize: " << elems << " parameter elements in " << secs(total.elapsed_s())
                    << ": layout and budgets " << secs(planned_s) << ", optimizer state " << secs(state_s) << " ("
                    << core::format_bytes(pinned) << " of it pinned, allocated and zeroed in " << secs(zero_s) << " by "
                    << cpu_threads_.threads << " thread(s)), the CPU optimizer and gradient path "
                    << secs(homes_t0 - planned_s - state_s - zero_s) << ", compute homes "
                    << secs(values_t0 - homes_t0) << ", initial values " << secs(total.elapsed_s() - values_t0)
                    << " (of them " << secs(sources_s) << " in the init callbacks and pretrained files"
                    << left_to_checkpoint() << ")";
  step_->forget_traffic();  // initialisation is not a step's traffic
  // Last: the initial values' staging goes back first (the ring is
  // allocated directly, past the cache).
  if (s.ok()) s = pinned_cache_->clear();
  return start_step(std::move(gradients), needs.ring_room, std::move(s), fingerprint);
}

namespace {

// The settings every rank of a run must share: the collectives each step and
// fetch issues, and the verdicts every rank takes alike, follow from them
// (another placement, budget or live limit on a rank is its own business).
struct SharedSetting {
  const char* key;
  std::uint64_t bits;  // the value, compared
  std::string shown;  // the value as the config says it; empty for a setting of several values
};

// A CRC64 of values, for a setting of several.
std::uint64_t crc_of(std::initializer_list<std::uint64_t> values, std::uint64_t crc = 0) {
  for (const std::uint64_t v : values) crc = nvme::crc64(crc, std::as_bytes(std::span<const std::uint64_t>(&v, 1)));
  return crc;
}

std::vector<SharedSetting> shared_settings(const Config& c, const std::vector<OptimizerGroupDesc>& groups) {
  const auto d = [](double x) { return std::bit_cast<std::uint64_t>(x); };
  const auto u = [](auto x) { return static_cast<std::uint64_t>(x); };
  const OptimizerConfig& o = c.optimizer;
  const SchedulerConfig& s = c.scheduler;
  const Fp16Config& f = c.fp16;
  std::uint64_t group_crc = crc_of({groups.size()});
  for (const OptimizerGroupDesc& g : groups) group_crc = crc_of({d(g.weight_decay), d(g.lr_scale)}, group_crc);
  return {
      {"optimizer.params (betas, eps, adam_w_mode, bias_correction)",
       crc_of({d(o.beta1), d(o.beta2), d(o.eps), u(o.adam_w_mode), u(o.bias_correction)}), ""},
      {"scheduler", crc_of({u(s.type), d(s.warmup_min_lr), d(s.warmup_max_lr), u(s.warmup_num_steps),
                            u(s.warmup_type), u(s.total_num_steps), d(s.warmup_min_ratio), d(s.cos_min_ratio)}),
       ""},
      {"fp16 (the loss scaler's settings)",
       c.precision != Precision::kFp16
           ? 0
           : crc_of({d(f.loss_scale), u(f.initial_scale_power), u(f.loss_scale_window), u(f.hysteresis),
                     u(f.consecutive_hysteresis), d(f.min_loss_scale)}),
       ""},
      {"the optimizer groups (add_optimizer_group: weight_decay, lr_scale)", group_crc, ""},
      {"zero_optimization.stage", u(c.zero.stage), str_cat(c.zero.stage)},
      {"strata.overlap", u(c.strata.overlap), std::string(to_string(c.strata.overlap))},
      {"the precision (bf16.enabled, fp16.enabled)", u(c.precision), std::string(to_string(c.precision))},
      {"gradient_accumulation_steps", u(c.gradient_accumulation_steps), str_cat(c.gradient_accumulation_steps)},
      {"train_micro_batch_size_per_gpu", u(c.train_micro_batch_size_per_gpu),
       str_cat(c.train_micro_batch_size_per_gpu)},
      {"gradient_clipping", d(c.gradient_clipping), str_cat(c.gradient_clipping)},
      {"strata.nonfinite", u(c.strata.nonfinite), std::string(to_string(c.strata.nonfinite))},
      {"strata.no_grad", u(c.strata.no_grad), std::string(to_string(c.strata.no_grad))},
      {"optimizer.type", u(c.optimizer.type), std::string(to_string(c.optimizer.type))},
      {"optimizer.params.lr", d(c.optimizer.lr), str_cat(c.optimizer.lr)},
      {"optimizer.params.weight_decay", d(c.optimizer.weight_decay), str_cat(c.optimizer.weight_decay)},
      {"strata.optimizer_state.format", u(c.strata.optimizer_state.format),
       std::string(to_string(c.strata.optimizer_state.format))},
      // Stage 3's prefetch gathers: which groups every rank gathers.
      {"zero_optimization.stage3_prefetch_bucket_size", u(c.zero.stage3_prefetch_bucket_size),
       str_cat(c.zero.stage3_prefetch_bucket_size)},
      {"communication_data_type", u(c.communication_data_type), std::string(to_string(c.communication_data_type))},
  };
}

}  // namespace

core::Status Engine::check_same_start(core::Status written, std::uint64_t fingerprint) {
  // Each rank wrote its own compute copies and its shard's masters: they
  // train one model only if they all started from the same values, with the
  // same settings. Every rank agrees, whether its own values were written or
  // not, so that a rank whose init callback failed fails the others at once,
  // naming it; then the shared settings (a rank configured otherwise would
  // issue other collectives: named here rather than hanging later), then
  // the values.
  const std::vector<SharedSetting> settings = shared_settings(config_, registry_.optimizer_groups);
  std::uint64_t settings_crc = 0;
  for (const SharedSetting& s : settings) settings_crc = crc_of({s.bits}, settings_crc);
  std::vector<std::uint64_t> theirs;
  STRATA_RETURN_IF_ERROR(agree("finalize", "preparing its state or writing its initial values", written,
                               settings_crc, &theirs));
  for (std::size_t k = 0; k < theirs.size(); ++k) {
    if (theirs[k] == settings_crc) continue;
    // Which setting: every rank's values gathered (each rank reaches this, as
    // every rank saw the same CRCs).
    std::vector<std::uint64_t> mine, all(settings.size() * theirs.size());
    for (const SharedSetting& s : settings) mine.push_back(s.bits);
    STRATA_RETURN_IF_ERROR(ranks_.weights->all_gather(mine.data(), all.data(), mine.size(), partition::DType::kI64)
                               .annotate("finalize: comparing the ranks' settings"));
    for (std::size_t r = 0; r < theirs.size(); ++r) {
      for (std::size_t i = 0; i < settings.size(); ++i) {
        if (all[r * settings.size() + i] == all[i]) continue;
        return Status::failed_precondition(str_cat(
            "finalize: rank ", r, "'s ", settings[i].key, " differs from rank 0's",
            settings[i].shown.empty() ? std::string() : str_cat(" (", settings[i].shown, " on rank ", ranks_.share.rank, ")"),
            ": every rank must run with the same config (the steps' collectives and verdicts follow from it)"));
      }
    }
  }
  std::vector<std::uint64_t> all;
  STRATA_RETURN_IF_ERROR(agree("finalize", "writing its initial values", Status(), fingerprint, &all));
  for (std::size_t k = 0; k < all.size(); ++k) {
    if (all[k] != all[0]) {
      return Status::failed_precondition(str_cat(
          "finalize: rank ", k, "'s initial values differ from rank 0's (CRC64 ", all[k], " vs ", all[0],
          "): every rank must register the same parameters with the same values (seed every rank alike, or load "
          "the same pretrained weights)"));
    }
  }
  return Status();
}

core::Status Engine::check_initial_values() const {
  // Where initial values come from, before anything is allocated.
  for (std::size_t pi = 0; pi < registry_.params.size(); ++pi) {
    if (registry_.inits[pi]) continue;
    if (registry_.pretrained == nullptr) {
      return Status::failed_precondition(str_cat("parameter '", registry_.params[pi].name,
                                                 "' has no init callback and there are no safetensors files to take "
                                                 "its initial values from (strata_init_from_safetensors)"));
    }
    STRATA_RETURN_IF_ERROR(registry_.pretrained->check_param(registry_.params[pi]));
  }
  if (registry_.pretrained != nullptr) STRATA_RETURN_IF_ERROR(registry_.pretrained->check_extra(registry_.params));
  return Status();
}

core::Result<Engine::Needs> Engine::check_budgets() const {
  // Budgets up front, with the numbers (the allocations below enforce them too).
  Needs needs;
  TierBytes& need = needs.tiers;
  need = layout_.bytes();
  // What the schedule holds beyond the placement's state, and why.
  std::string pinned_why;
  std::string& nvme_why = needs.nvme_why;
  // Compute homes offload_param.max_in_cpu keeps in pinned memory instead of nvme.
  if (config_.zero.offload_param.device == OffloadDevice::kNvme) {
    std::uint64_t kept = 0;
    for (const GroupPlace& gp : layout_.groups) kept += gp.compute_tier == Tier::kPinned ? layout_.home_bytes(gp) : 0;
    if (kept > 0) {
      pinned_why = str_cat(" (", core::format_bytes(kept), " of it compute copies that zero_optimization.offload_param."
                           "max_in_cpu = ", max_in_cpu_text(config_), " keeps there)");
    }
  }
  const ExtraShape extra = extra_shape(layout_);
  for (const ScheduleExtra& x : schedule_.extra_memory()) {
    const std::uint64_t bytes = extra_bytes(x.basis, extra);
    if (x.tier == Tier::kNvme) {
      need.nvme += bytes;
      nvme_why = str_cat(" (with ", x.why, ")");
    } else {
      need.pinned += bytes;
      pinned_why += str_cat(" (with ", x.why, ")");
    }
  }
  // The smallest device budget that works: the state kept there plus the
  // most one group's backward holds at once (its compute copies with its
  // gradient buffer), which every training step needs; refused below it.
  const std::uint64_t device_align = dev().caps().allocation_alignment_bytes;
  need.device = device_state_bytes(layout_, device_align);
  const std::uint64_t device_working = device_working_bytes(layout_, device_align);
  const std::uint64_t device_least = need.device + device_working;
  if (device_least > shared_device_->device_budget.limit_bytes()) {
    return Status::resource_exhausted(str_cat(
        "this placement keeps ", core::format_bytes(need.device), " of state on the device, and a step needs up "
        "to ", core::format_bytes(device_working), " more (a group's compute copies with its gradients, and a "
        "device chunk's update beside them); "
        "strata.budgets.device allows ", core::format_bytes(shared_device_->device_budget.limit_bytes()),
        ": strata.budgets.device >= ", device_least, " (", core::format_bytes(device_least),
        ") works for a framework that holds one group at a time (more groups at once, more). Or offload more "
        "(zero_optimization.offload_*)"));
  }
  // The smallest pinned budget that works: the state, the step's working
  // memory (reserved here, so a step never runs out of it) and one slot of
  // the disk pipeline's ring (or the slots strata.budgets.staging asks for);
  // a derived ring takes what is left, up to its depth.
  const std::uint64_t pinned_limit = shared_device_->pinned_budget.limit_bytes();
  // Early jobs as the step runs them (Step::early_jobs).
  const bool early_jobs = schedule_.early_jobs(StepRules::of(config_));
  const PinnedWorking pinned_working = pinned_working_bytes(layout_, schedule_.threaded(), early_jobs);
  const RingShape ring = ring_shape(layout_);
  const std::uint64_t slot = ring.slot_bytes;
  // memory_model.h's pinned_least (the least ring: ring_slots with no pinned
  // room left); need.pinned holds the schedule's extra pinned memory by now.
  const PinnedLeast least = pinned_least(need.pinned, pinned_working,
                                         {.shape = ring,
                                          .staging_bytes = config_.strata.budgets.staging_bytes,
                                          .depth = static_cast<std::uint64_t>(schedule_.ring_depth())});
  const std::uint64_t ring_least = least.ring_bytes;
  const std::uint64_t pinned_least = least.bytes;
  if (pinned_least > pinned_limit) {
    std::string ring_text;
    if (ring_least > 0) {
      ring_text = str_cat(", ", ring_least == slot ? "one slot" : "the slots strata.budgets.staging asks for",
                          " of the disk pipeline's staging ring ", core::format_bytes(ring_least));
    }
    return Status::resource_exhausted(str_cat(
        "this placement keeps ", core::format_bytes(need.pinned), " of state in pinned memory", pinned_why,
        ", and the step works in ", core::format_bytes(pinned_working.total()), " more (gradient staging ",
        core::format_bytes(pinned_working.gradient_staging), ", compute copies' staging ",
        core::format_bytes(pinned_working.compute_staging + pinned_working.optimizer_copies),
        ", between steps ", core::format_bytes(pinned_working.between_steps), ")", ring_text,
        "; strata.budgets.pinned allows ", core::format_bytes(pinned_limit), ": strata.budgets.pinned >= ",
        pinned_least, " (", core::format_bytes(pinned_least), ") works. Or put more on nvme "
        "(zero_optimization.offload_optimizer / offload_param), or lower strata.chunk_bytes"));
  }
  needs.ring_room = ring_room_bytes(pinned_limit, need.pinned, pinned_working);
  const RingSlots full_ring = ring_slots({.shape = ring,
                                         .staging_bytes = config_.strata.budgets.staging_bytes,
                                         .pinned_room_bytes = kNoRoomLimit,
                                         .depth = static_cast<std::uint64_t>(schedule_.ring_depth())});
  const std::uint64_t with_full_ring = need.pinned + pinned_working.total() + full_ring.bytes();
  needs.pinned_spare = pinned_limit > with_full_ring ? pinned_limit - with_full_ring : 0;
  return needs;
}

core::Status Engine::open_swap_store(const Needs& needs) {
  const TierBytes& need = needs.tiers;
  const std::string& nvme_why = needs.nvme_why;
  nvme::SwapStoreOptions o;
  o.paths = config_.swap_paths();
  if (layout_.share.ranks > 1) {
    // Each rank swaps under its own folder of every swap path.
    for (std::string& p : o.paths) {
      p = str_cat(p, "/rank-", layout_.share.rank);
      if (::mkdir(p.c_str(), 0700) == 0) {
        made_swap_dirs_.push_back(p);  // removed with the engine, once its files are
      } else if (errno != EEXIST) {
        return Status::from_errno(errno, str_cat("rank ", layout_.share.rank, ": creating its swap folder ", p));
      }
    }
  }
  const std::uint64_t wanted = swap_files_bytes(need.nvme);
  const std::uint64_t budget = config_.strata.budgets.disk_bytes;
  // The smallest disk budget that holds this placement, said in every
  // message about swap space.
  const std::uint64_t footprint = swap_footprint(layout_, schedule_.second_state_version());
  const std::string least = str_cat(
      "this placement keeps ", core::format_bytes(need.nvme), " on nvme", nvme_why,
      ": strata.budgets.disk >= ", footprint, " (", core::format_bytes(footprint), ", its blocks aligned",
      o.paths.size() > 1 ? "; more where several swap paths split it" : "", ") fits it");
  if (budget != 0 && budget < footprint) {
    return Status::resource_exhausted(str_cat("strata.budgets.disk = ", budget, " (",
                                              core::format_bytes(budget), ") is too small: ", least));
  }
  o.capacity_bytes = budget != 0 ? budget : wanted;
  o.stripe_bytes = config_.strata.io.stripe_bytes;
  o.request_bytes = config_.strata.io.block_bytes;
  o.crc = config_.strata.crc;
  o.keep_files = config_.strata.io.keep_files;
  o.io = io_backend_options(config_.strata.io);
  core::Result<std::unique_ptr<nvme::SwapStore>> store = nvme::SwapStore::create(o);
  if (!store.ok() && store.status().code() == core::StatusCode::kResourceExhausted) {
    // Too little free space for the swap files: say how much is asked, why,
    // and the smallest budget that would do.
    std::string free_text;
    core::Result<std::vector<DiskSpace>> disks = probe_disk_space(o.paths);
    if (disks.ok()) free_text = str_cat(" (", core::format_bytes(counted_free_bytes(*disks)), " free)");
    return Status::resource_exhausted(
        str_cat("the swap paths have too little free space", free_text, " for ",
                core::format_bytes(o.capacity_bytes), " of swap files (",
                budget != 0 ? "strata.budgets.disk"
                            : str_cat("strata.budgets.disk unset: the placement's ",
                                      core::format_bytes(need.nvme), " + 1/16 + 64 MiB of room"),
                "); ", least, ", or free some space"));
  }
  STRATA_ASSIGN_OR_RETURN(swap_, std::move(store));
  return Status();
}

core::Status Engine::start_step(std::unique_ptr<GradientPath> gradients, std::uint64_t ring_room,
                                core::Status ready, std::uint64_t fingerprint) {
  // What may fail is built first; with several ranks every rank then votes
  // (check_same_start), so that one failing here stops them all at once.
  // (Declared in the order they are built: each is destroyed before what it uses.)
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<OptimizerRunner> runner;
  std::unique_ptr<Fetcher> fetcher;
  if (ready.ok()) ready = build_step(*gradients, ring_room, optimizer, runner, fetcher);
  if (layout_.share.ranks > 1) ready = check_same_start(std::move(ready), fingerprint);
  STRATA_RETURN_IF_ERROR(ready);
  fetcher_ = std::move(fetcher);
  step_->start({.gradients = std::move(gradients),
                .optimizer = std::move(optimizer),
                .runner = std::move(runner),
                .fetcher = *fetcher_,
                .homes = *homes_,
                .state = *state_,
                .swap = swap_.get()});
  return Status();
}

core::Status Engine::build_step(GradientPath& gradients, std::uint64_t ring_room, std::unique_ptr<Optimizer>& optimizer,
                                std::unique_ptr<OptimizerRunner>& runner, std::unique_ptr<Fetcher>& fetcher) {
  STRATA_ASSIGN_OR_RETURN(optimizer,
                          Optimizer::create({.layout = layout_,
                                             .config = config_,
                                             .device = dev(),
                                             .cpu_adam = *cpu_adam_,
                                             .turns = *cpu_turns_,
                                             .state = *state_,
                                             .homes = *homes_,
                                             .gradients = gradients,
                                             .device_cache = *device_cache_,
                                             .pinned_cache = *pinned_cache_,
                                             .trace = trace_,
                                             .staging_budget = shared_device_->staging_budget,
                                             .pinned_room = ring_room,
                                             .ranks = ranks_.weights.get()},
                                            schedule_.ring_depth()));
  Optimizer* body = optimizer.get();
  runner = std::make_unique<OptimizerRunner>(layout_.groups.size(), schedule_.threaded(),
                                                  [body](OptimizerJob& job) { return body->run(job); });
  optimizer->set_runner(*runner);
  STRATA_ASSIGN_OR_RETURN(fetcher, Fetcher::create({.layout = layout_,
                                                       .config = config_,
                                                       .schedule = schedule_,
                                                       .device = dev(),
                                                       .homes = *homes_,
                                                       .runner = *runner,
                                                       .gradients = gradients,
                                                       .device_cache = *device_cache_,
                                                       .pinned_cache = *pinned_cache_,
                                                       .trace = trace_,
                                                       .stream = stream_,
                                                       .device_ranks = layout_.compute_sharded
                                                                           ? ranks_.device_fetches.get()
                                                                           : nullptr,
                                                       .launch_order = ranks_.launch_order.get(),
                                                       .prefetch_ranks = layout_.compute_sharded
                                                                             ? ranks_.prefetches.get()
                                                                             : nullptr,
                                                       .device_prefetch_ranks = layout_.compute_sharded
                                                                                    ? ranks_.device_prefetches.get()
                                                                                    : nullptr}));
  return Status();
}

core::Status Engine::write_initial_values(double* sources_s, std::uint64_t* fingerprint) {
  const int cb = layout_.compute_bytes;
  // Safetensors files come in through the nvme engine, as checkpoints do;
  // each is open from the first group that reads it to the last.
  // Destruction order: the stream (it owns the files) before the backend.
  std::unique_ptr<nvme::IoBackend> backend;
  std::unique_ptr<PretrainedWeights::Stream> pretrained;
  if (registry_.pretrained != nullptr) {
    auto created = nvme::IoBackend::create(io_backend_options(config_.strata.io));
    if (!created.ok()) return std::move(created).status().annotate("reading initial values");
    backend = std::move(created).value();
    pretrained = std::make_unique<PretrainedWeights::Stream>(*registry_.pretrained, *backend,
                                                             direct_file_options(config_.strata.io));
    for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
      if (values_left_to_checkpoint(g)) continue;
      for (std::size_t pi : layout_.groups[g].params) {
        if (!registry_.inits[pi]) pretrained->plan(g, layout_.params[pi].name);
      }
    }
  }
  // One buffer holds a group's fp32 values, reused from group to group (its
  // pages brought in once: a buffer made for each group took a third of
  // the engine's part of this on one thread), each parameter's values on a
  // cache line of their own (a callback may use aligned vector stores); the
  // copies, conversions and zero-fills run on CpuAdam's threads.
  constexpr std::size_t kLineFloats = core::kCacheLineBytes / sizeof(float);
  auto line_floats = [&](std::size_t pi) {
    return core::align_up(static_cast<std::size_t>(layout_.params[pi].numel()), kLineFloats);
  };
  std::size_t largest = 0;
  for (const GroupPlace& gp : layout_.groups) {
    std::size_t n = 0;
    for (std::size_t pi : gp.params) n += line_floats(pi);
    largest = std::max(largest, n);
  }
  STRATA_ASSIGN_OR_RETURN(core::AlignedBuffer buffer,
                          core::AlignedBuffer::allocate(largest * sizeof(float), core::kCacheLineBytes));
  adam::CpuAdam& threads = *cpu_adam_;
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    // (Its nvme blocks stay unwritten, its pinned and device homes zero,
    // until the load writes them whole; nothing reads them before.)
    if (values_left_to_checkpoint(g)) continue;
    const GroupPlace& gp = layout_.groups[g];
    std::map<std::size_t, std::span<float>> values;  // by parameter index
    std::size_t at = 0;
    for (std::size_t pi : gp.params) {
      const std::span<float> v = buffer.as<float>().subspan(at, static_cast<std::size_t>(layout_.params[pi].numel()));
      at += line_floats(pi);
      values[pi] = v;
      parallel_zero(threads, std::as_writable_bytes(v));
      Status s;
      const core::Stopwatch source;
      if (registry_.inits[pi]) {
        // The callback runs without the lock (calls into the engine meanwhile
        // see finalizing_ and fail).
        const InitFn& init = registry_.inits[pi];  // (registration is over: finalize refuses it)
        mu_.unlock();
        s = init(v);
        mu_.lock();
      } else {
        s = pretrained->read(layout_.params[pi], v);
      }
      *sources_s += source.elapsed_s();
      if (!s.ok()) return std::move(s).annotate(str_cat("initializing parameter '", layout_.params[pi].name, "'"));
    }
    if (pretrained != nullptr) pretrained->end_group(g);
    if (layout_.share.ranks > 1) {
      for (const auto& [pi, v] : values) *fingerprint = nvme::crc64(*fingerprint, std::as_bytes(v));
    }
    // The group's home as it is kept: its compute copies whole, or (stage
    // 3 over ranks) this rank's shard of them, converted from the values
    // straight into its place (padding zero): the staging holds the home
    // alone, as a checkpoint's load does.
    gpu::PinnedBuffer staging;
    const std::uint64_t bytes = homes_->bytes(g);
    std::span<std::byte> host;
    if (gp.compute_tier == Tier::kPinned) {
      host = homes_->pinned_home(g).bytes();
    } else {
      STRATA_ASSIGN_OR_RETURN(staging, pinned_cache_->get(core::align_up(bytes, core::kDirectIoAlignment),
                                                          "compute staging"));
      host = staging.bytes().first(bytes);
    }
    // (A pinned home was zero-filled when it was allocated.)
    if (gp.compute_tier != Tier::kPinned) parallel_zero(threads, host);
    for (const auto& [pi, v] : values) {
      std::span<const float> src = v;
      std::byte* dst = host.data() + layout_.places[pi].compute_offset * cb;
      if (layout_.compute_sharded) {
        const Layout::ShardPiece sp = layout_.shard_of(pi, ranks_.share.rank);
        if (sp.lo == sp.hi) continue;
        src = src.subspan(static_cast<std::size_t>(sp.lo), static_cast<std::size_t>(sp.hi - sp.lo));
        dst = host.data() + sp.home * cb;
      }
      threads.for_each_tile(static_cast<std::int64_t>(src.size()), [&](std::int64_t lo, std::int64_t len) {
        to_compute(src.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(len)), dst + lo * cb, cb,
                   config_.precision);
      });
    }
    STRATA_RETURN_IF_ERROR(homes_->commit(g, host, step_lane()));
    pinned_cache_->put(std::move(staging));  // the next group's, where its home is as large
    // Master weights, chunk by chunk (moments start at zero).
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
      const ChunkPlace& cp = layout_.chunks[c];
      gpu::PinnedBuffer cstage;
      std::vector<float> device_master;
      std::span<float> master;
      if (cp.state_tier == Tier::kDevice) {
        device_master.assign(static_cast<std::size_t>(cp.elems), 0.0f);
        master = device_master;
      } else if (cp.state_tier == Tier::kNvme) {
        // Written whole from here, never read (StateStore's nvme_unwritten):
        // zeros, then the masters.
        STRATA_ASSIGN_OR_RETURN(cstage, pinned_cache_->get(state_->staging_bytes(c), "state staging"));
        parallel_zero(threads, cstage.bytes());
        master = state_->staged_views(c, cstage.bytes()).master();
      } else {
        STRATA_ASSIGN_OR_RETURN(ChunkState st, state_->load(c, {}));
        master = st.master();
      }
      for (const Layout::Piece& p : layout_.pieces(cp)) {
        parallel_copy(threads, reinterpret_cast<std::byte*>(master.data() + (p.lo - cp.begin)),
                      reinterpret_cast<const std::byte*>(values.at(p.param).data() +
                                                         (p.lo - layout_.places[p.param].trainable_offset)),
                      static_cast<std::size_t>(p.hi - p.lo) * 4);
      }
      if (cp.state_tier == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan home, state_->device_state(c));
        STRATA_RETURN_IF_ERROR(copy_h2d(home.subspan(0, static_cast<std::uint64_t>(cp.elems) * 4),
                                        std::as_bytes(master)));
      } else if (cp.state_tier == Tier::kNvme) {
        STRATA_RETURN_IF_ERROR(state_->store(c, cstage.bytes()));
        step_lane().bytes->add_nvme_write(state_->path_bytes(c));
        pinned_cache_->put(std::move(cstage));
      }
    }
  }
  return Status();
}

bool Engine::values_left_to_checkpoint(std::size_t g) const {
  if (!values_from_checkpoint_) return false;
  const GroupPlace& gp = layout_.groups[g];
  return std::all_of(gp.params.begin(), gp.params.end(), [&](std::size_t pi) { return layout_.params[pi].trainable; });
}

core::Result<ChunkState> Engine::load_host_chunk(std::size_t c, gpu::PinnedBuffer& stage) {
  if (state_->staging_bytes(c) > 0) {
    STRATA_ASSIGN_OR_RETURN(stage, pinned_cache_->get(state_->staging_bytes(c), "state staging"));
  }
  return state_->load(c, stage.bytes());
}

}  // namespace strata::engine
