#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_adam/cpu_adam.h"
#include "core/clock.h"
#include "core/logging.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/cpu_turns.h"
#include "engine/internal/elem_types.h"
#include "engine/internal/engine_entry.h"
#include "engine/internal/group_state.h"
#include "engine/step/optimizer_job.h"
#include "engine/internal/serial_queue.h"
#include "engine/internal/view_holds.h"
#include "engine/io_options.h"
#include "engine/pretrained.h"
#include "engine/state/compute_homes.h"
#include "engine/state/state_store.h"
#include "gpu/cuda_device.h"
#include "gpu/host_device.h"
#include "nvme/io_backend.h"
#include "nvme/swap_store.h"

namespace strata::engine {

using core::Status;
using core::str_cat;
namespace nx = core::numerics;

namespace {

constexpr std::int64_t kBlock = nx::kNormBlockElems;
constexpr std::uint64_t kUnlimited = core::MemoryBudget::kUnlimited;


// Writes fp32 values as the compute dtype.
void to_compute(std::span<const float> src, std::byte* dst, int bytes, Precision p) {
  if (bytes == 4) {
    std::memcpy(dst, src.data(), src.size_bytes());
    return;
  }
  auto* h = reinterpret_cast<std::uint16_t*>(dst);
  for (std::size_t i = 0; i < src.size(); ++i) {
    h[i] = p == Precision::kFp16 ? nx::fp32_to_fp16_bits(src[i]) : nx::fp32_to_bf16_bits(src[i]);
  }
}
void from_compute(const std::byte* src, std::span<float> dst, int bytes, Precision p) {
  if (bytes == 4) {
    std::memcpy(dst.data(), src, dst.size_bytes());
    return;
  }
  const auto* h = reinterpret_cast<const std::uint16_t*>(src);
  for (std::size_t i = 0; i < dst.size(); ++i) {
    dst[i] = p == Precision::kFp16 ? nx::fp16_bits_to_fp32(h[i]) : nx::bf16_bits_to_fp32(h[i]);
  }
}

// The bytes of one of a schedule's extra copies (Schedule::extra_memory) in
// this layout.
std::uint64_t extra_bytes(const Layout& layout, ExtraBasis basis) {
  const auto cb = static_cast<std::uint64_t>(layout.compute_bytes);
  std::uint64_t bytes = 0;
  switch (basis) {
    case ExtraBasis::kNvmeState: return StateStore::nvme_bytes(layout, false);
    case ExtraBasis::kNvmeGroupCompute:
      for (const GroupPlace& gp : layout.groups) {
        for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
          if (layout.chunks[c].state_tier != Tier::kNvme) continue;
          bytes += static_cast<std::uint64_t>(gp.compute_elems) * cb;
          break;
        }
      }
      return bytes;
    case ExtraBasis::kTrainableGroupCompute:
      for (const GroupPlace& gp : layout.groups) {
        if (gp.chunk_count > 0) bytes += static_cast<std::uint64_t>(gp.compute_elems) * cb;
      }
      return bytes;
  }
  return bytes;
}

// Adds the seconds from construction to destruction to `total`.
class StageTimer {
 public:
  explicit StageTimer(double& total) : total_(total) {}
  ~StageTimer() { total_ += sw_.elapsed_s(); }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  double& total_;
  core::Stopwatch sw_;
};

}  // namespace


Engine::Engine(const Config& config, LossScaler scaler, LrSchedule schedule)
    : config_(config),
      schedule_(schedule_for(config.strata.overlap)),
      verdict_(config_, std::move(scaler), std::move(schedule)),
      shared_device_(std::make_shared<SharedDevice>(
          config.strata.budgets.device_bytes != 0                ? config.strata.budgets.device_bytes
          : config.strata.device == DeviceKind::kHost ? config.strata.host_device.memory_bytes
                                                      : kUnlimited,
          config.strata.budgets.pinned_bytes != 0 ? config.strata.budgets.pinned_bytes : kUnlimited)),
      holds_(std::make_shared<ViewHolds>(shared_device_)),
      staging_budget_("the disk pipeline's staging memory",
                      config.strata.budgets.staging_bytes != 0 ? config.strata.budgets.staging_bytes : kUnlimited,
                      "strata.budgets.staging"),
      trace_(config.strata.trace) {
  cpu_turns_ = std::make_unique<CpuTurns>();
  registry_.optimizer_groups.push_back({"default", config.optimizer.weight_decay, 1.0});
}

Engine::~Engine() {
  // Lent views outlive the engine: from here on a buffer whose last lease
  // ends is freed, not cached, and every lent buffer the engine lets go of
  // below stays parked in holds_ until then.
  holds_->set_home(nullptr);
  if (gradients_ != nullptr) gradients_->shutdown();  // drains the gradient copies and passes
  copies_.prefetcher.reset();      // and the prefetches (which may wait for the optimizer)
  copies_.resident.reset();        // into the cache, whose clear waits for their fences
  if (runner_ != nullptr) runner_->stop();  // its queued jobs run first
  for (GroupState& gs : groups_) {  // into the cache (or holds_, when lent); nothing goes back after its clear
    if (device_cache_ != nullptr) {
      device_cache_->put(std::move(gs.working));
      device_cache_->put(std::move(gs.grad));
    }
    gs.working.reset();
    gs.grad.reset();
  }
  if (device_cache_ != nullptr) device_cache_->clear().ignore_error();  // errors were reported where they arose
  if (pinned_cache_ != nullptr) pinned_cache_->clear().ignore_error();
  if (shared_device_->device != nullptr) dev().synchronize().ignore_error();  // errors were reported where they arose
  if (const Status s = trace_.write(); !s.ok()) {
    STRATA_LOG(kWarn) << "strata.trace: " << s;
  }
  if (homes_ != nullptr) homes_->park_device_homes(*holds_);  // a lent compute home stays until its lease ends
  groups_.clear();
  gradients_.reset();  // after the optimizer, which reads the host gradients
  optimizer_.reset();  // the staging ring, before the budgets it charges
  state_.reset();
  stream_.reset();
}

