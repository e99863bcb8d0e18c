// The io_uring driver (liburing): one ring per I/O thread, a sparse
// fixed-file table, optional fixed buffers and optional SQPOLL.
#include <liburing.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

#include "core/str.h"
#include "nvme/internal/io_driver.h"

namespace strata::nvme::internal {
namespace {

using core::Status;
using core::str_cat;

// One SQE moves at most this much; IoBackend issues the rest as a short transfer.
constexpr std::uint64_t kMaxOpBytes = 1ull << 30;
constexpr unsigned kReapBatch = 64;

std::string errno_text(int err) {
  char buf[128];
  return strerror_r(err, buf, sizeof buf);
}

class UringDriver final : public IoDriver {
 public:
  static core::Result<std::unique_ptr<IoDriver>> create(const IoBackendOptions& options) {
    auto d = std::unique_ptr<UringDriver>(new UringDriver(options.queue_depth));
    io_uring_params params;
    std::memset(&params, 0, sizeof params);
    if (options.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = options.sqpoll_idle_ms;
    }
    const int rc = io_uring_queue_init_params(options.queue_depth, &d->ring_, &params);
    if (rc < 0) {
      const int err = -rc;
      std::string hint;
      if (err == EPERM || err == EACCES) hint = ": io_uring is disabled here (sysctl kernel.io_uring_disabled or a seccomp sandbox)";
      if (err == ENOSYS) hint = ": the kernel has no io_uring";
      return Status::unavailable(str_cat("io_uring_queue_init(", options.queue_depth,
                                         options.sqpoll ? ", IORING_SETUP_SQPOLL" : "", ") failed: errno ", err,
                                         " (", errno_text(err), ")", hint))
          .with_errno(err);
    }
    d->ring_ok_ = true;
    // Old kernels need fixed files for SQPOLL; every op here uses one anyway.
    const int frc = io_uring_register_files_sparse(&d->ring_, kMaxRegisteredFiles);
    if (frc < 0) {
      return Status::unavailable(str_cat("io_uring_register_files_sparse(", kMaxRegisteredFiles, ") failed: errno ",
                                         -frc, " (", errno_text(-frc), ")"))
          .with_errno(-frc);
    }
    return std::unique_ptr<IoDriver>(std::move(d));
  }

  ~UringDriver() override {
    if (ring_ok_) io_uring_queue_exit(&ring_);  // IoBackend drained every op before this
  }

  unsigned capacity() const override { return depth_; }

  Status prepare(const DriverOp& op) override {
    if (!broken_.ok()) return broken_;
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    for (int spins = 0; sqe == nullptr && spins < 1000; ++spins) {
      // With SQPOLL the kernel thread may not have consumed the ring yet.
      submit();
      if (!broken_.ok()) return broken_;
      sched_yield();
      sqe = io_uring_get_sqe(&ring_);
    }
    if (sqe == nullptr) return Status::internal("io_uring submission queue full");
    const auto len = static_cast<unsigned>(std::min(op.length, kMaxOpBytes));
    if (op.op == IoOp::kRead) {
      if (op.buffer_index >= 0) {
        io_uring_prep_read_fixed(sqe, op.file_index, op.data, len, op.offset, op.buffer_index);
      } else {
        io_uring_prep_read(sqe, op.file_index, op.data, len, op.offset);
      }
    } else {
      if (op.buffer_index >= 0) {
        io_uring_prep_write_fixed(sqe, op.file_index, op.data, len, op.offset, op.buffer_index);
      } else {
        io_uring_prep_write(sqe, op.file_index, op.data, len, op.offset);
      }
    }
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, op.tag);
    unsubmitted_.push_back(op.tag);
    return Status();
  }

