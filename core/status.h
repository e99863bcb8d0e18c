// Status: the error type of every fallible call inside strata (no exceptions
// cross module boundaries). Thread-compatible value type; OK allocates nothing.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>

namespace strata::core {

// One code per strata_status value of the C API (bindings/c), same order.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller passed something wrong (config, argument)
  kNotFound = 2,            // a named thing (file, block, key, group) does not exist
  kAlreadyExists = 3,       // creating something that is there (or a locked path)
  kPermissionDenied = 4,    // the OS refused access
  kOutOfMemory = 5,         // an allocator failed (host, pinned, device)
  kResourceExhausted = 6,   // a budget or a disk would be exceeded
  kFailedPrecondition = 7,  // wrong call order or state
  kOutOfRange = 8,          // an offset or index past the end
  kUnimplemented = 9,       // not built in, or not supported by this backend
  kUnavailable = 10,        // the resource exists but cannot be used now (no GPU driver)
  kIoError = 11,            // a read/write/open/fsync failed
  kDataLoss = 12,           // corrupt data (CRC mismatch, truncated file)
  kCancelled = 13,          // stopped on request
  kInternal = 14,           // a bug in strata
};

// Stable upper-case name ("INVALID_ARGUMENT"), the same strings the C API uses.
std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  // OK.
  Status() noexcept = default;
  Status(StatusCode code, std::string message);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  // --- factories (message says what was wrong, naming key paths, files, offsets) ---
  static Status invalid_argument(std::string message);
  static Status not_found(std::string message);
  static Status already_exists(std::string message);
  static Status permission_denied(std::string message);
  static Status out_of_memory(std::string message);
  static Status resource_exhausted(std::string message);
  static Status failed_precondition(std::string message);
  static Status out_of_range(std::string message);
  static Status unimplemented(std::string message);
  static Status unavailable(std::string message);
  static Status io_error(std::string message);
  static Status data_loss(std::string message);
  static Status cancelled(std::string message);
  static Status internal(std::string message);

  // An error from a syscall: the code follows errno (ENOENT -> kNotFound,
  // ENOSPC/EDQUOT -> kResourceExhausted, EACCES/EPERM -> kPermissionDenied,
  // EINTR/EAGAIN -> retryable kUnavailable, ENOMEM -> kOutOfMemory, EINVAL ->
  // kInvalidArgument, else kIoError); the message ends with strerror(err).
  static Status from_errno(int err, std::string_view what);
  // An I/O error with its context: "<op> <path> at offset <offset>: wanted
  // <want> bytes, got <got>" plus strerror(err) when err != 0.
  static Status io_error(int err, std::string_view op, std::string_view path,
                         std::uint64_t offset, std::uint64_t want, std::int64_t got);

  bool ok() const noexcept { return rep_ == nullptr; }
  StatusCode code() const noexcept { return rep_ ? rep_->code : StatusCode::kOk; }
  std::string_view message() const noexcept {
    return rep_ ? std::string_view(rep_->message) : std::string_view();
  }
  // errno that caused this error, 0 when none.
  int error_number() const noexcept { return rep_ ? rep_->error_number : 0; }
  // Retrying the same operation may succeed (EINTR, EAGAIN, a transient fault).
  bool retryable() const noexcept { return rep_ && rep_->retryable; }
  // Data was lost or found corrupt; the caller must not use what it read.
  bool is_data_loss() const noexcept { return rep_ && rep_->data_loss; }

  // Builders for the attributes; no effect on an OK status.
  Status&& with_errno(int err) &&;
  Status&& with_retryable(bool retryable) &&;
  Status&& with_data_loss(bool data_loss) &&;
  // Prefixes the message with context: "<context>: <message>". No-op on OK.
  Status&& annotate(std::string_view context) &&;

  // "OK" or "IO_ERROR: <message>".
  std::string to_string() const;

  // Explicitly drops an error. Write why beside every call.
  void ignore_error() const noexcept {}

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    int error_number = 0;
    bool retryable = false;
    bool data_loss = false;
  };
  std::unique_ptr<Rep> rep_;
};

inline bool operator==(const Status& a, StatusCode c) { return a.code() == c; }

// Writes to_string() (for logs and test failure messages).
std::ostream& operator<<(std::ostream& os, const Status& s);

}  // namespace strata::core
