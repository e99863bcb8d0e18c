// gpu::Device: one accelerator behind one interface, with two backends (the
// emulated host device, gpu/host_device.h; CUDA, gpu/cuda_device.h). The split
// follows ggml-backend: the Device owns memory and capabilities; a Stream is a
// FIFO queue of work; an Event marks a point in a stream; DeviceBuffer and
// PinnedBuffer own memory. Public methods are non-virtual: they validate
// arguments once for every backend and dispatch to the backend's do_* hooks.
//
// Thread-safety: Device is thread-safe (any thread may enqueue on any stream).
// DeviceBuffer, PinnedBuffer, Stream and Event are move-only owners, released
// through their Device, which must outlive them (its destructor checks).
//
// Asynchrony: enqueueing calls (copies, kernels, record, wait, callbacks)
// return after validation; the work runs later in stream order. An error found
// while validating is returned and nothing is enqueued. An error found while
// the work runs (a CUDA fault; on the host device a buffer freed before the
// work ran) is sticky on its stream: later work on that stream is skipped,
// streams waiting on it through events fail too, and synchronize/query of the
// stream or of a later event return it. Host memory handed to an async copy
// must stay valid until the copy completes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "core/host_allocator.h"
#include "core/memory_budget.h"
#include "core/mutex.h"
#include "core/result.h"
#include "gpu/device_span.h"

namespace strata::gpu {

enum class DeviceKind { kHost, kCuda };
std::string_view device_kind_name(DeviceKind kind);  // "host", "cuda"

// What a backend offers. Filled once by the backend; read-only after.
struct DeviceCaps {
  DeviceKind kind = DeviceKind::kHost;
  std::string name;                         // "host (emulated)", "NVIDIA H100 80GB HBM3"
  std::uint64_t device_memory_bytes = 0;    // what allocate() can hand out in all (arena or budget)
  std::uint64_t allocation_alignment_bytes = 256;  // every DeviceBuffer starts on this
  bool page_locked_host_memory = false;     // pinned memory is really page-locked (DMA-able)
  bool native_streams = false;              // wrap_native_stream() and Stream::native_handle() work
  bool declared_compute = false;            // declare_compute() takes its modeled time
  bool timing_model = false;                // copies and kernels take modeled time
  bool strict = false;                      // run-time checks: unrecorded events, freed buffers
  int compute_capability = 0;               // 90 for sm_90; 0 on the host device
  int index = 0;                            // the CUDA device ordinal; 0 on the host device
  // Where the GPU sits on its machine's PCI bus: (domain << 16) | (bus << 8)
  // | device; 0 on the host device. Two ranks of one machine with the same
  // location share a GPU (NCCL refuses them one communicator).
  std::uint64_t pci_location = 0;
};

class Device;

// Backend state of a stream or an event (each backend derives its own).
class StreamImpl {
 public:
  virtual ~StreamImpl() = default;
};
class EventImpl {
 public:
  virtual ~EventImpl() = default;
};

// Which end of the device's memory an allocation is placed from. Buffers
// that live long or are fetched (state, compute copies) come from the low end,
// buffers a step takes and gives back (gradients, an update's working copies)
// from the high end: the two kinds come and go interleaved, and a small one
// left below a large one would keep the large one's successor from the room
// the budget says it has (an arena, as the CUDA device's, does not move
// what it has placed). A device without an arena ignores it.
enum class ArenaEnd : std::uint8_t { kLow, kHigh };

// One device allocation, charged to the device budget. Move-only; frees its
// memory and returns its charge when destroyed or reset. Work still queued
// that uses the buffer must finish first (the host device reports a buffer
// freed under queued work as an error of that work's stream).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  DeviceSpan span() const { return span_; }
  DeviceSpan subspan(std::uint64_t offset_bytes, std::uint64_t size_bytes) const {
    return span_.subspan(offset_bytes, size_bytes);
  }
  void* data() const { return span_.data(); }
  std::uint64_t size_bytes() const { return span_.size_bytes(); }
  std::uint64_t id() const { return span_.buffer_id(); }
  bool empty() const { return device_ == nullptr; }
  ArenaEnd arena_end() const { return end_; }
  void reset() noexcept;

 private:
  friend class Device;
  Device* device_ = nullptr;
  DeviceSpan span_;
  ArenaEnd end_ = ArenaEnd::kLow;
  core::BudgetCharge charge_;
};

