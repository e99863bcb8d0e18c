// Engine: creation, registration, the learning rate, the fetch and step
// calls (their order checked, then delegated to engine/fetch/ and
// engine/step/), lookups and inspection (read_state, read_compute). The rest
// of the facade lives beside it: finalize.cpp, save_load.cpp.
#include "engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <filesystem>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/logging.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/internal/engine_entry.h"
#include "engine/internal/engine_util.h"
#include "engine/internal/view_holds.h"
#include "engine/checkpoint/pretrained.h"
#include "engine/fetch/fetcher.h"
#include "engine/step/step.h"
#include "engine/state/compute_homes.h"
#include "engine/state/state_store.h"
#include "gpu/cuda_device.h"
#include "gpu/device_query.h"
#include "gpu/host_device.h"
#include "nvme/crc64.h"
#include "nvme/swap_store.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

namespace {
constexpr std::uint64_t kUnlimited = core::MemoryBudget::kUnlimited;
// NCCL's own device memory for each communicator of several ranks' (its
// channels' buffers, 4 MiB per channel, protocol and peer by default),
// left outside a derived arena besides the CUDA device's 1 GiB (also where
// the ranks then find they share a GPU and run their collectives on the host).
constexpr std::uint64_t kNcclHeadroomBytes = 1ull << 30;

// Several ranks with the collectives on the device: the communicators of
// device buffers a rank makes (Engine::create): the gradients' sums', and
// at stage 3 the fetches' and, under a threaded schedule, the prefetches'.
int device_communicators(std::int64_t stage, bool threaded) { return stage != 3 ? 1 : threaded ? 3 : 2; }

// Several ranks: the collective library that runs this rank's collectives
// on its device (strata.device_collectives), "" for none (on the host), or
// why it cannot ("on" where the build has no NCCL).
core::Result<std::string> device_collectives_backend(const gpu::Device& device, DeviceCollectives mode) {
  if (mode == DeviceCollectives::kOff) return std::string();
  if (device.kind() == gpu::DeviceKind::kHost) return std::string("gloo");  // its memory is the host's
  if (partition::has_backend("nccl")) return std::string("nccl");
  if (mode == DeviceCollectives::kOn) {
    return Status::unimplemented(
        "strata.device_collectives is \"on\" and this build has no NCCL for collectives on the GPU (it comes "
        "with the CUDA toolkit: put nvcc on PATH and reconfigure), or set it to \"auto\" or \"off\" (on the "
        "host)");
  }
  return std::string();
}

// Which GPU of which machine this is (0 on the host device): two ranks with
// the same key share a GPU, which NCCL refuses one communicator.
std::int64_t gpu_key(const gpu::Device& device) {
  if (device.kind() == gpu::DeviceKind::kHost) return 0;
  // The machine: its host name and boot id (containers of identical nodes
  // may share a host name; a boot id is the kernel's, each machine's own).
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string machine = host;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r"); f != nullptr) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof boot, f) != nullptr) machine += boot;
    std::fclose(f);
  }
  const std::uint64_t pci = device.caps().pci_location;
  const std::uint64_t h =
      nvme::crc64(nvme::crc64(0, std::as_bytes(std::span(machine))), std::as_bytes(std::span(&pci, 1)));
  return static_cast<std::int64_t>(h | 1);  // never 0
}