core::Result<std::unique_ptr<Engine>> Engine::create(const Config& config) {
  if (config.optimizer.type == OptimizerType::kAdagrad || config.optimizer.type == OptimizerType::kLion) {
    return Status::unimplemented(str_cat("optimizer.type ", to_string(config.optimizer.type),
                                         " is not implemented yet; use Adam or AdamW"));
  }
  STRATA_ASSIGN_OR_RETURN(LossScaler scaler,
                          LossScaler::create(config.precision == Precision::kFp16 ? config.fp16 : Fp16Config{}));
  STRATA_ASSIGN_OR_RETURN(LrSchedule schedule, LrSchedule::create(config.scheduler, config.optimizer.lr));
  std::unique_ptr<Engine> e(new Engine(config, std::move(scaler), std::move(schedule)));
  const gpu::DeviceBudgets budgets{&e->shared_device_->device_budget, &e->shared_device_->pinned_budget};
  if (config.strata.device == DeviceKind::kHost) {
    gpu::HostDeviceOptions o;
    o.budgets = budgets;
    o.timing.h2d_gb_per_s = config.strata.host_device.h2d_gbps;
    o.timing.d2h_gb_per_s = config.strata.host_device.d2h_gbps;
    o.timing.device_memory_gb_per_s = config.strata.host_device.d2d_gbps;
    o.timing.compute_tflops = config.strata.host_device.tflops;
    STRATA_ASSIGN_OR_RETURN(e->shared_device_->device, gpu::make_host_device(o));
  } else {
    auto cuda = gpu::make_cuda_device({budgets});
    if (cuda.ok()) {
      e->shared_device_->device = std::move(cuda).value();
    } else if (config.strata.device == DeviceKind::kCuda) {
      return Status(cuda.status()).annotate("strata.device is \"cuda\"");
    } else {
      STRATA_LOG(kInfo) << "strata.device auto: no CUDA device (" << cuda.status().message()
                        << "); using the host device";
      gpu::HostDeviceOptions o;
      o.budgets = budgets;
      STRATA_ASSIGN_OR_RETURN(e->shared_device_->device, gpu::make_host_device(o));
    }
  }
  STRATA_ASSIGN_OR_RETURN(e->stream_, e->dev().create_stream("engine"));
  gpu::Device* d = e->shared_device_->device.get();
  ViewHolds* holds = e->holds_.get();
  e->device_cache_ = std::make_unique<BufferCache<gpu::DeviceBuffer>>(
      [d](std::uint64_t bytes, const std::string& what) { return d->allocate(bytes, what); },
      [d](gpu::Event& fence) { return d->synchronize(fence); }, [d](gpu::Event& fence) { return d->query(fence); },
      // A lent buffer is parked, never reused, until its last lease ends.
      [holds](gpu::DeviceBuffer& b, std::shared_ptr<gpu::Event>& fence) { return holds->park(b, fence); });
  e->holds_->set_home(e->device_cache_.get());
  e->pinned_cache_ = std::make_unique<BufferCache<gpu::PinnedBuffer>>(
      [d](std::uint64_t bytes, const std::string& what) { return d->allocate_pinned(bytes, what); });
  return e;
}

core::Result<int> Engine::add_optimizer_group(const OptimizerGroupDesc& group) {
  STRATA_ENGINE_ENTRY("add_optimizer_group");
  if (finalized_) return Status::failed_precondition("add_optimizer_group after finalize");
  if (!(group.weight_decay >= 0.0) || !(group.lr_scale >= 0.0)) {
    return Status::invalid_argument(str_cat("optimizer group '", group.name, "': weight_decay ", group.weight_decay,
                                            " and lr_scale ", group.lr_scale, " must be >= 0"));
  }
  registry_.optimizer_groups.push_back(group);
  return static_cast<int>(registry_.optimizer_groups.size() - 1);
}

core::Status Engine::register_param(const ParamDesc& desc, InitFn init) {
  STRATA_ENGINE_ENTRY("register_param");
  if (finalized_) return Status::failed_precondition(str_cat("register_param('", desc.name, "') after finalize"));
  if (!init && registry_.pretrained != nullptr) STRATA_RETURN_IF_ERROR(registry_.pretrained->check_param(desc));
  registry_.params.push_back(desc);
  registry_.inits.push_back(std::move(init));
  return Status();
}

core::Status Engine::init_from_safetensors(const std::string& path, const std::string& name_prefix) {
  STRATA_ENGINE_ENTRY("init_from_safetensors");
  if (finalized_) return Status::failed_precondition(str_cat("init_from_safetensors('", path, "') after finalize"));
  if (registry_.pretrained != nullptr) {
    return Status::failed_precondition(str_cat("init_from_safetensors('", path, "'): initial values come from ",
                                               registry_.pretrained->describe(), " already"));
  }
  STRATA_ASSIGN_OR_RETURN(PretrainedWeights w, PretrainedWeights::open(path, name_prefix));
  for (std::size_t pi = 0; pi < registry_.params.size(); ++pi) {
    if (!registry_.inits[pi]) STRATA_RETURN_IF_ERROR(w.check_param(registry_.params[pi]));
  }
  registry_.pretrained = std::make_unique<PretrainedWeights>(std::move(w));
  return Status();
}

double Engine::loss_scale() const {
  const core::MutexLock lock(mu_);
  return verdict_.loss_scale();
}

core::Status Engine::finalize_running(const char* op) {
  return Status::failed_precondition(
      str_cat(op, " while finalize runs (from an init callback or another thread): init callbacks must not call "
                  "into the engine"));
}

core::Status Engine::check_finalized(const char* op) const {
  if (!finalized_) return Status::failed_precondition(str_cat(op, " before finalize"));
  return Status();
}

core::Result<ChunkState> Engine::load_host_chunk(std::size_t c, gpu::PinnedBuffer& stage) {
  if (state_->staging_bytes(c) > 0) {
    STRATA_ASSIGN_OR_RETURN(stage, pinned_cache_->get(state_->staging_bytes(c), "state staging"));
  }
  return state_->load(c, stage.bytes());
}

