// IoBackend: the I/O threads, the request queue, backend selection, and the
// one place where completion results are interpreted (retry or report).
#include "nvme/io_backend.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <deque>
#include <thread>
#include <utility>

#include "core/check.h"
#include "core/logging.h"
#include "core/str.h"
#include "nvme/internal/io_driver.h"
#include "strata_build_config.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define STRATA_NVME_ASAN 1
#endif

namespace strata::nvme {

using core::Result;
using core::Status;
using core::str_cat;

std::string_view to_string(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

std::string_view to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kIoUring: return "io_uring";
    case BackendKind::kLibaio: return "libaio";
    case BackendKind::kPsync: return "psync";
  }
  return "unknown";
}

Result<BackendKind> parse_backend_kind(std::string_view text) {
  for (BackendKind k : {BackendKind::kAuto, BackendKind::kIoUring, BackendKind::kLibaio, BackendKind::kPsync}) {
    if (text == to_string(k)) return k;
  }
  return Status::invalid_argument(
      str_cat("I/O backend \"", text, "\" is not one of auto, io_uring, libaio, psync"));
}

bool backend_compiled(BackendKind kind) {
  switch (kind) {
    case BackendKind::kIoUring: return STRATA_HAVE_LIBURING != 0;
    case BackendKind::kLibaio: return STRATA_HAVE_LIBAIO != 0;
    default: return true;
  }
}

// --- IoBatch ---------------------------------------------------------------

IoBatch::IoBatch(std::vector<IoRequest> requests) : requests_(std::move(requests)) {}

IoBatch::~IoBatch() {
  if (submitted_) wait().ignore_error();  // the owner had its chance to look; just never free early
}

void IoBatch::add(const IoRequest& request) {
  STRATA_CHECK(!submitted_) << "IoBatch::add after submit";
  requests_.push_back(request);
}

void IoBatch::prepare_for_submit() {
  statuses_.assign(requests_.size(), Status());
  done_ = std::make_unique<std::atomic<bool>[]>(requests_.size());
  for (std::size_t i = 0; i < requests_.size(); ++i) done_[i].store(false, std::memory_order_relaxed);
  remaining_.store(requests_.size(), std::memory_order_release);
  submitted_ = true;
}

void IoBatch::complete(std::size_t i, Status status) {
  statuses_[i] = std::move(status);
  done_[i].store(true, std::memory_order_release);
  // Notify under the lock: once it is released the waiter may destroy the batch.
  core::MutexLock lock(mu_);
  remaining_.fetch_sub(1, std::memory_order_acq_rel);
  cv_.notify_all();
}

Status IoBatch::wait() {
  if (!submitted_) return Status();
  {
    core::MutexLock lock(mu_);
    cv_.wait(mu_, [&] { return remaining_.load(std::memory_order_acquire) == 0; });
  }
  for (std::size_t i = 0; i < statuses_.size(); ++i) {
    if (!statuses_[i].ok()) {
      return Status(statuses_[i]).annotate(str_cat("request ", i, " of ", statuses_.size()));
    }
  }
  return Status();
}

Status IoBatch::wait_request(std::size_t i) {
  STRATA_CHECK(i < requests_.size()) << "request " << i << " of " << requests_.size();
  if (!submitted_) return Status::failed_precondition("wait_request on a batch never submitted");
  if (!done_[i].load(std::memory_order_acquire)) {
    core::MutexLock lock(mu_);
    cv_.wait(mu_, [&] { return done_[i].load(std::memory_order_acquire); });
  }
  return statuses_[i];
}

// --- IoEngine: threads, queue, retries -------------------------------------

namespace {

struct FileSlot {
  int fd = -1;
  std::string path;
};

// A file slot's bytes moved (IoBackend::traffic), written by the I/O threads
// as completions arrive, outside the engine's lock.
struct SlotTraffic {
  std::atomic<std::uint64_t> bytes_read{0};
  std::atomic<std::uint64_t> bytes_written{0};
};

struct BufferRegion {
  const std::byte* begin;
  const std::byte* end;
  int index;
};

}  // namespace

