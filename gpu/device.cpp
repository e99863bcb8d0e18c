// The dispatch layer of gpu::Device: argument checks shared by every backend,
// buffer bookkeeping, the owners' release paths, and the optional hooks'
// defaults.
#include "gpu/device.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/check.h"
#include "core/logging.h"
#include "core/str.h"
#include "gpu/host_numa.h"

namespace strata::gpu {

using core::Result;
using core::Status;
using core::str_cat;

namespace {

std::atomic<std::uint64_t> g_next_buffer_id{1};

struct Range {
  std::string_view role;
  std::uintptr_t begin;
  std::uintptr_t end;
};

Range range_of(std::string_view role, const DeviceSpan& s) {
  const auto begin = reinterpret_cast<std::uintptr_t>(s.data());
  return {role, begin, begin + s.size_bytes()};
}

Status check_disjoint(std::initializer_list<Range> ranges, std::string_view op) {
  for (auto a = ranges.begin(); a != ranges.end(); ++a) {
    for (auto b = a + 1; b != ranges.end(); ++b) {
      if (a->begin == a->end || b->begin == b->end) continue;
      if (a->begin < b->end && b->begin < a->end) {
        return Status::invalid_argument(str_cat(op, ": ", a->role, " and ", b->role, " overlap"));
      }
    }
  }
  return Status();
}

Status check_constants(const core::numerics::AdamStepConstants& c, std::string_view op) {
  const std::pair<const char*, float> fields[] = {
      {"grad_scale", c.grad_scale},     {"beta1", c.beta1},
      {"beta2", c.beta2},               {"one_minus_beta1", c.one_minus_beta1},
      {"one_minus_beta2", c.one_minus_beta2}, {"eps", c.eps},
      {"inv_sqrt_bias_correction2", c.inv_sqrt_bias_correction2},
      {"neg_step_size", c.neg_step_size}, {"neg_lr_decay", c.neg_lr_decay},
      {"l2_decay", c.l2_decay}};
  for (const auto& [name, value] : fields) {
    if (!std::isfinite(value)) {
      return Status::invalid_argument(str_cat(op, ": constant ", name, " is not finite (", value, ")"));
    }
  }
  return Status();
}

}  // namespace

std::string_view elem_type_name(ElemType type) {
  switch (type) {
    case ElemType::kF32: return "fp32";
    case ElemType::kBf16: return "bf16";
    case ElemType::kF16: return "fp16";
  }
  return "?";
}

std::string_view device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kHost: return "host";
    case DeviceKind::kCuda: return "cuda";
  }
  return "?";
}

// --- owners ------------------------------------------------------------------

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      span_(std::exchange(other.span_, DeviceSpan())),
      end_(other.end_),
      charge_(std::move(other.charge_)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    span_ = std::exchange(other.span_, DeviceSpan());
    end_ = other.end_;
    charge_ = std::move(other.charge_);
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (device_ != nullptr) device_->release_buffer(*this);
  device_ = nullptr;
  span_ = DeviceSpan();
  charge_.release();
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      registered_(std::exchange(other.registered_, false)),
      charge_(std::move(other.charge_)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    registered_ = std::exchange(other.registered_, false);
    charge_ = std::move(other.charge_);
  }
  return *this;
}

void PinnedBuffer::reset() noexcept {
  if (device_ != nullptr) device_->release_pinned(*this);
  device_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
  registered_ = false;
  charge_.release();
}

Stream::Stream(Stream&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      name_(std::move(other.name_)),
      impl_(std::move(other.impl_)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    name_ = std::move(other.name_);
    impl_ = std::move(other.impl_);
  }
  return *this;
}

void* Stream::native_handle() const {
  return device_ != nullptr ? device_->do_native_handle(*impl_) : nullptr;
}

void Stream::reset() noexcept {
  if (device_ != nullptr) device_->release_stream(*this);
  device_ = nullptr;
  impl_.reset();
}

Event::Event(Event&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)), impl_(std::move(other.impl_)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    impl_ = std::move(other.impl_);
  }
  return *this;
}

void Event::reset() noexcept {
  if (device_ != nullptr) device_->release_event(*this);
  device_ = nullptr;
  impl_.reset();
}

// --- the pinned allocator ----------------------------------------------------

class Device::PinnedHostAllocator final : public core::HostAllocator {
 public:
  explicit PinnedHostAllocator(Device* device)
      : device_(device), name_(str_cat("pinned host memory (", device_kind_name(device->kind()), ")")) {}