// Where every rank's collectives run, agreed over `comm` (each rank would
// otherwise meet the others over another library, or issue other
// collectives): each rank's choice, its GPU and its mode gathered; a rank
// that refused, ranks that differ, or ranks that share a GPU under "on"
// fail every rank alike, naming them; ranks that share a GPU under "auto"
// all run them on the host.
core::Result<std::string> agree_device_collectives(partition::Communicator& comm, const gpu::Device& device,
                                                   const Config& config, bool threaded) {
  const DeviceCollectives mode = config.strata.device_collectives;
  core::Result<std::string> choice = device_collectives_backend(device, mode);
  const auto code = [&]() -> std::int64_t {
    if (!choice.ok()) return 3;
    return choice->empty() ? 0 : *choice == "gloo" ? 1 : 2;
  };
  // The stage and whether the schedule is threaded decide the communicators
  // each rank makes next (stage 3's fetches', a threaded schedule's
  // prefetches'): compared here, before any rank waits to meet over one
  // another does not make (finalize compares the rest).
  const std::array<std::int64_t, 5> mine{code(), gpu_key(device), static_cast<std::int64_t>(mode),
                                         config.zero.stage, threaded ? 1 : 0};
  constexpr std::size_t kFields = mine.size();
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> all(kFields * n);
  STRATA_RETURN_IF_ERROR(comm.all_gather(mine.data(), all.data(), kFields, partition::DType::kI64)
                             .annotate("comparing where the ranks' collectives run"));
  if (!choice.ok()) return choice.status();
  constexpr const char* kWhere[] = {"on the host", "on its device over Gloo (the host device)", "on its GPU over NCCL"};
  const int me = comm.rank();
  for (std::size_t k = 0; k < n; ++k) {
    const std::int64_t* t = all.data() + kFields * k;
    const auto made = [](const std::int64_t* x) { return device_communicators(x[3], x[4] != 0); };
    if (t[0] != 3 && made(t) != made(mine.data())) {
      return Status::failed_precondition(str_cat(
          "ranks: rank ", k, " runs zero_optimization.stage ", t[3], (t[4] != 0 ? " under a threaded" : " under the"),
          " strata.overlap", (t[4] != 0 ? "" : " \"none\""), " and rank ", me, " stage ", mine[3],
          (mine[4] != 0 ? " under a threaded one" : " under \"none\""),
          ": every rank must share zero_optimization.stage and strata.overlap"));
    }
    if (t[0] == 3) {
      return Status::failed_precondition(str_cat("ranks: rank ", k, " cannot run its collectives on its device ",
                                                 "(its own error names the cause), so rank ", me, " stops too"));
    }
    if (t[0] != mine[0] || t[2] != mine[2]) {
      return Status::failed_precondition(str_cat(
          "ranks: rank ", me, " runs its collectives ", kWhere[mine[0]], " (strata.device_collectives \"",
          to_string(mode), "\") and rank ", k, " ", kWhere[t[0]], " (\"",
          to_string(static_cast<DeviceCollectives>(t[2])), "\"): strata.device, strata.device_collectives and the "
          "build must agree on every rank"));
    }
  }
  for (std::size_t a = 0; mine[0] == 2 && a < n; ++a) {
    for (std::size_t b = a + 1; b < n; ++b) {
      if (all[kFields * a + 1] != all[kFields * b + 1]) continue;
      if (mode == DeviceCollectives::kOn) {
        return Status::failed_precondition(str_cat(
            "ranks: ranks ", a, " and ", b, " drive the same GPU, which NCCL refuses one communicator: give each "
            "rank a GPU of its own, or set strata.device_collectives to \"auto\" or \"off\" (on the host)"));
      }
      STRATA_LOG(kInfo) << "strata.device_collectives auto: ranks " << a << " and " << b
                        << " drive the same GPU (NCCL refuses them one communicator): every rank's collectives run "
                           "on the host";
      return std::string();
    }
  }
  if (mine[0] == 0 && mode == DeviceCollectives::kAuto && device.kind() != gpu::DeviceKind::kHost) {
    STRATA_LOG(kInfo) << "strata.device_collectives auto: this build has no NCCL; the ranks' collectives run on "
                         "the host (the gradients come down whole)";
  }
  return *choice;
}
}  // namespace

Engine::Engine(const Config& config)
    : config_(config),
      schedule_(schedule_for(config.strata.overlap)),
      shared_device_(std::make_shared<SharedDevice>(
          config.strata.budgets.device_bytes != 0                ? config.strata.budgets.device_bytes
          : config.strata.device == DeviceKind::kHost ? config.strata.host_device.memory_bytes
                                                      : kUnlimited,
          config.strata.budgets.pinned_bytes != 0 ? config.strata.budgets.pinned_bytes : kUnlimited,
          config.strata.budgets.staging_bytes != 0 ? config.strata.budgets.staging_bytes : kUnlimited)),
      holds_(std::make_shared<ViewHolds>(shared_device_)),
      trace_(config.strata.trace) {
  cpu_turns_ = std::make_unique<CpuTurns>();
  registry_.optimizer_groups.push_back({"default", config.optimizer.weight_decay, 1.0});
}