// One request in flight: where it started, how far it got, how often it was retried.
struct Op {
  IoBatch* batch;
  std::size_t index;
  IoOp op;
  int file_index;
  int fd;
  const std::string* path;  // points into the engine's file table (stable)
  std::uint64_t offset;
  std::byte* data;
  std::uint64_t length;
  int buffer_index;
  std::uint64_t done = 0;
  unsigned retries = 0;
};

class IoEngine {
 public:
  IoEngine(const IoBackendOptions& options, BackendKind kind, std::string reason,
           std::vector<std::unique_ptr<internal::IoDriver>> drivers)
      : options_(options), kind_(kind), reason_(std::move(reason)), drivers_(std::move(drivers)) {
    threads_.reserve(drivers_.size());
    for (auto& d : drivers_) {
      internal::IoDriver* driver = d.get();
      threads_.emplace_back([this, driver] { run(*driver); });
    }
  }

  ~IoEngine() STRATA_EXCLUDES(mu_) {
    std::deque<Op*> cancelled;
    {
      core::MutexLock lock(mu_);
      stop_ = true;
      cancelled.swap(queue_);
    }
    cv_.notify_all();
    for (Op* op : cancelled) {
      op->batch->complete(op->index, Status::cancelled(str_cat(
          to_string(kind_), " ", to_string(op->op), " '", *op->path, "' at offset ", op->offset,
          ": the I/O backend was destroyed before the request started")));
      delete op;
    }
    for (auto& t : threads_) t.join();
  }

  BackendKind kind() const { return kind_; }
  const std::string& reason() const { return reason_; }
  unsigned queue_depth() const { return options_.queue_depth; }

  Result<FileId> register_file(int fd, std::string path) STRATA_EXCLUDES(mu_) {
    if (fd < 0) return Status::invalid_argument(str_cat("register_file '", path, "': bad descriptor ", fd));
    core::MutexLock lock(mu_);
    int slot = -1;
    for (int i = 0; i < static_cast<int>(kMaxRegisteredFiles); ++i) {
      if (files_[i].fd < 0) {
        slot = i;
        break;
      }
    }
    if (slot < 0) {
      return Status::resource_exhausted(str_cat("register_file '", path, "': all ", kMaxRegisteredFiles,
                                                " file slots of the I/O backend are in use"));
    }
    for (auto& d : drivers_) {
      Status s = d->register_file(slot, fd);
      if (!s.ok()) {
        for (auto& u : drivers_) u->register_file(slot, -1).ignore_error();  // best-effort undo
        return std::move(s).annotate(str_cat("register_file '", path, "'"));
      }
    }
    files_[slot].fd = fd;
    files_[slot].path = std::move(path);
    traffic_[slot].bytes_read.store(0, std::memory_order_relaxed);
    traffic_[slot].bytes_written.store(0, std::memory_order_relaxed);
    return FileId{slot};
  }

  FileTraffic traffic(FileId file) const {
    if (file.index < 0 || file.index >= static_cast<int>(kMaxRegisteredFiles)) return {};
    const SlotTraffic& t = traffic_[file.index];
    return {t.bytes_read.load(std::memory_order_relaxed), t.bytes_written.load(std::memory_order_relaxed)};
  }

  Status unregister_file(FileId file) STRATA_EXCLUDES(mu_) {
    core::MutexLock lock(mu_);
    if (file.index < 0 || file.index >= static_cast<int>(kMaxRegisteredFiles) || files_[file.index].fd < 0) {
      return Status::invalid_argument(str_cat("unregister_file: file id ", file.index, " is not registered"));
    }
    Status first;
    for (auto& d : drivers_) {
      Status s = d->register_file(file.index, -1);
      if (first.ok() && !s.ok()) first = std::move(s);
    }
    files_[file.index].fd = -1;
    return first;
  }

  Status register_buffers(std::span<const std::span<std::byte>> buffers) STRATA_EXCLUDES(mu_) {
    core::MutexLock lock(mu_);
    regions_.clear();
    for (auto& d : drivers_) {
      if (!d->uses_registered_buffers()) continue;
      STRATA_RETURN_IF_ERROR(d->register_buffers(buffers));
    }
    if (!drivers_.empty() && drivers_[0]->uses_registered_buffers()) {
      for (std::size_t i = 0; i < buffers.size(); ++i) {
        regions_.push_back({buffers[i].data(), buffers[i].data() + buffers[i].size(), static_cast<int>(i)});
      }
      std::sort(regions_.begin(), regions_.end(),
                [](const BufferRegion& a, const BufferRegion& b) { return a.begin < b.begin; });
    }
    return Status();
  }