  std::string_view name() const override { return name_; }

  // A node asked for here (nvme's buffer pool's) before the device's own.
  Result<void*> allocate(std::size_t size_bytes, std::size_t alignment, int numa_node) override {
    if (size_bytes == 0) return Status::invalid_argument(str_cat(name_, ": allocation of 0 bytes"));
    if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0 || alignment > kPageBytes) {
      return Status::invalid_argument(str_cat(name_, ": alignment ", alignment,
                                              " is not a power of two in [", sizeof(void*), ", ", kPageBytes, "]"));
    }
    return device_->do_allocate_pinned(size_bytes, numa_node >= 0 ? numa_node : device_->pinned_numa_node());
  }

  void deallocate(void* p, std::size_t size_bytes) noexcept override {
    if (p != nullptr) device_->do_free_pinned(p, size_bytes);
  }

 private:
  static constexpr std::size_t kPageBytes = 4096;  // what every pinned allocation is aligned to
  Device* device_;
  std::string name_;
};

// --- Device ------------------------------------------------------------------

Device::Device(DeviceCaps caps, DeviceBudgets budgets) : caps_(std::move(caps)), budgets_(budgets) {
  STRATA_CHECK(budgets_.device != nullptr && budgets_.pinned != nullptr) << "a Device needs both budgets";
}

Device::~Device() {
  core::MutexLock lock(mu_);
  STRATA_CHECK(live_buffers_.empty() && live_pinned_ == 0 && live_streams_ == 0 && live_events_ == 0)
      << "gpu::Device destroyed while its objects live: " << live_buffers_.size() << " buffers, "
      << live_pinned_ << " pinned buffers, " << live_streams_ << " streams, " << live_events_ << " events";
}

core::HostAllocator& Device::pinned_allocator() {
  core::MutexLock lock(mu_);
  if (pinned_allocator_ == nullptr) pinned_allocator_ = std::make_unique<PinnedHostAllocator>(this);
  return *pinned_allocator_;
}

Result<DeviceBuffer> Device::allocate(std::uint64_t size_bytes, std::string_view what, ArenaEnd end) {
  if (size_bytes == 0) return Status::invalid_argument(str_cat("device allocation of 0 bytes for ", what));
  // Charged as the memory it takes: rounded up to the allocation alignment
  // (the CUDA arena hands out whole 256-byte units).
  STRATA_ASSIGN_OR_RETURN(core::BudgetCharge charge,
                          budgets_.device->charge(core::align_up(size_bytes, caps_.allocation_alignment_bytes), what));
  const std::uint64_t id = g_next_buffer_id.fetch_add(1, std::memory_order_relaxed);
  Result<void*> p = do_allocate(id, size_bytes, end);
  if (!p.ok()) return std::move(p).status().annotate(str_cat("allocating ", what));
  {
    core::MutexLock lock(mu_);
    live_buffers_.emplace(id, LiveBuffer{size_bytes, *p});
  }
  DeviceBuffer b;
  b.device_ = this;
  b.span_ = DeviceSpan(this, id, *p, size_bytes);
  b.end_ = end;
  b.charge_ = std::move(charge);
  return b;
}

void Device::release_buffer(DeviceBuffer& buffer) noexcept {
  {
    core::MutexLock lock(mu_);
    live_buffers_.erase(buffer.span_.buffer_id());
  }
  do_free(buffer.span_.buffer_id(), buffer.span_.data(), buffer.span_.buffer_size_bytes());
}

Result<PinnedBuffer> Device::allocate_pinned(std::size_t size_bytes, std::string_view what) {
  return allocate_pinned(size_bytes, what, nullptr);
}

Result<void*> Device::do_allocate_pinned_filled(std::size_t size_bytes, int numa_node, const PinnedFill& fill) {
  STRATA_ASSIGN_OR_RETURN(void* p, do_allocate_pinned(size_bytes, numa_node));
  fill({static_cast<std::byte*>(p), size_bytes});
  return p;
}

