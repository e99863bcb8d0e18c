// CpuAdam: validation, run-time kernel choice, and oneTBB threads over fixed
// tiles (pinned to cores with hwloc).
#include "cpu_adam/cpu_adam.h"

#include <hwloc.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cpu_adam/kernels/kernels.h"
#include "core/aligned_buffer.h"
#include "core/logging.h"
#include "core/str.h"

namespace strata::adam {
namespace {

namespace nx = core::numerics;
using core::Status;
using core::str_cat;

constexpr std::int64_t kDefaultTileElems = 4 * nx::kNormBlockElems;

// Keeps the floating-point environment at the contract's settings while a
// kernel runs: round to nearest, no flush-to-zero, no denormals-are-zero (an
// embedding framework may have set them on its threads).
class FpEnvGuard {
 public:
  FpEnvGuard() {
#if defined(__x86_64__)
    saved_ = __builtin_ia32_stmxcsr();
    // MXCSR bits: 6 DAZ, 13-14 rounding control, 15 FTZ.
    const unsigned wanted = saved_ & ~((1u << 6) | (3u << 13) | (1u << 15));
    if (wanted != saved_) __builtin_ia32_ldmxcsr(wanted);
#endif
  }
  ~FpEnvGuard() {
#if defined(__x86_64__)
    if (__builtin_ia32_stmxcsr() != saved_) __builtin_ia32_ldmxcsr(saved_);
#endif
  }
  FpEnvGuard(const FpEnvGuard&) = delete;
  FpEnvGuard& operator=(const FpEnvGuard&) = delete;

 private:
  unsigned saved_ = 0;
};

const kernels::KernelTable& table_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return kernels::avx512_bf16_kernels();
    case Isa::kAvx512:
      return kernels::avx512_kernels();
    case Isa::kAvx2:
      return kernels::avx2_kernels();
    case Isa::kScalar:
      break;
  }
  return kernels::scalar_kernels();
}

struct ByteRange {
  const char* name;
  std::uintptr_t begin;
  std::uintptr_t end;
};

// Errors when any two ranges overlap. The ranges named `identical_a` and
// `identical_b` may coincide exactly (src == dst in the gradient pass).
Status check_disjoint(const std::vector<ByteRange>& ranges, std::string_view identical_a = {},
                      std::string_view identical_b = {}) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    for (size_t j = i + 1; j < ranges.size(); ++j) {
      const ByteRange& x = ranges[i];
      const ByteRange& y = ranges[j];
      if (x.begin >= y.end || y.begin >= x.end) continue;
      const std::string_view xn = x.name, yn = y.name;
      const bool pair = !identical_a.empty() && ((xn == identical_a && yn == identical_b) ||
                                                 (xn == identical_b && yn == identical_a));
      if (pair && x.begin == y.begin && x.end == y.end) continue;
      return Status::invalid_argument(str_cat("buffers ", x.name, " and ", y.name, " overlap"));
    }
  }
  return Status();
}

ByteRange range_of(const char* name, const void* p, std::int64_t n, int elem_bytes) {
  const auto b = reinterpret_cast<std::uintptr_t>(p);
  return {name, b, b + static_cast<std::uintptr_t>(n) * static_cast<std::uintptr_t>(elem_bytes)};
}

Status check_aligned(const char* name, const void* p, int elem_bytes) {
  if (p == nullptr) return Status::invalid_argument(str_cat(name, " is null"));
  if (!core::is_aligned(p, static_cast<std::size_t>(elem_bytes))) {
    return Status::invalid_argument(
        str_cat(name, " at ", p, " is not aligned to its element size (", elem_bytes, " bytes)"));
  }
  return Status();
}

// An optimizer state array (fp32, bf16 bit patterns or 8-bit codes) and its
// name, for the step checks.
struct NamedState {
  NamedState(const char* name_in, std::span<const float> s)
      : name(name_in), data(s.data()), size(static_cast<std::int64_t>(s.size())), elem_bytes(4) {}
  NamedState(const char* name_in, std::span<const std::uint16_t> s)
      : name(name_in), data(s.data()), size(static_cast<std::int64_t>(s.size())), elem_bytes(2) {}
  NamedState(const char* name_in, std::span<const std::uint8_t> s)
      : name(name_in), data(s.data()), size(static_cast<std::int64_t>(s.size())), elem_bytes(1) {}
  const char* name;
  const void* data;
  std::int64_t size;  // elements
  int elem_bytes;
};