bool Engine::between_steps() const {
  if (step_.micro_step != 0) return false;
  for (const GroupState& gs : groups_) {
    if (gs.grads_micro_step >= 0 || gs.fetched || !gs.grad.empty()) return false;
  }
  return true;
}

core::Result<std::size_t> Engine::group_index(std::string_view name, const char* op) const {
  STRATA_RETURN_IF_ERROR(check_finalized(op));
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    if (layout_.groups[g].name == name) return g;
  }
  return Status::not_found(str_cat(op, ": no fetch group named '", name, "'"));
}

core::Result<gpu::DeviceBuffer> Engine::allocate_working(std::uint64_t bytes, const std::string& what) {
  core::Result<gpu::DeviceBuffer> b = device_cache_->get(bytes, what);
  if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  if (!copies_.resident->empty()) {  // resident copies give their memory back first
    copies_.resident->drop(DropCopies::kAll);
    b = device_cache_->get(bytes, what);
    if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  }
  if (schedule_.threaded()) {
    // Gradient passes in flight hold device buffers: let them finish, then try again.
    STRATA_RETURN_IF_ERROR(gradients_->wait(what.c_str()));
    b = device_cache_->get(bytes, what);
    if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  }
  if (copies_.prefetcher == nullptr || copies_.prefetcher->empty()) return b;
  // Prefetched copies only save a later copy: they give their memory back
  // last, to what is needed now (a fetch, a gradient buffer).
  copies_.prefetcher->drop(DropCopies::kAll);
  return device_cache_->get(bytes, what);
}

core::Status Engine::finalize() {
  STRATA_ENGINE_ENTRY("finalize");
  if (finalized_) return Status::failed_precondition("finalize called twice");
  STRATA_ASSIGN_OR_RETURN(layout_, plan_layout(registry_.params, registry_.optimizer_groups, config_));
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

  // Budgets up front, with the numbers (the allocations below enforce them too).
  TierBytes need = layout_.bytes();
  // What the schedule holds beyond the placement's state, and why.
  std::string pinned_why, nvme_why;
  for (const ScheduleExtra& x : schedule_.extra_memory()) {
    const std::uint64_t bytes = extra_bytes(layout_, x.basis);
    if (x.tier == Tier::kNvme) {
      need.nvme += bytes;
      nvme_why = str_cat(" (with ", x.why, ")");
    } else {
      need.pinned += bytes;
      pinned_why = str_cat(" (with ", x.why, ")");
    }
  }
  if (need.device > shared_device_->device_budget.limit_bytes()) {
    return Status::resource_exhausted(str_cat("this placement keeps ", core::format_bytes(need.device),
                                              " of state on the device; strata.budgets.device allows ",
                                              core::format_bytes(shared_device_->device_budget.limit_bytes()),
                                              ". Offload more (zero_optimization.offload_*) or raise the budget"));
  }
  if (need.pinned > shared_device_->pinned_budget.limit_bytes()) {
    return Status::resource_exhausted(str_cat("this placement keeps ", core::format_bytes(need.pinned),
                                              " of state in pinned memory", pinned_why,
                                              "; strata.budgets.pinned allows ",
                                              core::format_bytes(shared_device_->pinned_budget.limit_bytes()),
                                              ". Put the optimizer state on nvme or raise the budget"));
  }
  if (need.nvme > 0) {
    nvme::SwapStoreOptions o;
    o.paths = config_.swap_paths();
    const std::uint64_t wanted = core::align_up(need.nvme + need.nvme / 16 + (64ull << 20), 1ull << 20);
    if (config_.strata.budgets.disk_bytes != 0 && config_.strata.budgets.disk_bytes < need.nvme) {
      return Status::resource_exhausted(str_cat("this placement keeps ", core::format_bytes(need.nvme),
                                                " on nvme", nvme_why,
                                                "; strata.budgets.disk allows ",
                                                core::format_bytes(config_.strata.budgets.disk_bytes)));
    }
    o.capacity_bytes = config_.strata.budgets.disk_bytes != 0 ? config_.strata.budgets.disk_bytes : wanted;
    o.stripe_bytes = config_.strata.io.stripe_bytes;
    o.request_bytes = config_.strata.io.block_bytes;
    o.crc = config_.strata.crc;
    o.keep_files = config_.strata.io.keep_files;
    o.io = io_backend_options(config_.strata.io);
    STRATA_ASSIGN_OR_RETURN(swap_, nvme::SwapStore::create(o));
  }

  adam::CpuAdamOptions ao;
  switch (config_.strata.cpu_adam.isa) {
    case CpuAdamIsa::kAuto: ao.auto_isa = true; break;
    case CpuAdamIsa::kAvx512Bf16: ao.auto_isa = false; ao.isa = adam::Isa::kAvx512Bf16; break;
    case CpuAdamIsa::kAvx512: ao.auto_isa = false; ao.isa = adam::Isa::kAvx512; break;
    case CpuAdamIsa::kAvx2: ao.auto_isa = false; ao.isa = adam::Isa::kAvx2; break;
    case CpuAdamIsa::kScalar: ao.auto_isa = false; ao.isa = adam::Isa::kScalar; break;
  }
  ao.threads = config_.strata.cpu_adam.threads;
  ao.tile_elems = config_.strata.cpu_adam.tile_elems;
  STRATA_ASSIGN_OR_RETURN(cpu_adam_, adam::CpuAdam::create(ao));

  STRATA_ASSIGN_OR_RETURN(state_, StateStore::create(layout_, dev(), swap_.get(), schedule_.second_state_version()));
  STRATA_ASSIGN_OR_RETURN(gradients_, GradientPath::create({.layout = layout_,
                                                            .precision = config_.precision,
                                                            .device = dev(),
                                                            .cpu_adam = *cpu_adam_,
                                                            .turns = *cpu_turns_,
                                                            .device_cache = *device_cache_,
                                                            .pinned_cache = *pinned_cache_,
                                                            .trace = trace_,
                                                            .inline_lane = step_lane()},
                                                           schedule_.threaded()));

  // Compute homes, then the initial values group by group (the host holds one
  // group's fp32 values at a time).
  groups_.resize(layout_.groups.size());
  STRATA_ASSIGN_OR_RETURN(homes_, ComputeHomes::create(layout_, dev(), swap_.get(), *pinned_cache_, trace_));
  const auto cb_live = static_cast<std::uint64_t>(layout_.compute_bytes);
  copies_.resident = std::make_unique<ResidentSet>(layout_, config_.zero.stage3_param_persistence_threshold,
                                            static_cast<std::uint64_t>(config_.zero.stage3_max_live_parameters) * cb_live,
                                            *device_cache_);
  finalized_ = true;  // the loaders below use the finalized paths
  finalizing_ = true;
  const Status init = write_initial_values();
  finalizing_ = false;
  if (!init.ok()) {
    finalized_ = false;
    return init;
  }
  step_.bytes = {};  // initialisation is not a step's traffic
  // Last, so that a derived ring takes what pinned memory has left.
  STRATA_ASSIGN_OR_RETURN(optimizer_, Optimizer::create({.layout = layout_,
                                                         .config = config_,
                                                         .device = dev(),
                                                         .cpu_adam = *cpu_adam_,
                                                         .turns = *cpu_turns_,
                                                         .state = *state_,
                                                         .homes = *homes_,
                                                         .gradients = *gradients_,
                                                         .device_cache = *device_cache_,
                                                         .pinned_cache = *pinned_cache_,
                                                         .trace = trace_,
                                                         .staging_budget = staging_budget_,
                                                         .pinned_budget = shared_device_->pinned_budget},
                                                        schedule_.ring_depth()));
  Optimizer* optimizer = optimizer_.get();
  runner_ = std::make_unique<OptimizerRunner>(layout_.groups.size(), schedule_.threaded(),
                                              [optimizer](OptimizerJob& job) { return optimizer->run(job); });
  optimizer_->set_runner(*runner_);
  if (schedule_.threaded()) {
    const auto cb = static_cast<std::uint64_t>(layout_.compute_bytes);
    STRATA_ASSIGN_OR_RETURN(
        copies_.prefetcher,
        Prefetcher::create(dev(), layout_, static_cast<std::uint64_t>(config_.zero.stage3_prefetch_bucket_size) * cb,
                           *device_cache_, [this](std::size_t g, gpu::DeviceSpan dst, gpu::Event* fence, Lane lane) {
                             // A prefetch never copies a stale compute copy.
                             Status s = waits_for_optimizer(g) ? runner_->wait_group(g, "prefetch") : Status();
                             if (s.ok() && fence != nullptr) s = dev().wait(*lane.stream, *fence);
                             if (!s.ok()) return s;
                             TraceScope t(trace_, TraceTrack::kPrefetch, str_cat("prefetch ", layout_.groups[g].name),
                                          dst.size_bytes());
                             gpu::PinnedBuffer staging;
                             core::Result<std::span<std::byte>> host = homes_->load(g, staging, lane);
                             s = host.ok() ? copy_h2d(dst, *host, lane) : host.status();
                             pinned_cache_->put(std::move(staging));
                             return s;
                           }));
  }
  return Status();
}

