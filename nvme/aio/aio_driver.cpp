// The Linux AIO driver (libaio): one context per I/O thread. io_getevents may
// return fewer events than asked; reap() loops until it has what it needs.
#include <libaio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/str.h"
#include "nvme/internal/io_driver.h"

namespace strata::nvme::internal {
namespace {

using core::Status;
using core::str_cat;

constexpr std::uint64_t kMaxOpBytes = 1ull << 30;

class AioDriver final : public IoDriver {
 public:
  static core::Result<std::unique_ptr<IoDriver>> create(const IoBackendOptions& options) {
    auto d = std::unique_ptr<AioDriver>(new AioDriver(options.queue_depth));
    const int rc = io_setup(static_cast<int>(options.queue_depth), &d->ctx_);
    if (rc < 0) {
      char buf[128];
      return Status::unavailable(str_cat("io_setup(", options.queue_depth, ") failed: errno ", -rc, " (",
                                         strerror_r(-rc, buf, sizeof buf), ")"))
          .with_errno(-rc);
    }
    d->ctx_ok_ = true;
    return std::unique_ptr<IoDriver>(std::move(d));
  }

  ~AioDriver() override {
    if (ctx_ok_) io_destroy(ctx_);  // IoBackend drained every op before this
  }

  unsigned capacity() const override { return depth_; }

  Status prepare(const DriverOp& op) override {
    if (free_.empty()) return Status::internal("libaio driver: more ops than its queue depth");
    iocb* cb = free_.back();
    free_.pop_back();
    const auto len = static_cast<std::size_t>(std::min(op.length, kMaxOpBytes));
    if (op.op == IoOp::kRead) {
      io_prep_pread(cb, op.fd, op.data, len, static_cast<long long>(op.offset));
    } else {
      io_prep_pwrite(cb, op.fd, op.data, len, static_cast<long long>(op.offset));
    }
    cb->data = op.tag;
    pending_.push_back(cb);
    return Status();
  }

  void submit() override {
    while (!pending_.empty()) {
      const int rc = io_submit(ctx_, static_cast<long>(pending_.size()), pending_.data());
      if (rc > 0) {
        pending_.erase(pending_.begin(), pending_.begin() + rc);
        in_kernel_ += static_cast<unsigned>(rc);
        continue;
      }
      if (rc == -EINTR) continue;
      if ((rc == -EAGAIN || rc == 0) && in_kernel_ > 0) return;  // submit again after reaping
      // Refused with nothing in flight (or a hard error): each op comes back
      // with the error; IoBackend retries EAGAIN.
      const int err = rc == 0 ? EAGAIN : -rc;
      for (iocb* cb : pending_) {
        refused_.push_back({cb->data, -err});
        free_.push_back(cb);
      }
      pending_.clear();
    }
  }

  Status reap(unsigned min_complete, std::vector<DriverCompletion>& out) override {
    const std::size_t start = out.size();
    out.insert(out.end(), refused_.begin(), refused_.end());
    refused_.clear();
    for (;;) {
      if (!pending_.empty()) submit();
      if (!refused_.empty()) {
        out.insert(out.end(), refused_.begin(), refused_.end());
        refused_.clear();
      }
      const std::size_t have = out.size() - start;
      if (in_kernel_ == 0) return Status();
      const long want = have >= min_complete ? 0 : static_cast<long>(min_complete - have);
      const int rc = io_getevents(ctx_, want, static_cast<long>(events_.size()), events_.data(), nullptr);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        char buf[128];
        return Status::io_error(str_cat("io_getevents failed: errno ", -rc, " (", strerror_r(-rc, buf, sizeof buf),
                                        ")"))
            .with_errno(-rc);
      }
      for (int i = 0; i < rc; ++i) {
        // res carries bytes or -errno in an unsigned field.
        out.push_back({events_[i].data, static_cast<std::int64_t>(static_cast<long>(events_[i].res))});
        free_.push_back(events_[i].obj);
      }
      in_kernel_ -= std::min(in_kernel_, static_cast<unsigned>(rc));
      // Ops io_submit could not take yet are submitted on the next call.
      if (out.size() - start >= min_complete) return Status();
    }
  }

 private:
  explicit AioDriver(unsigned depth) : depth_(depth), iocbs_(depth), events_(depth) {
    free_.reserve(depth);
    for (auto& cb : iocbs_) free_.push_back(&cb);
  }

  const unsigned depth_;
  io_context_t ctx_ = nullptr;
  bool ctx_ok_ = false;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<iocb*> pending_;      // prepared, not yet taken by io_submit
  std::vector<io_event> events_;
  std::vector<DriverCompletion> refused_;
  unsigned in_kernel_ = 0;
};

}  // namespace

core::Result<std::unique_ptr<IoDriver>> make_aio_driver(const IoBackendOptions& options) {
  return AioDriver::create(options);
}

}  // namespace strata::nvme::internal
