// UniqueFd.
#include "core/unique_fd.h"

#include <cerrno>
#include <unistd.h>

#include "core/str.h"

namespace strata::core {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);  // error ignored by contract: use close() for written files
  fd_ = fd;
}

Status UniqueFd::close(std::string_view what) {
  if (fd_ < 0) return Status();
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) {
    const int err = errno;
    return Status::from_errno(err, str_cat("close '", what, "'"));
  }
  return Status();
}

}  // namespace strata::core