core::Status Engine::write_initial_values() {
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
      for (std::size_t pi : layout_.groups[g].params) {
        if (!registry_.inits[pi]) pretrained->plan(g, layout_.params[pi].name);
      }
    }
  }
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    const GroupPlace& gp = layout_.groups[g];
    std::map<std::size_t, std::vector<float>> values;  // by parameter index
    for (std::size_t pi : gp.params) {
      std::vector<float>& v = values[pi];
      v.assign(static_cast<std::size_t>(layout_.params[pi].numel()), 0.0f);
      Status s;
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
      if (!s.ok()) return std::move(s).annotate(str_cat("initializing parameter '", layout_.params[pi].name, "'"));
    }
    if (pretrained != nullptr) pretrained->end_group(g);
    gpu::PinnedBuffer staging;
    const std::uint64_t bytes = static_cast<std::uint64_t>(gp.compute_elems) * static_cast<std::uint64_t>(cb);
    std::span<std::byte> host;
    if (gp.compute_tier == Tier::kPinned) {
      host = homes_->pinned_home(g).bytes();
    } else {
      STRATA_ASSIGN_OR_RETURN(staging, dev().allocate_pinned(core::align_up(bytes, 4096), "compute staging"));
      host = staging.bytes().first(bytes);
    }
    std::memset(host.data(), 0, host.size());
    for (const auto& [pi, v] : values) {
      to_compute(v, host.data() + layout_.places[pi].compute_offset * cb, cb, config_.precision);
    }
    STRATA_RETURN_IF_ERROR(homes_->commit(g, host, step_lane()));
    // Master weights, chunk by chunk (moments start at zero).
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
      const ChunkPlace& cp = layout_.chunks[c];
      gpu::PinnedBuffer cstage;
      std::vector<float> device_master;
      std::span<float> master;
      if (cp.state_tier == Tier::kDevice) {
        device_master.assign(static_cast<std::size_t>(cp.elems), 0.0f);
        master = device_master;
      } else {
        STRATA_ASSIGN_OR_RETURN(ChunkState st, load_host_chunk(c, cstage));
        if (cp.state_tier == Tier::kNvme) step_.bytes.nvme_read += state_->staging_bytes(c);
        master = st.master;
      }
      for (const Layout::Piece& p : layout_.pieces(cp)) {
        std::memcpy(master.data() + (p.lo - cp.begin),
                    values.at(p.param).data() + (p.lo - layout_.places[p.param].trainable_offset),
                    static_cast<std::size_t>(p.hi - p.lo) * 4);
      }
      if (cp.state_tier == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan home, state_->device_state(c));
        STRATA_RETURN_IF_ERROR(copy_h2d(home.subspan(0, static_cast<std::uint64_t>(cp.elems) * 4),
                                        std::as_bytes(master)));
      } else {
        STRATA_RETURN_IF_ERROR(state_->store(c, cstage.bytes()));
        if (cp.state_tier == Tier::kNvme) step_.bytes.nvme_write += state_->staging_bytes(c);
      }
    }
  }
  return Status();
}

