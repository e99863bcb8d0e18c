// UniqueFd: one owner of a POSIX file descriptor. Move-only; thread-compatible.
// Close a file you wrote through close() and check its Status: an error there
// can mean lost data. The destructor closes silently (for read-only use and
// error paths).
#pragma once

#include <string>
#include <utility>

#include "core/status.h"

namespace strata::core {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership without closing.
  int release() { return std::exchange(fd_, -1); }
  // Closes the current descriptor (ignoring errors) and takes `fd`.
  void reset(int fd = -1);
  // Closes and reports the error (EIO on close means a write was lost).
  // `what` names the file in the message. OK when not open.
  Status close(std::string_view what);

 private:
  int fd_ = -1;
};

}  // namespace strata::core