// Pinned (page-locked) host memory: allocated by the device, or existing host
// memory registered with it. Charged to the pinned budget. Move-only; frees or
// unregisters when destroyed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  std::byte* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }
  std::span<std::byte> bytes() const { return {data_, size_bytes_}; }
  // True for memory registered with register_host() (the caller owns it).
  bool registered() const { return registered_; }
  bool empty() const { return device_ == nullptr; }
  void reset() noexcept;

 private:
  friend class Device;
  Device* device_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t size_bytes_ = 0;
  bool registered_ = false;
  core::BudgetCharge charge_;
};

// A FIFO queue of device work. Move-only; destroying it waits for its work.
class Stream {
 public:
  Stream() = default;
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { reset(); }

  const std::string& name() const { return name_; }
  bool empty() const { return device_ == nullptr; }
  // The backend's handle (a cudaStream_t on CUDA); nullptr on the host device.
  void* native_handle() const;
  StreamImpl* impl() const { return impl_.get(); }
  void reset() noexcept;

 private:
  friend class Device;
  Device* device_ = nullptr;
  std::string name_;
  std::unique_ptr<StreamImpl> impl_;
};

// A point in a stream: record() captures the work enqueued so far on a
// stream; wait() makes later work on another stream wait for it. Recording
// again moves the point (waits already enqueued keep the old one).
class Event {
 public:
  Event() = default;
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { reset(); }

  bool empty() const { return device_ == nullptr; }
  EventImpl* impl() const { return impl_.get(); }
  void reset() noexcept;

 private:
  friend class Device;
  Device* device_ = nullptr;
  std::unique_ptr<EventImpl> impl_;
};

// Budgets a device charges. Borrowed: both must outlive the device.
struct DeviceBudgets {
  core::MemoryBudget* device = nullptr;  // every DeviceBuffer (required)
  core::MemoryBudget* pinned = nullptr;  // every PinnedBuffer (required)
};

class Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const DeviceCaps& caps() const { return caps_; }
  DeviceKind kind() const { return caps_.kind; }
  core::MemoryBudget& device_budget() const { return *budgets_.device; }
  core::MemoryBudget& pinned_budget() const { return *budgets_.pinned; }

  // --- memory -----------------------------------------------------------------
  // Allocates `size_bytes` (> 0) of device memory for `what` ("layer 3 params"),
  // aligned to caps().allocation_alignment_bytes and charged to the device
  // budget rounded up to it (what it takes); contents undefined.
  // Errors: kInvalidArgument for 0 bytes; kResourceExhausted naming the device
  // budget when it would go over, or when the arena has no free range that
  // large (fragmented: freeing buffers makes room, as for the budget);
  // kOutOfMemory when the backend's own memory fails it. `end`: where an
  // arena places it (ArenaEnd above).
  core::Result<DeviceBuffer> allocate(std::uint64_t size_bytes, std::string_view what,
                                      ArenaEnd end = ArenaEnd::kLow) STRATA_EXCLUDES(mu_);

  // Allocates pinned host memory (page-aligned), charged to the pinned budget.
  // Errors as allocate() (kResourceExhausted names the pinned budget).
  core::Result<PinnedBuffer> allocate_pinned(std::size_t size_bytes, std::string_view what) STRATA_EXCLUDES(mu_);

  // As above, with `fill` writing every byte of the memory before it is
  // page-locked; the buffer holds what it wrote. Locking faults in every page
  // that is not yet there, one at a time on one thread (cudaHostAlloc and
  // cudaHostRegister alike: about 2 GB/s), so a fill that writes with many
  // threads (the engine's zero-fill on the CPU optimizer's threads) makes
  // large allocations several times faster, and places the pages near the
  // threads that touch them. `fill` runs once, on the calling thread (it may
  // fan out); it must not call into the device.
  using PinnedFill = std::function<void(std::span<std::byte>)>;
  core::Result<PinnedBuffer> allocate_pinned(std::size_t size_bytes, std::string_view what, const PinnedFill& fill)
      STRATA_EXCLUDES(mu_);

  // The NUMA node (the OS's number) pinned memory allocated from now on is
  // placed on (preferred: another node's pages once it is full); -1 (the
  // default): where the allocating thread first touches it. The engine sets
  // it, before its pinned allocations, to the node of this device's GPU
  // (several ranks on a machine of several nodes). A node the kernel refuses
  // (a container that forbids mbind) leaves the memory where it falls, said
  // once in a warning.
  void set_pinned_numa_node(int node) STRATA_EXCLUDES(mu_);
  int pinned_numa_node() const STRATA_EXCLUDES(mu_);

  // Pins existing host memory (the caller keeps owning it and must keep it
  // alive until the returned buffer is destroyed). Charged to the pinned budget.
  // Errors: kInvalidArgument for an empty range; kAlreadyExists when part of it
  // is registered already; kResourceExhausted over budget.
  core::Result<PinnedBuffer> register_host(std::span<std::byte> memory, std::string_view what) STRATA_EXCLUDES(mu_);

  // This device's pinned memory as a core::HostAllocator, to hand to modules
  // that must not see the GPU (nvme/'s buffer pool). Allocations through it
  // are not charged to a budget (the caller that owns the buffer charges).
  // Lives as long as the device.
  core::HostAllocator& pinned_allocator() STRATA_EXCLUDES(mu_);

  // --- streams and events ----------------------------------------------------
  // Errors: the backend's (a CUDA call that failed).
  core::Result<Stream> create_stream(std::string_view name) STRATA_EXCLUDES(mu_);
  // Wraps a stream the embedding framework owns (a cudaStream_t passed as void*);
  // the Stream does not destroy it. (optional) default: kUnimplemented.
  core::Result<Stream> wrap_native_stream(void* native_stream, std::string_view name) STRATA_EXCLUDES(mu_);
  core::Result<Event> create_event() STRATA_EXCLUDES(mu_);

  // Captures the work enqueued on `stream` so far into `event`.
  core::Status record(Event& event, Stream& stream);
  // Later work on `stream` waits until `event`'s captured work is done; the
  // host does not block. Errors: kFailedPrecondition on a strict device when
  // the event was never recorded (CUDA treats that wait as a no-op).
  core::Status wait(Stream& stream, const Event& event);
  // Blocks until the captured work is done; returns its stream's sticky error.
  // An event never recorded is complete.
  core::Status synchronize(Event& event);
  // True when the captured work is done (or the event was never recorded);
  // the sticky error of its stream otherwise.
  core::Result<bool> query(Event& event);
  // Blocks until all work enqueued on `stream` is done; its sticky error.
  core::Status synchronize(Stream& stream);

  // Runs fn on a runtime thread after the work enqueued before it (stream
  // order), and before the work enqueued after it. fn must not call into this
  // Device (CUDA forbids runtime calls in host functions) and must not throw.
  // It is not called if the stream has failed.
  core::Status host_callback(Stream& stream, std::function<void()> fn);

  // --- copies (async; sizes must be equal, views in bounds) --------------------
  // Errors: kInvalidArgument (sizes differ, a view of another device, dst and
  // src overlap for d2d), kOutOfRange (a view past its buffer's end),
  // kFailedPrecondition (a view of a freed buffer).
  core::Status copy_h2d(Stream& stream, DeviceSpan dst, std::span<const std::byte> src);
  core::Status copy_d2h(Stream& stream, std::span<std::byte> dst, DeviceSpan src);
  core::Status copy_d2d(Stream& stream, DeviceSpan dst, DeviceSpan src);

  // --- kernels (async; formulas in core/numerics.h, bit-identical to
  // it on every backend for finite values; NaN in gives NaN out) ----------------
  // Besides the copy errors: kInvalidArgument for sizes that differ, a byte size
  // that is not a whole number of elements, a misaligned view, or wrong types.

  // dst = src converted element-wise (fp32 -> bf16/fp16 rounds to nearest
  // even; bf16/fp16 -> fp32 is exact; between 16-bit types through fp32; the
  // same type copies bit patterns). Same element count; no overlap.
  core::Status convert(Stream& stream, DeviceTypedSpan dst, DeviceTypedSpan src);
  // dst (fp32) = dst + fp32(src), element-wise. Same element count; no overlap.
  core::Status accumulate(Stream& stream, DeviceSpan dst_f32, DeviceTypedSpan src);
  // Norm partials and the inf/nan flag (see NormPartialsArgs).
  core::Status norm_partials(Stream& stream, const NormPartialsArgs& args);
  // x = x * factor (in fp32, rounded back to x's type).
  core::Status scale(Stream& stream, DeviceTypedSpan x, float factor);
  // x = value (rounded to x's type).
  core::Status fill(Stream& stream, DeviceTypedSpan x, float value);
  // One AdamW/Adam step (see AdamStepArgs). Also kInvalidArgument for
  // constants that are not finite.
  core::Status adam_step(Stream& stream, const AdamStepArgs& args);
  // One AdamW/Adam step with bf16 moments (see AdamStepBf16MomentsArgs),
  // checked as adam_step with exp_avg and exp_avg_sq as bf16 (2 bytes per
  // element, 2-byte aligned); also kInvalidArgument for an unknown rounding,
  // a negative index_base, or an index_base + n past INT64_MAX.
  core::Status adam_step_bf16_moments(Stream& stream, const AdamStepBf16MomentsArgs& args);
  // One AdamW/Adam step with 8-bit blockwise moments (see AdamStepInt8Args),
  // checked as adam_step with exp_avg and exp_avg_sq as n bytes each (any
  // alignment) and exp_avg_scale and exp_avg_sq_scale as fp32 (4-byte
  // aligned) of ceil(n / 256) scales each; errors name the field.
  core::Status adam_step_int8_blockwise(Stream& stream, const AdamStepInt8Args& args);
  // One Lion / Adagrad step (LionStepArgs, AdagradStepArgs), checked as adam_step.
  core::Status lion_step(Stream& stream, const LionStepArgs& args);
  core::Status adagrad_step(Stream& stream, const AdagradStepArgs& args);

  // Another library's work over device memory in stream order (a
  // collective: NCCL on CUDA, Gloo on the host device). `fn` gets the
  // stream's native handle (a cudaStream_t on CUDA; null on the host device)
  // and the spans' device addresses, in order. On CUDA fn runs now, on the
  // calling thread, and may only queue work on that stream; its failure is
  // returned. On the host device it runs once the stream's earlier work is
  // done, on the stream's thread, the spans' memory the host's to read and
  // write while it runs; its failure becomes the stream's error (sticky,
  // returned by the next synchronize). Errors: as the copies' for the
  // spans; kInvalidArgument for an empty fn or more than 8 spans.
  using StreamWork = std::function<core::Status(void* native_stream, std::span<void* const> ptrs)>;
  core::Status run_on_stream(Stream& stream, std::span<const DeviceSpan> spans, StreamWork fn);

  // A compute operation of `flops` floating-point operations that does
  // nothing but take the time the timing model gives it, so a pipeline can be
  // measured without a GPU. (optional) default: kUnimplemented (see
  // caps().declared_compute).
  core::Status declare_compute(Stream& stream, double flops, std::string_view what);

  // Blocks until all work on every stream of this device is done.
  core::Status synchronize();

 protected:
  Device(DeviceCaps caps, DeviceBudgets budgets);
  // Backends set this once their caps are known (before any other call).
  DeviceCaps& mutable_caps() { return caps_; }

  // --- backend hooks. Arguments are validated; views are in bounds, of this
  // device, of live buffers, aligned for their element type. -----------------
  virtual core::Result<void*> do_allocate(std::uint64_t buffer_id, std::uint64_t size_bytes, ArenaEnd end) = 0;
  virtual void do_free(std::uint64_t buffer_id, void* p, std::uint64_t size_bytes) noexcept = 0;
  // `numa_node` >= 0: place the pages on that node (place_on_numa_node).
  virtual core::Result<void*> do_allocate_pinned(std::size_t size_bytes, int numa_node) = 0;
  // With a fill run before the memory is locked (allocate_pinned's second
  // form); freed by do_free_pinned. Default: do_allocate_pinned, then the fill.
  virtual core::Result<void*> do_allocate_pinned_filled(std::size_t size_bytes, int numa_node,
                                                        const PinnedFill& fill);
  virtual void do_free_pinned(void* p, std::size_t size_bytes) noexcept = 0;
  virtual core::Status do_register_host(void* p, std::size_t size_bytes) = 0;
  virtual void do_unregister_host(void* p, std::size_t size_bytes) noexcept = 0;
  // Places fresh pinned pages on `node` before they are touched or locked;
  // the kernel's refusal is a warning (once per device), never an error.
  void place_on_numa_node(void* p, std::size_t size_bytes, int node) STRATA_EXCLUDES(mu_);

  virtual core::Result<std::unique_ptr<StreamImpl>> do_create_stream(std::string_view name) = 0;
  virtual core::Result<std::unique_ptr<StreamImpl>> do_wrap_native_stream(void* native_stream,
                                                                           std::string_view name);
  virtual void* do_native_handle(StreamImpl& stream) const;
  virtual core::Result<std::unique_ptr<EventImpl>> do_create_event() = 0;
  virtual core::Status do_record(EventImpl& event, StreamImpl& stream) = 0;
  virtual core::Status do_wait(StreamImpl& stream, const EventImpl& event) = 0;
  virtual core::Status do_synchronize_event(EventImpl& event) = 0;
  virtual core::Result<bool> do_query_event(EventImpl& event) = 0;
  virtual core::Status do_synchronize_stream(StreamImpl& stream) = 0;
  virtual core::Status do_host_callback(StreamImpl& stream, std::function<void()> fn) = 0;
  virtual core::Status do_synchronize_device() = 0;

  virtual core::Status do_copy_h2d(StreamImpl& stream, const DeviceSpan& dst, const void* src) = 0;
  virtual core::Status do_copy_d2h(StreamImpl& stream, void* dst, const DeviceSpan& src) = 0;
  virtual core::Status do_copy_d2d(StreamImpl& stream, const DeviceSpan& dst, const DeviceSpan& src) = 0;

  virtual core::Status do_convert(StreamImpl& stream, const DeviceTypedSpan& dst, const DeviceTypedSpan& src) = 0;
  virtual core::Status do_accumulate(StreamImpl& stream, const DeviceSpan& dst_f32, const DeviceTypedSpan& src) = 0;
  virtual core::Status do_norm_partials(StreamImpl& stream, const NormPartialsArgs& args) = 0;
  virtual core::Status do_scale(StreamImpl& stream, const DeviceTypedSpan& x, float factor) = 0;
  virtual core::Status do_fill(StreamImpl& stream, const DeviceTypedSpan& x, float value) = 0;
  virtual core::Status do_adam_step(StreamImpl& stream, const AdamStepArgs& args) = 0;
  virtual core::Status do_adam_step_bf16_moments(StreamImpl& stream, const AdamStepBf16MomentsArgs& args) = 0;
  virtual core::Status do_adam_step_int8_blockwise(StreamImpl& stream, const AdamStepInt8Args& args) = 0;
  virtual core::Status do_lion_step(StreamImpl& stream, const LionStepArgs& args) = 0;
  virtual core::Status do_adagrad_step(StreamImpl& stream, const AdagradStepArgs& args) = 0;
  virtual core::Status do_declare_compute(StreamImpl& stream, double flops);
  virtual core::Status do_run_on_stream(StreamImpl& stream, std::vector<DeviceSpan> spans, StreamWork fn) = 0;

 private:
  friend class DeviceBuffer;
  friend class PinnedBuffer;
  friend class Stream;
  friend class Event;
  class PinnedHostAllocator;

  void release_buffer(DeviceBuffer& buffer) noexcept STRATA_EXCLUDES(mu_);
  void release_pinned(PinnedBuffer& buffer) noexcept STRATA_EXCLUDES(mu_);
  void release_stream(Stream& stream) noexcept STRATA_EXCLUDES(mu_);
  void release_event(Event& event) noexcept STRATA_EXCLUDES(mu_);

  // Checks a view against this device's live buffers; `role` names it in errors.
  core::Status check_span(const DeviceSpan& span, std::string_view role) const STRATA_EXCLUDES(mu_);
  core::Status check_typed(const DeviceTypedSpan& span, std::string_view role) const STRATA_EXCLUDES(mu_);
  // The views of an optimizer step `op` other than Adam's: fp32 `arrays` of
  // one element count, the gradient of that count, an optional bf16/fp16
  // copy_out, no two overlapping. Returns the count.
  core::Result<std::int64_t> check_step_views(std::string_view op,
                                              std::initializer_list<std::pair<std::string_view, DeviceSpan>> arrays,
                                              const DeviceTypedSpan& grad, const DeviceTypedSpan& copy_out) const
      STRATA_EXCLUDES(mu_);
  core::Status check_stream(const Stream& stream) const;
  core::Status check_event(const Event& event) const;

  DeviceCaps caps_;
  const DeviceBudgets budgets_;
  std::unique_ptr<PinnedHostAllocator> pinned_allocator_ STRATA_GUARDED_BY(mu_);  // made on first use

  mutable core::Mutex mu_;
  // Live DeviceBuffers: id -> size. Ids are unique per process, never reused.
  struct LiveBuffer {
    std::uint64_t size_bytes;
    void* base;
  };
  std::unordered_map<std::uint64_t, LiveBuffer> live_buffers_ STRATA_GUARDED_BY(mu_);
  std::int64_t live_pinned_ STRATA_GUARDED_BY(mu_) = 0;
  int pinned_numa_node_ STRATA_GUARDED_BY(mu_) = -1;
  bool numa_refusal_said_ STRATA_GUARDED_BY(mu_) = false;
  std::int64_t live_streams_ STRATA_GUARDED_BY(mu_) = 0;
  std::int64_t live_events_ STRATA_GUARDED_BY(mu_) = 0;
};

}  // namespace strata::gpu
