// The emulated device (gpu/host_device.h): budgeted host memory as device
// memory, one worker thread per stream, CUDA-like events, strict run-time
// checks, and the timing model (sleeping, never spinning).
#include "gpu/arena.h"
#include "gpu/host_device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/mutex.h"
#include "core/numerics.h"
#include "core/str.h"

#if defined(__SANITIZE_ADDRESS__)
#define STRATA_HOST_DEVICE_POISON 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STRATA_HOST_DEVICE_POISON 1
#endif
#endif
#if defined(STRATA_HOST_DEVICE_POISON)
#include <sanitizer/asan_interface.h>
#endif

namespace strata::gpu {
namespace {

using core::Result;
using core::Status;
using core::str_cat;
namespace nx = core::numerics;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kAlignment = 256;     // like cudaMalloc
constexpr std::size_t kPinnedAlignment = 4096;

void poison(void* p, std::size_t n) {
#if defined(STRATA_HOST_DEVICE_POISON)
  ASAN_POISON_MEMORY_REGION(p, n);
#else
  (void)p;
  (void)n;
#endif
}
void unpoison(void* p, std::size_t n) {
#if defined(STRATA_HOST_DEVICE_POISON)
  ASAN_UNPOISON_MEMORY_REGION(p, n);
#else
  (void)p;
  (void)n;
#endif
}

// One device allocation. Shared by the registry and by work that runs on it,
// so memory freed under queued work stays valid until that work has failed.
// Poisoned (under ASan) while no device work touches it.
class Allocation {
 public:
  Allocation(std::byte* data, std::uint64_t size_bytes) : data_(data), size_bytes_(size_bytes) {
    poison(data_, size_bytes_);
  }
  ~Allocation() {
    unpoison(data_, size_bytes_);
    std::free(data_);
  }
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;

  std::byte* data() const { return data_; }
  std::uint64_t size_bytes() const { return size_bytes_; }

  void begin_access() {
    core::MutexLock lock(mu_);
    if (active_++ == 0) unpoison(data_, size_bytes_);
  }
  void end_access() {
    core::MutexLock lock(mu_);
    if (--active_ == 0) poison(data_, size_bytes_);
  }

 private:
  std::byte* const data_;
  const std::uint64_t size_bytes_;
  core::Mutex mu_;
  int active_ STRATA_GUARDED_BY(mu_) = 0;
};

// Holds the allocations one operation touches, unpoisoned, for its duration.
class AccessSet {
 public:
  AccessSet() = default;
  AccessSet(const AccessSet&) = delete;
  AccessSet& operator=(const AccessSet&) = delete;
  ~AccessSet() {
    for (auto& a : held_) a->end_access();
  }
  std::byte* add(std::shared_ptr<Allocation> a, std::uint64_t offset_bytes) {
    std::byte* p = a->data() + offset_bytes;
    if (std::find(held_.begin(), held_.end(), a) == held_.end()) {
      a->begin_access();
      held_.push_back(std::move(a));
    }
    return p;
  }

 private:
  std::vector<std::shared_ptr<Allocation>> held_;
};

// --- streams -----------------------------------------------------------------

// Progress of one stream, shared with events and with waits on other streams
// (which may outlive the stream object).
struct StreamState {
  explicit StreamState(std::string n) : name(std::move(n)) {}
  const std::string name;
  core::Mutex mu;
  core::CondVar cv;
  std::uint64_t submitted STRATA_GUARDED_BY(mu) = 0;
  std::uint64_t completed STRATA_GUARDED_BY(mu) = 0;
  // The first error and the operation it happened in (0: none). Sticky.
  Status error STRATA_GUARDED_BY(mu);
  std::uint64_t error_seq STRATA_GUARDED_BY(mu) = 0;

  // Waits until operation `seq` is done; the stream's error if it failed at or
  // before `seq`.
  Status wait_for(std::uint64_t seq) {
    core::MutexLock lock(mu);
    cv.wait(mu, [&]() STRATA_REQUIRES(mu) { return completed >= seq; });
    return error_at(seq);
  }
  Status error_at(std::uint64_t seq) STRATA_REQUIRES(mu) {
    if (error_seq != 0 && error_seq <= seq) return error;
    return Status();
  }
};

enum class Resource { kNone, kH2D, kD2H, kDevice };
constexpr int kResourceCount = 4;

struct Op {
  std::uint64_t seq = 0;
  Resource resource = Resource::kNone;
  double modeled_s = 0.0;             // 0: not modeled
  std::function<Status()> run;
};

class HostDevice;

class HostStream final : public StreamImpl {
 public:
  HostStream(HostDevice* device, std::string name);
  ~HostStream() override;

  const std::shared_ptr<StreamState>& state() const { return state_; }
  // Appends an operation; it runs after everything enqueued before it.
  void enqueue(Resource resource, double modeled_s, std::function<Status()> run);

