// The Communicator's checks, the rank-order reduction every host backend
// uses, the one-rank backend and the factory.
#include "partition/communicator.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "core/numerics.h"
#include "core/str.h"

namespace strata::partition {

using core::Status;
using core::str_cat;

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kBf16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kU8: return "u8";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

std::size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBf16: return 2;
    case DType::kF16: return 2;
    case DType::kU8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "max"; }

namespace {

template <typename T, typename Load, typename Store, typename Add>
void reduce_blocks(const std::byte* blocks, int ranks, std::size_t count, ReduceOp op, std::byte* out, Load load,
                   Store store, Add add) {
  for (std::size_t i = 0; i < count; ++i) {
    auto acc = load(blocks, i);
    for (int r = 1; r < ranks; ++r) {
      const auto x = load(blocks + static_cast<std::size_t>(r) * count * sizeof(T), i);
      // max: a NaN, once met, stays (x != x is false for integers).
      acc = op == ReduceOp::kSum ? add(acc, x) : (x != x || x > acc ? x : acc);
    }
    store(out, i, acc);
  }
}

template <typename T>
T load_as(const std::byte* p, std::size_t i) {
  T x;
  std::memcpy(&x, p + i * sizeof(T), sizeof(T));
  return x;
}
template <typename T>
void store_as(std::byte* p, std::size_t i, T x) {
  std::memcpy(p + i * sizeof(T), &x, sizeof(T));
}

}  // namespace

void reduce_in_rank_order(const void* blocks_v, int ranks, std::size_t count, DType t, ReduceOp op, void* out_v) {
  const auto* blocks = static_cast<const std::byte*>(blocks_v);
  auto* out = static_cast<std::byte*>(out_v);
  namespace nx = core::numerics;
  switch (t) {
    case DType::kF32:
      reduce_blocks<float>(blocks, ranks, count, op, out, load_as<float>, store_as<float>,
                           [](float a, float b) { return nx::add_f32(a, b); });
      return;
    case DType::kF64:
      reduce_blocks<double>(blocks, ranks, count, op, out, load_as<double>, store_as<double>,
                            [](double a, double b) { return a + b; });
      return;
    case DType::kBf16:
      // Summed in fp32 in rank order, rounded to bf16 (nearest even) once.
      reduce_blocks<std::uint16_t>(
          blocks, ranks, count, op, out,
          [](const std::byte* p, std::size_t i) { return nx::bf16_bits_to_fp32(load_as<std::uint16_t>(p, i)); },
          [](std::byte* p, std::size_t i, float x) { store_as<std::uint16_t>(p, i, nx::fp32_to_bf16_bits(x)); },
          [](float a, float b) { return nx::add_f32(a, b); });
      return;
    case DType::kF16:
      // The same in fp16: summed in fp32, rounded once.
      reduce_blocks<std::uint16_t>(
          blocks, ranks, count, op, out,
          [](const std::byte* p, std::size_t i) { return nx::fp16_bits_to_fp32(load_as<std::uint16_t>(p, i)); },
          [](std::byte* p, std::size_t i, float x) { store_as<std::uint16_t>(p, i, nx::fp32_to_fp16_bits(x)); },
          [](float a, float b) { return nx::add_f32(a, b); });
      return;
    case DType::kU8:
      reduce_blocks<std::uint8_t>(blocks, ranks, count, op, out, load_as<std::uint8_t>, store_as<std::uint8_t>,
                                  [](std::uint8_t a, std::uint8_t b) { return static_cast<std::uint8_t>(a + b); });
      return;
    case DType::kI32:
      reduce_blocks<std::int32_t>(blocks, ranks, count, op, out, load_as<std::int32_t>, store_as<std::int32_t>,
                                  [](std::int32_t a, std::int32_t b) {
                                    return static_cast<std::int32_t>(static_cast<std::uint32_t>(a) +
                                                                     static_cast<std::uint32_t>(b));
                                  });
      return;
    case DType::kI64:
      reduce_blocks<std::int64_t>(blocks, ranks, count, op, out, load_as<std::int64_t>, store_as<std::int64_t>,
                                  [](std::int64_t a, std::int64_t b) {
                                    return static_cast<std::int64_t>(static_cast<std::uint64_t>(a) +
                                                                     static_cast<std::uint64_t>(b));
                                  });
      return;
  }
}

template <typename Call>
Status Communicator::run(std::string_view what, Status checked, Call&& call) {
  if (!broken_.ok()) {
    return Status::failed_precondition(str_cat(what, " on rank ", rank_, " of ", size_, ": the communicator (",
                                               backend_, ") broke at an earlier call: ", broken_.message()));
  }
  Status s = std::move(checked);
  if (s.ok()) {
    try {
      s = call();
    } catch (const std::bad_alloc&) {
      s = Status::resource_exhausted("out of host memory for the collective's scratch buffers");
    }
  }
  if (!s.ok()) {
    s = std::move(s).annotate(str_cat(what, " on rank ", rank_, " of ", size_, " (", backend_, ")"));
    broken_ = s;
  }
  return s;
}

