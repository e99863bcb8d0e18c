// The CUDA device (gpu/cuda_device.h): device memory from one arena reserved
// with a single cudaMalloc, pinned memory from cudaHostAlloc/cudaHostRegister,
// CUDA streams and events, and the kernels of cuda_kernels.cu. Every CUDA call
// is checked; an error names the call and CUDA's error name and text.
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/logging.h"
#include "core/mutex.h"
#include "core/str.h"
#include "gpu/arena.h"
#include "gpu/cuda/cuda_kernels.h"
#include "gpu/cuda_device.h"

namespace strata::gpu {
namespace {

using core::Result;
using core::Status;
using core::str_cat;

constexpr std::uint64_t kArenaAlignment = 256;
constexpr std::uint64_t kHeadroomBytes = 1ull << 30;

// A CUDA error as a Status: the code follows the error, the message names the call.
Status cuda_status(cudaError_t err, std::string_view call) {
  (void)cudaGetLastError();  // clear a non-sticky error so later launches do not report it
  std::string msg = str_cat(call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation: return Status::out_of_memory(std::move(msg));
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch: return Status::unavailable(std::move(msg));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice: return Status::invalid_argument(std::move(msg));
    case cudaErrorHostMemoryAlreadyRegistered: return Status::already_exists(std::move(msg));
    case cudaErrorHostMemoryNotRegistered: return Status::failed_precondition(std::move(msg));
    default: return Status::internal(std::move(msg));
  }
}

// Runs `fn args`, and returns its error as a Status naming `fn`.
#define STRATA_CUDA_RETURN_IF_ERROR(fn, args)                      \
  do {                                                             \
    const cudaError_t strata_cuda_err_ = fn args;                  \
    if (strata_cuda_err_ != cudaSuccess) [[unlikely]]              \
      return cuda_status(strata_cuda_err_, #fn);                   \
  } while (false)

// Logs a failure of a call in a path that cannot return one (destructors).
void log_if_error(cudaError_t err, std::string_view call) {
  if (err != cudaSuccess) {
    STRATA_LOG(kWarn) << cuda_status(err, call);
  }
}

class CudaStream final : public StreamImpl {
 public:
  CudaStream(int ordinal, cudaStream_t stream, bool owned) : ordinal_(ordinal), stream_(stream), owned_(owned) {}
  ~CudaStream() override {
    if (!owned_) return;  // the framework's stream: its owner synchronizes and destroys it
    log_if_error(cudaSetDevice(ordinal_), "cudaSetDevice");
    log_if_error(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    log_if_error(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }
  cudaStream_t get() const { return stream_; }

 private:
  const int ordinal_;
  const cudaStream_t stream_;
  const bool owned_;
};

class CudaEvent final : public EventImpl {
 public:
  CudaEvent(int ordinal, cudaEvent_t event) : ordinal_(ordinal), event_(event) {}
  ~CudaEvent() override {
    log_if_error(cudaSetDevice(ordinal_), "cudaSetDevice");
    log_if_error(cudaEventDestroy(event_), "cudaEventDestroy");
  }
  cudaEvent_t get() const { return event_; }

 private:
  const int ordinal_;
  const cudaEvent_t event_;
};

cudaStream_t stream_of(StreamImpl& s) { return static_cast<CudaStream&>(s).get(); }
cudaEvent_t event_of(const EventImpl& e) { return static_cast<const CudaEvent&>(e).get(); }

void host_func_trampoline(void* user_data) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(user_data));
  (*fn)();
}

class CudaDevice final : public Device {
 public:
  CudaDevice(DeviceCaps caps, DeviceBudgets budgets, int ordinal, void* arena_base, std::uint64_t arena_bytes)
      : Device(std::move(caps), budgets), ordinal_(ordinal), arena_base_(arena_base), arena_(arena_bytes, kArenaAlignment) {}

  ~CudaDevice() override {
    log_if_error(cudaSetDevice(ordinal_), "cudaSetDevice");
    log_if_error(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    log_if_error(cudaFree(arena_base_), "cudaFree");
  }

 protected:
  Status activate() {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice, (ordinal_));
    return Status();
  }

  // --- memory ---
  Result<void*> do_allocate(std::uint64_t /*buffer_id*/, std::uint64_t size_bytes, ArenaEnd end) override {
    const std::optional<std::uint64_t> offset = arena_.allocate(size_bytes, end);
    if (!offset) {
      // Fragmented (the budget allowed it): kResourceExhausted, as a budget refusal, so that
      // the caches give their buffers back and the allocation is tried again.
      return Status::resource_exhausted(str_cat("CUDA device arena (", core::format_bytes(arena_.size_bytes()),
                                                ") has no free range of ", core::format_bytes(size_bytes),
                                                " (largest free range: ", core::format_bytes(arena_.largest_free()), ")"));
    }
    return static_cast<void*>(static_cast<std::byte*>(arena_base_) + *offset);
  }

  void do_free(std::uint64_t /*buffer_id*/, void* p, std::uint64_t size_bytes) noexcept override {
    arena_.free(static_cast<std::uint64_t>(static_cast<std::byte*>(p) - static_cast<std::byte*>(arena_base_)),
                size_bytes);
  }

  // Pinned memory is page-aligned (Device::allocate_pinned's contract: the swap engine reads and
  // writes it with O_DIRECT). cudaHostAlloc promises no more than 256 bytes: the driver hands small
  // requests out of a shared pinned pool (on an H200 with CUDA 13, small blocks came back off page
  // boundaries, and every O_DIRECT read into them failed).
  // The size is rounded up to whole pages; an answer off a page boundary is given back and taken
  // again one page larger, the block's start kept to free it.
  //
  // On a NUMA node (numa_node >= 0) the pages are mapped here, placed on the node while none is
  // touched, and then page-locked with cudaHostRegister (which faults them in there): memory
  // cudaHostAlloc returns is locked already, where it fell, and locked pages do not move.
  Result<void*> do_allocate_pinned(std::size_t size_bytes, int numa_node) override {
    STRATA_RETURN_IF_ERROR(activate());
    const std::size_t rounded = core::align_up(size_bytes, kPinnedAlignment);
    if (numa_node >= 0) return allocate_pinned_on_node(rounded, numa_node);
    void* p = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaHostAlloc, (&p, rounded, cudaHostAllocPortable));
    if (reinterpret_cast<std::uintptr_t>(p) % kPinnedAlignment == 0) return p;
    log_if_error(cudaFreeHost(p), "cudaFreeHost");
    void* base = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaHostAlloc, (&base, rounded + kPinnedAlignment, cudaHostAllocPortable));
    void* aligned = reinterpret_cast<void*>(core::align_up(reinterpret_cast<std::uintptr_t>(base), kPinnedAlignment));
    core::MutexLock lock(pinned_mu_);
    offset_pinned_.emplace(aligned, base);
    return aligned;
  }