core::Result<gpu::DeviceSpan> Engine::fetch(std::string_view group) {
  STRATA_ENGINE_ENTRY("fetch");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "fetch"));
  const StageTimer timer(step_.times.fetch_s);
  TraceScope t(trace_, TraceTrack::kStep, str_cat("fetch ", group));
  GroupState& gs = groups_[g];
  if (gs.fetched) {
    return Status::failed_precondition(str_cat("fetch('", group, "'): already fetched; release it first"));
  }
  if (early_.applying_in_place && gs.grads_micro_step == step_.micro_step) {
    return Status::failed_precondition(str_cat(
        "fetch('", group, "'): its gradients of the step's last micro-batch are in, and the optimizer is updating it "
        "in place (strata.overlap \"", schedule_.name(),
        "\" with no clipping, no loss scaler and strata.nonfinite \"apply\"); fetch it again after step_end"));
  }
  // The last step's optimizer may still be writing this group's copies
  // (under "delayed" it writes them elsewhere, and the step uses the old).
  if (waits_for_optimizer(g)) {
    STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "fetch"));
  } else {
    STRATA_RETURN_IF_ERROR(runner_->error("fetch"));  // its error, if any
  }
  copies_.trace.note_fetch(g);
  const GroupPlace& gp = layout_.groups[g];
  if (gp.compute_tier == Tier::kDevice) {
    gs.fetched = true;
    return homes_->device_home(g).span();
  }
  if (std::optional<gpu::DeviceBuffer> kept = copies_.resident->take(g)) {  // still on the device since its release
    gs.working = std::move(*kept);  // read again: its fence does not matter
    ++step_.resident;
    step_.resident_bytes += gs.working.size_bytes();
    gs.fetched = true;
    issue_prefetches();
    return gs.working.span();
  }
  std::optional<gpu::DeviceBuffer> prefetched;
  if (copies_.prefetcher != nullptr) {
    STRATA_ASSIGN_OR_RETURN(prefetched, copies_.prefetcher->take(g, step_.bytes));
  }
  if (prefetched) {
    gs.working = std::move(*prefetched);
    ++step_.prefetched;
    gs.fetched = true;
    issue_prefetches();
    return gs.working.span();
  }
  const std::uint64_t bytes = static_cast<std::uint64_t>(gp.compute_elems) * static_cast<std::uint64_t>(layout_.compute_bytes);
  STRATA_ASSIGN_OR_RETURN(gs.working, allocate_working(bytes, str_cat("fetched group '", gp.name, "'")));
  gpu::PinnedBuffer staging;
  STRATA_ASSIGN_OR_RETURN(std::span<std::byte> host, homes_->load(g, staging, step_lane()));
  STRATA_RETURN_IF_ERROR(copy_h2d(gs.working.span(), host));
  pinned_cache_->put(std::move(staging));
  gs.fetched = true;
  issue_prefetches();
  return gs.working.span();
}

core::Status Engine::release(std::string_view group, gpu::Stream* used_on) {
  STRATA_ENGINE_ENTRY("release");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "release"));
  GroupState& gs = groups_[g];
  if (!gs.fetched) return Status::failed_precondition(str_cat("release('", group, "'): the group is not fetched"));
  // The framework's work on the view so far: the buffer is written again
  // only once it has passed.
  std::shared_ptr<gpu::Event> fence;
  if (used_on != nullptr && !gs.working.empty()) {
    STRATA_ASSIGN_OR_RETURN(gpu::Event ev, dev().create_event());
    STRATA_RETURN_IF_ERROR(dev().record(ev, *used_on));
    fence = std::make_shared<gpu::Event>(std::move(ev));
  }
  if (schedule_.threaded() && layout_.groups[g].compute_tier != Tier::kDevice) {
    // The threaded schedules keep it while current, within the room.
    copies_.resident->keep(g, std::move(gs.working), std::move(fence));
    gs.working = {};
    copies_.resident->make_room(live_bytes(), 0, SIZE_MAX, copies_.trace);
  } else {
    device_cache_->put(std::move(gs.working), std::move(fence));
  }
  gs.working = {};
  gs.fetched = false;
  return Status();
}

core::Result<gpu::DeviceSpan> Engine::grad_buffer(std::string_view group) {
  STRATA_ENGINE_ENTRY("grad_buffer");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "grad_buffer"));
  return grad_buffer_locked(g);
}

core::Result<gpu::DeviceSpan> Engine::grad_buffer_locked(std::size_t g) {
  const GroupPlace& gp = layout_.groups[g];
  const std::string& group = gp.name;
  GroupState& gs = groups_[g];
  if (gp.trainable_elems == 0) {
    return Status::failed_precondition(str_cat("grad_buffer('", group, "'): the group has no trainable parameters"));
  }
  if (gs.grads_micro_step == step_.micro_step) {
    return Status::failed_precondition(
        str_cat("grad_buffer('", group, "'): its gradients for this micro-batch have arrived already"));
  }
  // (Under "delayed" the gradient pass waits instead: see grads_ready.)
  if (schedule_.gradients_wait_for_optimizer()) STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "grad_buffer"));
  // The group's last gradients are down (they may still be on their way
  // when step_end did not wait for them): so the framework runs at most a
  // step ahead of the copies, with one gradient buffer per group.
  STRATA_RETURN_IF_ERROR(gradients_->wait_down(g, group));
  copies_.trace.note_backward(g);
  if (gs.grad.empty()) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(gp.compute_elems) * static_cast<std::uint64_t>(layout_.compute_bytes);
    STRATA_ASSIGN_OR_RETURN(gs.grad, allocate_working(bytes, str_cat("gradients of group '", gp.name, "'")));
  }
  return gs.grad.span();
}

ViewLease::ViewLease(std::shared_ptr<ViewHolds> holds, std::uint64_t buffer_id)
    : holds_(std::move(holds)), buffer_id_(buffer_id) {
  holds_->hold(buffer_id_);
}

ViewLease::~ViewLease() { holds_->end(buffer_id_); }