  void submit() override {
    while (!unsubmitted_.empty() && broken_.ok()) {
      const int rc = io_uring_submit(&ring_);
      if (rc >= 0) {
        const auto n = std::min<std::size_t>(static_cast<std::size_t>(rc), unsubmitted_.size());
        unsubmitted_.erase(unsubmitted_.begin(), unsubmitted_.begin() + static_cast<std::ptrdiff_t>(n));
        in_kernel_ += static_cast<unsigned>(n);
        if (rc == 0) return;  // nothing taken now; reap() tries again
        continue;
      }
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == -EBUSY) return;  // reap() submits again after completions
      // The ring cannot take work any more: fail what it did not take.
      broken_ = Status::io_error(str_cat("io_uring_submit failed: errno ", -rc, " (", errno_text(-rc), ")"))
                    .with_errno(-rc);
      for (void* tag : unsubmitted_) refused_.push_back({tag, rc});
      unsubmitted_.clear();
    }
  }

  Status reap(unsigned min_complete, std::vector<DriverCompletion>& out) override {
    const std::size_t start = out.size();
    out.insert(out.end(), refused_.begin(), refused_.end());
    refused_.clear();
    if (!unsubmitted_.empty()) submit();
    if (!unsubmitted_.empty() && in_kernel_ == 0) {
      // The kernel took nothing and nothing will complete. The SQEs cannot be
      // taken back out of the ring, so the ring is retired: the ops come back
      // with EAGAIN and their retries fail in prepare() with this error.
      broken_ = Status::unavailable("io_uring accepted no submissions (EAGAIN with nothing in flight)");
      for (void* tag : unsubmitted_) out.push_back({tag, -EAGAIN});
      unsubmitted_.clear();
    }
    io_uring_cqe* cqes[kReapBatch];
    for (;;) {
      const unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, kReapBatch);
      for (unsigned i = 0; i < n; ++i) {
        out.push_back({io_uring_cqe_get_data(cqes[i]), cqes[i]->res});
      }
      io_uring_cq_advance(&ring_, n);
      in_kernel_ -= std::min(in_kernel_, n);
      if (out.size() - start >= min_complete) return Status();
      if (in_kernel_ == 0) return Status();
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -ETIME) {
        return Status::io_error(str_cat("io_uring_wait_cqe failed: errno ", -rc, " (", errno_text(-rc), ")"))
            .with_errno(-rc);
      }
    }
  }

  Status register_file(int index, int fd) override {
    const int rc = io_uring_register_files_update(&ring_, static_cast<unsigned>(index), &fd, 1);
    if (rc < 0) {
      return Status::from_errno(-rc, str_cat("io_uring_register_files_update(slot ", index, ")"));
    }
    return Status();
  }

  Status register_buffers(std::span<const std::span<std::byte>> buffers) override {
    if (buffers_registered_) {
      io_uring_unregister_buffers(&ring_);
      buffers_registered_ = false;
    }
    if (buffers.empty()) return Status();
    std::vector<iovec> iov(buffers.size());
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      iov[i].iov_base = buffers[i].data();
      iov[i].iov_len = buffers[i].size();
    }
    const int rc = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (rc < 0) {
      return Status::from_errno(-rc, str_cat("io_uring_register_buffers(", iov.size(), " buffers)"));
    }
    buffers_registered_ = true;
    return Status();
  }

  bool uses_registered_buffers() const override { return true; }

 private:
  explicit UringDriver(unsigned depth) : depth_(depth) {}

  const unsigned depth_;
  io_uring ring_{};
  bool ring_ok_ = false;
  bool buffers_registered_ = false;
  unsigned in_kernel_ = 0;          // submitted, not yet reaped
  std::deque<void*> unsubmitted_;   // prepared, in the SQ ring, not yet taken by the kernel
  std::vector<DriverCompletion> refused_;
  Status broken_;
};

}  // namespace

core::Result<std::unique_ptr<IoDriver>> make_uring_driver(const IoBackendOptions& options) {
  return UringDriver::create(options);
}

}  // namespace strata::nvme::internal