 private:
  void loop();

  HostDevice* const device_;
  const std::shared_ptr<StreamState> state_;
  std::deque<Op> queue_ STRATA_GUARDED_BY(state_->mu);
  bool stopping_ STRATA_GUARDED_BY(state_->mu) = false;
  std::jthread worker_;  // last: started after the members above exist, joined first
};

class HostEvent final : public EventImpl {
 public:
  core::Mutex mu;
  bool recorded STRATA_GUARDED_BY(mu) = false;
  std::shared_ptr<StreamState> stream STRATA_GUARDED_BY(mu);
  std::uint64_t seq STRATA_GUARDED_BY(mu) = 0;
};

// --- typed element access (numerics.h conversions) ---------------------------

float load(const std::byte* p, ElemType type, std::int64_t i) {
  switch (type) {
    case ElemType::kF32: {
      float x;
      std::memcpy(&x, p + 4 * i, 4);
      return x;
    }
    case ElemType::kBf16: {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return nx::bf16_bits_to_fp32(h);
    }
    case ElemType::kF16: {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return nx::fp16_bits_to_fp32(h);
    }
  }
  return 0.0f;
}

void store(std::byte* p, ElemType type, std::int64_t i, float x) {
  switch (type) {
    case ElemType::kF32: std::memcpy(p + 4 * i, &x, 4); break;
    case ElemType::kBf16: {
      const std::uint16_t h = nx::fp32_to_bf16_bits(x);
      std::memcpy(p + 2 * i, &h, 2);
      break;
    }
    case ElemType::kF16: {
      const std::uint16_t h = nx::fp32_to_fp16_bits(x);
      std::memcpy(p + 2 * i, &h, 2);
      break;
    }
  }
}

// --- the device --------------------------------------------------------------

class HostDevice final : public Device {
 public:
  HostDevice(DeviceCaps caps, DeviceBudgets budgets, TimingModel timing, bool arena)
      : Device(std::move(caps), budgets),
        timing_(timing),
        // An unlimited budget has nothing to fragment: no arena.
        use_arena_(arena && this->caps().device_memory_bytes != core::MemoryBudget::kUnlimited),
        arena_(use_arena_ ? this->caps().device_memory_bytes / kAlignment * kAlignment : 0, kAlignment) {
    for (auto& t : resource_free_at_) t = Clock::time_point::min();
  }

  ~HostDevice() override {
    core::MutexLock lock(mu_);
    STRATA_CHECK(streams_.empty()) << "host device destroyed with live streams";
  }

  // Runs one operation's timing: waits for its resource, runs it, and does not
  // return before its modeled end.
  Status run_timed(const Op& op) {
    if (op.modeled_s <= 0.0 || op.resource == Resource::kNone) return op.run();
    const auto duration = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(op.modeled_s));
    Clock::time_point start;
    Clock::time_point end;
    {
      core::MutexLock lock(timing_mu_);
      auto& free_at = resource_free_at_[static_cast<int>(op.resource)];
      start = std::max(Clock::now(), free_at);
      end = start + duration;
      free_at = end;
    }
    std::this_thread::sleep_until(start);
    Status s = op.run();
    std::this_thread::sleep_until(end);
    return s;
  }

  void add_stream(const std::shared_ptr<StreamState>& s) {
    core::MutexLock lock(mu_);
    streams_.push_back(s);
  }
  void remove_stream(const std::shared_ptr<StreamState>& s) {
    core::MutexLock lock(mu_);
    streams_.erase(std::remove(streams_.begin(), streams_.end(), s), streams_.end());
  }

 protected:
  // --- memory ---
  // Each allocation takes a range of the arena as the CUDA device's would (the memory itself
  // comes from the heap): a budget fragmented on CUDA is fragmented here too.
  Result<void*> do_allocate(std::uint64_t buffer_id, std::uint64_t size_bytes, ArenaEnd end) override {
    const std::optional<std::uint64_t> offset =
        use_arena_ ? arena_.allocate(size_bytes, end) : std::optional<std::uint64_t>(0);
    if (!offset) {
      // Fragmented (the budget allowed it): kResourceExhausted, as a budget refusal, so that
      // the caches give their buffers back and the allocation is tried again.
      return Status::resource_exhausted(str_cat("host device arena (", core::format_bytes(arena_.size_bytes()),
                                                ") has no free range of ", core::format_bytes(size_bytes),
                                                " (largest free range: ", core::format_bytes(arena_.largest_free()), ")"));
    }
    const std::uint64_t rounded = (size_bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) {
      if (use_arena_) arena_.free(*offset, size_bytes);
      return Status::out_of_memory(str_cat("host device: cannot allocate ", core::format_bytes(size_bytes)));
    }
    auto a = std::make_shared<Allocation>(static_cast<std::byte*>(p), size_bytes);
    core::MutexLock lock(mu_);
    by_address_.emplace(reinterpret_cast<std::uintptr_t>(p), a);
    allocations_.emplace(buffer_id, std::move(a));
    if (use_arena_) arena_offsets_.emplace(buffer_id, *offset);
    return p;
  }

