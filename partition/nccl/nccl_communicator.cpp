// The NCCL backend: device buffers, each collective queued on the caller's
// CUDA stream. The communicator is non-blocking (ncclConfig_t.blocking = 0)
// so that nothing waits without a bound: creation and every call poll
// ncclCommGetAsyncError until done or the timeout, and abort the
// communicator when it passes. With several ranks rank 0's ncclUniqueId
// reaches the others through a Gloo communicator met in store_dir.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "core/str.h"
#include "partition/communicator.h"

namespace strata::partition {

core::Result<std::unique_ptr<Communicator>> make_gloo_communicator(const CommunicatorOptions& options);
bool gloo_built();

namespace {

using core::Status;
using core::str_cat;
using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBf16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kU8: return ncclUint8;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

// NCCL's failure as a status of its kind: a caller's mistake
// (ncclInvalidArgument, ncclInvalidUsage) INVALID_ARGUMENT, memory NCCL
// could not allocate (its last error says so) RESOURCE_EXHAUSTED, as the
// engine's own allocations say it, else UNAVAILABLE (a peer, the network,
// a timeout).
Status nccl_error(std::string_view what, ncclResult_t r, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  const std::string text = str_cat("nccl ", what, ": ", ncclGetErrorString(r),
                                   last != nullptr && *last != '\0' ? str_cat(" (", last, ")") : std::string());
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return Status::invalid_argument(text);
  const std::string_view said = last != nullptr ? std::string_view(last) : std::string_view();
  if ((r == ncclSystemError || r == ncclUnhandledCudaError) &&
      (said.find("out of memory") != std::string_view::npos || said.find("Out of memory") != std::string_view::npos)) {
    return Status::resource_exhausted(text);
  }
  return Status::unavailable(text);
}

Status cuda_error(std::string_view what, cudaError_t e) {
  const std::string text = str_cat("cuda ", what, ": ", cudaGetErrorString(e));
  return e == cudaErrorMemoryAllocation ? Status::resource_exhausted(text) : Status::unavailable(text);
}

// The calling thread's current device set to `device` for a scope, then
// restored (the caller's CUDA work goes on on its own device).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  Status status() const { return status_ == cudaSuccess ? Status() : cuda_error("cudaSetDevice", status_); }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// Waits until the non-blocking communicator has no call in progress (and,
// with `stream`, until the stream's work is done), within `timeout`. Any
// error, and the timeout, abort the communicator (NCCL's rule after an
// asynchronous error; kernels waiting on a dead peer would spin otherwise).
Status settle(ncclComm_t comm, ncclResult_t started, cudaStream_t stream, bool wait_stream,
              std::chrono::milliseconds timeout, std::string_view what, bool* aborted) {
  const auto deadline = Clock::now() + timeout;
  ncclResult_t state = started;
  auto abort_with = [&](Status s) {
    if (comm != nullptr && !*aborted) ncclCommAbort(comm);
    *aborted = true;
    return s;
  };
  while (true) {
    if (state != ncclSuccess && state != ncclInProgress) return abort_with(nccl_error(what, state, comm));
    if (state == ncclSuccess) {
      if (!wait_stream) return Status();
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return Status();
      if (q != cudaErrorNotReady) return abort_with(cuda_error(what, q));
    }
    if (Clock::now() > deadline) {
      return abort_with(Status::unavailable(str_cat("nccl ", what, ": not done within the ", timeout.count(),
                                                    " ms timeout (a rank did not take part, or its process "
                                                    "ended); the communicator was aborted")));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    const ncclResult_t polled = ncclCommGetAsyncError(comm, &state);
    if (polled != ncclSuccess) return abort_with(nccl_error(what, polled, comm));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, ncclComm_t comm, std::chrono::milliseconds timeout)
      : Communicator("nccl", rank, size), device_(device), comm_(comm), timeout_(timeout) {}
  // The communicator first (finalized within the timeout, else aborted: its
  // kernels must not be left waiting on a peer), then the flag and stream
  // (cudaFree synchronizes the device).
  ~NcclCommunicator() override {
    const DeviceScope on(device_);
    bool destroyed = false;
    if (!aborted_) {
      ncclResult_t state = ncclCommFinalize(comm_);
      const auto deadline = Clock::now() + timeout_;
      while (state == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
      }
      if (state == ncclSuccess) destroyed = ncclCommDestroy(comm_) == ncclSuccess;
    }
    if (!destroyed && !aborted_) ncclCommAbort(comm_);
    if (flag_ != nullptr) cudaFree(flag_);
    if (sync_ != nullptr) cudaStreamDestroy(sync_);
  }

  Status init() {
    if (const cudaError_t e = cudaMalloc(&flag_, sizeof(std::int32_t)); e != cudaSuccess) {
      return cuda_error("allocating the barrier's flag", e);
    }
    if (const cudaError_t e = cudaMemset(flag_, 0, sizeof(std::int32_t)); e != cudaSuccess) {
      return cuda_error("clearing the barrier's flag", e);
    }
    if (const cudaError_t e = cudaStreamCreateWithFlags(&sync_, cudaStreamNonBlocking); e != cudaSuccess) {
      return cuda_error("creating the barrier's stream", e);
    }
    return Status();
  }

 private:
  // Buffers NCCL can read: device (or managed) memory of this rank's device.
  Status check_memory(std::string_view what, std::initializer_list<const void*> ptrs) const override {
    for (const void* p : ptrs) {
      cudaPointerAttributes a{};
      if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();  // (clears the error a host pointer leaves on older runtimes)
        return Status::invalid_argument(str_cat(what, ": not CUDA memory; nccl takes device buffers"));
      }
      if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
        return Status::invalid_argument(str_cat(what, ": a host buffer; nccl takes device buffers (use gloo for "
                                                      "host memory)"));
      }
      if (a.type == cudaMemoryTypeDevice && a.device != device_) {
        return Status::invalid_argument(str_cat(what, ": a buffer of device ", a.device, "; this rank's is ",
                                                device_));
      }
    }
    return Status();
  }