Engine::~Engine() {
  // Lent views outlive the engine: from here on a buffer whose last lease
  // ends is freed, not cached, and every lent buffer the engine lets go of
  // below stays parked in holds_ until then.
  holds_->set_home(nullptr);
  if (step_ != nullptr) step_->shutdown_gradients();  // drains the gradient copies and passes
  if (fetcher_ != nullptr) fetcher_->stop();  // the prefetches (which may wait for the optimizer) and resident copies
  if (step_ != nullptr) step_->stop_runner();  // its queued jobs run first
  // Into the cache (or holds_, when lent); nothing goes back after its clear.
  fetcher_.reset();
  if (step_ != nullptr && device_cache_ != nullptr) step_->put_back_buffers(*device_cache_);
  if (device_cache_ != nullptr) device_cache_->clear().ignore_error();  // errors were reported where they arose
  if (pinned_cache_ != nullptr) pinned_cache_->clear().ignore_error();
  if (shared_device_->device != nullptr) dev().synchronize().ignore_error();  // errors were reported where they arose
  if (const Status s = trace_.write(); !s.ok()) {
    STRATA_LOG(kWarn) << "strata.trace: " << s;
  }
  if (homes_ != nullptr) homes_->park_device_homes(*holds_);  // a lent compute home stays until its lease ends
  step_.reset();  // the gradient path, the optimizer and its staging ring, before the budgets they charge
  state_.reset();
  stream_.reset();
  if (ranks_.launch_order != nullptr) ranks_.launch_order->forget_last();  // its event, before the device goes
  if (!made_swap_dirs_.empty()) {
    // The rank's swap folders finalize made go once the swap files in them
    // are removed (the store closes with the homes that hold its blocks);
    // one that still holds something (kept files, another's) stays.
    homes_.reset();
    swap_.reset();
    for (const std::string& d : made_swap_dirs_) {
      if (::rmdir(d.c_str()) != 0 && errno != ENOTEMPTY && errno != EEXIST && errno != ENOENT) {
        STRATA_LOG(kWarn) << "ranks: could not remove the swap folder " << d << ": " << std::strerror(errno);
      }
    }
  }
}

core::Result<std::unique_ptr<Engine>> Engine::create(const Config& config) {
  return create(config, partition::CommunicatorOptions{});
}