Result<PinnedBuffer> Device::allocate_pinned(std::size_t size_bytes, std::string_view what, const PinnedFill& fill) {
  if (size_bytes == 0) return Status::invalid_argument(str_cat("pinned allocation of 0 bytes for ", what));
  STRATA_ASSIGN_OR_RETURN(core::BudgetCharge charge, budgets_.pinned->charge(size_bytes, what));
  Result<void*> p = fill != nullptr ? do_allocate_pinned_filled(size_bytes, pinned_numa_node(), fill)
                                    : do_allocate_pinned(size_bytes, pinned_numa_node());
  if (!p.ok()) return std::move(p).status().annotate(str_cat("allocating pinned memory for ", what));
  {
    core::MutexLock lock(mu_);
    ++live_pinned_;
  }
  PinnedBuffer b;
  b.device_ = this;
  b.data_ = static_cast<std::byte*>(*p);
  b.size_bytes_ = size_bytes;
  b.registered_ = false;
  b.charge_ = std::move(charge);
  return b;
}

void Device::set_pinned_numa_node(int node) {
  core::MutexLock lock(mu_);
  pinned_numa_node_ = node < 0 ? -1 : node;
}

int Device::pinned_numa_node() const {
  core::MutexLock lock(mu_);
  return pinned_numa_node_;
}

void Device::place_on_numa_node(void* p, std::size_t size_bytes, int node) {
  if (node < 0) return;
  const Status placed = prefer_numa_node(p, size_bytes, node);
  if (placed.ok()) return;
  core::MutexLock lock(mu_);
  if (std::exchange(numa_refusal_said_, true)) return;
  STRATA_LOG(kWarn) << "pinned host memory (" << device_kind_name(kind()) << "): cannot place it on NUMA node "
                    << node << " (" << placed.message() << "); it stays where first touched";
}

Result<PinnedBuffer> Device::register_host(std::span<std::byte> memory, std::string_view what) {
  if (memory.empty() || memory.data() == nullptr) {
    return Status::invalid_argument(str_cat("register_host: empty range for ", what));
  }
  STRATA_ASSIGN_OR_RETURN(core::BudgetCharge charge, budgets_.pinned->charge(memory.size(), what));
  Status s = do_register_host(memory.data(), memory.size());
  if (!s.ok()) return std::move(s).annotate(str_cat("registering host memory for ", what));
  {
    core::MutexLock lock(mu_);
    ++live_pinned_;
  }
  PinnedBuffer b;
  b.device_ = this;
  b.data_ = memory.data();
  b.size_bytes_ = memory.size();
  b.registered_ = true;
  b.charge_ = std::move(charge);
  return b;
}

void Device::release_pinned(PinnedBuffer& buffer) noexcept {
  if (buffer.registered_) {
    do_unregister_host(buffer.data_, buffer.size_bytes_);
  } else {
    do_free_pinned(buffer.data_, buffer.size_bytes_);
  }
  core::MutexLock lock(mu_);
  --live_pinned_;
}

Result<Stream> Device::create_stream(std::string_view name) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StreamImpl> impl, do_create_stream(name));
  {
    core::MutexLock lock(mu_);
    ++live_streams_;
  }
  Stream s;
  s.device_ = this;
  s.name_ = std::string(name);
  s.impl_ = std::move(impl);
  return s;
}

Result<Stream> Device::wrap_native_stream(void* native_stream, std::string_view name) {
  if (native_stream == nullptr) return Status::invalid_argument("wrap_native_stream: null stream");
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StreamImpl> impl, do_wrap_native_stream(native_stream, name));
  {
    core::MutexLock lock(mu_);
    ++live_streams_;
  }
  Stream s;
  s.device_ = this;
  s.name_ = std::string(name);
  s.impl_ = std::move(impl);
  return s;
}

void Device::release_stream(Stream& stream) noexcept {
  stream.impl_.reset();  // the backend drains the stream in its destructor
  core::MutexLock lock(mu_);
  --live_streams_;
}

Result<Event> Device::create_event() {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<EventImpl> impl, do_create_event());
  {
    core::MutexLock lock(mu_);
    ++live_events_;
  }
  Event e;
  e.device_ = this;
  e.impl_ = std::move(impl);
  return e;
}

void Device::release_event(Event& event) noexcept {
  event.impl_.reset();
  core::MutexLock lock(mu_);
  --live_events_;
}

// --- checks ------------------------------------------------------------------

Status Device::check_stream(const Stream& stream) const {
  if (stream.device_ == nullptr) return Status::invalid_argument("empty stream (moved from or never created)");
  if (stream.device_ != this) {
    return Status::invalid_argument(str_cat("stream '", stream.name_, "' belongs to another device"));
  }
  return Status();
}

Status Device::check_event(const Event& event) const {
  if (event.device_ == nullptr) return Status::invalid_argument("empty event (moved from or never created)");
  if (event.device_ != this) return Status::invalid_argument("event belongs to another device");
  return Status();
}