  template <typename Call>
  Status queued(std::string_view what, void* stream, Call&& call) {
    const DeviceScope on(device_);
    STRATA_RETURN_IF_ERROR(on.status());
    return settle(comm_, call(static_cast<cudaStream_t>(stream)), nullptr, false, timeout_, what, &aborted_);
  }

  Status do_synchronize(void* stream) override {
    const DeviceScope on(device_);
    STRATA_RETURN_IF_ERROR(on.status());
    return settle(comm_, ncclSuccess, static_cast<cudaStream_t>(stream), true, timeout_, "synchronize", &aborted_);
  }

  Status do_all_reduce(void* buf, std::size_t count, DType t, ReduceOp op, void* stream) override {
    return queued("all_reduce", stream, [&](cudaStream_t s) {
      return ncclAllReduce(buf, buf, count, nccl_type(t), nccl_op(op), comm_, s);
    });
  }
  Status do_all_gather(const void* send, void* recv, std::size_t count, DType t, void* stream) override {
    return queued("all_gather", stream,
                  [&](cudaStream_t s) { return ncclAllGather(send, recv, count, nccl_type(t), comm_, s); });
  }
  Status do_reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op,
                           void* stream) override {
    return queued("reduce_scatter", stream, [&](cudaStream_t s) {
      return ncclReduceScatter(send, recv, count, nccl_type(t), nccl_op(op), comm_, s);
    });
  }
  Status do_broadcast(void* buf, std::size_t count, DType t, int root, void* stream) override {
    return queued("broadcast", stream,
                  [&](cudaStream_t s) { return ncclBroadcast(buf, buf, count, nccl_type(t), root, comm_, s); });
  }
  // A one-element all-reduce on the communicator's own stream, waited for
  // within the timeout.
  Status do_barrier() override {
    const DeviceScope on(device_);
    STRATA_RETURN_IF_ERROR(on.status());
    const ncclResult_t r = ncclAllReduce(flag_, flag_, 1, ncclInt32, ncclSum, comm_, sync_);
    return settle(comm_, r, sync_, true, timeout_, "barrier", &aborted_);
  }

  int device_;
  ncclComm_t comm_;
  std::chrono::milliseconds timeout_;
  bool aborted_ = false;
  std::int32_t* flag_ = nullptr;
  cudaStream_t sync_ = nullptr;
};

}  // namespace

bool nccl_built() { return true; }

core::Result<std::unique_ptr<Communicator>> make_nccl_communicator(const CommunicatorOptions& o) {
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return Status::unavailable(str_cat("communicator \"nccl\": no CUDA device (",
                                       e != cudaSuccess ? cudaGetErrorString(e) : "none found", ")"));
  }
  int device = o.device;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) device = 0;
  if (device >= devices) {
    return Status::invalid_argument(str_cat("communicator \"nccl\": device ", device, " of ", devices, " devices"));
  }
  const DeviceScope on(device);
  STRATA_RETURN_IF_ERROR(on.status());

  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (o.rank == 0) {
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return nccl_error("ncclGetUniqueId", r, nullptr);
  }
  if (o.size > 1) {
    if (!gloo_built()) {
      return Status::unimplemented("communicator \"nccl\" with several ranks: NCCL's id travels over Gloo, which "
                                   "this build lacks (install libgloo-dev and reconfigure)");
    }
    CommunicatorOptions boot = o;
    boot.backend = "gloo";
    boot.prefix = o.prefix + "-nccl";
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> gloo, make_gloo_communicator(boot));
    STRATA_RETURN_IF_ERROR(gloo->broadcast(&id, sizeof id, DType::kU8, 0));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&comm, o.size, id, o.rank, &config);
  bool aborted = false;
  if (const Status s = settle(comm, started, nullptr, false, o.connect_timeout, "ncclCommInitRankConfig", &aborted);
      !s.ok()) {
    return std::move(Status(s)).annotate(str_cat("communicator \"nccl\": rank ", o.rank, " of ", o.size));
  }
  auto c = std::make_unique<NcclCommunicator>(o.rank, o.size, device, comm, o.timeout);
  STRATA_RETURN_IF_ERROR(c->init());
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace strata::partition