core::Result<std::unique_ptr<Engine>> Engine::create(const Config& config,
                                                     const partition::CommunicatorOptions& ranks) {
  if (ranks.size < 1 || ranks.rank < 0 || ranks.rank >= ranks.size) {
    return Status::invalid_argument(str_cat("ranks: rank ", ranks.rank, " of ", ranks.size,
                                            " (the rank must be in [0, size), size >= 1)"));
  }
  if (ranks.size > 1 && ranks.backend != "gloo") {
    return Status::unimplemented(str_cat("ranks: backend \"", ranks.backend, "\" with ", ranks.size,
                                         " ranks: the ranks meet and exchange host buffers over \"gloo\" (the "
                                         "gradients' sums on a GPU take NCCL by themselves: "
                                         "strata.device_collectives)"));
  }
  // This rank among its machine's: it picks the GPU and its share of the CPU
  // optimizer's cores. Not given: every rank on this machine.
  const int local_rank = ranks.local_rank >= 0 ? ranks.local_rank : ranks.rank;
  const int local_ranks = ranks.local_size > 0 ? ranks.local_size : ranks.size;
  if (local_rank >= local_ranks) {
    return Status::invalid_argument(str_cat("ranks: local rank ", local_rank, " of ", local_ranks,
                                            " on this machine: it must be below the count"));
  }
  STRATA_ASSIGN_OR_RETURN(LossScaler scaler,
                          LossScaler::create(config.precision == Precision::kFp16 ? config.fp16 : Fp16Config{}));
  STRATA_ASSIGN_OR_RETURN(LrSchedule schedule, LrSchedule::create(config.scheduler, config.optimizer.lr));
  // The batch keys were resolved for config.world_size ranks (ParseOptions):
  // for this run's, or for one process (a C++ caller's config, each rank
  // then taking gradient_accumulation_steps micro-batches a step).
  if (config.world_size != ranks.size && config.world_size != 1) {
    return Status::invalid_argument(str_cat(
        "ranks: the config's batch sizes were resolved for a world size of ", config.world_size,
        " (ParseOptions::world_size) and this engine is one of ", ranks.size,
        " ranks: parse the config with the run's world size"));
  }
  Config with_ranks = config;
  with_ranks.world_size = ranks.size;
  if (config.world_size != ranks.size) {
    std::int64_t per_rank = 0, train = 0;
    if (__builtin_mul_overflow(config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps, &per_rank) ||
        __builtin_mul_overflow(per_rank, static_cast<std::int64_t>(ranks.size), &train)) {
      return Status::invalid_argument("ranks: train_batch_size over the ranks overflows a 64-bit integer");
    }
    with_ranks.train_batch_size = train;
    STRATA_LOG(kInfo) << "ranks: the config's batch sizes were resolved for one process: each of the " << ranks.size
                      << " ranks takes " << config.gradient_accumulation_steps << " micro-batch(es) of "
                      << config.train_micro_batch_size_per_gpu << " a step, train_batch_size " << train;
  }
  std::unique_ptr<Engine> e(new Engine(with_ranks));
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
    // The rank's GPU: the one given, else its local rank's among those visible.
    gpu::CudaDeviceOptions o{budgets};
    o.ordinal = ranks.device;
    // NCCL allocates its buffers itself, outside the arena, once its
    // communicators connect: a derived arena leaves them room.
    if (ranks.size > 1 && config.strata.device_collectives != DeviceCollectives::kOff &&
        partition::has_backend("nccl")) {
      o.extra_headroom_bytes =
          kNcclHeadroomBytes * static_cast<std::uint64_t>(device_communicators(
                                   config.zero.stage, schedule_for(config.strata.overlap).threaded()));
    }
    if (o.ordinal < 0) {
      // Counted without touching them (a context on every GPU would take
      // memory from the other ranks' and fail on exclusive-process GPUs).
      core::Result<int> visible = gpu::cuda_device_count();
      const int count = visible.ok() ? *visible : 0;
      if (count > 0) {
        core::Result<int> mine = gpu::device_for_local_rank(local_rank, local_ranks, count);
        if (!mine.ok()) return Status(mine.status()).annotate(str_cat("rank ", ranks.rank, ": choosing its GPU"));
        o.ordinal = *mine;
      } else {
        o.ordinal = 0;  // make_cuda_device says why there is none
      }
    }
    auto cuda = gpu::make_cuda_device(o);
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
  e->step_ = std::make_unique<Step>(Step::Parts{.layout = e->layout_,
                                                .config = e->config_,
                                                .schedule = e->schedule_,
                                                .device = e->dev(),
                                                .trace = e->trace_,
                                                .stream = e->stream_},
                                    Verdict(e->config_, std::move(scaler), std::move(schedule)));
  gpu::Device* d = e->shared_device_->device.get();
  ViewHolds* holds = e->holds_.get();
  e->device_cache_ = std::make_unique<BufferCache<gpu::DeviceBuffer>>(
      [d](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end) { return d->allocate(bytes, what, end); },
      [d](gpu::Event& fence) { return d->synchronize(fence); }, [d](gpu::Event& fence) { return d->query(fence); },
      // A lent buffer is parked, never reused, until its last lease ends.
      [holds](gpu::DeviceBuffer& b, std::shared_ptr<gpu::Event>& fence) { return holds->park(b, fence); });
  e->device_cache_->set_headroom([d] { return d->device_budget().available_bytes(); });
  e->holds_->set_home(e->device_cache_.get());
  // Pinned staging put back with a fence: a queued copy still reads it (fetch's copies).
  e->pinned_cache_ = std::make_unique<BufferCache<gpu::PinnedBuffer>>(
      [d](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd) { return d->allocate_pinned(bytes, what); },
      [d](gpu::Event& fence) { return d->synchronize(fence); }, [d](gpu::Event& fence) { return d->query(fence); });
  e->ranks_.share = {ranks.rank, ranks.size};
  if (ranks.size > 1) {
    // One communicator per thread that uses it (each is one thread at a
    // time, and every rank issues its collectives in the same order).
    partition::CommunicatorOptions o = ranks;
    o.prefix = ranks.prefix + "-gradients";
    auto grads = partition::make_communicator(o);
    if (!grads.ok()) return Status(grads.status()).annotate(str_cat("rank ", ranks.rank, ": meeting the other ranks"));
    o.prefix = ranks.prefix + "-weights";
    auto weights = partition::make_communicator(o);
    if (!weights.ok()) {
      return Status(weights.status()).annotate(str_cat("rank ", ranks.rank, ": meeting the other ranks"));
    }
    e->ranks_.grads = std::move(grads).value();
    e->ranks_.weights = std::move(weights).value();
    // Where the collectives run: every rank alike.
    core::Result<std::string> agreed =
        agree_device_collectives(*e->ranks_.weights, e->dev(), config, e->schedule_.threaded());
    if (!agreed.ok()) return Status(agreed.status()).annotate(str_cat("rank ", ranks.rank));
    const std::string backend = *agreed;
    // Stage 3 under a threaded schedule prefetches: its gathers' thread has
    // communicators of its own (device_communicators counts the device's).
    const bool prefetches = config.zero.stage == 3 && e->schedule_.threaded();
    const auto meet = [&](const std::string& backend_name, const std::string& suffix,
                          std::unique_ptr<partition::Communicator>& out) -> Status {
      partition::CommunicatorOptions m = o;
      m.backend = backend_name;
      m.prefix = ranks.prefix + suffix;
      m.device = e->dev().caps().index;
      auto made = partition::make_communicator(m);
      if (!made.ok()) return Status(made.status()).annotate(str_cat("rank ", ranks.rank, ": meeting the other ranks"));
      out = std::move(made).value();
      return Status();
    };
    if (prefetches) STRATA_RETURN_IF_ERROR(meet(ranks.backend, "-prefetches", e->ranks_.prefetches));
    if (!backend.empty()) {
      STRATA_RETURN_IF_ERROR(meet(backend, "-device", e->ranks_.device));
      if (config.zero.stage == 3) STRATA_RETURN_IF_ERROR(meet(backend, "-device-fetches", e->ranks_.device_fetches));
      if (prefetches) STRATA_RETURN_IF_ERROR(meet(backend, "-device-prefetches", e->ranks_.device_prefetches));
      e->ranks_.share.device_collectives = true;
      e->ranks_.share.sum_bytes = config.communication_data_type == Precision::kFp32 ? 4 : 2;
      e->ranks_.launch_order = std::make_unique<LaunchOrder>(ranks.timeout);
    }
    e->ranks_.local_rank = local_rank;
    e->ranks_.local_ranks = local_ranks;
    if (ranks.store_is_the_runs) {
      // Every rank has met over both communicators: the run's private
      // rendezvous directory is not read again. Rank 0 removes it once all
      // are past this barrier, so a later engine of the run meets in a fresh one.
      STRATA_RETURN_IF_ERROR(e->ranks_.weights->barrier().annotate(str_cat("rank ", ranks.rank, ": meeting the other ranks")));
      if (ranks.rank == 0) {
        std::error_code ec;
        std::filesystem::remove_all(ranks.store_dir, ec);
        if (ec) {
          STRATA_LOG(kWarn) << "ranks: could not remove the rendezvous directory " << ranks.store_dir << ": "
                            << ec.message();
        }
      }
      // No rank goes on (to a next engine of the run, which meets there
      // anew) before the directory is gone.
      STRATA_RETURN_IF_ERROR(e->ranks_.weights->barrier().annotate(str_cat("rank ", ranks.rank, ": meeting the other ranks")));
    }
  }
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
  STRATA_ASSIGN_OR_RETURN(PretrainedWeights w, PretrainedWeights::open(path, name_prefix, config_.strata.io));
  for (std::size_t pi = 0; pi < registry_.params.size(); ++pi) {
    if (!registry_.inits[pi]) STRATA_RETURN_IF_ERROR(w.check_param(registry_.params[pi]));
  }
  registry_.pretrained = std::make_unique<PretrainedWeights>(std::move(w));
  return Status();
}