  void do_free(std::uint64_t buffer_id, void* p, std::uint64_t size_bytes) noexcept override {
    std::shared_ptr<Allocation> a;  // dropped after the lock: may free the memory
    core::MutexLock lock(mu_);
    auto it = allocations_.find(buffer_id);
    if (it == allocations_.end()) return;
    a = std::move(it->second);
    allocations_.erase(it);
    by_address_.erase(reinterpret_cast<std::uintptr_t>(p));
    if (const auto o = arena_offsets_.find(buffer_id); o != arena_offsets_.end()) {
      arena_.free(o->second, size_bytes);
      arena_offsets_.erase(o);
    }
  }

  Result<void*> do_allocate_pinned(std::size_t size_bytes, int numa_node) override {
    void* p = nullptr;
    if (posix_memalign(&p, kPinnedAlignment, size_bytes) != 0) {
      return Status::out_of_memory(str_cat("host device: cannot allocate ", core::format_bytes(size_bytes),
                                           " of pinned (emulated) host memory"));
    }
    // Pages a small block shares with others already placed move too.
    place_on_numa_node(p, size_bytes, numa_node);
    return p;
  }

  void do_free_pinned(void* p, std::size_t /*size_bytes*/) noexcept override { std::free(p); }

  Status do_register_host(void* p, std::size_t size_bytes) override {
    const auto begin = reinterpret_cast<std::uintptr_t>(p);
    const auto end = begin + size_bytes;
    core::MutexLock lock(mu_);
    auto it = registered_.upper_bound(begin);
    if (it != registered_.begin()) {
      auto prev = std::prev(it);
      if (prev->second > begin) return already_registered(prev->first, prev->second);
    }
    if (it != registered_.end() && it->first < end) return already_registered(it->first, it->second);
    registered_.emplace(begin, end);
    return Status();
  }

  void do_unregister_host(void* p, std::size_t /*size_bytes*/) noexcept override {
    core::MutexLock lock(mu_);
    registered_.erase(reinterpret_cast<std::uintptr_t>(p));
  }

  // --- streams and events ---
  Result<std::unique_ptr<StreamImpl>> do_create_stream(std::string_view name) override {
    auto s = std::make_unique<HostStream>(this, std::string(name));
    add_stream(s->state());
    return std::unique_ptr<StreamImpl>(std::move(s));
  }

  Result<std::unique_ptr<EventImpl>> do_create_event() override {
    return std::unique_ptr<EventImpl>(std::make_unique<HostEvent>());
  }

  Status do_record(EventImpl& event_impl, StreamImpl& stream_impl) override {
    auto& event = static_cast<HostEvent&>(event_impl);
    auto& stream = static_cast<HostStream&>(stream_impl);
    std::uint64_t seq;
    {
      core::MutexLock lock(stream.state()->mu);
      seq = stream.state()->submitted;
    }
    core::MutexLock lock(event.mu);
    event.recorded = true;
    event.stream = stream.state();
    event.seq = seq;
    return Status();
  }

  Status do_wait(StreamImpl& stream_impl, const EventImpl& event_impl) override {
    auto& event = const_cast<HostEvent&>(static_cast<const HostEvent&>(event_impl));
    auto& stream = static_cast<HostStream&>(stream_impl);
    std::shared_ptr<StreamState> other;
    std::uint64_t seq;
    {
      core::MutexLock lock(event.mu);
      if (!event.recorded) {
        return Status::failed_precondition(
            str_cat("stream '", stream.state()->name, "' waits on an event that was never recorded"));
      }
      other = event.stream;
      seq = event.seq;
    }
    if (other == stream.state()) return Status();  // already ordered by the stream itself
    stream.enqueue(Resource::kNone, 0.0, [other, seq]() -> Status {
      Status s = other->wait_for(seq);
      if (!s.ok()) return std::move(s).annotate(str_cat("waited on an event of failed stream '", other->name, "'"));
      return Status();
    });
    return Status();
  }

  Status do_synchronize_event(EventImpl& event_impl) override {
    auto& event = static_cast<HostEvent&>(event_impl);
    std::shared_ptr<StreamState> stream;
    std::uint64_t seq;
    {
      core::MutexLock lock(event.mu);
      if (!event.recorded) return Status();
      stream = event.stream;
      seq = event.seq;
    }
    return stream->wait_for(seq);
  }