Status Device::check_span(const DeviceSpan& span, std::string_view role) const {
  if (span.buffer_id() == 0) return Status::invalid_argument(str_cat(role, ": view of no buffer"));
  if (span.device() != this) return Status::invalid_argument(str_cat(role, ": view of another device's buffer"));
  {
    core::MutexLock lock(mu_);
    auto it = live_buffers_.find(span.buffer_id());
    if (it == live_buffers_.end()) {
      return Status::failed_precondition(str_cat(role, ": buffer ", span.buffer_id(), " was freed"));
    }
  }
  if (!span.in_bounds()) {
    return Status::out_of_range(str_cat(role, ": bytes [", span.offset_bytes(), ", ",
                                        span.offset_bytes() + span.size_bytes(), ") are past the end of buffer ",
                                        span.buffer_id(), " (", span.buffer_size_bytes(), " bytes)"));
  }
  return Status();
}

Status Device::check_typed(const DeviceTypedSpan& span, std::string_view role) const {
  STRATA_RETURN_IF_ERROR(check_span(span.bytes, role));
  const std::uint64_t elem = elem_size_bytes(span.type);
  if (span.bytes.size_bytes() % elem != 0) {
    return Status::invalid_argument(str_cat(role, ": ", span.bytes.size_bytes(), " bytes is not a whole number of ",
                                            elem_type_name(span.type), " elements"));
  }
  if (reinterpret_cast<std::uintptr_t>(span.bytes.data()) % elem != 0) {
    return Status::invalid_argument(str_cat(role, ": offset ", span.bytes.offset_bytes(), " is not aligned to ",
                                            elem_type_name(span.type), " (", elem, " bytes)"));
  }
  return Status();
}

// --- streams and events ------------------------------------------------------

Status Device::record(Event& event, Stream& stream) {
  STRATA_RETURN_IF_ERROR(check_event(event));
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  return do_record(*event.impl_, *stream.impl_);
}

Status Device::wait(Stream& stream, const Event& event) {
  STRATA_RETURN_IF_ERROR(check_event(event));
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  return do_wait(*stream.impl_, *event.impl_);
}

Status Device::synchronize(Event& event) {
  STRATA_RETURN_IF_ERROR(check_event(event));
  return do_synchronize_event(*event.impl_);
}

Result<bool> Device::query(Event& event) {
  STRATA_RETURN_IF_ERROR(check_event(event));
  return do_query_event(*event.impl_);
}

Status Device::synchronize(Stream& stream) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  return do_synchronize_stream(*stream.impl_);
}

Status Device::synchronize() { return do_synchronize_device(); }

Status Device::host_callback(Stream& stream, std::function<void()> fn) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  if (!fn) return Status::invalid_argument("host_callback: empty function");
  return do_host_callback(*stream.impl_, std::move(fn));
}

// --- copies ------------------------------------------------------------------

Status Device::copy_h2d(Stream& stream, DeviceSpan dst, std::span<const std::byte> src) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_span(dst, "copy_h2d dst"));
  if (dst.size_bytes() != src.size()) {
    return Status::invalid_argument(str_cat("copy_h2d: sizes differ: dst ", dst.size_bytes(), " bytes, src ",
                                            src.size(), " bytes"));
  }
  if (src.empty()) return Status();
  if (src.data() == nullptr) return Status::invalid_argument("copy_h2d: null source");
  return do_copy_h2d(*stream.impl_, dst, src.data());
}

Status Device::copy_d2h(Stream& stream, std::span<std::byte> dst, DeviceSpan src) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_span(src, "copy_d2h src"));
  if (dst.size() != src.size_bytes()) {
    return Status::invalid_argument(str_cat("copy_d2h: sizes differ: dst ", dst.size(), " bytes, src ",
                                            src.size_bytes(), " bytes"));
  }
  if (dst.empty()) return Status();
  if (dst.data() == nullptr) return Status::invalid_argument("copy_d2h: null destination");
  return do_copy_d2h(*stream.impl_, dst.data(), src);
}

Status Device::copy_d2d(Stream& stream, DeviceSpan dst, DeviceSpan src) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_span(dst, "copy_d2d dst"));
  STRATA_RETURN_IF_ERROR(check_span(src, "copy_d2d src"));
  if (dst.size_bytes() != src.size_bytes()) {
    return Status::invalid_argument(str_cat("copy_d2d: sizes differ: dst ", dst.size_bytes(), " bytes, src ",
                                            src.size_bytes(), " bytes"));
  }
  STRATA_RETURN_IF_ERROR(check_disjoint({range_of("dst", dst), range_of("src", src)}, "copy_d2d"));
  if (dst.empty()) return Status();
  return do_copy_d2d(*stream.impl_, dst, src);
}

