// open_file: O_DIRECT where the file system takes it, the page cache (logged)
// where it does not and the caller allows that.
#include "nvme/direct_io.h"

#include <fcntl.h>

#include <cerrno>

#include "core/logging.h"
#include "core/str.h"

namespace strata::nvme {

using core::Status;
using core::str_cat;

core::Result<OpenedFile> open_file(const std::string& path, int flags, mode_t mode, DirectIo direct,
                                   std::string_view what) {
  const int base = flags | O_CLOEXEC;
  const bool try_direct = direct != DirectIo::kOff;
  int fd = ::open(path.c_str(), base | (try_direct ? O_DIRECT : 0), mode);
  int err = fd < 0 ? errno : 0;
  bool is_direct = try_direct;
  if (fd < 0 && err == EINVAL && try_direct) {
    if (direct == DirectIo::kOn) {
      return Status::unavailable(
          str_cat(what, " '", path, "': the file system refuses O_DIRECT (direct I/O was requested)"));
    }
    STRATA_LOG(kInfo) << "nvme: the file system of '" << path << "' refuses O_DIRECT; this " << what
                      << " goes through the page cache";
    is_direct = false;
    fd = ::open(path.c_str(), base, mode);
    err = fd < 0 ? errno : 0;
  }
  if (fd < 0) return Status::from_errno(err, str_cat("open ", what, " '", path, "'"));
  OpenedFile out;
  out.fd.reset(fd);
  out.direct = is_direct;
  return out;
}

}  // namespace strata::nvme