  Result<bool> do_query_event(EventImpl& event_impl) override {
    auto& event = static_cast<HostEvent&>(event_impl);
    std::shared_ptr<StreamState> stream;
    std::uint64_t seq;
    {
      core::MutexLock lock(event.mu);
      if (!event.recorded) return true;
      stream = event.stream;
      seq = event.seq;
    }
    core::MutexLock lock(stream->mu);
    if (stream->completed < seq) return false;
    Status s = stream->error_at(seq);
    if (!s.ok()) return s;
    return true;
  }

  Status do_synchronize_stream(StreamImpl& stream_impl) override {
    auto& state = *static_cast<HostStream&>(stream_impl).state();
    std::uint64_t seq;
    {
      core::MutexLock lock(state.mu);
      seq = state.submitted;
    }
    return state.wait_for(seq);
  }

  Status do_synchronize_device() override {
    std::vector<std::shared_ptr<StreamState>> streams;
    {
      core::MutexLock lock(mu_);
      streams = streams_;
    }
    Status first;
    for (auto& s : streams) {
      std::uint64_t seq;
      {
        core::MutexLock lock(s->mu);
        seq = s->submitted;
      }
      Status e = s->wait_for(seq);
      if (first.ok() && !e.ok()) first = std::move(e).annotate(str_cat("stream '", s->name, "'"));
    }
    return first;
  }

  Status do_host_callback(StreamImpl& stream, std::function<void()> fn) override {
    static_cast<HostStream&>(stream).enqueue(Resource::kNone, 0.0, [fn = std::move(fn)]() {
      fn();
      return Status();
    });
    return Status();
  }

  // --- copies ---
  Status do_copy_h2d(StreamImpl& stream, const DeviceSpan& dst, const void* src) override {
    STRATA_RETURN_IF_ERROR(check_host_range(src, dst.size_bytes(), "copy_h2d source"));
    const std::uint64_t n = dst.size_bytes();
    return enqueue(stream, Resource::kH2D, seconds(n, timing_.h2d_gb_per_s), "copy_h2d", {dst},
                   [n, src](std::byte* const* p) { std::memcpy(p[0], src, n); });
  }

  Status do_copy_d2h(StreamImpl& stream, void* dst, const DeviceSpan& src) override {
    STRATA_RETURN_IF_ERROR(check_host_range(dst, src.size_bytes(), "copy_d2h destination"));
    const std::uint64_t n = src.size_bytes();
    return enqueue(stream, Resource::kD2H, seconds(n, timing_.d2h_gb_per_s), "copy_d2h", {src},
                   [n, dst](std::byte* const* p) { std::memcpy(dst, p[0], n); });
  }

  Status do_copy_d2d(StreamImpl& stream, const DeviceSpan& dst, const DeviceSpan& src) override {
    const std::uint64_t n = dst.size_bytes();
    return enqueue(stream, Resource::kDevice, seconds(2 * n, timing_.device_memory_gb_per_s), "copy_d2d",
                   {dst, src}, [n](std::byte* const* p) { std::memcpy(p[0], p[1], n); });
  }

  // --- kernels ---
  Status do_convert(StreamImpl& stream, const DeviceTypedSpan& dst, const DeviceTypedSpan& src) override {
    const std::int64_t n = dst.size();
    const ElemType dt = dst.type;
    const ElemType st = src.type;
    const std::uint64_t bytes = dst.bytes.size_bytes() + src.bytes.size_bytes();
    return enqueue(stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s), "convert",
                   {dst.bytes, src.bytes}, [n, dt, st](std::byte* const* p) {
                     if (dt == st) {
                       std::memcpy(p[0], p[1], static_cast<std::size_t>(n) * elem_size_bytes(dt));
                       return;
                     }
                     for (std::int64_t i = 0; i < n; ++i) store(p[0], dt, i, load(p[1], st, i));
                   });
  }

