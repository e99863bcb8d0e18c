// partition/communicator.h: collectives among the ranks of one data-parallel
// run (DESIGN.md section 10), behind one interface with three backends:
//   self  one rank; every collective is a copy (or nothing);
//   gloo  host buffers over TCP (Gloo), the bootstrap of the others;
//   nccl  device buffers (NCCL, from the CUDA toolkit), ordered on a native
//         stream (a cudaStream_t; null is the device's default stream).
// partition/ sees core/ only: buffers are raw pointers, a stream is the
// backend's native handle (cudaStream_t for nccl; null for host backends,
// whose calls complete before they return).
//
// Reductions are deterministic and the same on every rank: the host backends
// sum in rank order (rank 0's value + rank 1's + ...), whatever N, so reruns
// with the same N give the same bits, and with one micro-batch per rank the
// sum is the one a single rank accumulating those micro-batches in order would
// form. (A squared norm that must not depend on N is not all-reduced: gather
// its per-block partials, the shards being block-aligned, and sum them in
// block order.)
//
// (NCCL sums in its own order, deterministic for one machine and N but not
// rank order; the host backends are the reference.)
//
// Every collective has the communicator's timeout: a rank that does not take
// part in time, or whose process died, makes the call fail (UNAVAILABLE or
// DEADLINE-style message naming the collective, this rank and the size)
// rather than hang. On nccl the collectives are queued on the stream and
// return at once; synchronize(stream) and barrier() wait for them within the
// timeout and abort the communicator when it passes (never synchronize a
// stream carrying NCCL work by other means: a dead peer would hang it). After
// a failed or refused call the communicator is broken: later calls fail at
// once (FAILED_PRECONDITION), as the ranks' sequences may no longer match (a
// call refused on one rank only would pair the others' next collective with
// the wrong one).
//
// Thread-compatible: one thread at a time per communicator (the collectives
// of all ranks must be issued in the same order).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "core/status.h"

namespace strata::partition {

enum class DType { kF32, kF64, kBf16, kF16, kU8, kI32, kI64 };
std::string_view dtype_name(DType t);
std::size_t dtype_bytes(DType t);

enum class ReduceOp { kSum, kMax };
std::string_view reduce_op_name(ReduceOp op);

// A key-value store the ranks meet through instead of a directory: a
// framework's own (torch.distributed's TCP store, through the C API's
// callbacks), so that ranks on machines without a shared file system meet.
// Keys are written once. Used while communicators are made, on the thread
// that makes them.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual core::Status set(const std::string& key, const std::vector<char>& value) = 0;
  // The value of `key` once some rank has set it; UNAVAILABLE (named) when
  // none has within `timeout`.
  virtual core::Result<std::vector<char>> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

struct CommunicatorOptions {
  std::string backend = "self";  // "self", "gloo" (or "nccl" once built)
  int rank = 0;
  int size = 1;
  // gloo: the rendezvous. A directory every rank can reach (a file store: the
  // ranks as threads or processes of one machine, or a shared file system);
  // each run needs its own (or `prefix`).
  std::string store_dir;
  // Or a store of the caller's (store_dir then unused). Every rank gives one
  // that reaches the same keys.
  std::shared_ptr<RendezvousStore> store;
  std::string prefix = "strata";  // keys of this run in the store
  // The store is this run's alone (the launcher's default private directory,
  // partition/launch.h): once every rank has met, the caller that made the
  // run's communicators may remove it (Engine::create does, on rank 0).
  bool store_is_the_runs = false;
  // This rank among the ranks of its machine (the launcher's LOCAL_RANK,
  // LOCAL_WORLD_SIZE): it picks the GPU, and the CPU optimizer's cores are
  // split among a machine's ranks. -1 and 0: the rank and the size (every
  // rank on one machine, as ranks that are threads of one process are).
  int local_rank = -1;
  int local_size = 0;
  std::string hostname = "127.0.0.1";  // this rank's address for the TCP transport
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // each collective
  // Meeting the others (make_communicator): across machines it may take minutes.
  std::chrono::milliseconds connect_timeout{std::chrono::minutes(5)};
  // nccl: the CUDA device of this rank (-1: the calling thread's current one;
  // an Engine's: its local rank's, gpu::device_for_local_rank).
  // With several ranks NCCL's id goes from rank 0 to the others over a Gloo
  // communicator met through store_dir (prefix + "-nccl").
  int device = -1;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string_view backend() const { return backend_; }