// The checks every step makes before a thread starts: sizes, the copy type,
// alignment, disjoint buffers. `what` begins each message ("adam step").
// `block_scales` (8-bit moments) must each hold one fp32 value per
// numerics::kQuantBlockElems elements, the last block counting even when short.
Status check_step_buffers(std::string_view what, std::span<const float> master,
                          std::initializer_list<NamedState> states, const ConstTypedSpan& grad,
                          const TypedSpan& copy_out, std::initializer_list<NamedState> block_scales = {}) {
  const std::int64_t n = static_cast<std::int64_t>(master.size());
  if (n == 0) return Status::invalid_argument(str_cat(what, ": zero elements"));
  const bool copy = copy_out.data != nullptr;
  bool sizes_match = grad.size == n && (!copy || copy_out.size == n);
  std::string sizes = str_cat("master ", n);
  for (const NamedState& s : states) {
    sizes_match = sizes_match && s.size == n;
    sizes += str_cat(", ", s.name, " ", s.size);
  }
  if (!sizes_match) {
    return Status::invalid_argument(str_cat(what, ": sizes differ: ", sizes, ", grad ", grad.size,
                                            copy ? str_cat(", copy_out ", copy_out.size) : std::string()));
  }
  const std::int64_t blocks = (n + nx::kQuantBlockElems - 1) / nx::kQuantBlockElems;
  for (const NamedState& s : block_scales) {
    if (s.size != blocks) {
      return Status::invalid_argument(str_cat(what, ": ", s.name, " holds ", s.size, " scales; ", n,
                                              " elements need ceil(", n, " / ", nx::kQuantBlockElems,
                                              ") = ", blocks));
    }
  }
  if (copy && copy_out.type == ElemType::kF32) {
    return Status::invalid_argument(
        str_cat(what, ": copy_out must be bf16 or fp16 (the master is the fp32 copy)"));
  }
  STRATA_RETURN_IF_ERROR(check_aligned("master", master.data(), 4));
  for (const NamedState& s : states) STRATA_RETURN_IF_ERROR(check_aligned(s.name, s.data, s.elem_bytes));
  for (const NamedState& s : block_scales) STRATA_RETURN_IF_ERROR(check_aligned(s.name, s.data, s.elem_bytes));
  STRATA_RETURN_IF_ERROR(check_aligned("grad", grad.data, elem_size_bytes(grad.type)));
  if (copy) STRATA_RETURN_IF_ERROR(check_aligned("copy_out", copy_out.data, 2));
  std::vector<ByteRange> ranges = {range_of("master", master.data(), n, 4)};
  for (const NamedState& s : states) ranges.push_back(range_of(s.name, s.data, n, s.elem_bytes));
  for (const NamedState& s : block_scales) ranges.push_back(range_of(s.name, s.data, blocks, s.elem_bytes));
  ranges.push_back(range_of("grad", grad.data, n, elem_size_bytes(grad.type)));
  if (copy) ranges.push_back(range_of("copy_out", copy_out.data, n, 2));
  return check_disjoint(ranges);
}

// Where a tile starting at element `begin` finds its gradient and its copy.
const void* grad_at(const ConstTypedSpan& grad, std::int64_t begin) {
  return static_cast<const std::byte*>(grad.data) + begin * elem_size_bytes(grad.type);
}
void* copy_at(const TypedSpan& copy_out, std::int64_t begin) {
  if (copy_out.data == nullptr) return nullptr;
  return static_cast<std::byte*>(copy_out.data) + begin * elem_size_bytes(copy_out.type);
}

// Pins each worker thread that enters the arena to one core, round robin.
class CorePinner : public oneapi::tbb::task_scheduler_observer {
 public:
  CorePinner(oneapi::tbb::task_arena& arena, hwloc_topology_t topology)
      : oneapi::tbb::task_scheduler_observer(arena), topology_(topology) {
    cores_ = hwloc_get_nbobjs_by_type(topology_, HWLOC_OBJ_CORE);
    observe(true);
  }
  ~CorePinner() override { observe(false); }

