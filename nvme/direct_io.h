// O_DIRECT: the mode a caller asks for, and the one place that opens a file
// with it and falls back to the page cache where the file system refuses it
// (swap files, checkpoint and export files).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "core/result.h"
#include "core/unique_fd.h"

namespace strata::nvme {

// O_DIRECT on a file. kAuto: on where the file system accepts it, else off
// with a log line; kOn: a file system that refuses it is an error; kOff: the
// page cache.
enum class DirectIo : std::uint8_t { kAuto, kOn, kOff };

struct OpenedFile {
  core::UniqueFd fd;
  bool direct = false;  // opened with O_DIRECT
};

// Opens `path` with `flags` (O_CLOEXEC is added) and `mode` (for O_CREAT),
// with O_DIRECT unless `direct` is kOff. Where the file system refuses O_DIRECT
// (EINVAL from open): kAuto logs one info line naming the file and `what` and
// opens it without; kOn returns kUnavailable naming the file. Other errors:
// Status::from_errno "open <what> '<path>'" (ENOENT is kNotFound). `what`
// says what the file is ("swap file", "checkpoint file").
core::Result<OpenedFile> open_file(const std::string& path, int flags, mode_t mode, DirectIo direct,
                                   std::string_view what);

}  // namespace strata::nvme
