// Status implementation: factories, errno mapping, formatting.
#include "core/status.h"

#include <cerrno>
#include <cstring>
#include <ostream>
#include <string>

#include "core/str.h"

namespace strata::core {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kOutOfMemory: return "OUT_OF_MEMORY";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kIoError: return "IO_ERROR";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) {
    rep_ = std::make_unique<Rep>(Rep{code, std::move(message)});
  }
}

Status::Status(const Status& other)
    : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
  return *this;
}

#define STRATA_STATUS_FACTORY(fn, code_value) \
  Status Status::fn(std::string message) { return Status(StatusCode::code_value, std::move(message)); }
STRATA_STATUS_FACTORY(invalid_argument, kInvalidArgument)
STRATA_STATUS_FACTORY(not_found, kNotFound)
STRATA_STATUS_FACTORY(already_exists, kAlreadyExists)
STRATA_STATUS_FACTORY(permission_denied, kPermissionDenied)
STRATA_STATUS_FACTORY(out_of_memory, kOutOfMemory)
STRATA_STATUS_FACTORY(resource_exhausted, kResourceExhausted)
STRATA_STATUS_FACTORY(failed_precondition, kFailedPrecondition)
STRATA_STATUS_FACTORY(out_of_range, kOutOfRange)
STRATA_STATUS_FACTORY(unimplemented, kUnimplemented)
STRATA_STATUS_FACTORY(unavailable, kUnavailable)
STRATA_STATUS_FACTORY(io_error, kIoError)
STRATA_STATUS_FACTORY(cancelled, kCancelled)
STRATA_STATUS_FACTORY(internal, kInternal)
#undef STRATA_STATUS_FACTORY

Status Status::data_loss(std::string message) {
  return Status(StatusCode::kDataLoss, std::move(message)).with_data_loss(true);
}

namespace {
StatusCode code_for_errno(int err) {
  switch (err) {
    case ENOENT: return StatusCode::kNotFound;
    case EEXIST: return StatusCode::kAlreadyExists;
    case EACCES:
    case EPERM:
    case EROFS: return StatusCode::kPermissionDenied;
    case ENOSPC:
    case EDQUOT: return StatusCode::kResourceExhausted;
    case ENOMEM: return StatusCode::kOutOfMemory;
    case EINVAL: return StatusCode::kInvalidArgument;
    case EINTR:
    case EAGAIN: return StatusCode::kUnavailable;
    case ENOSYS:
    case EOPNOTSUPP: return StatusCode::kUnimplemented;
    default: return StatusCode::kIoError;
  }
}

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message (maybe not in buf).
  const char* text = strerror_r(err, buf, sizeof buf);
  return str_cat("errno ", err, ": ", text);
}
}  // namespace

Status Status::from_errno(int err, std::string_view what) {
  Status s(code_for_errno(err), str_cat(what, " (", errno_text(err), ")"));
  return std::move(s).with_errno(err).with_retryable(err == EINTR || err == EAGAIN);
}

Status Status::io_error(int err, std::string_view op, std::string_view path,
                        std::uint64_t offset, std::uint64_t want, std::int64_t got) {
  std::string msg = str_cat(op, " '", path, "' at offset ", offset, ": wanted ", want,
                            " bytes, got ", got);
  if (err != 0) msg += str_cat(" (", errno_text(err), ")");
  const StatusCode code = err != 0 ? code_for_errno(err) : StatusCode::kIoError;
  Status s(code == StatusCode::kOk ? StatusCode::kIoError : code, std::move(msg));
  return std::move(s).with_errno(err).with_retryable(err == EINTR || err == EAGAIN);
}

Status&& Status::with_errno(int err) && {
  if (rep_) rep_->error_number = err;
  return std::move(*this);
}
Status&& Status::with_retryable(bool retryable) && {
  if (rep_) rep_->retryable = retryable;
  return std::move(*this);
}
Status&& Status::with_data_loss(bool data_loss) && {
  if (rep_) rep_->data_loss = data_loss;
  return std::move(*this);
}
Status&& Status::annotate(std::string_view context) && {
  if (rep_) rep_->message = str_cat(context, ": ", rep_->message);
  return std::move(*this);
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return str_cat(status_code_name(rep_->code), ": ", rep_->message);
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.to_string(); }

}  // namespace strata::core