  // buf[0, count) reduced over the ranks, the result on every rank.
  core::Status all_reduce(void* buf, std::size_t count, DType t, ReduceOp op, void* stream = nullptr);
  // recv[r * count, (r + 1) * count) = rank r's send[0, count), on every rank.
  // send may be recv + rank() * count (in place).
  core::Status all_gather(const void* send, void* recv, std::size_t count, DType t, void* stream = nullptr);
  // recv[0, count) = the reduction over the ranks of their send[rank() * count,
  // (rank() + 1) * count): each rank gets its shard of the reduced buffer.
  core::Status reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op,
                              void* stream = nullptr);
  // buf[0, count) of rank `root` on every rank.
  core::Status broadcast(void* buf, std::size_t count, DType t, int root, void* stream = nullptr);
  core::Status barrier();
  // Waits for the collectives queued on `stream` within the timeout (nccl;
  // the host backends have nothing queued).
  core::Status synchronize(void* stream = nullptr);

 protected:
  Communicator(std::string backend, int rank, int size) : backend_(std::move(backend)), rank_(rank), size_(size) {}

  virtual core::Status do_all_reduce(void* buf, std::size_t count, DType t, ReduceOp op, void* stream) = 0;
  virtual core::Status do_all_gather(const void* send, void* recv, std::size_t count, DType t, void* stream) = 0;
  virtual core::Status do_reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op,
                                         void* stream) = 0;
  virtual core::Status do_broadcast(void* buf, std::size_t count, DType t, int root, void* stream) = 0;
  virtual core::Status do_barrier() = 0;
  virtual core::Status do_synchronize(void*) { return core::Status(); }
  // The backend's own checks of a call's buffers (nccl: device memory of its
  // device), before the call is issued.
  virtual core::Status check_memory(std::string_view, std::initializer_list<const void*>) const {
    return core::Status();
  }

 private:
  // Checks the arguments (`checked`: the common checks' result), runs `call`,
  // and breaks the communicator when either fails.
  template <typename Call>
  core::Status run(std::string_view what, core::Status checked, Call&& call);
  // A collective: its buffers checked (with `extra`, the op's or the root's
  // check, and the backend's check_memory), then run() with `call`, which a
  // count of 0 skips (every rank passes the same count: nothing to exchange).
  template <typename Call>
  core::Status collective(std::string_view what, std::size_t count, DType t, std::initializer_list<const void*> ptrs,
                          void* stream, core::Status extra, Call&& call);

  std::string backend_;
  int rank_;
  int size_;
  core::Status broken_;  // the failure that broke it
};

// The communicator of `options.backend`. UNIMPLEMENTED for a backend this
// build lacks (saying how to get it), INVALID_ARGUMENT for a bad rank or size,
// UNAVAILABLE when the ranks do not all arrive within the timeout.
core::Result<std::unique_ptr<Communicator>> make_communicator(const CommunicatorOptions& options);

// Whether this build has the backend.
bool has_backend(std::string_view backend);

// Sums (or takes the max of) `ranks` blocks of `count` elements laid out one
// after another in `blocks`, in rank order, into `out`: the host backends'
// reduction, shared so that every backend rounds alike.
void reduce_in_rank_order(const void* blocks, int ranks, std::size_t count, DType t, ReduceOp op, void* out);

}  // namespace strata::partition