double Engine::loss_scale() const {
  const core::MutexLock lock(mu_);
  return step_->verdict().loss_scale();
}

core::Status Engine::set_lr(double lr) {
  STRATA_ENGINE_ENTRY("set_lr");
  STRATA_RETURN_IF_ERROR(check_not_torn("set_lr"));  // a load would replace it
  if (!(lr >= 0.0) || !std::isfinite(lr)) return Status::invalid_argument(str_cat("set_lr(", lr, "): expected >= 0"));
  if (lr == step_->verdict().lr_override()) return Status();
  // The step's job started early holds the constants of the old rate: it
  // stops (the next grads_ready starts another), unless it has begun to
  // update in place.
  STRATA_RETURN_IF_ERROR(step_->abandon_speculation("set_lr"));
  step_->verdict().set_lr_override(lr);
  return Status();
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

core::Status Engine::check_not_torn(const char* op) const {
  if (torn_load_.empty()) return Status();
  return Status::failed_precondition(str_cat(op, ": ", torn_load_, ": load a checkpoint again before going on"));
}

bool Engine::between_steps() const {
  return step_->between_steps() && (fetcher_ == nullptr || !fetcher_->any_fetched());
}

core::Result<std::size_t> Engine::group_index(std::string_view name, const char* op) const {
  STRATA_RETURN_IF_ERROR(check_finalized(op));
  STRATA_RETURN_IF_ERROR(check_not_torn(op));
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    if (layout_.groups[g].name == name) return g;
  }
  return Status::not_found(str_cat(op, ": no fetch group named '", name, "'"));
}