core::Result<LentView> Engine::lend_view(std::string_view group, ViewKind kind) {
  STRATA_ENGINE_ENTRY("lend_view");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "lend_view"));
  GroupState& gs = groups_[g];
  const gpu::DeviceBuffer* lent = &gs.grad;
  if (kind == ViewKind::kCompute) {
    if (!gs.fetched) {
      return Status::failed_precondition(
          str_cat("lend_view('", group, "'): the group is not fetched; its compute copies are lent while fetched"));
    }
    lent = layout_.groups[g].compute_tier == Tier::kDevice ? &homes_->device_home(g) : &gs.working;
  } else {
    STRATA_RETURN_IF_ERROR(grad_buffer_locked(g).status());
  }
  STRATA_CHECK(!lent->empty()) << "lend_view('" << group << "'): no buffer";
  return LentView{lent->span(), std::unique_ptr<ViewLease>(new ViewLease(holds_, lent->id()))};
}

core::Status Engine::grads_ready(std::string_view group, gpu::Stream* written_on) {
  STRATA_ENGINE_ENTRY("grads_ready");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "grads_ready"));
  const StageTimer timer(step_.times.grads_s);
  TraceScope t(trace_, TraceTrack::kStep, str_cat("grads_ready ", group));
  GroupState& gs = groups_[g];
  if (gs.grad.empty()) {
    return Status::failed_precondition(str_cat("grads_ready('", group, "') without grad_buffer('", group, "')"));
  }
  // The host gradients of this group are the last step optimizer's input:
  // the pass that writes them waits for its update. Here, except under
  // "delayed", where the framework goes on (nothing it reads changes) and
  // the pass thread waits for the job submitted by now (the next step_end
  // may submit another before the pass runs).
  std::int64_t pass_after_job = 0;
  if (!schedule_.gradients_wait_for_optimizer()) {
    pass_after_job = runner_->decided();
  } else {
    STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "grads_ready"));
  }
  const int micro_step = step_.micro_step;
  // The framework's writes, as an event its stream records now.
  std::shared_ptr<gpu::Event> written;
  if (written_on != nullptr) {
    STRATA_ASSIGN_OR_RETURN(gpu::Event ev, dev().create_event());
    STRATA_RETURN_IF_ERROR(dev().record(ev, *written_on));
    written = std::make_shared<gpu::Event>(std::move(ev));
  }
  gs.grads_micro_step = micro_step;
  // overlap "speculative", or "exact" with certain steps: the step's
  // optimizer job (started by the last step_end, or here for the first step)
  // updates each group as its gradients of the last micro-batch are in.
  std::int64_t early = 0;
  if (gradients_->threaded() && early_jobs() && micro_step + 1 == config_.gradient_accumulation_steps) {
    if (early_.job == 0) STRATA_RETURN_IF_ERROR(start_early_job());
    early = early_.job;
    early_.applying_in_place = certain_steps();
  }
  gpu::DeviceBuffer grad = std::move(gs.grad);
  gs.grad = {};
  // The pass writes the host gradients the last step's job reads (under
  // "delayed" that job may still be running): it waits for the job's mark.
  OptimizerRunner* runner = runner_.get();
  auto before = [runner, g, pass_after_job] { return runner->wait_group_job(g, pass_after_job, "the gradient pass"); };
  auto after = [runner, g, early] {
    if (early != 0) runner->note_grads_in(g, early);
  };
  return gradients_->submit(g, std::move(grad), std::move(written), micro_step, before, after);
}

core::Status Engine::micro_step_end() {
  STRATA_ENGINE_ENTRY("micro_step_end");
  STRATA_RETURN_IF_ERROR(check_finalized("micro_step_end"));
  STRATA_RETURN_IF_ERROR(gradients_->wait("micro_step_end"));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (layout_.groups[g].trainable_elems > 0 && groups_[g].grads_micro_step != step_.micro_step) {
      return Status::failed_precondition(str_cat("micro_step_end: group '", layout_.groups[g].name,
                                                 "' has no gradients for micro-batch ", step_.micro_step + 1));
    }
  }
  if (step_.micro_step + 1 >= config_.gradient_accumulation_steps) {
    return Status::failed_precondition(str_cat("micro_step_end after micro-batch ", step_.micro_step + 1, " of ",
                                               config_.gradient_accumulation_steps,
                                               " (gradient_accumulation_steps): call step_end instead"));
  }
  ++step_.micro_step;
  return Status();
}

core::Status Engine::set_lr(double lr) {
  STRATA_ENGINE_ENTRY("set_lr");
  if (!(lr >= 0.0) || !std::isfinite(lr)) return Status::invalid_argument(str_cat("set_lr(", lr, "): expected >= 0"));
  if (lr == verdict_.lr_override()) return Status();
  // The step's job started early holds the constants of the old rate: it
  // stops (the next grads_ready starts another), unless it has begun to
  // update in place.
  STRATA_RETURN_IF_ERROR(abandon_speculation("set_lr"));
  verdict_.set_lr_override(lr);
  return Status();
}

