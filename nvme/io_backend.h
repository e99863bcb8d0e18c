// IoBackend: asynchronous batched file I/O behind one interface, with io_uring,
// libaio and pread/pwrite (psync) drivers underneath. Every completion is
// checked here, in one place: short transfers, EINTR and EAGAIN are retried;
// everything else comes back as a Status naming the path, offset and length.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "core/result.h"
#include "core/status.h"

namespace strata::nvme {

class FaultInjector;
class IoEngine;

enum class IoOp : std::uint8_t { kRead, kWrite };
std::string_view to_string(IoOp op);  // "read", "write"

// Which driver runs the I/O. kAuto: io_uring, else libaio, else psync, with a
// log line saying what was picked and why (config: strata.io.backend).
enum class BackendKind : std::uint8_t { kAuto, kIoUring, kLibaio, kPsync };
std::string_view to_string(BackendKind kind);  // "auto", "io_uring", "libaio", "psync"
// Parses the names above. Errors: kInvalidArgument naming the text.
core::Result<BackendKind> parse_backend_kind(std::string_view text);
// True when the driver was compiled in (io_uring and libaio are optional).
bool backend_compiled(BackendKind kind);

// A file registered with a backend (an index into its file table).
struct FileId {
  int index = -1;
  friend bool operator==(FileId, FileId) = default;
};

// Bytes moved to and from one registered file since it was registered, as the
// kernel reported them: a short transfer counts what it moved, an op that
// failed what it moved before failing, and nothing is counted twice across
// retries. With O_DIRECT that is whole sectors.
struct FileTraffic {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  friend bool operator==(const FileTraffic&, const FileTraffic&) = default;
};

// One read or write. `buffer` is borrowed: it must stay valid (and, for
// writes, unchanged) until the request completes. For files opened with
// O_DIRECT the offset, length and buffer address must be multiples of the
// file system's direct-I/O alignment (4096 is always safe).
struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file;
  std::uint64_t offset = 0;       // bytes from the start of the file
  std::span<std::byte> buffer;    // destination (read) or source (write); length > 0
};

// What a backend is asked to be (strata.io.* in the config).
struct IoBackendOptions {
  BackendKind kind = BackendKind::kAuto;  // strata.io.backend; default auto
  // Requests in flight per ring (io_uring), per context (libaio) or threads
  // (psync). strata.io.queue_depth; default 32; 1..4096.
  unsigned queue_depth = 32;
  // I/O threads, each with its own ring or context (strata.io.rings; default 1,
  // 1..64). psync uses queue_depth threads in all (at most kMaxPsyncThreads).
  unsigned rings = 1;
  // io_uring kernel submission polling (strata.io.sqpoll; default false). An
  // explicit request the kernel refuses is an error.
  bool sqpoll = false;
  // Idle time before the SQPOLL thread sleeps, milliseconds; default 1000.
  unsigned sqpoll_idle_ms = 1000;
  // How often one request is retried after EINTR, EAGAIN or a transfer that
  // made no progress before it fails (short transfers that made progress do
  // not count); default 64.
  unsigned max_retries = 64;
  // Borrowed; must outlive the backend. When set, every driver is wrapped in a
  // fault-injecting decorator (tests). Default none.
  FaultInjector* fault_injector = nullptr;
};

inline constexpr unsigned kMaxPsyncThreads = 16;
inline constexpr unsigned kMaxRegisteredFiles = 64;

// A batch of requests and their completions (RocksDB MultiRead's shape): one
// Status per request and one for the batch. Build it, hand it to
// IoBackend::submit, then wait. Requests run in any order and may overlap in
// time. Thread-safe after submit (any thread may wait); the destructor waits for
// completion, so a batch never outlives its requests' buffers unknowingly.
class IoBatch {
 public:
  IoBatch() = default;
  explicit IoBatch(std::vector<IoRequest> requests);
  IoBatch(const IoBatch&) = delete;
  IoBatch& operator=(const IoBatch&) = delete;
  ~IoBatch();