  void do_free_pinned(void* p, std::size_t /*size_bytes*/) noexcept override {
    void* base = p;
    std::size_t mapped = 0;
    {
      core::MutexLock lock(pinned_mu_);
      if (auto it = offset_pinned_.find(p); it != offset_pinned_.end()) {
        base = it->second;
        offset_pinned_.erase(it);
      } else if (auto m = mapped_pinned_.find(p); m != mapped_pinned_.end()) {
        mapped = m->second;
        mapped_pinned_.erase(m);
      }
    }
    if (mapped == 0) {
      log_if_error(cudaFreeHost(base), "cudaFreeHost");
      return;
    }
    log_if_error(cudaHostUnregister(p), "cudaHostUnregister");
    if (::munmap(p, mapped) != 0) {
      STRATA_LOG(kWarn) << "CUDA device: munmap of pinned memory failed";
    }
  }

  // do_allocate_pinned's NUMA-placed memory: `bytes` (whole pages) mapped, placed, registered.
  Result<void*> allocate_pinned_on_node(std::size_t bytes, int numa_node) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return Status::out_of_memory(str_cat("CUDA device: cannot map ", core::format_bytes(bytes),
                                           " of host memory to pin on NUMA node ", numa_node));
    }
    // A fork (a data loader's workers) must not copy the locked pages into the child, as it
    // would private memory pinned for DMA; cudaHostAlloc's memory is kept out of children too.
    (void)::madvise(p, bytes, MADV_DONTFORK);
    place_on_numa_node(p, bytes, numa_node);
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      // The node is a preference: the memory comes from cudaHostAlloc instead, wherever it falls.
      ::munmap(p, bytes);
      (void)cudaGetLastError();  // the failed registration is not the next call's error
      STRATA_LOG(kWarn) << "CUDA device: cannot lock " << core::format_bytes(bytes) << " placed on NUMA node "
                        << numa_node << " (" << cuda_status(e, "cudaHostRegister").message()
                        << "); allocating it with cudaHostAlloc, off that node";
      return do_allocate_pinned(bytes, -1);
    }
    core::MutexLock lock(pinned_mu_);
    mapped_pinned_.emplace(p, bytes);
    return p;
  }

  // allocate_pinned with a fill: the pages mapped here (placed on the node first), written by the
  // caller's fill on its threads, and only then locked with cudaHostRegister, which finds them all
  // present (cudaHostAlloc, or a registration of untouched memory, faults them in one at a time on
  // the calling thread: 38 s for the 72 GiB of a 7B model's optimizer state on an H200 machine).
  // The fallback holds the mapped block and its copy at once, the first time only.
  // Small blocks (each mapping is an entry the kernel counts against vm.max_map_count) and memory
  // that cannot be mapped come from do_allocate_pinned, then the fill. Where the driver refuses to
  // lock mapped memory, that memory is copied into cudaHostAlloc's (off any NUMA node: a placed
  // block is locked the same way), said once, and every later block comes from cudaHostAlloc.
  Result<void*> do_allocate_pinned_filled(std::size_t size_bytes, int numa_node, const PinnedFill& fill) override {
    STRATA_RETURN_IF_ERROR(activate());
    const std::size_t bytes = core::align_up(size_bytes, kPinnedAlignment);
    bool refused = false;
    {
      core::MutexLock lock(pinned_mu_);
      refused = register_refused_;
    }
    if (refused) return Device::do_allocate_pinned_filled(size_bytes, -1, fill);
    if (bytes < kFilledMappedMinBytes) return Device::do_allocate_pinned_filled(size_bytes, numa_node, fill);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return Device::do_allocate_pinned_filled(size_bytes, numa_node, fill);
    (void)::madvise(p, bytes, MADV_DONTFORK);  // as allocate_pinned_on_node's
    place_on_numa_node(p, bytes, numa_node);
    fill({static_cast<std::byte*>(p), size_bytes});
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // the failed registration is not the next call's error
      {
        core::MutexLock lock(pinned_mu_);
        if (!std::exchange(register_refused_, true)) {
          STRATA_LOG(kWarn) << "CUDA device: cannot lock " << core::format_bytes(bytes) << " of host memory filled "
                            << "before locking (" << cuda_status(e, "cudaHostRegister").message()
                            << "); such memory comes from cudaHostAlloc from now on (slower to allocate)";
        }
      }
      Result<void*> q = do_allocate_pinned(size_bytes, -1);
      if (q.ok()) std::memcpy(*q, p, size_bytes);
      ::munmap(p, bytes);
      return q;
    }
    core::MutexLock lock(pinned_mu_);
    mapped_pinned_.emplace(p, bytes);
    return p;
  }

  Status do_register_host(void* p, std::size_t size_bytes) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cudaHostRegister, (p, size_bytes, cudaHostRegisterPortable));
    return Status();
  }

  void do_unregister_host(void* p, std::size_t /*size_bytes*/) noexcept override {
    log_if_error(cudaHostUnregister(p), "cudaHostUnregister");
  }

  // --- streams and events ---
  Result<std::unique_ptr<StreamImpl>> do_create_stream(std::string_view /*name*/) override {
    STRATA_RETURN_IF_ERROR(activate());
    cudaStream_t s = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags, (&s, cudaStreamNonBlocking));
    return std::unique_ptr<StreamImpl>(std::make_unique<CudaStream>(ordinal_, s, true));
  }

  Result<std::unique_ptr<StreamImpl>> do_wrap_native_stream(void* native_stream, std::string_view /*name*/) override {
    return std::unique_ptr<StreamImpl>(
        std::make_unique<CudaStream>(ordinal_, static_cast<cudaStream_t>(native_stream), false));
  }

  void* do_native_handle(StreamImpl& stream) const override { return stream_of(stream); }

  Result<std::unique_ptr<EventImpl>> do_create_event() override {
    STRATA_RETURN_IF_ERROR(activate());
    cudaEvent_t e = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags, (&e, cudaEventDisableTiming));
    return std::unique_ptr<EventImpl>(std::make_unique<CudaEvent>(ordinal_, e));
  }

  Status do_record(EventImpl& event, StreamImpl& stream) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord, (event_of(event), stream_of(stream)));
    return Status();
  }

  Status do_wait(StreamImpl& stream, const EventImpl& event) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent, (stream_of(stream), event_of(event), 0));
    return Status();
  }

  Status do_synchronize_event(EventImpl& event) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize, (event_of(event)));
    return Status();
  }

  Result<bool> do_query_event(EventImpl& event) override {
    const cudaError_t err = cudaEventQuery(event_of(event));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it
      return false;
    }
    return cuda_status(err, "cudaEventQuery");
  }

  Status do_synchronize_stream(StreamImpl& stream) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize, (stream_of(stream)));
    return Status();
  }

  Status do_synchronize_device() override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize, ());
    return Status();
  }

  Status do_host_callback(StreamImpl& stream, std::function<void()> fn) override {
    auto heap = std::make_unique<std::function<void()>>(std::move(fn));
    STRATA_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc, (stream_of(stream), host_func_trampoline, heap.get()));
    (void)heap.release();  // owned by the trampoline now
    return Status();
  }

  Status do_run_on_stream(StreamImpl& stream, std::vector<DeviceSpan> spans, StreamWork fn) override {
    STRATA_RETURN_IF_ERROR(activate());
    void* ptrs[8] = {};
    for (std::size_t i = 0; i < spans.size(); ++i) ptrs[i] = spans[i].data();
    return fn(stream_of(stream), std::span<void* const>(ptrs, spans.size()));
  }

  // --- copies ---
  Status do_copy_h2d(StreamImpl& stream, const DeviceSpan& dst, const void* src) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync,
                                (dst.data(), src, dst.size_bytes(), cudaMemcpyHostToDevice, stream_of(stream)));
    return Status();
  }

  Status do_copy_d2h(StreamImpl& stream, void* dst, const DeviceSpan& src) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync,
                                (dst, src.data(), src.size_bytes(), cudaMemcpyDeviceToHost, stream_of(stream)));
    return Status();
  }

  Status do_copy_d2d(StreamImpl& stream, const DeviceSpan& dst, const DeviceSpan& src) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync, (dst.data(), src.data(), dst.size_bytes(),
                                                  cudaMemcpyDeviceToDevice, stream_of(stream)));
    return Status();
  }

  // --- kernels ---
  Status do_convert(StreamImpl& stream, const DeviceTypedSpan& dst, const DeviceTypedSpan& src) override {
    if (dst.type == src.type) return do_copy_d2d(stream, dst.bytes, src.bytes);
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cuda::launch_convert, (dst.bytes.data(), dst.type, src.bytes.data(), src.type,
                                                       dst.size(), stream_of(stream)));
    return Status();
  }

  Status do_accumulate(StreamImpl& stream, const DeviceSpan& dst, const DeviceTypedSpan& src) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cuda::launch_accumulate, (static_cast<float*>(dst.data()), src.bytes.data(),
                                                          src.type, src.size(), stream_of(stream)));
    return Status();
  }

  Status do_norm_partials(StreamImpl& stream, const NormPartialsArgs& args) override {
    STRATA_RETURN_IF_ERROR(activate());
    auto* flag = args.nonfinite_flag.buffer_id() != 0 ? static_cast<std::uint32_t*>(args.nonfinite_flag.data())
                                                      : nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cuda::launch_norm_partials,
                                (args.src.bytes.data(), args.src.type, args.src.size(),
                                 static_cast<double*>(args.partials.data()), flag, stream_of(stream)));
    return Status();
  }

  Status do_scale(StreamImpl& stream, const DeviceTypedSpan& x, float factor) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cuda::launch_scale, (x.bytes.data(), x.type, x.size(), factor, stream_of(stream)));
    return Status();
  }

  Status do_fill(StreamImpl& stream, const DeviceTypedSpan& x, float value) override {
    STRATA_RETURN_IF_ERROR(activate());
    STRATA_CUDA_RETURN_IF_ERROR(cuda::launch_fill, (x.bytes.data(), x.type, x.size(), value, stream_of(stream)));
    return Status();
  }

  Status do_adam_step(StreamImpl& stream, const AdamStepArgs& args) override {
    STRATA_RETURN_IF_ERROR(activate());
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    STRATA_CUDA_RETURN_IF_ERROR(
        cuda::launch_adam_step,
        (args.constants, static_cast<float*>(args.master.data()), static_cast<float*>(args.exp_avg.data()),
         static_cast<float*>(args.exp_avg_sq.data()), args.grad.bytes.data(), args.grad.type,
         has_copy ? args.copy_out.bytes.data() : nullptr, args.copy_out.type, args.grad.size(), stream_of(stream)));
    return Status();
  }

  Status do_adam_step_bf16_moments(StreamImpl& stream, const AdamStepBf16MomentsArgs& args) override {
    STRATA_RETURN_IF_ERROR(activate());
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    // The step's key is 64-bit scalar work: done once here, not per element.
    const std::uint64_t key = core::numerics::stochastic_rounding_key(args.seed, args.step);
    STRATA_CUDA_RETURN_IF_ERROR(
        cuda::launch_adam_step_bf16_moments,
        (args.constants, static_cast<float*>(args.master.data()),
         static_cast<std::uint16_t*>(args.exp_avg.data()),
         static_cast<std::uint16_t*>(args.exp_avg_sq.data()), args.grad.bytes.data(), args.grad.type,
         has_copy ? args.copy_out.bytes.data() : nullptr, args.copy_out.type, args.rounding, key,
         args.index_base, args.grad.size(), stream_of(stream)));
    return Status();
  }

  Status do_adam_step_int8_blockwise(StreamImpl& stream, const AdamStepInt8Args& args) override {
    STRATA_RETURN_IF_ERROR(activate());
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    STRATA_CUDA_RETURN_IF_ERROR(
        cuda::launch_adam_step_int8_blockwise,
        (args.constants, static_cast<float*>(args.master.data()),
         static_cast<std::uint8_t*>(args.exp_avg.data()), static_cast<std::uint8_t*>(args.exp_avg_sq.data()),
         static_cast<float*>(args.exp_avg_scale.data()), static_cast<float*>(args.exp_avg_sq_scale.data()),
         args.grad.bytes.data(), args.grad.type, has_copy ? args.copy_out.bytes.data() : nullptr,
         args.copy_out.type, args.grad.size(), stream_of(stream)));
    return Status();
  }

  Status do_lion_step(StreamImpl& stream, const LionStepArgs& args) override {
    STRATA_RETURN_IF_ERROR(activate());
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    STRATA_CUDA_RETURN_IF_ERROR(
        cuda::launch_lion_step,
        (args.constants, static_cast<float*>(args.master.data()), static_cast<float*>(args.exp_avg.data()),
         args.grad.bytes.data(), args.grad.type, has_copy ? args.copy_out.bytes.data() : nullptr, args.copy_out.type,
         args.grad.size(), stream_of(stream)));
    return Status();
  }

  Status do_adagrad_step(StreamImpl& stream, const AdagradStepArgs& args) override {
    STRATA_RETURN_IF_ERROR(activate());
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    STRATA_CUDA_RETURN_IF_ERROR(
        cuda::launch_adagrad_step,
        (args.constants, static_cast<float*>(args.master.data()), static_cast<float*>(args.exp_avg_sq.data()),
         args.grad.bytes.data(), args.grad.type, has_copy ? args.copy_out.bytes.data() : nullptr, args.copy_out.type,
         args.grad.size(), stream_of(stream)));
    return Status();
  }

 private:
  static constexpr std::size_t kPinnedAlignment = core::kDirectIoAlignment;
  // do_allocate_pinned_filled maps blocks of this size and more (a 72 GiB state in 16 MiB chunks
  // is 4,608 mappings; the kernel's default limit is 65,530 a process).
  static constexpr std::size_t kFilledMappedMinBytes = std::size_t{2} << 20;

  const int ordinal_;
  void* const arena_base_;
  Arena arena_;
  core::Mutex pinned_mu_;
  // Pinned blocks taken one page larger to align them: the address handed out -> cudaHostAlloc's.
  std::unordered_map<void*, void*> offset_pinned_ STRATA_GUARDED_BY(pinned_mu_);
  // Pinned blocks mapped and registered (do_allocate_pinned on a NUMA node, and
  // do_allocate_pinned_filled): start -> bytes.
  std::unordered_map<void*, std::size_t> mapped_pinned_ STRATA_GUARDED_BY(pinned_mu_);
  // A registration of filled memory was refused (said once): later fills go to cudaHostAlloc's.
  bool register_refused_ STRATA_GUARDED_BY(pinned_mu_) = false;
};

}  // namespace