  Status do_accumulate(StreamImpl& stream, const DeviceSpan& dst, const DeviceTypedSpan& src) override {
    const std::int64_t n = src.size();
    const ElemType st = src.type;
    const std::uint64_t bytes = 2 * dst.size_bytes() + src.bytes.size_bytes();
    return enqueue(stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s), "accumulate",
                   {dst, src.bytes}, [n, st](std::byte* const* p) {
                     for (std::int64_t i = 0; i < n; ++i) {
                       store(p[0], ElemType::kF32, i, load(p[0], ElemType::kF32, i) + load(p[1], st, i));
                     }
                   });
  }

  Status do_norm_partials(StreamImpl& stream, const NormPartialsArgs& args) override {
    const std::int64_t n = args.src.size();
    const ElemType st = args.src.type;
    const bool has_flag = args.nonfinite_flag.buffer_id() != 0;
    const std::uint64_t bytes = args.src.bytes.size_bytes() + 8 * static_cast<std::uint64_t>(nx::norm_block_count(n));
    std::vector<DeviceSpan> spans = {args.src.bytes, args.partials};
    if (has_flag) spans.push_back(args.nonfinite_flag);
    return enqueue(stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s), "norm_partials",
                   std::move(spans), [n, st, has_flag](std::byte* const* p) {
                     const std::int64_t blocks = nx::norm_block_count(n);
                     bool nonfinite = false;
                     for (std::int64_t b = 0; b < blocks; ++b) {
                       const std::int64_t begin = b * nx::kNormBlockElems;
                       const std::int64_t len = std::min<std::int64_t>(nx::kNormBlockElems, n - begin);
                       double lanes[nx::kNormLanes] = {};
                       for (std::int64_t i = 0; i < len; ++i) {
                         const int lane = static_cast<int>(i % nx::kNormLanes);
                         lanes[lane] = lanes[lane] + nx::square_f64(load(p[0], st, begin + i));
                       }
                       const double partial = nx::fold_norm_lanes(lanes);
                       std::memcpy(p[1] + 8 * b, &partial, 8);
                       // A partial is inf or NaN exactly when one of its values is:
                       // squares of finite floats sum far below the double range.
                       if (!std::isfinite(partial)) nonfinite = true;
                     }
                     if (has_flag && nonfinite) {
                       const std::uint32_t one = 1;
                       std::memcpy(p[2], &one, 4);
                     }
                   });
  }

  Status do_scale(StreamImpl& stream, const DeviceTypedSpan& x, float factor) override {
    const std::int64_t n = x.size();
    const ElemType t = x.type;
    return enqueue(stream, Resource::kDevice, seconds(2 * x.bytes.size_bytes(), timing_.device_memory_gb_per_s),
                   "scale", {x.bytes}, [n, t, factor](std::byte* const* p) {
                     for (std::int64_t i = 0; i < n; ++i) store(p[0], t, i, nx::mul_f32(load(p[0], t, i), factor));
                   });
  }

  Status do_fill(StreamImpl& stream, const DeviceTypedSpan& x, float value) override {
    const std::int64_t n = x.size();
    const ElemType t = x.type;
    return enqueue(stream, Resource::kDevice, seconds(x.bytes.size_bytes(), timing_.device_memory_gb_per_s), "fill",
                   {x.bytes}, [n, t, value](std::byte* const* p) {
                     for (std::int64_t i = 0; i < n; ++i) store(p[0], t, i, value);
                   });
  }

  Status do_adam_step(StreamImpl& stream, const AdamStepArgs& args) override {
    const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
    const nx::AdamStepConstants c = args.constants;
    const ElemType gt = args.grad.type;
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    const ElemType ct = args.copy_out.type;
    const std::uint64_t bytes = 24 * static_cast<std::uint64_t>(n) + args.grad.bytes.size_bytes() +
                                (has_copy ? args.copy_out.bytes.size_bytes() : 0);
    std::vector<DeviceSpan> spans = {args.master, args.exp_avg, args.exp_avg_sq, args.grad.bytes};
    if (has_copy) spans.push_back(args.copy_out.bytes);
    return enqueue(stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s), "adam_step",
                   std::move(spans), [n, c, gt, has_copy, ct](std::byte* const* p) {
                     for (std::int64_t i = 0; i < n; ++i) {
                       float w = load(p[0], ElemType::kF32, i);
                       float m = load(p[1], ElemType::kF32, i);
                       float v = load(p[2], ElemType::kF32, i);
                       nx::adam_step(c, load(p[3], gt, i), w, m, v);
                       store(p[0], ElemType::kF32, i, w);
                       store(p[1], ElemType::kF32, i, m);
                       store(p[2], ElemType::kF32, i, v);
                       if (has_copy) store(p[4], ct, i, w);
                     }
                   });
  }

  Status do_adam_step_bf16_moments(StreamImpl& stream, const AdamStepBf16MomentsArgs& args) override {
    const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
    const nx::AdamStepConstants c = args.constants;
    const ElemType gt = args.grad.type;
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    const ElemType ct = args.copy_out.type;
    const nx::Bf16Rounding rounding = args.rounding;
    const bool stochastic = rounding == nx::Bf16Rounding::kStochastic;
    const std::uint64_t key = nx::stochastic_rounding_key(args.seed, args.step);  // once per call
    const std::int64_t index_base = args.index_base;
    // Read and written: master 4 + 4, m 2 + 2, v 2 + 2 bytes per element.
    const std::uint64_t bytes = 16 * static_cast<std::uint64_t>(n) + args.grad.bytes.size_bytes() +
                                (has_copy ? args.copy_out.bytes.size_bytes() : 0);
    std::vector<DeviceSpan> spans = {args.master, args.exp_avg, args.exp_avg_sq, args.grad.bytes};
    if (has_copy) spans.push_back(args.copy_out.bytes);
    return enqueue(stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s),
                   "adam_step_bf16_moments", std::move(spans),
                   [n, c, gt, has_copy, ct, rounding, stochastic, key, index_base](std::byte* const* p) {
                     for (std::int64_t i = 0; i < n; ++i) {
                       float w = load(p[0], ElemType::kF32, i);
                       std::uint16_t m;
                       std::uint16_t v;
                       std::memcpy(&m, p[1] + 2 * i, 2);
                       std::memcpy(&v, p[2] + 2 * i, 2);
                       std::uint32_t bits_m = 0;
                       std::uint32_t bits_v = 0;
                       if (stochastic) {
                         bits_m = nx::stochastic_rounding_bits(key, index_base + i, nx::AdamMoment::kExpAvg);
                         bits_v =
                             nx::stochastic_rounding_bits(key, index_base + i, nx::AdamMoment::kExpAvgSq);
                       }
                       nx::adam_step_bf16_moments(c, load(p[3], gt, i), w, m, v, rounding, bits_m, bits_v);
                       store(p[0], ElemType::kF32, i, w);
                       std::memcpy(p[1] + 2 * i, &m, 2);
                       std::memcpy(p[2] + 2 * i, &v, 2);
                       if (has_copy) store(p[4], ct, i, w);
                     }
                   });
  }

  Status do_adam_step_int8_blockwise(StreamImpl& stream, const AdamStepInt8Args& args) override {
    const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
    const nx::AdamStepConstants c = args.constants;
    const ElemType gt = args.grad.type;
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    const ElemType ct = args.copy_out.type;
    // Read and written: master 4 + 4, codes 1 + 1 per moment per element,
    // each block's two scales read and written, the gradient, the copy.
    const std::uint64_t bytes = 12 * static_cast<std::uint64_t>(n) + 2 * args.exp_avg_scale.size_bytes() +
                                2 * args.exp_avg_sq_scale.size_bytes() + args.grad.bytes.size_bytes() +
                                (has_copy ? args.copy_out.bytes.size_bytes() : 0);
    std::vector<DeviceSpan> spans = {args.master,        args.exp_avg,          args.exp_avg_sq,
                                     args.exp_avg_scale, args.exp_avg_sq_scale, args.grad.bytes};
    if (has_copy) spans.push_back(args.copy_out.bytes);
    return enqueue(
        stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s), "adam_step_int8_blockwise",
        std::move(spans), [n, c, gt, has_copy, ct](std::byte* const* p) {
          const nx::QuantTables& t = nx::kQuantTables;
          float g[nx::kQuantBlockElems];
          float w[nx::kQuantBlockElems];
          // Block b covers elements [b * 256, min(n, (b + 1) * 256)).
          for (std::int64_t begin = 0, b = 0; begin < n; begin += nx::kQuantBlockElems, ++b) {
            const int len = static_cast<int>(std::min<std::int64_t>(nx::kQuantBlockElems, n - begin));
            for (int i = 0; i < len; ++i) {
              g[i] = load(p[5], gt, begin + i);
              w[i] = load(p[0], ElemType::kF32, begin + i);
            }
            float m_scale = load(p[3], ElemType::kF32, b);
            float v_scale = load(p[4], ElemType::kF32, b);
            // Codes are bytes: unsigned char may alias any object.
            nx::adam_step_int8_block(c, t, g, w, reinterpret_cast<std::uint8_t*>(p[1] + begin),
                                     reinterpret_cast<std::uint8_t*>(p[2] + begin), m_scale, v_scale, len);
            store(p[3], ElemType::kF32, b, m_scale);
            store(p[4], ElemType::kF32, b, v_scale);
            for (int i = 0; i < len; ++i) {
              store(p[0], ElemType::kF32, begin + i, w[i]);
              if (has_copy) store(p[6], ct, begin + i, w[i]);
            }
          }
        });
  }

  Status do_lion_step(StreamImpl& stream, const LionStepArgs& args) override {
    const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
    const nx::LionStepConstants c = args.constants;
    const ElemType gt = args.grad.type;
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    const ElemType ct = args.copy_out.type;
    const std::uint64_t bytes = 16 * static_cast<std::uint64_t>(n) + args.grad.bytes.size_bytes() +
                                (has_copy ? args.copy_out.bytes.size_bytes() : 0);
    std::vector<DeviceSpan> spans = {args.master, args.exp_avg, args.grad.bytes};
    if (has_copy) spans.push_back(args.copy_out.bytes);
    return enqueue(stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s), "lion_step",
                   std::move(spans), [n, c, gt, has_copy, ct](std::byte* const* p) {
                     for (std::int64_t i = 0; i < n; ++i) {
                       float w = load(p[0], ElemType::kF32, i);
                       float m = load(p[1], ElemType::kF32, i);
                       nx::lion_step(c, load(p[2], gt, i), w, m);
                       store(p[0], ElemType::kF32, i, w);
                       store(p[1], ElemType::kF32, i, m);
                       if (has_copy) store(p[3], ct, i, w);
                     }
                   });
  }

  Status do_adagrad_step(StreamImpl& stream, const AdagradStepArgs& args) override {
    const std::int64_t n = static_cast<std::int64_t>(args.master.size_bytes() / 4);
    const nx::AdagradStepConstants c = args.constants;
    const ElemType gt = args.grad.type;
    const bool has_copy = args.copy_out.bytes.buffer_id() != 0;
    const ElemType ct = args.copy_out.type;
    const std::uint64_t bytes = 16 * static_cast<std::uint64_t>(n) + args.grad.bytes.size_bytes() +
                                (has_copy ? args.copy_out.bytes.size_bytes() : 0);
    std::vector<DeviceSpan> spans = {args.master, args.exp_avg_sq, args.grad.bytes};
    if (has_copy) spans.push_back(args.copy_out.bytes);
    return enqueue(stream, Resource::kDevice, seconds(bytes, timing_.device_memory_gb_per_s), "adagrad_step",
                   std::move(spans), [n, c, gt, has_copy, ct](std::byte* const* p) {
                     for (std::int64_t i = 0; i < n; ++i) {
                       float w = load(p[0], ElemType::kF32, i);
                       float v = load(p[1], ElemType::kF32, i);
                       nx::adagrad_step(c, load(p[2], gt, i), w, v);
                       store(p[0], ElemType::kF32, i, w);
                       store(p[1], ElemType::kF32, i, v);
                       if (has_copy) store(p[3], ct, i, w);
                     }
                   });
  }

  Status do_declare_compute(StreamImpl& stream, double flops) override {
    const double s = timing_.compute_tflops > 0 ? flops / (timing_.compute_tflops * 1e12) : 0.0;
    static_cast<HostStream&>(stream).enqueue(Resource::kDevice, s, [] { return Status(); });
    return Status();
  }

 private:
  static double seconds(std::uint64_t bytes, double gb_per_s) {
    return gb_per_s > 0 ? static_cast<double>(bytes) / (gb_per_s * 1e9) : 0.0;
  }

  static Status already_registered(std::uintptr_t begin, std::uintptr_t end) {
    return Status::already_exists(str_cat("host memory overlaps a range registered already (", end - begin,
                                          " bytes at 0x", std::hex, begin, ")"));
  }

  // Host memory handed to a copy must not be device memory.
  Status check_host_range(const void* p, std::uint64_t n, std::string_view role) {
    const auto begin = reinterpret_cast<std::uintptr_t>(p);
    const auto end = begin + n;
    core::MutexLock lock(mu_);
    auto it = by_address_.upper_bound(begin);
    if (it != by_address_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second->size_bytes() > begin) {
        return Status::invalid_argument(str_cat(role, " lies in device memory: use copy_d2d or a DeviceSpan"));
      }
    }
    if (it != by_address_.end() && it->first < end) {
      return Status::invalid_argument(str_cat(role, " overlaps device memory"));
    }
    return Status();
  }

  // Enqueues `body` over the given views. When it runs, each view is looked up
  // again: a buffer freed since enqueueing fails the operation (and its stream).
  Status do_run_on_stream(StreamImpl& stream, std::vector<DeviceSpan> spans, StreamWork fn) override {
    // (Not modeled: another library's work takes the time it takes.)
    const std::size_t n = spans.size();
    return enqueue_fallible(stream, Resource::kNone, 0.0, "run_on_stream", std::move(spans),
                            [fn = std::move(fn), n](std::byte* const* p) -> Status {
                              void* ptrs[8] = {};
                              for (std::size_t i = 0; i < n; ++i) ptrs[i] = p[i];
                              return fn(nullptr, std::span<void* const>(ptrs, n));
                            });
  }

  Status enqueue(StreamImpl& stream_impl, Resource resource, double modeled_s, const char* what,
                 std::vector<DeviceSpan> spans, std::function<void(std::byte* const*)> body) {
    return enqueue_fallible(stream_impl, resource, modeled_s, what, std::move(spans),
                            [body = std::move(body)](std::byte* const* p) -> Status {
                              body(p);
                              return Status();
                            });
  }

  Status enqueue_fallible(StreamImpl& stream_impl, Resource resource, double modeled_s, const char* what,
                          std::vector<DeviceSpan> spans, std::function<Status(std::byte* const*)> body) {
    auto& stream = static_cast<HostStream&>(stream_impl);
    stream.enqueue(resource, modeled_s,
                   [this, what, spans = std::move(spans), body = std::move(body)]() -> Status {
                     AccessSet access;
                     std::byte* ptrs[8] = {};
                     STRATA_CHECK(spans.size() <= 8);
                     for (std::size_t i = 0; i < spans.size(); ++i) {
                       std::shared_ptr<Allocation> a;
                       {
                         core::MutexLock lock(mu_);
                         auto it = allocations_.find(spans[i].buffer_id());
                         if (it != allocations_.end()) a = it->second;
                       }
                       if (a == nullptr) {
                         return Status::failed_precondition(str_cat(what, ": buffer ", spans[i].buffer_id(),
                                                                    " was freed before the operation ran"));
                       }
                       ptrs[i] = access.add(std::move(a), spans[i].offset_bytes());
                     }
                     return body(ptrs);
                   });
    return Status();
  }

  const TimingModel timing_;

  core::Mutex timing_mu_;
  Clock::time_point resource_free_at_[kResourceCount] STRATA_GUARDED_BY(timing_mu_);

  core::Mutex mu_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Allocation>> allocations_ STRATA_GUARDED_BY(mu_);
  std::map<std::uintptr_t, std::shared_ptr<Allocation>> by_address_ STRATA_GUARDED_BY(mu_);
  std::map<std::uintptr_t, std::uintptr_t> registered_ STRATA_GUARDED_BY(mu_);  // begin -> end
  std::vector<std::shared_ptr<StreamState>> streams_ STRATA_GUARDED_BY(mu_);
  const bool use_arena_;  // HostDeviceOptions::arena
  Arena arena_;
  std::unordered_map<std::uint64_t, std::uint64_t> arena_offsets_ STRATA_GUARDED_BY(mu_);  // buffer id -> offset
};