core::Result<StepStats> Engine::step_end() {
  STRATA_ENGINE_ENTRY("step_end");
  STRATA_RETURN_IF_ERROR(check_finalized("step_end"));
  TraceScope t(trace_, TraceTrack::kStep, "step_end");
  // The previous step's optimizer is done by now in a well-ordered step
  // (every group was fetched); this also collects its traffic and errors.
  STRATA_RETURN_IF_ERROR(wait_optimizer("step_end"));
  // With deferred verdicts the step's job waits for its last gradients, not
  // step_end (which only checks that every grads_ready was called).
  const bool defer = deferred_verdicts();
  if (!defer) STRATA_RETURN_IF_ERROR(gradients_->wait("step_end"));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (layout_.groups[g].trainable_elems > 0 && groups_[g].grads_micro_step != step_.micro_step) {
      return Status::failed_precondition(str_cat("step_end: group '", layout_.groups[g].name,
                                                 "' has no gradients for micro-batch ", step_.micro_step + 1));
    }
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    // The optimizer writes new compute copies home: no view of them may be out.
    if (groups_[g].fetched) {
      return Status::failed_precondition(str_cat("step_end: group '", layout_.groups[g].name,
                                                 "' is still fetched; release it first"));
    }
  }
  if (step_.micro_step + 1 != config_.gradient_accumulation_steps) {
    return Status::failed_precondition(str_cat("step_end after ", step_.micro_step + 1, " micro-batches; ",
                                               "gradient_accumulation_steps is ", config_.gradient_accumulation_steps));
  }
  // overlap "delayed": the update of the step before this one becomes what
  // the next step computes with.
  STRATA_RETURN_IF_ERROR(commit_pending("step_end"));
  StepStats stats;
  // The optimizer's traffic and time since the last step_end: with overlap
  // "exact" that is the previous step's job, which ran during this step's
  // forward (and finished: wait_optimizer above); with deferred verdicts
  // also the last step's gradient path. Taken before this step's job gets
  // its verdict, so that a job which finishes right after it is counted by
  // the next step, always.
  auto take_optimizer_stats = [&] {
    const OptimizerRunner::Totals opt = runner_->take_totals();
    stats.bytes += opt.bytes;
    stats.optimizer_s += opt.seconds;
    stats.speculative_discarded += opt.discarded_elems;
    const GradientPath::Totals late = gradients_->take_late_totals();
    stats.bytes += late.bytes;
    stats.grads_s += late.seconds;
  };
  std::unique_ptr<OptimizerJob> job;
  bool applied = false;
  if (defer) {
    // The job takes this step's verdict; the stats report the last one taken.
    take_optimizer_stats();
    learn_fetch_trace();
    job = make_optimizer_job({}, verdict_.applied_steps() + 1);
    job->deferred_verdict = true;
    job->marker = ++step_.markers;
    job->norm_step = verdict_.verdicts() + 1;
    job->hyper = verdict_.hyperparams(layout_.optimizer_groups);
    gradients_->post_marker(job->marker);
    stats.grad_norm = verdict_.last().grad_norm;
    stats.lr = verdict_.last().lr;
    stats.skipped = verdict_.last().skipped;
    stats.norm_step = verdict_.last().norm_step;
  } else {
    STRATA_ASSIGN_OR_RETURN(const Verdict::Decision decision,
                            verdict_.decide(gradients_->raw_norm(), gradients_->take_nonfinite()));
    const bool skip = decision.skip;
    stats.grad_norm = decision.grad_norm;
    take_optimizer_stats();
    learn_fetch_trace();
    if (!skip) {
      std::vector<nx::AdamStepConstants> constants = verdict_.constants(layout_.optimizer_groups, decision.clip);
      // overlap "speculative": the job under way applies these very constants
      // (no clipping, same learning rate): it commits what it did and goes on.
      const bool speculated =
          early_.job != 0 && constants.size() == early_.constants.size() &&
          std::memcmp(constants.data(), early_.constants.data(), constants.size() * sizeof(nx::AdamStepConstants)) == 0;
      // A certain job under way has updated in place already: it cannot but
      // agree (set_lr is refused while it applies).
      if (early_.applying_in_place && !speculated) {
        return Status::internal("step_end: the optimizer job updating in place disagrees with the step's constants");
      }
      if (early_.job != 0) STRATA_RETURN_IF_ERROR(runner_->settle(early_.job, speculated, false));
      if (!speculated) job = make_optimizer_job(std::move(constants), verdict_.applied_steps() + 1);
      const double lr = verdict_.next_lr();
      if (job != nullptr && !schedule_.threaded()) {
        // The sequential schedule: the optimizer runs here, to the end.
        TraceScope t(trace_, TraceTrack::kStep, str_cat("optimizer, step ", verdict_.applied_steps() + 1));
        STRATA_RETURN_IF_ERROR(runner_->submit(std::move(job)).status());
        take_optimizer_stats();
      }
      applied = true;
      verdict_.count(false);
      stats.lr = lr * layout_.optimizer_groups[0].lr_scale;
    } else {
      // An early job under way stops; nothing it did is committed.
      if (early_.job != 0) STRATA_RETURN_IF_ERROR(runner_->settle(early_.job, false, false));
      verdict_.count(true);
    }
    stats.skipped = skip;
    stats.norm_step = verdict_.verdicts();
  }
  early_.job = 0;
  early_.applying_in_place = false;
  stats.step = verdict_.applied_steps();
  stats.skipped_total = verdict_.skipped_steps();
  stats.loss_scale = verdict_.loss_scale();
  // This step's own traffic (the optimizer's is in already).
  stats.bytes += step_.bytes;
  stats.fetch_s = step_.times.fetch_s;
  stats.grads_s += step_.times.grads_s;
  if (!defer) {  // (else the gradient path's own, behind the marker)
    const GradientPath::Totals grads = gradients_->take_totals();
    stats.bytes += grads.bytes;
    stats.grads_s += grads.seconds;
  }
  stats.prefetched = step_.prefetched;
  step_.prefetched = 0;
  stats.resident = step_.resident;
  stats.resident_bytes = step_.resident_bytes;
  step_.resident = 0;
  step_.resident_bytes = 0;
  step_.bytes = {};
  step_.times = {};
  step_.micro_step = 0;
  for (GroupState& gs : groups_) gs.grads_micro_step = -1;
  if (applied && !schedule_.delays_update()) {
    // A copy prefetched during this step (an evaluation pass's, or one the
    // trace ran ahead to), or kept since a release, holds compute copies the
    // step's job replaces.
    drop_device_copies(DropCopies::kUpdated);
  }
  if (job != nullptr) STRATA_RETURN_IF_ERROR(runner_->submit(std::move(job)).status());
  // The next step's job starts now (overlap "speculative", or "exact" with
  // certain steps), so that it reads the first chunks the backward will need
  // while the forward runs.
  if (early_jobs()) STRATA_RETURN_IF_ERROR(start_early_job());
  issue_prefetches();  // the next step's first groups, as the optimizer finishes them
  return stats;
}