  void on_scheduler_entry(bool is_worker) override {
    // The caller's own thread is never pinned: it belongs to the embedder.
    if (!is_worker || cores_ <= 0) return;
    const int slot = oneapi::tbb::this_task_arena::current_thread_index();
    hwloc_obj_t core = hwloc_get_obj_by_type(topology_, HWLOC_OBJ_CORE, slot % cores_);
    if (core == nullptr) return;
    if (hwloc_set_cpubind(topology_, core->cpuset, HWLOC_CPUBIND_THREAD) != 0 && !warned_.exchange(true)) {
      STRATA_LOG(kInfo) << "cpu_adam: could not pin worker threads to cores; running unpinned";
    }
  }

 private:
  hwloc_topology_t topology_;
  int cores_ = 0;
  std::atomic<bool> warned_{false};
};

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "?";
}

std::string_view elem_type_name(ElemType type) {
  switch (type) {
    case ElemType::kF32:
      return "fp32";
    case ElemType::kBf16:
      return "bf16";
    case ElemType::kF16:
      return "fp16";
  }
  return "?";
}

bool isa_supported(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    case Isa::kAvx512Bf16:
      return isa_supported(Isa::kAvx512) && __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

Isa best_isa() {
  if (isa_supported(Isa::kAvx512Bf16)) return Isa::kAvx512Bf16;
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

Status validate_adam_constants(const nx::AdamStepConstants& c) {
  auto bad = [](const char* field, float value, const char* expected) {
    return Status::invalid_argument(str_cat("adam constants: ", field, " = ", value, " ", expected));
  };
  const float all[] = {c.grad_scale,
                       c.beta1,
                       c.beta2,
                       c.one_minus_beta1,
                       c.one_minus_beta2,
                       c.eps,
                       c.inv_sqrt_bias_correction2,
                       c.neg_step_size,
                       c.neg_lr_decay,
                       c.l2_decay};
  for (float x : all) {
    if (!std::isfinite(x)) return bad("a constant", x, "is not finite");
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f)) return bad("beta1", c.beta1, "is outside [0, 1)");
  if (!(c.beta2 >= 0.0f && c.beta2 < 1.0f)) return bad("beta2", c.beta2, "is outside [0, 1)");
  if (!(c.eps > 0.0f)) return bad("eps", c.eps, "must be > 0");
  if (!(c.grad_scale > 0.0f)) return bad("grad_scale", c.grad_scale, "must be > 0");
  if (!(c.inv_sqrt_bias_correction2 > 0.0f)) {
    return bad("inv_sqrt_bias_correction2", c.inv_sqrt_bias_correction2, "must be > 0");
  }
  if (c.neg_step_size > 0.0f) return bad("neg_step_size", c.neg_step_size, "must be <= 0 (it is -lr/bc1)");
  return Status();
}

Status validate_lion_constants(const nx::LionStepConstants& c) {
  auto bad = [](const char* field, float value, const char* expected) {
    return Status::invalid_argument(str_cat("lion constants: ", field, " = ", value, " ", expected));
  };
  const float all[] = {c.grad_scale,      c.beta1,  c.beta2,       c.one_minus_beta1,
                       c.one_minus_beta2, c.neg_lr, c.neg_lr_decay};
  for (float x : all) {
    if (!std::isfinite(x)) return bad("a constant", x, "is not finite");
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f)) return bad("beta1", c.beta1, "is outside [0, 1)");
  if (!(c.beta2 >= 0.0f && c.beta2 < 1.0f)) return bad("beta2", c.beta2, "is outside [0, 1)");
  if (!(c.grad_scale > 0.0f)) return bad("grad_scale", c.grad_scale, "must be > 0");
  if (c.neg_lr > 0.0f) return bad("neg_lr", c.neg_lr, "must be <= 0 (it is -lr)");
  if (c.neg_lr_decay > 0.0f) {
    return bad("neg_lr_decay", c.neg_lr_decay, "must be <= 0 (it is -lr * weight_decay)");
  }
  return Status();
}