Result<std::unique_ptr<Device>> make_cuda_device(const CudaDeviceOptions& options) {
  if (options.budgets.device == nullptr || options.budgets.pinned == nullptr) {
    return Status::invalid_argument("CUDA device: both budgets (device, pinned) are required");
  }
  int count = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount, (&count));
  if (count == 0) return Status::unavailable("no CUDA device is visible");
  if (options.ordinal < 0 || options.ordinal >= count) {
    return Status::invalid_argument(str_cat("CUDA device ordinal ", options.ordinal, " is not in [0, ", count, ")"));
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice, (options.ordinal));
  cudaDeviceProp prop{};
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties, (&prop, options.ordinal));
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo, (&free_bytes, &total_bytes));
  // The 8-bit Adam kernel's code tables: the host's, byte for byte.
  STRATA_CUDA_RETURN_IF_ERROR(cuda::upload_quant_tables, (core::numerics::kQuantTables));

  std::uint64_t arena_bytes = options.arena_bytes;
  if (arena_bytes == 0) {
    const std::uint64_t limit = options.budgets.device->limit_bytes();
    const std::uint64_t headroom = kHeadroomBytes + options.extra_headroom_bytes;
    arena_bytes = limit != core::MemoryBudget::kUnlimited
                      ? limit
                      : (free_bytes > headroom ? free_bytes - headroom : free_bytes / 2);
  }
  arena_bytes = arena_bytes / kArenaAlignment * kArenaAlignment;
  if (arena_bytes == 0) return Status::invalid_argument("CUDA device: the arena would be empty");
  void* base = nullptr;
  const cudaError_t err = cudaMalloc(&base, arena_bytes);
  if (err != cudaSuccess) {
    return cuda_status(err, "cudaMalloc").annotate(str_cat("reserving the CUDA device arena of ",
                                                           core::format_bytes(arena_bytes), " (",
                                                           core::format_bytes(free_bytes), " free)"));
  }

  DeviceCaps caps;
  caps.kind = DeviceKind::kCuda;
  caps.name = prop.name;
  caps.index = options.ordinal;
  caps.pci_location = (static_cast<std::uint64_t>(prop.pciDomainID) << 16) |
                      (static_cast<std::uint64_t>(prop.pciBusID) << 8) | static_cast<std::uint64_t>(prop.pciDeviceID);
  caps.device_memory_bytes = arena_bytes;
  caps.allocation_alignment_bytes = kArenaAlignment;
  caps.page_locked_host_memory = true;
  caps.native_streams = true;
  caps.declared_compute = false;
  caps.timing_model = false;
  caps.strict = false;
  caps.compute_capability = prop.major * 10 + prop.minor;
  return std::unique_ptr<Device>(
      std::make_unique<CudaDevice>(std::move(caps), options.budgets, options.ordinal, base, arena_bytes));
}

}  // namespace strata::gpu