// --- kernels -----------------------------------------------------------------

Status Device::convert(Stream& stream, DeviceTypedSpan dst, DeviceTypedSpan src) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_typed(dst, "convert dst"));
  STRATA_RETURN_IF_ERROR(check_typed(src, "convert src"));
  if (dst.size() != src.size()) {
    return Status::invalid_argument(str_cat("convert: element counts differ: dst ", dst.size(), ", src ", src.size()));
  }
  STRATA_RETURN_IF_ERROR(check_disjoint({range_of("dst", dst.bytes), range_of("src", src.bytes)}, "convert"));
  if (dst.size() == 0) return Status();
  return do_convert(*stream.impl_, dst, src);
}

Status Device::accumulate(Stream& stream, DeviceSpan dst_f32, DeviceTypedSpan src) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  const DeviceTypedSpan dst = typed(dst_f32, ElemType::kF32);
  STRATA_RETURN_IF_ERROR(check_typed(dst, "accumulate dst"));
  STRATA_RETURN_IF_ERROR(check_typed(src, "accumulate src"));
  if (dst.size() != src.size()) {
    return Status::invalid_argument(
        str_cat("accumulate: element counts differ: dst ", dst.size(), ", src ", src.size()));
  }
  STRATA_RETURN_IF_ERROR(check_disjoint({range_of("dst", dst.bytes), range_of("src", src.bytes)}, "accumulate"));
  if (dst.size() == 0) return Status();
  return do_accumulate(*stream.impl_, dst_f32, src);
}

Status Device::norm_partials(Stream& stream, const NormPartialsArgs& args) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_typed(args.src, "norm_partials src"));
  STRATA_RETURN_IF_ERROR(check_span(args.partials, "norm_partials partials"));
  const std::int64_t n = args.src.size();
  const std::int64_t blocks = core::numerics::norm_block_count(n);
  if (args.partials.size_bytes() < static_cast<std::uint64_t>(blocks) * 8) {
    return Status::invalid_argument(str_cat("norm_partials: partials holds ", args.partials.size_bytes(),
                                            " bytes, ", blocks * 8, " needed for ", n, " elements"));
  }
  if (reinterpret_cast<std::uintptr_t>(args.partials.data()) % 8 != 0) {
    return Status::invalid_argument("norm_partials: partials is not 8-byte aligned");
  }
  const bool has_flag = args.nonfinite_flag.buffer_id() != 0;
  if (has_flag) {
    STRATA_RETURN_IF_ERROR(check_span(args.nonfinite_flag, "norm_partials nonfinite_flag"));
    if (args.nonfinite_flag.size_bytes() != 4 || reinterpret_cast<std::uintptr_t>(args.nonfinite_flag.data()) % 4 != 0) {
      return Status::invalid_argument("norm_partials: nonfinite_flag must be 4 bytes, 4-byte aligned");
    }
  }
  const DeviceSpan partials = args.partials.subspan(0, static_cast<std::uint64_t>(blocks) * 8);
  STRATA_RETURN_IF_ERROR(check_disjoint({range_of("src", args.src.bytes), range_of("partials", partials),
                                         range_of("nonfinite_flag", has_flag ? args.nonfinite_flag : DeviceSpan())},
                                        "norm_partials"));
  if (n == 0) return Status();
  return do_norm_partials(*stream.impl_, args);
}

Status Device::scale(Stream& stream, DeviceTypedSpan x, float factor) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_typed(x, "scale x"));
  if (x.size() == 0) return Status();
  return do_scale(*stream.impl_, x, factor);
}

Status Device::fill(Stream& stream, DeviceTypedSpan x, float value) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_typed(x, "fill x"));
  if (x.size() == 0) return Status();
  return do_fill(*stream.impl_, x, value);
}