  Status unregister_buffers() STRATA_EXCLUDES(mu_) { return register_buffers({}); }

  Status submit(IoBatch& batch) STRATA_EXCLUDES(mu_) {
    if (batch.submitted_) return Status::failed_precondition("IoBatch submitted twice");
    std::vector<Op*> ops;
    ops.reserve(batch.requests_.size());
    {
      core::MutexLock lock(mu_);
      for (std::size_t i = 0; i < batch.requests_.size(); ++i) {
        const IoRequest& r = batch.requests_[i];
        if (r.file.index < 0 || r.file.index >= static_cast<int>(kMaxRegisteredFiles) ||
            files_[r.file.index].fd < 0) {
          return Status::invalid_argument(str_cat("request ", i, ": file id ", r.file.index, " is not registered"));
        }
        if (r.buffer.empty()) {
          return Status::invalid_argument(str_cat("request ", i, " on '", files_[r.file.index].path,
                                                  "' at offset ", r.offset, " has an empty buffer"));
        }
#if defined(STRATA_NVME_ASAN)
        // The kernel writes and reads these bytes where ASan cannot see it.
        if (__asan_region_is_poisoned(r.buffer.data(), r.buffer.size()) != nullptr) {
          return Status::invalid_argument(str_cat("request ", i, ": buffer of ", r.buffer.size(),
                                                  " bytes is not addressable memory (AddressSanitizer)"));
        }
#endif
      }
      batch.prepare_for_submit();
      for (std::size_t i = 0; i < batch.requests_.size(); ++i) {
        const IoRequest& r = batch.requests_[i];
        ops.push_back(new Op{&batch, i, r.op, r.file.index, files_[r.file.index].fd, &files_[r.file.index].path,
                             r.offset, r.buffer.data(), r.buffer.size(), find_region(r.buffer)});
      }
      if (stop_) {
        for (Op* op : ops) {
          op->batch->complete(op->index, Status::cancelled("I/O backend is shutting down"));
          delete op;
        }
        return Status();
      }
      queue_.insert(queue_.end(), ops.begin(), ops.end());
    }
    cv_.notify_all();
    return Status();
  }

 private:
  int find_region(std::span<std::byte> b) const STRATA_REQUIRES(mu_) {
    if (regions_.empty()) return -1;
    auto it = std::upper_bound(regions_.begin(), regions_.end(), b.data(),
                               [](const std::byte* p, const BufferRegion& r) { return p < r.begin; });
    if (it == regions_.begin()) return -1;
    --it;
    return (b.data() >= it->begin && b.data() + b.size() <= it->end) ? it->index : -1;
  }

  void finish(Op* op, Status status, unsigned& owned) {
    op->batch->complete(op->index, std::move(status));
    delete op;
    --owned;
  }

  std::string describe(const Op* op) const { return str_cat(to_string(kind_), " ", to_string(op->op)); }