core::Status Engine::read_state(std::string_view param, int which, std::span<float> out) {
  STRATA_ENGINE_ENTRY("read_state");
  STRATA_RETURN_IF_ERROR(step_->wait_optimizer("read_state"));
  STRATA_RETURN_IF_ERROR(step_->abandon_speculation("read_state"));  // it may be reading the same blocks
  return read_state_locked(param, which, out);
}

core::Status Engine::read_state_locked(std::string_view param, int which, std::span<float> out) {
  STRATA_RETURN_IF_ERROR(check_finalized("read_master"));
  STRATA_RETURN_IF_ERROR(check_not_torn("read_state"));
  if (which < 0 || which >= layout_.optimizer.arrays) {
    return Status::invalid_argument(str_cat("read_state: array ", which, " (", to_string(layout_.optimizer.type),
                                            " keeps ", layout_.optimizer.arrays, ": 0 to ",
                                            layout_.optimizer.arrays - 1, ")"));
  }
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    if (layout_.params[pi].name != param) continue;
    const ParamPlace& pl = layout_.places[pi];
    const std::int64_t n = layout_.params[pi].numel();
    if (pl.trainable_offset < 0) return Status::failed_precondition(str_cat("'", param, "' is frozen: no master"));
    if (static_cast<std::int64_t>(out.size()) != n) {
      return Status::invalid_argument(str_cat("read_master('", param, "'): ", n, " elements, buffer of ", out.size()));
    }
    const GroupPlace& gp = layout_.groups[pl.group];
    // With several ranks this rank's chunks cover its shard only.
    if (layout_.share.ranks > 1) std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
      const ChunkPlace& cp = layout_.chunks[c];
      const std::int64_t lo = std::max(pl.trainable_offset, cp.begin), hi = std::min(pl.trainable_offset + n, cp.begin + cp.elems);
      if (lo >= hi) continue;
      float* dst = out.data() + (lo - pl.trainable_offset);
      const auto count = static_cast<std::size_t>(hi - lo);
      // bf16 and int8 arrays come in beside and are widened to fp32 (bf16
      // exactly; int8 codes as a step dequantizes them, with their blocks'
      // scales: lo starts a block, a parameter's offset and a chunk's begin do).
      const OptimizerSpec& spec = layout_.optimizer;
      const auto eb = static_cast<std::size_t>(spec.elem_bytes(which));
      const bool blockwise = which > 0 && spec.blockwise();
      const std::size_t blocks = blockwise ? OptimizerSpec::blocks(hi - lo) : 0;
      const std::size_t first_block = blockwise ? static_cast<std::size_t>(lo - cp.begin) / core::numerics::kQuantBlockElems : 0;
      std::vector<std::byte> narrow(eb < 4 ? count * eb : 0);
      std::vector<float> scales(blocks);
      std::byte* raw = eb < 4 ? narrow.data() : reinterpret_cast<std::byte*>(dst);
      if (cp.state_tier == Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan s, state_->device_state(c));
        const std::uint64_t array = spec.array_offset(which, cp.elems);
        STRATA_RETURN_IF_ERROR(copy_d2h({raw, count * eb}, s.subspan(array + static_cast<std::uint64_t>(lo - cp.begin) * eb,
                                                                     count * eb)));
        if (blockwise) {
          STRATA_RETURN_IF_ERROR(copy_d2h(std::as_writable_bytes(std::span<float>(scales)),
                                          s.subspan(spec.scales_offset(which, cp.elems) + first_block * 4, blocks * 4)));
        }
      } else {
        gpu::PinnedBuffer stage;
        STRATA_ASSIGN_OR_RETURN(ChunkState st, load_host_chunk(c, stage));
        const StateArray& a = st.arrays[static_cast<std::size_t>(which)];
        std::memcpy(raw, a.data + static_cast<std::size_t>(lo - cp.begin) * eb, count * eb);
        if (blockwise) std::memcpy(scales.data(), a.scales + first_block, blocks * 4);
      }
      if (eb < 4) widen_state(static_cast<int>(eb), spec.signed_codes(which), raw, scales.data(), count, dst);
    }
    return Status();
  }
  return Status::not_found(str_cat("read_master: no parameter named '", param, "'"));
}

