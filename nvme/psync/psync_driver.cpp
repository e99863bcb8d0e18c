// The portable driver: one pread/pwrite at a time on its I/O thread. The
// backend runs several of these (a small thread pool) for queue depth.
#include <unistd.h>

#include <cerrno>
#include <optional>

#include "nvme/internal/io_driver.h"

namespace strata::nvme::internal {
namespace {

class PsyncDriver final : public IoDriver {
 public:
  unsigned capacity() const override { return 1; }

  core::Status prepare(const DriverOp& op) override {
    if (pending_ || done_) return core::Status::internal("psync driver holds one op at a time");
    pending_ = op;
    return core::Status();
  }

  void submit() override {
    if (!pending_) return;
    const DriverOp& op = *pending_;
    // One syscall; whatever it returns (short, EINTR, EAGAIN) is judged by IoBackend.
    const ssize_t n = op.op == IoOp::kRead
                          ? ::pread(op.fd, op.data, op.length, static_cast<off_t>(op.offset))
                          : ::pwrite(op.fd, op.data, op.length, static_cast<off_t>(op.offset));
    const std::int64_t result = n >= 0 ? static_cast<std::int64_t>(n) : -static_cast<std::int64_t>(errno);
    done_ = DriverCompletion{op.tag, result};
    pending_.reset();
  }

  core::Status reap(unsigned /*min_complete*/, std::vector<DriverCompletion>& out) override {
    if (done_) {
      out.push_back(*done_);
      done_.reset();
    }
    return core::Status();
  }

 private:
  std::optional<DriverOp> pending_;
  std::optional<DriverCompletion> done_;
};

}  // namespace

core::Result<std::unique_ptr<IoDriver>> make_psync_driver() {
  return std::unique_ptr<IoDriver>(new PsyncDriver());
}

}  // namespace strata::nvme::internal