  // Appends a request; only before submit.
  void add(const IoRequest& request);
  std::size_t size() const { return requests_.size(); }
  const IoRequest& request(std::size_t i) const { return requests_[i]; }

  // Blocks until every request completed. Returns OK, or the first failed
  // request's Status (lowest index) prefixed with "request i of n". OK for an
  // empty or never-submitted batch.
  core::Status wait() STRATA_EXCLUDES(mu_);
  // Blocks until request `i` completed and returns its Status.
  core::Status wait_request(std::size_t i) STRATA_EXCLUDES(mu_);
  // True when every request completed (non-blocking).
  bool done() const { return remaining_.load(std::memory_order_acquire) == 0; }
  // Request i's Status; only after wait() or a successful wait_request(i).
  const core::Status& request_status(std::size_t i) const { return statuses_[i]; }

 private:
  friend class IoEngine;
  void prepare_for_submit();
  void complete(std::size_t i, core::Status status) STRATA_EXCLUDES(mu_);  // called by I/O threads

  std::vector<IoRequest> requests_;
  std::vector<core::Status> statuses_;
  std::unique_ptr<std::atomic<bool>[]> done_;
  std::atomic<std::size_t> remaining_{0};
  bool submitted_ = false;
  core::Mutex mu_;  // guards nothing but the wake-up below
  core::CondVar cv_;
};

// The backend. Thread-safe: any thread may register, submit and wait; the I/O
// itself runs on the backend's own threads (one ring or context per thread).
// Destruction drains requests already handed to the kernel and cancels
// (kCancelled) those not yet started.
class IoBackend {
 public:
  // Builds the backend `options` asks for. Errors: kInvalidArgument for bad
  // options; kUnavailable when an explicitly requested driver cannot run here
  // (io_uring disabled by the kernel or a sandbox: io_uring_queue_init returned
  // -EPERM or -ENOSYS; SQPOLL refused), kUnimplemented when it was not compiled
  // in. kAuto falls back and logs once what it picked and why.
  static core::Result<std::unique_ptr<IoBackend>> create(const IoBackendOptions& options);

  ~IoBackend();
  IoBackend(const IoBackend&) = delete;
  IoBackend& operator=(const IoBackend&) = delete;

  // The driver that runs (never kAuto), and why it was chosen.
  BackendKind kind() const;
  const std::string& selection_reason() const;
  unsigned queue_depth() const;

  // Registers an open file; `fd` is borrowed and must stay open until
  // unregister_file (io_uring installs it in each ring's fixed-file table).
  // `path` names the file in error messages. Errors: kResourceExhausted past
  // kMaxRegisteredFiles; the driver's registration error.
  core::Result<FileId> register_file(int fd, std::string path);
  // Only while no request on the file is in flight.
  core::Status unregister_file(FileId file);
  // The file's traffic so far (FileTraffic), counted as completions arrive:
  // a snapshot, exact once no request on the file is in flight. Zeros for an
  // id that is not registered.
  FileTraffic traffic(FileId file) const;

  // Registers memory that requests will use (io_uring: fixed buffers, pinned
  // once instead of per request). Optional: requests on other memory work too.
  // The memory must outlive the backend or unregister_buffers. Call before any
  // I/O is in flight; replaces earlier registrations.
  core::Status register_buffers(std::span<const std::span<std::byte>> buffers);
  core::Status unregister_buffers();

  // Starts every request of `batch`; returns at once. The batch must not be
  // changed or destroyed before it is done. Errors (nothing was started):
  // kInvalidArgument for an empty buffer or an unknown file; kFailedPrecondition
  // when the batch was already submitted.
  core::Status submit(IoBatch& batch);

  // submit + wait.
  core::Status execute(IoBatch& batch);

 private:
  explicit IoBackend(std::unique_ptr<IoEngine> engine);
  std::unique_ptr<IoEngine> engine_;
};

}  // namespace strata::nvme