Status Device::adam_step(Stream& stream, const AdamStepArgs& args) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_constants(args.constants, "adam_step"));
  STRATA_RETURN_IF_ERROR(check_typed(typed(args.master, ElemType::kF32), "adam_step master"));
  STRATA_RETURN_IF_ERROR(check_typed(typed(args.exp_avg, ElemType::kF32), "adam_step exp_avg"));
  STRATA_RETURN_IF_ERROR(check_typed(typed(args.exp_avg_sq, ElemType::kF32), "adam_step exp_avg_sq"));
  STRATA_RETURN_IF_ERROR(check_typed(args.grad, "adam_step grad"));
  const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
  const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
  if (has_copy) {
    STRATA_RETURN_IF_ERROR(check_typed(args.copy_out, "adam_step copy_out"));
    if (args.copy_out.type == ElemType::kF32) {
      return Status::invalid_argument("adam_step: copy_out must be bf16 or fp16");
    }
  }
  if (args.exp_avg.size_bytes() / 4 != static_cast<std::uint64_t>(n) ||
      args.exp_avg_sq.size_bytes() / 4 != static_cast<std::uint64_t>(n) || args.grad.size() != n ||
      (has_copy && args.copy_out.size() != n)) {
    return Status::invalid_argument(str_cat("adam_step: element counts differ: master ", n, ", exp_avg ",
                                            args.exp_avg.size_bytes() / 4, ", exp_avg_sq ",
                                            args.exp_avg_sq.size_bytes() / 4, ", grad ", args.grad.size(),
                                            has_copy ? str_cat(", copy_out ", args.copy_out.size()) : ""));
  }
  STRATA_RETURN_IF_ERROR(check_disjoint(
      {range_of("master", args.master), range_of("exp_avg", args.exp_avg), range_of("exp_avg_sq", args.exp_avg_sq),
       range_of("grad", args.grad.bytes), range_of("copy_out", has_copy ? args.copy_out.bytes : DeviceSpan())},
      "adam_step"));
  if (n == 0) return Status();
  return do_adam_step(*stream.impl_, args);
}

Status Device::adam_step_bf16_moments(Stream& stream, const AdamStepBf16MomentsArgs& args) {
  constexpr std::string_view op = "adam_step_bf16_moments";
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_constants(args.constants, op));
  STRATA_RETURN_IF_ERROR(check_typed(typed(args.master, ElemType::kF32), str_cat(op, " master")));
  STRATA_RETURN_IF_ERROR(check_typed(typed(args.exp_avg, ElemType::kBf16), str_cat(op, " exp_avg")));
  STRATA_RETURN_IF_ERROR(check_typed(typed(args.exp_avg_sq, ElemType::kBf16), str_cat(op, " exp_avg_sq")));
  STRATA_RETURN_IF_ERROR(check_typed(args.grad, str_cat(op, " grad")));
  const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
  const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
  if (has_copy) {
    STRATA_RETURN_IF_ERROR(check_typed(args.copy_out, str_cat(op, " copy_out")));
    if (args.copy_out.type == ElemType::kF32) {
      return Status::invalid_argument(str_cat(op, ": copy_out must be bf16 or fp16"));
    }
  }
  if (args.exp_avg.size_bytes() / 2 != static_cast<std::uint64_t>(n) ||
      args.exp_avg_sq.size_bytes() / 2 != static_cast<std::uint64_t>(n) || args.grad.size() != n ||
      (has_copy && args.copy_out.size() != n)) {
    return Status::invalid_argument(
        str_cat(op, ": element counts differ: master ", n, " (fp32), exp_avg ", args.exp_avg.size_bytes() / 2,
                " (bf16), exp_avg_sq ", args.exp_avg_sq.size_bytes() / 2, " (bf16), grad ", args.grad.size(),
                has_copy ? str_cat(", copy_out ", args.copy_out.size()) : ""));
  }
  STRATA_RETURN_IF_ERROR(
      check_disjoint({range_of("master", args.master), range_of("exp_avg", args.exp_avg),
                      range_of("exp_avg_sq", args.exp_avg_sq), range_of("grad", args.grad.bytes),
                      range_of("copy_out", has_copy ? args.copy_out.bytes : DeviceSpan())},
                     op));
  if (args.rounding != core::numerics::Bf16Rounding::kNearestEven &&
      args.rounding != core::numerics::Bf16Rounding::kStochastic) {
    return Status::invalid_argument(str_cat(op, ": rounding = ", static_cast<int>(args.rounding),
                                            " is neither kNearestEven (0) nor kStochastic (1)"));
  }
  if (args.index_base < 0 || args.index_base > std::numeric_limits<std::int64_t>::max() - n) {
    return Status::invalid_argument(str_cat(op, ": index_base = ", args.index_base,
                                            " must be >= 0 and index_base + n (n = ", n,
                                            ") must not pass INT64_MAX"));
  }
  if (n == 0) return Status();
  return do_adam_step_bf16_moments(*stream.impl_, args);
}