core::Status Engine::read_compute(std::string_view param, std::span<float> out) {
  STRATA_ENGINE_ENTRY("read_compute");
  if (finalized_) STRATA_RETURN_IF_ERROR(check_not_torn("read_compute"));  // the same verdict on every rank
  if (finalized_ && layout_.compute_sharded) {
    // A gather every rank takes part in, whatever fails here first.
    Status ready = step_->refuse_while_applying("read_compute");
    if (ready.ok()) ready = step_->wait_optimizer("read_compute");
    return read_compute_locked(param, out, std::move(ready));
  }
  STRATA_RETURN_IF_ERROR(step_->refuse_while_applying("read_compute"));
  STRATA_RETURN_IF_ERROR(step_->wait_optimizer("read_compute"));
  // Between steps, the latest update (which "delayed" would show only at the
  // next step_end) becomes visible; within a step, the copies it computes with.
  // With several ranks committing here would change this rank's next
  // forward alone: the pending copies are read where they wait instead.
  if (finalized_ && between_steps() && ranks_.share.ranks == 1) {
    STRATA_RETURN_IF_ERROR(step_->flush_delayed("read_compute"));
  }
  return read_compute_locked(param, out);
}

core::Status Engine::read_compute_locked(std::string_view param, std::span<float> out, core::Status ready) {
  STRATA_RETURN_IF_ERROR(check_finalized("read_compute"));
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    if (layout_.params[pi].name != param) continue;
    const ParamPlace& pl = layout_.places[pi];
    if (ready.ok() && static_cast<std::int64_t>(out.size()) != layout_.params[pi].numel()) {
      ready = Status::invalid_argument(str_cat("read_compute('", param, "'): ", layout_.params[pi].numel(),
                                               " elements, buffer of ", out.size()));
    }
    if (layout_.compute_sharded) {
      // Stage 3 over several ranks: a call every rank makes; the group's
      // shards gathered (each rank's pending copy where one waits), a
      // failure here carried into the gather, so that no rank waits for
      // another.
      gpu::PinnedBuffer staging;
      std::span<std::byte> host;
      gather_compute(pl.group, staging, host, ready);
      STRATA_RETURN_IF_ERROR(ready);
      from_compute(host.data() + pl.compute_offset * layout_.compute_bytes, out, layout_.compute_bytes,
                   config_.precision);
      pinned_cache_->put(std::move(staging));
      return Status();
    }
    STRATA_RETURN_IF_ERROR(ready);
    if (const std::byte* pending = homes_->pending_copy(pl.group); pending != nullptr) {
      // "delayed" with several ranks: the newest copies, not yet home.
      from_compute(pending + pl.compute_offset * layout_.compute_bytes, out, layout_.compute_bytes, config_.precision);
      return Status();
    }
    fetcher_->settle_prefetches();  // they may be reading this group's home
    gpu::PinnedBuffer staging;
    const Step::TrafficPause pause(*step_);  // inspection is not step traffic
    STRATA_ASSIGN_OR_RETURN(std::span<std::byte> host, homes_->load(pl.group, staging, step_lane()));
    from_compute(host.data() + pl.compute_offset * layout_.compute_bytes, out, layout_.compute_bytes, config_.precision);
    return Status();
  }
  return Status::not_found(str_cat("read_compute: no parameter named '", param, "'"));
}