  // The one place a completion result is judged. Returns true when `op` must
  // be issued again (retry or the rest of a short transfer).
  bool judge(Op* op, std::int64_t result, unsigned& owned) {
    const std::uint64_t want = op->length - op->done;
    if (result < 0) {
      const int err = static_cast<int>(-result);
      if ((err == EINTR || err == EAGAIN) && op->retries < options_.max_retries) {
        ++op->retries;
        if (err == EAGAIN && op->retries > 1) {
          // The kernel is short of something: back off a little, growing.
          std::this_thread::sleep_for(std::chrono::microseconds(50 * op->retries));
        }
        return true;
      }
      Status s = Status::io_error(err, describe(op), *op->path, op->offset, op->length,
                                  static_cast<std::int64_t>(op->done));
      if (err == EINTR || err == EAGAIN) s = std::move(s).annotate(str_cat("gave up after ", op->retries, " retries"));
      finish(op, std::move(s), owned);
      return false;
    }
    const auto got = static_cast<std::uint64_t>(result);
    if (got > want) {
      finish(op, Status::internal(str_cat(describe(op), " '", *op->path, "' at offset ", op->offset + op->done,
                                          ": the kernel reported ", got, " bytes for a ", want, "-byte request")),
             owned);
      return false;
    }
    if (got == 0) {
      if (op->op == IoOp::kRead) {
        finish(op, Status::data_loss(str_cat(describe(op), " '", *op->path, "' at offset ", op->offset,
                                             ": wanted ", op->length, " bytes, got ", op->done,
                                             " (unexpected end of file)")),
               owned);
        return false;
      }
      if (op->retries < options_.max_retries) {
        ++op->retries;
        return true;
      }
      finish(op, Status::io_error(0, describe(op), *op->path, op->offset, op->length,
                                  static_cast<std::int64_t>(op->done))
                     .annotate(str_cat("no progress after ", op->retries, " retries")),
             owned);
      return false;
    }
    op->done += got;
    SlotTraffic& traffic = traffic_[op->file_index];
    (op->op == IoOp::kRead ? traffic.bytes_read : traffic.bytes_written).fetch_add(got, std::memory_order_relaxed);
    if (op->done < op->length) return true;  // short transfer: issue the rest
    finish(op, Status(), owned);
    return false;
  }

  internal::DriverOp driver_op(const Op* op) const {
    internal::DriverOp d;
    d.op = op->op;
    d.file_index = op->file_index;
    d.fd = op->fd;
    d.offset = op->offset + op->done;
    d.data = op->data + op->done;
    d.length = op->length - op->done;
    d.buffer_index = op->buffer_index;
    d.tag = const_cast<Op*>(op);
    return d;
  }