Status Device::adam_step_int8_blockwise(Stream& stream, const AdamStepInt8Args& args) {
  constexpr std::string_view op = "adam_step_int8_blockwise";
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  STRATA_RETURN_IF_ERROR(check_constants(args.constants, op));
  STRATA_RETURN_IF_ERROR(check_typed(typed(args.master, ElemType::kF32), str_cat(op, " master")));
  // Codes are bytes: any size, any alignment.
  STRATA_RETURN_IF_ERROR(check_span(args.exp_avg, str_cat(op, " exp_avg")));
  STRATA_RETURN_IF_ERROR(check_span(args.exp_avg_sq, str_cat(op, " exp_avg_sq")));
  STRATA_RETURN_IF_ERROR(
      check_typed(typed(args.exp_avg_scale, ElemType::kF32), str_cat(op, " exp_avg_scale")));
  STRATA_RETURN_IF_ERROR(
      check_typed(typed(args.exp_avg_sq_scale, ElemType::kF32), str_cat(op, " exp_avg_sq_scale")));
  STRATA_RETURN_IF_ERROR(check_typed(args.grad, str_cat(op, " grad")));
  const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
  const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
  if (has_copy) {
    STRATA_RETURN_IF_ERROR(check_typed(args.copy_out, str_cat(op, " copy_out")));
    if (args.copy_out.type == ElemType::kF32) {
      return Status::invalid_argument(str_cat(op, ": copy_out must be bf16 or fp16"));
    }
  }
  if (args.exp_avg.size_bytes() != static_cast<std::uint64_t>(n) ||
      args.exp_avg_sq.size_bytes() != static_cast<std::uint64_t>(n) || args.grad.size() != n ||
      (has_copy && args.copy_out.size() != n)) {
    return Status::invalid_argument(str_cat(op, ": element counts differ: master ", n, " (fp32), exp_avg ",
                                            args.exp_avg.size_bytes(), " (bytes), exp_avg_sq ",
                                            args.exp_avg_sq.size_bytes(), " (bytes), grad ", args.grad.size(),
                                            has_copy ? str_cat(", copy_out ", args.copy_out.size()) : ""));
  }
  constexpr std::int64_t kBlockElems = core::numerics::kQuantBlockElems;
  const std::int64_t blocks = (n + kBlockElems - 1) / kBlockElems;
  const std::pair<std::string_view, std::uint64_t> scales[] = {
      {"exp_avg_scale", args.exp_avg_scale.size_bytes() / 4},
      {"exp_avg_sq_scale", args.exp_avg_sq_scale.size_bytes() / 4}};
  for (const auto& [role, count] : scales) {
    if (count != static_cast<std::uint64_t>(blocks)) {
      return Status::invalid_argument(str_cat(op, ": ", role, " has ", count,
                                              " fp32 scales, want one per block of ", kBlockElems, ": ceil(",
                                              n, " / ", kBlockElems, ") = ", blocks));
    }
  }
  STRATA_RETURN_IF_ERROR(
      check_disjoint({range_of("master", args.master), range_of("exp_avg", args.exp_avg),
                      range_of("exp_avg_sq", args.exp_avg_sq), range_of("exp_avg_scale", args.exp_avg_scale),
                      range_of("exp_avg_sq_scale", args.exp_avg_sq_scale), range_of("grad", args.grad.bytes),
                      range_of("copy_out", has_copy ? args.copy_out.bytes : DeviceSpan())},
                     op));
  if (n == 0) return Status();
  return do_adam_step_int8_blockwise(*stream.impl_, args);
}