Status validate_adagrad_constants(const nx::AdagradStepConstants& c) {
  auto bad = [](const char* field, float value, const char* expected) {
    return Status::invalid_argument(str_cat("adagrad constants: ", field, " = ", value, " ", expected));
  };
  const float all[] = {c.grad_scale, c.eps, c.neg_lr, c.l2_decay};
  for (float x : all) {
    if (!std::isfinite(x)) return bad("a constant", x, "is not finite");
  }
  if (!(c.eps > 0.0f)) return bad("eps", c.eps, "must be > 0");
  if (!(c.grad_scale > 0.0f)) return bad("grad_scale", c.grad_scale, "must be > 0");
  if (c.neg_lr > 0.0f) return bad("neg_lr", c.neg_lr, "must be <= 0 (it is -lr)");
  if (c.l2_decay < 0.0f) return bad("l2_decay", c.l2_decay, "must be >= 0 (it is weight_decay)");
  return Status();
}

struct CpuAdam::Impl {
  const kernels::KernelTable* table = nullptr;
  // Destruction order: the pinner stops observing before the arena goes, and
  // both before the topology they use.
  hwloc_topology_t topology = nullptr;
  std::unique_ptr<oneapi::tbb::task_arena> arena;
  std::unique_ptr<CorePinner> pinner;

  ~Impl() {
    pinner.reset();
    arena.reset();
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }
};

core::Result<std::unique_ptr<CpuAdam>> CpuAdam::create(const CpuAdamOptions& options) {
  Isa isa = options.auto_isa ? best_isa() : options.isa;
  if (!isa_supported(isa)) {
    return Status::unimplemented(
        str_cat("cpu_adam: ISA ", isa_name(isa),
                " was requested but this CPU does not support it (best: ", isa_name(best_isa()), ")"));
  }
  if (options.threads < 0) {
    return Status::invalid_argument(str_cat("cpu_adam: threads = ", options.threads, " must be >= 0"));
  }
  std::int64_t tile = options.tile_elems == 0 ? kDefaultTileElems : options.tile_elems;
  if (tile < 0 || tile % nx::kNormBlockElems != 0) {
    return Status::invalid_argument(str_cat("cpu_adam: tile_elems = ", options.tile_elems,
                                            " must be a positive multiple of ", nx::kNormBlockElems,
                                            " (the norm block)"));
  }
  auto impl = std::make_unique<Impl>();
  impl->table = &table_for(isa);
  int threads = options.threads;
  if (hwloc_topology_init(&impl->topology) == 0 && hwloc_topology_load(impl->topology) == 0) {
    if (threads == 0) threads = std::max(1, hwloc_get_nbobjs_by_type(impl->topology, HWLOC_OBJ_CORE));
  } else {
    if (impl->topology != nullptr) hwloc_topology_destroy(impl->topology);
    impl->topology = nullptr;
  }
  const int max_threads = std::max(1, oneapi::tbb::info::default_concurrency());
  if (threads == 0) threads = max_threads;
  if (threads > max_threads) {
    STRATA_LOG(kInfo) << "cpu_adam: " << threads << " threads requested but this process may run "
                      << max_threads << " at once; using " << max_threads;
    threads = max_threads;
  }
  impl->arena = std::make_unique<oneapi::tbb::task_arena>(threads);
  if (options.bind_threads && impl->topology != nullptr && threads > 1) {
    impl->pinner = std::make_unique<CorePinner>(*impl->arena, impl->topology);
  }
  STRATA_LOG(kDebug) << "cpu_adam: " << isa_name(isa) << " kernels, " << threads << " threads, tiles of "
                     << tile << " elements";
  return std::unique_ptr<CpuAdam>(new CpuAdam(threads, tile, std::move(impl)));
}

CpuAdam::CpuAdam(int threads, std::int64_t tile_elems, std::unique_ptr<Impl> impl)
    : threads_(threads), tile_elems_(tile_elems), impl_(std::move(impl)) {}

Isa CpuAdam::isa() const { return impl_->table->isa; }

CpuAdam::~CpuAdam() = default;

Status CpuAdam::set_isa(Isa isa) {
  if (!isa_supported(isa)) {
    return Status::unimplemented(str_cat("cpu_adam: this CPU does not support ISA ", isa_name(isa)));
  }
  impl_->table = &table_for(isa);
  return Status();
}

void CpuAdam::for_each_tile(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  const std::int64_t tile = tile_elems_;
  const std::int64_t tiles = (n + tile - 1) / tile;
  impl_->arena->execute([&] {
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<std::int64_t>(0, tiles, 1),
        [&](const oneapi::tbb::blocked_range<std::int64_t>& r) {
          FpEnvGuard fp_env;
          for (std::int64_t t = r.begin(); t < r.end(); ++t) fn(t * tile, std::min(tile, n - t * tile));
        },
        oneapi::tbb::simple_partitioner());
  });
}