  // One I/O thread: owns `driver` and every op it pulled until it completes.
  void run(internal::IoDriver& driver) STRATA_EXCLUDES(mu_) {
    const unsigned capacity = driver.capacity();
    unsigned owned = 0;             // ops pulled and not yet finished
    std::vector<Op*> to_issue;      // pulled or to be retried, not yet prepared
    std::vector<internal::DriverCompletion> completions;
    bool reap_error_logged = false;
    for (;;) {
      {
        core::MutexLock lock(mu_);
        if (owned == 0) cv_.wait(mu_, [this]() STRATA_REQUIRES(mu_) { return stop_ || !queue_.empty(); });
        while (owned < capacity && !queue_.empty()) {
          to_issue.push_back(queue_.front());
          queue_.pop_front();
          ++owned;
        }
        if (stop_ && owned == 0) return;
      }
      if (!to_issue.empty()) {
        for (Op* op : to_issue) {
          Status s = driver.prepare(driver_op(op));
          if (!s.ok()) finish(op, std::move(s).annotate(str_cat(describe(op), " '", *op->path, "'")), owned);
        }
        to_issue.clear();
        driver.submit();
      }
      if (owned == 0) continue;
      completions.clear();
      Status s = driver.reap(1, completions);
      if (!s.ok()) {
        // The kernel still owns the buffers of ops in flight: they cannot be
        // given back until they complete, so keep reaping.
        if (!reap_error_logged) {
          STRATA_LOG(kError) << "nvme: " << to_string(kind_) << " reap failed: " << s;
        }
        reap_error_logged = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      for (const auto& c : completions) {
        Op* op = static_cast<Op*>(c.tag);
        if (judge(op, c.result, owned)) to_issue.push_back(op);
      }
    }
  }

  const IoBackendOptions options_;
  const BackendKind kind_;
  const std::string reason_;
  // Destruction order: the destructor joins threads_ explicitly before the
  // drivers (rings, contexts) are torn down.
  std::vector<std::unique_ptr<internal::IoDriver>> drivers_;
  core::Mutex mu_;  // lock order: IoEngine::mu_ before IoBatch::mu_
  core::CondVar cv_;
  std::deque<Op*> queue_ STRATA_GUARDED_BY(mu_);
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  FileSlot files_[kMaxRegisteredFiles] STRATA_GUARDED_BY(mu_);
  SlotTraffic traffic_[kMaxRegisteredFiles];  // atomics: read and written without mu_
  std::vector<BufferRegion> regions_ STRATA_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

// --- IoBackend ---------------------------------------------------------------

namespace {

Result<std::vector<std::unique_ptr<internal::IoDriver>>> make_drivers(BackendKind kind,
                                                                      const IoBackendOptions& options) {
  std::vector<std::unique_ptr<internal::IoDriver>> drivers;
  const unsigned count =
      kind == BackendKind::kPsync ? std::min(options.queue_depth, kMaxPsyncThreads) : options.rings;
  for (unsigned i = 0; i < count; ++i) {
    Result<std::unique_ptr<internal::IoDriver>> d = Status::internal("no driver");
    switch (kind) {
      case BackendKind::kIoUring: d = internal::make_uring_driver(options); break;
      case BackendKind::kLibaio: d = internal::make_aio_driver(options); break;
      case BackendKind::kPsync: d = internal::make_psync_driver(); break;
      case BackendKind::kAuto: break;
    }
    if (!d.ok()) return std::move(d).status();
    std::unique_ptr<internal::IoDriver> driver = std::move(d).value();
    if (options.fault_injector != nullptr) {
      driver = internal::make_fault_injecting_driver(std::move(driver), *options.fault_injector);
    }
    drivers.push_back(std::move(driver));
  }
  return drivers;
}

}  // namespace

Result<std::unique_ptr<IoBackend>> IoBackend::create(const IoBackendOptions& options) {
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return Status::invalid_argument(str_cat("I/O queue depth ", options.queue_depth,
                                            " is outside 1..4096 (strata.io.queue_depth)"));
  }
  if (options.rings < 1 || options.rings > 64) {
    return Status::invalid_argument(str_cat("I/O rings ", options.rings, " is outside 1..64 (strata.io.rings)"));
  }
  BackendKind kind = options.kind;
  std::string reason;
  std::vector<std::unique_ptr<internal::IoDriver>> drivers;
  if (kind != BackendKind::kAuto) {
    auto d = make_drivers(kind, options);
    if (!d.ok()) {
      return std::move(d).status().annotate(str_cat("strata.io.backend \"", to_string(kind), "\" was requested"));
    }
    drivers = std::move(d).value();
    reason = "requested";
  } else {
    std::string why_not;
    for (BackendKind k : {BackendKind::kIoUring, BackendKind::kLibaio, BackendKind::kPsync}) {
      auto d = make_drivers(k, options);
      if (d.ok()) {
        kind = k;
        drivers = std::move(d).value();
        reason = why_not.empty() ? std::string("the best available") : str_cat("fallback: ", why_not);
        break;
      }
      if (!why_not.empty()) why_not += "; ";
      why_not += str_cat(to_string(k), " unavailable (", d.status().message(), ")");
    }
    if (drivers.empty()) return Status::unavailable(str_cat("no I/O backend can run here: ", why_not));
    STRATA_LOG(kInfo) << "nvme: strata.io.backend auto picked " << to_string(kind) << " (" << reason << ")";
  }
  auto engine = std::make_unique<IoEngine>(options, kind, std::move(reason), std::move(drivers));
  return std::unique_ptr<IoBackend>(new IoBackend(std::move(engine)));
}

IoBackend::IoBackend(std::unique_ptr<IoEngine> engine) : engine_(std::move(engine)) {}
IoBackend::~IoBackend() = default;

BackendKind IoBackend::kind() const { return engine_->kind(); }
const std::string& IoBackend::selection_reason() const { return engine_->reason(); }
unsigned IoBackend::queue_depth() const { return engine_->queue_depth(); }

Result<FileId> IoBackend::register_file(int fd, std::string path) {
  return engine_->register_file(fd, std::move(path));
}
Status IoBackend::unregister_file(FileId file) { return engine_->unregister_file(file); }
FileTraffic IoBackend::traffic(FileId file) const { return engine_->traffic(file); }
Status IoBackend::register_buffers(std::span<const std::span<std::byte>> buffers) {
  return engine_->register_buffers(buffers);
}
Status IoBackend::unregister_buffers() { return engine_->unregister_buffers(); }
Status IoBackend::submit(IoBatch& batch) { return engine_->submit(batch); }
Status IoBackend::execute(IoBatch& batch) {
  STRATA_RETURN_IF_ERROR(engine_->submit(batch));
  return batch.wait();
}

}  // namespace strata::nvme