// --- HostStream --------------------------------------------------------------

HostStream::HostStream(HostDevice* device, std::string name)
    : device_(device), state_(std::make_shared<StreamState>(std::move(name))), worker_([this] { loop(); }) {}

HostStream::~HostStream() {
  {
    core::MutexLock lock(state_->mu);
    stopping_ = true;
  }
  state_->cv.notify_all();
  worker_.join();  // after draining the queue
  device_->remove_stream(state_);
}

void HostStream::enqueue(Resource resource, double modeled_s, std::function<Status()> run) {
  {
    core::MutexLock lock(state_->mu);
    Op op;
    op.seq = ++state_->submitted;
    op.resource = resource;
    op.modeled_s = modeled_s;
    op.run = std::move(run);
    queue_.push_back(std::move(op));
  }
  state_->cv.notify_all();
}

void HostStream::loop() {
  for (;;) {
    Op op;
    bool failed;
    {
      core::MutexLock lock(state_->mu);
      state_->cv.wait(state_->mu, [&]() STRATA_REQUIRES(state_->mu) { return !queue_.empty() || stopping_; });
      if (queue_.empty()) return;  // stopping, and drained
      op = std::move(queue_.front());
      queue_.pop_front();
      failed = state_->error_seq != 0;
    }
    Status s = failed ? Status() : device_->run_timed(op);  // a failed stream skips its work
    op.run = nullptr;  // drop captured state (allocations) before reporting completion
    {
      core::MutexLock lock(state_->mu);
      state_->completed = op.seq;
      if (!s.ok() && state_->error_seq == 0) {
        state_->error = std::move(s).annotate(str_cat("stream '", state_->name, "'"));
        state_->error_seq = op.seq;
      }
    }
    state_->cv.notify_all();
  }
}

}  // namespace