Status CpuAdam::step(const AdamStepArgs& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers(
      "adam step", args.master, {{"exp_avg", args.exp_avg}, {"exp_avg_sq", args.exp_avg_sq}}, args.grad,
      args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_adam_constants(args.constants));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    kernels::AdamKernelArgs k{&args.constants,
                              args.master.data() + begin,
                              args.exp_avg.data() + begin,
                              args.exp_avg_sq.data() + begin,
                              grad_at(args.grad, begin),
                              args.grad.type,
                              copy_at(args.copy_out, begin),
                              args.copy_out.type,
                              length};
    table.adam(k);
  });
  return Status();
}

Status CpuAdam::step_bf16_moments(const AdamStepBf16MomentsArgs& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers("adam step (bf16 moments)", args.master,
                                            {{"exp_avg", args.exp_avg}, {"exp_avg_sq", args.exp_avg_sq}},
                                            args.grad, args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_adam_constants(args.constants));
  const std::int64_t n = static_cast<std::int64_t>(args.master.size());
  if (args.rounding != nx::Bf16Rounding::kNearestEven && args.rounding != nx::Bf16Rounding::kStochastic) {
    return Status::invalid_argument(str_cat("adam step (bf16 moments): rounding = ",
                                            static_cast<int>(args.rounding),
                                            " is neither kNearestEven (0) nor kStochastic (1)"));
  }
  if (args.index_base < 0 || args.index_base > std::numeric_limits<std::int64_t>::max() - n) {
    return Status::invalid_argument(str_cat("adam step (bf16 moments): index_base = ", args.index_base,
                                            " must be >= 0 and index_base + n (n = ", n,
                                            ") must not pass INT64_MAX"));
  }

  const kernels::KernelTable& table = *impl_->table;
  const std::uint64_t key = nx::stochastic_rounding_key(args.seed, args.step);
  for_each_tile(n, [&](std::int64_t begin, std::int64_t length) {
    kernels::AdamBf16MomentsKernelArgs k{&args.constants,
                                         args.master.data() + begin,
                                         args.exp_avg.data() + begin,
                                         args.exp_avg_sq.data() + begin,
                                         grad_at(args.grad, begin),
                                         args.grad.type,
                                         copy_at(args.copy_out, begin),
                                         args.copy_out.type,
                                         args.rounding,
                                         args.seed,
                                         args.step,
                                         key,
                                         args.index_base + begin,
                                         length};
    table.adam_bf16_moments(k);
  });
  return Status();
}

Status CpuAdam::step_int8_blockwise(const AdamStepInt8Args& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers("adam step (8-bit moments)", args.master,
                                            {{"exp_avg", args.exp_avg}, {"exp_avg_sq", args.exp_avg_sq}},
                                            args.grad, args.copy_out,
                                            {{"exp_avg_scale", args.exp_avg_scale},
                                             {"exp_avg_sq_scale", args.exp_avg_sq_scale}}));
  STRATA_RETURN_IF_ERROR(validate_adam_constants(args.constants));

  // Tiles are multiples of 65536 elements, so each starts on a block boundary
  // and its scales at begin / 256.
  static_assert(nx::kNormBlockElems % nx::kQuantBlockElems == 0);
  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    const std::int64_t block = begin / nx::kQuantBlockElems;
    kernels::AdamInt8KernelArgs k{&args.constants,
                                  args.master.data() + begin,
                                  args.exp_avg.data() + begin,
                                  args.exp_avg_sq.data() + begin,
                                  args.exp_avg_scale.data() + block,
                                  args.exp_avg_sq_scale.data() + block,
                                  grad_at(args.grad, begin),
                                  args.grad.type,
                                  copy_at(args.copy_out, begin),
                                  args.copy_out.type,
                                  length};
    table.adam_int8(k);
  });
  return Status();
}