core::Result<gpu::DeviceSpan> Engine::fetch(std::string_view group, gpu::Stream* stream) {
  STRATA_ENGINE_ENTRY("fetch");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "fetch"));
  STRATA_RETURN_IF_ERROR(step_->may_fetch(g));
  return fetcher_->fetch(g, stream);
}

core::Status Engine::wait_fetched(std::string_view group) {
  STRATA_ENGINE_ENTRY("wait_fetched");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "wait_fetched"));
  return fetcher_->wait_fetched(g);
}

core::Status Engine::release(std::string_view group, gpu::Stream* used_on) {
  STRATA_ENGINE_ENTRY("release");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "release"));
  return fetcher_->release(g, used_on);
}

ViewLease::ViewLease(std::shared_ptr<ViewHolds> holds, std::uint64_t buffer_id)
    : holds_(std::move(holds)), buffer_id_(buffer_id) {
  holds_->hold(buffer_id_);
}

ViewLease::~ViewLease() { holds_->end(buffer_id_); }

core::Result<LentView> Engine::lend_view(std::string_view group, ViewKind kind) {
  STRATA_ENGINE_ENTRY("lend_view");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "lend_view"));
  const gpu::DeviceBuffer* lent = &step_->gradient_buffer(g);
  if (kind == ViewKind::kCompute) {
    STRATA_ASSIGN_OR_RETURN(lent, fetcher_->fetched_buffer(g));
  } else {
    STRATA_RETURN_IF_ERROR(step_->grad_buffer(g).status());
  }
  STRATA_CHECK(!lent->empty()) << "lend_view('" << group << "'): no buffer";
  return LentView{lent->span(), std::unique_ptr<ViewLease>(new ViewLease(holds_, lent->id()))};
}

std::vector<std::string> Engine::fetch_sequence() const {
  const core::MutexLock lock(mu_);
  std::vector<std::string> names;
  if (fetcher_ == nullptr) return names;
  for (std::size_t g : fetcher_->sequence().learned()) names.push_back(layout_.groups[g].name);
  return names;
}

std::vector<std::string> Engine::swap_paths() const {
  const core::MutexLock lock(mu_);
  return swap_ != nullptr ? swap_->paths() : std::vector<std::string>{};
}

std::vector<SwapPathBytes> Engine::swap_traffic() const {
  const core::MutexLock lock(mu_);
  return swap_traffic_of(swap_.get());
}

CopyLane Engine::step_lane() { return step_->lane(); }

std::size_t Engine::staging_slots() const { return step_->ring_slots(); }  // set once, by finalize

core::Result<gpu::DeviceSpan> Engine::grad_buffer(std::string_view group) {
  STRATA_ENGINE_ENTRY("grad_buffer");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "grad_buffer"));
  return step_->grad_buffer(g);
}

core::Status Engine::grads_ready(std::string_view group, gpu::Stream* written_on) {
  STRATA_ENGINE_ENTRY("grads_ready");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "grads_ready"));
  return step_->grads_ready(g, written_on);
}

core::Status Engine::no_grads(std::string_view group, std::span<const std::string_view> params) {
  STRATA_ENGINE_ENTRY("no_grads");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "no_grads"));
  std::vector<std::size_t> indices;
  indices.reserve(params.size());
  for (std::string_view name : params) {
    const std::vector<std::size_t>& in_group = layout_.groups[g].params;
    const auto it = std::find_if(in_group.begin(), in_group.end(),
                                 [&](std::size_t pi) { return layout_.params[pi].name == name; });
    if (it == in_group.end()) {
      return Status::invalid_argument(
          str_cat("no_grads('", group, "'): the group has no parameter named '", name, "'"));
    }
    indices.push_back(*it);
  }
  return step_->no_grads(g, indices);
}

core::Status Engine::micro_step_end() {
  STRATA_ENGINE_ENTRY("micro_step_end");
  STRATA_RETURN_IF_ERROR(check_finalized("micro_step_end"));
  STRATA_RETURN_IF_ERROR(check_not_torn("micro_step_end"));
  return step_->micro_step_end();
}

core::Result<StepStats> Engine::step_end() {
  STRATA_ENGINE_ENTRY("step_end");
  STRATA_RETURN_IF_ERROR(check_finalized("step_end"));
  STRATA_RETURN_IF_ERROR(check_not_torn("step_end"));
  return step_->step_end();
}

}  // namespace strata::engine