Result<std::unique_ptr<Device>> make_host_device(const HostDeviceOptions& options) {
  if (options.budgets.device == nullptr || options.budgets.pinned == nullptr) {
    return Status::invalid_argument("host device: both budgets (device, pinned) are required");
  }
  const std::pair<const char*, double> rates[] = {{"h2d_gb_per_s", options.timing.h2d_gb_per_s},
                                                  {"d2h_gb_per_s", options.timing.d2h_gb_per_s},
                                                  {"device_memory_gb_per_s", options.timing.device_memory_gb_per_s},
                                                  {"compute_tflops", options.timing.compute_tflops}};
  for (const auto& [name, value] : rates) {
    if (!std::isfinite(value) || value < 0) {
      return Status::invalid_argument(str_cat("host device timing model: ", name, " must be >= 0 and finite, not ",
                                              value));
    }
  }
  DeviceCaps caps;
  caps.kind = DeviceKind::kHost;
  caps.name = "host (emulated)";
  caps.device_memory_bytes = options.budgets.device->limit_bytes();
  caps.allocation_alignment_bytes = kAlignment;
  caps.page_locked_host_memory = false;
  caps.native_streams = false;
  caps.declared_compute = options.timing.compute_tflops > 0;
  caps.timing_model = options.timing.enabled();
  caps.strict = true;
  return std::unique_ptr<Device>(std::make_unique<HostDevice>(std::move(caps), options.budgets, options.timing, options.arena));
}

}  // namespace strata::gpu