Status CpuAdam::lion_step(const LionStepArgs& args) {
  STRATA_RETURN_IF_ERROR(
      check_step_buffers("lion step", args.master, {{"exp_avg", args.exp_avg}}, args.grad, args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_lion_constants(args.constants));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    kernels::LionKernelArgs k{&args.constants,
                              args.master.data() + begin,
                              args.exp_avg.data() + begin,
                              grad_at(args.grad, begin),
                              args.grad.type,
                              copy_at(args.copy_out, begin),
                              args.copy_out.type,
                              length};
    table.lion(k);
  });
  return Status();
}

Status CpuAdam::adagrad_step(const AdagradStepArgs& args) {
  STRATA_RETURN_IF_ERROR(check_step_buffers("adagrad step", args.master, {{"exp_avg_sq", args.exp_avg_sq}},
                                            args.grad, args.copy_out));
  STRATA_RETURN_IF_ERROR(validate_adagrad_constants(args.constants));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(static_cast<std::int64_t>(args.master.size()), [&](std::int64_t begin, std::int64_t length) {
    kernels::AdagradKernelArgs k{&args.constants,
                                 args.master.data() + begin,
                                 args.exp_avg_sq.data() + begin,
                                 grad_at(args.grad, begin),
                                 args.grad.type,
                                 copy_at(args.copy_out, begin),
                                 args.copy_out.type,
                                 length};
    table.adagrad(k);
  });
  return Status();
}

core::Result<GradPassResult> CpuAdam::grad_pass(const GradPassArgs& args) {
  const std::int64_t n = args.src.size;
  if (n == 0) return Status::invalid_argument("gradient pass: zero elements");
  if (args.dst.size != n) {
    return Status::invalid_argument(str_cat("gradient pass: sizes differ: src ", n, ", dst ", args.dst.size));
  }
  const bool same_type = args.src.type == args.dst.type;
  if (args.dst.type != ElemType::kF32 && !same_type) {
    return Status::invalid_argument(str_cat(
        "gradient pass: cannot convert ", elem_type_name(args.src.type), " into ",
        elem_type_name(args.dst.type), " (16-bit gradients are kept as they arrive or widened to fp32)"));
  }
  if (args.accumulate && args.dst.type != ElemType::kF32) {
    return Status::invalid_argument(str_cat("gradient pass: accumulation needs an fp32 destination, not ",
                                            elem_type_name(args.dst.type)));
  }
  if (args.accumulate && args.src.data == args.dst.data) {
    return Status::invalid_argument("gradient pass: cannot accumulate a buffer into itself");
  }
  const std::int64_t blocks = nx::norm_block_count(n);
  if (static_cast<std::int64_t>(args.norm_partials.size()) < blocks) {
    return Status::invalid_argument(str_cat("gradient pass: norm_partials holds ", args.norm_partials.size(),
                                            " values, ", blocks, " needed for ", n, " elements"));
  }
  const int src_bytes = elem_size_bytes(args.src.type);
  const int dst_bytes = elem_size_bytes(args.dst.type);
  STRATA_RETURN_IF_ERROR(check_aligned("src", args.src.data, src_bytes));
  STRATA_RETURN_IF_ERROR(check_aligned("dst", args.dst.data, dst_bytes));
  STRATA_RETURN_IF_ERROR(check_aligned("norm_partials", args.norm_partials.data(), 8));
  STRATA_RETURN_IF_ERROR(check_disjoint(
      {range_of("src", args.src.data, n, src_bytes), range_of("dst", args.dst.data, n, dst_bytes),
       range_of("norm_partials", args.norm_partials.data(), blocks, 8)},
      "src", "dst"));

  const kernels::KernelTable& table = *impl_->table;
  for_each_tile(n, [&](std::int64_t begin, std::int64_t length) {
    kernels::GradKernelArgs k{static_cast<const std::byte*>(args.src.data) + begin * src_bytes,
                              args.src.type,
                              static_cast<std::byte*>(args.dst.data) + begin * dst_bytes,
                              args.dst.type,
                              args.accumulate,
                              args.norm_partials.data() + begin / nx::kNormBlockElems,
                              length};
    table.grad_pass(k);
  });
  // A block partial is inf or NaN exactly when one of its values is: squares
  // of finite floats sum far below the double range.
  GradPassResult result;
  for (std::int64_t b = 0; b < blocks; ++b) {
    if (!std::isfinite(args.norm_partials[static_cast<size_t>(b)])) {
      result.nonfinite = true;
      break;
    }
  }
  return result;
}

}  // namespace strata::adam