core::Result<std::int64_t> Device::check_step_views(
    std::string_view op, std::initializer_list<std::pair<std::string_view, DeviceSpan>> arrays,
    const DeviceTypedSpan& grad, const DeviceTypedSpan& copy_out) const {
  for (const auto& [role, span] : arrays) {
    STRATA_RETURN_IF_ERROR(check_typed(typed(span, ElemType::kF32), str_cat(op, " ", role)));
  }
  STRATA_RETURN_IF_ERROR(check_typed(grad, str_cat(op, " grad")));
  const std::int64_t n = static_cast<std::int64_t>(arrays.begin()->second.size_bytes() / 4);
  const bool has_copy = copy_out.bytes.buffer_id() != 0;
  if (has_copy) {
    STRATA_RETURN_IF_ERROR(check_typed(copy_out, str_cat(op, " copy_out")));
    if (copy_out.type == ElemType::kF32) return Status::invalid_argument(str_cat(op, ": copy_out must be bf16 or fp16"));
  }
  std::string counts;
  bool differ = grad.size() != n || (has_copy && copy_out.size() != n);
  for (const auto& [role, span] : arrays) {
    differ = differ || span.size_bytes() / 4 != static_cast<std::uint64_t>(n);
    counts += str_cat(counts.empty() ? "" : ", ", role, " ", span.size_bytes() / 4);
  }
  if (differ) {
    return Status::invalid_argument(str_cat(op, ": element counts differ: ", counts, ", grad ", grad.size(),
                                            has_copy ? str_cat(", copy_out ", copy_out.size()) : ""));
  }
  std::vector<std::pair<std::string_view, DeviceSpan>> all(arrays);
  all.emplace_back("grad", grad.bytes);
  if (has_copy) all.emplace_back("copy_out", copy_out.bytes);
  for (std::size_t a = 0; a < all.size(); ++a) {
    for (std::size_t b = a + 1; b < all.size(); ++b) {
      STRATA_RETURN_IF_ERROR(check_disjoint({range_of(all[a].first, all[a].second), range_of(all[b].first, all[b].second)}, op));
    }
  }
  return n;
}

Status Device::lion_step(Stream& stream, const LionStepArgs& args) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  const auto& c = args.constants;
  for (const float v : {c.grad_scale, c.beta1, c.beta2, c.one_minus_beta1, c.one_minus_beta2, c.neg_lr, c.neg_lr_decay}) {
    if (!std::isfinite(v)) return Status::invalid_argument(str_cat("lion_step: a constant is not finite (", v, ")"));
  }
  STRATA_ASSIGN_OR_RETURN(const std::int64_t n, check_step_views("lion_step", {{"master", args.master}, {"exp_avg", args.exp_avg}},
                                                                 args.grad, args.copy_out));
  if (n == 0) return Status();
  return do_lion_step(*stream.impl_, args);
}

Status Device::adagrad_step(Stream& stream, const AdagradStepArgs& args) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  const auto& c = args.constants;
  for (const float v : {c.grad_scale, c.eps, c.neg_lr, c.l2_decay}) {
    if (!std::isfinite(v)) return Status::invalid_argument(str_cat("adagrad_step: a constant is not finite (", v, ")"));
  }
  STRATA_ASSIGN_OR_RETURN(const std::int64_t n,
                          check_step_views("adagrad_step", {{"master", args.master}, {"exp_avg_sq", args.exp_avg_sq}},
                                           args.grad, args.copy_out));
  if (n == 0) return Status();
  return do_adagrad_step(*stream.impl_, args);
}

Status Device::run_on_stream(Stream& stream, std::span<const DeviceSpan> spans, StreamWork fn) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  if (!fn) return Status::invalid_argument("run_on_stream: empty function");
  if (spans.size() > 8) {
    return Status::invalid_argument(str_cat("run_on_stream: ", spans.size(), " spans (at most 8)"));
  }
  for (std::size_t i = 0; i < spans.size(); ++i) {
    STRATA_RETURN_IF_ERROR(check_span(spans[i], str_cat("run_on_stream span ", i)));
  }
  return do_run_on_stream(*stream.impl_, std::vector<DeviceSpan>(spans.begin(), spans.end()), std::move(fn));
}

Status Device::declare_compute(Stream& stream, double flops, std::string_view what) {
  STRATA_RETURN_IF_ERROR(check_stream(stream));
  if (!(flops >= 0.0) || !std::isfinite(flops)) {
    return Status::invalid_argument(str_cat("declare_compute ", what, ": flops must be finite and >= 0, not ", flops));
  }
  return do_declare_compute(*stream.impl_, flops);
}

// --- optional hooks' defaults ------------------------------------------------

Result<std::unique_ptr<StreamImpl>> Device::do_wrap_native_stream(void* /*native_stream*/, std::string_view /*name*/) {
  return Status::unimplemented(str_cat("the ", device_kind_name(kind()), " device has no native streams to wrap"));
}

void* Device::do_native_handle(StreamImpl& /*stream*/) const { return nullptr; }

Status Device::do_declare_compute(StreamImpl& /*stream*/, double /*flops*/) {
  return Status::unimplemented(
      str_cat("the ", device_kind_name(kind()), " device does not model declared compute (host device only)"));
}

}  // namespace strata::gpu