void Engine::issue_prefetches() {
  if (copies_.prefetcher == nullptr) return;
  copies_.prefetcher->issue(copies_.trace, *copies_.resident, fetched_bytes(), [this](std::size_t g) {
    return groups_[g].fetched || layout_.groups[g].compute_tier == Tier::kDevice;
  });
}

void Engine::drop_device_copies(DropCopies which) {
  if (copies_.prefetcher != nullptr) copies_.prefetcher->drop(which);
  if (copies_.resident != nullptr) copies_.resident->drop(which);
}

std::uint64_t Engine::fetched_bytes() const {
  std::uint64_t bytes = 0;
  for (const GroupState& gs : groups_) bytes += gs.working.size_bytes();
  return bytes;
}

std::uint64_t Engine::live_bytes() const {
  return fetched_bytes() + (copies_.prefetcher != nullptr ? copies_.prefetcher->bytes() : 0) + copies_.resident->live_bytes();
}

void Engine::learn_fetch_trace() {
  if (copies_.trace.learn()) {
    STRATA_LOG(kInfo) << "the fetch sequence changed; prefetch and the optimizer follow the new one";
  }
}

std::vector<std::string> Engine::fetch_sequence() const {
  const core::MutexLock lock(mu_);
  std::vector<std::string> names;
  for (std::size_t g : copies_.trace.learned()) names.push_back(layout_.groups[g].name);
  return names;
}

core::Status Engine::commit_pending(const char* op) {
  core::Result<bool> committed = homes_->commit_pending(step_lane());
  if (!committed.ok()) return std::move(committed).status().annotate(op);
  // Copies on the device since a release or a prefetch hold the old ones.
  if (*committed) drop_device_copies(DropCopies::kUpdated);
  return Status();
}

core::Status Engine::flush_delayed(const char* op) {
  if (!schedule_.delays_update()) return Status();
  STRATA_RETURN_IF_ERROR(wait_optimizer(op));
  return commit_pending(op);
}

core::Status Engine::read_state(std::string_view param, int which, std::span<float> out) {
  STRATA_ENGINE_ENTRY("read_state");
  STRATA_RETURN_IF_ERROR(wait_optimizer("read_state"));
  STRATA_RETURN_IF_ERROR(abandon_speculation("read_state"));  // it may be reading the same blocks
  return read_state_locked(param, which, out);
}

core::Status Engine::read_state_locked(std::string_view param, int which, std::span<float> out) {
  STRATA_RETURN_IF_ERROR(check_finalized("read_master"));
  if (which < 0 || which > 2) return Status::invalid_argument(str_cat("read_state: array ", which, " (0, 1 or 2)"));
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    if (layout_.params[pi].name != param) continue;
    const ParamPlace& pl = layout_.places[pi];
    const std::int64_t n = layout_.params[pi].numel();
    if (pl.trainable_offset < 0) return Status::failed_precondition(str_cat("'", param, "' is frozen: no master"));
    if (static_cast<std::int64_t>(out.size()) != n) {
      return Status::invalid_argument(str_cat("read_master('", param, "'): ", n, " elements, buffer of ", out.size()));
    }
    const GroupPlace& gp = layout_.groups[pl.group];
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
      const ChunkPlace& cp = layout_.chunks[c];
      const std::int64_t lo = std::max(pl.trainable_offset, cp.begin), hi = std::min(pl.trainable_offset + n, cp.begin + cp.elems);
      if (lo >= hi) continue;
      float* dst = out.data() + (lo - pl.trainable_offset);
      if (cp.state_tier == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan s, state_->device_state(c));
        const std::uint64_t array = static_cast<std::uint64_t>(which) * static_cast<std::uint64_t>(cp.elems) * 4;
        STRATA_RETURN_IF_ERROR(copy_d2h({reinterpret_cast<std::byte*>(dst), static_cast<std::size_t>(hi - lo) * 4},
                                        s.subspan(array + static_cast<std::uint64_t>(lo - cp.begin) * 4,
                                                  static_cast<std::uint64_t>(hi - lo) * 4)));
      } else {
        gpu::PinnedBuffer stage;
        STRATA_ASSIGN_OR_RETURN(ChunkState st, load_host_chunk(c, stage));
        const std::span<float> arrays[3] = {st.master, st.exp_avg, st.exp_avg_sq};
        std::memcpy(dst, arrays[which].data() + (lo - cp.begin), static_cast<std::size_t>(hi - lo) * 4);
      }
    }
    return Status();
  }
  return Status::not_found(str_cat("read_master: no parameter named '", param, "'"));
}

core::Status Engine::read_compute(std::string_view param, std::span<float> out) {
  STRATA_ENGINE_ENTRY("read_compute");
  STRATA_RETURN_IF_ERROR(refuse_while_applying("read_compute"));
  STRATA_RETURN_IF_ERROR(wait_optimizer("read_compute"));
  // Between steps, the latest update (which "delayed" would show only at the
  // next step_end) becomes visible; within a step, the copies it computes with.
  if (finalized_ && between_steps()) STRATA_RETURN_IF_ERROR(flush_delayed("read_compute"));
  return read_compute_locked(param, out);
}

core::Status Engine::read_compute_locked(std::string_view param, std::span<float> out) {
  STRATA_RETURN_IF_ERROR(check_finalized("read_compute"));
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    if (layout_.params[pi].name != param) continue;
    const ParamPlace& pl = layout_.places[pi];
    if (static_cast<std::int64_t>(out.size()) != layout_.params[pi].numel()) {
      return Status::invalid_argument(str_cat("read_compute('", param, "'): ", layout_.params[pi].numel(),
                                              " elements, buffer of ", out.size()));
    }
    gpu::PinnedBuffer staging;
    const StepBytes saved = step_.bytes;
    STRATA_ASSIGN_OR_RETURN(std::span<std::byte> host, homes_->load(pl.group, staging, step_lane()));
    step_.bytes = saved;  // inspection is not step traffic
    from_compute(host.data() + pl.compute_offset * layout_.compute_bytes, out, layout_.compute_bytes, config_.precision);
    return Status();
  }
  return Status::not_found(str_cat("read_compute: no parameter named '", param, "'"));
}

}  // namespace strata::engine