namespace {

Status check_buffers(std::string_view what, std::size_t count, DType t, std::initializer_list<const void*> ptrs,
                     void* stream, bool takes_stream, int size) {
  if (dtype_bytes(t) == 0) return Status::invalid_argument(str_cat(what, ": unknown dtype"));
  if (count > std::numeric_limits<std::size_t>::max() / dtype_bytes(t) / static_cast<std::size_t>(size)) {
    return Status::invalid_argument(str_cat(what, ": ", count, " elements overflow a byte count"));
  }
  if (count > 0) {
    for (const void* p : ptrs) {
      if (p == nullptr) return Status::invalid_argument(str_cat(what, ": a null buffer for ", count, " elements"));
    }
  }
  if (stream != nullptr && !takes_stream) {
    return Status::invalid_argument(str_cat(what, ": a stream was given, but a host backend completes each "
                                                  "collective before it returns (pass none)"));
  }
  return Status();
}

bool takes_stream(std::string_view backend) { return backend == "nccl"; }

Status check_op(ReduceOp op) {
  return op == ReduceOp::kSum || op == ReduceOp::kMax ? Status() : Status::invalid_argument("unknown reduce op");
}

}  // namespace

// Every call is checked first; a refused call breaks the communicator too
// (run()), since the other ranks' matching call is then left unpaired. A
// count of 0 exchanges nothing (every rank passes the same count).

template <typename Call>
Status Communicator::collective(std::string_view what, std::size_t count, DType t,
                                std::initializer_list<const void*> ptrs, void* stream, Status extra, Call&& call) {
  Status checked = check_buffers(what, count, t, ptrs, stream, takes_stream(backend_), size_);
  if (checked.ok()) checked = std::move(extra);
  if (checked.ok() && count > 0) checked = check_memory(what, ptrs);
  return run(what, std::move(checked), [&] { return count == 0 ? Status() : call(); });
}

Status Communicator::all_reduce(void* buf, std::size_t count, DType t, ReduceOp op, void* stream) {
  return collective("all_reduce", count, t, {buf}, stream, check_op(op),
                    [&] { return do_all_reduce(buf, count, t, op, stream); });
}

Status Communicator::all_gather(const void* send, void* recv, std::size_t count, DType t, void* stream) {
  return collective("all_gather", count, t, {send, recv}, stream, Status(),
                    [&] { return do_all_gather(send, recv, count, t, stream); });
}

Status Communicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op,
                                    void* stream) {
  return collective("reduce_scatter", count, t, {send, recv}, stream, check_op(op),
                    [&] { return do_reduce_scatter(send, recv, count, t, op, stream); });
}

Status Communicator::broadcast(void* buf, std::size_t count, DType t, int root, void* stream) {
  Status root_ok = root < 0 || root >= size_
                       ? Status::invalid_argument(str_cat("broadcast: root ", root, " is not a rank of ", size_))
                       : Status();
  return collective("broadcast", count, t, {buf}, stream, std::move(root_ok),
                    [&] { return do_broadcast(buf, count, t, root, stream); });
}

Status Communicator::barrier() {
  return run("barrier", Status(), [&] { return do_barrier(); });
}

Status Communicator::synchronize(void* stream) {
  Status checked = stream != nullptr && !takes_stream(backend_)
                       ? Status::invalid_argument("synchronize: a host backend has no streams (pass none)")
                       : Status();
  return run("synchronize", std::move(checked), [&] { return do_synchronize(stream); });
}

namespace {

// One rank: the reductions are the input, the gathers a copy.
class SelfCommunicator final : public Communicator {
 public:
  SelfCommunicator() : Communicator("self", 0, 1) {}

 private:
  Status do_all_reduce(void*, std::size_t, DType, ReduceOp, void*) override { return Status(); }
  Status do_all_gather(const void* send, void* recv, std::size_t count, DType t, void*) override {
    if (send != recv) std::memmove(recv, send, count * dtype_bytes(t));
    return Status();
  }
  Status do_reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp, void*) override {
    if (send != recv) std::memmove(recv, send, count * dtype_bytes(t));
    return Status();
  }
  Status do_broadcast(void*, std::size_t, DType, int, void*) override { return Status(); }
  Status do_barrier() override { return Status(); }
};

}  // namespace

// partition/gloo/gloo_communicator.cpp, or partition/gloo_none.cpp.
core::Result<std::unique_ptr<Communicator>> make_gloo_communicator(const CommunicatorOptions& options);
bool gloo_built();
// partition/nccl/nccl_communicator.cpp, or partition/nccl_none.cpp.
core::Result<std::unique_ptr<Communicator>> make_nccl_communicator(const CommunicatorOptions& options);
bool nccl_built();

bool has_backend(std::string_view backend) {
  return backend == "self" || (backend == "gloo" && gloo_built()) || (backend == "nccl" && nccl_built());
}

core::Result<std::unique_ptr<Communicator>> make_communicator(const CommunicatorOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return Status::invalid_argument(str_cat("communicator: rank ", o.rank, " of size ", o.size,
                                            ": need 0 <= rank < size"));
  }
  if (o.timeout.count() <= 0 || o.connect_timeout.count() <= 0) {
    return Status::invalid_argument("communicator: the timeouts must be positive");
  }
  if (o.backend == "self") {
    if (o.size != 1) {
      return Status::invalid_argument(str_cat("communicator \"self\" has one rank; size is ", o.size,
                                              " (use \"gloo\" for several)"));
    }
    return std::unique_ptr<Communicator>(new SelfCommunicator());
  }
  if (o.backend == "gloo") return make_gloo_communicator(o);
  if (o.backend == "nccl") return make_nccl_communicator(o);
  return Status::invalid_argument(str_cat("communicator: unknown backend \"", o.backend,
                                          "\" (one of self, gloo, nccl)"));
}

}  // namespace strata::partition
