// The CPU optimizer: fused Adam/AdamW (with fp32, bf16 or 8-bit blockwise
// moments), Lion and Adagrad steps and the gradient pass, one pass over memory per tile, with
// AVX-512, AVX2+FMA and scalar kernels chosen at run time and oneTBB threads
// over fixed tiles. Every kernel, thread count and tile size gives
// bit-identical results (core/numerics.h is the contract).
//
// CpuAdam is thread-compatible: one call at a time per object (each call uses
// the object's threads). Buffers are borrowed for the duration of a call.
// Create one CpuAdam per process and share it: oneTBB hands its worker
// threads to the arena that first claims them, so a second arena of the same
// size often runs on the calling thread alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/numerics.h"
#include "core/result.h"

namespace strata::adam {

// Kernels, narrowest first. kAvx512Bf16 is kAvx512 with the hardware fp32->bf16
// conversion (AVX512_BF16) for the compute copy; the bits are the same.
enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Bf16 };
enum class ElemType { kF32, kBf16, kF16 };

std::string_view isa_name(Isa isa);  // "scalar", "avx2", "avx512", "avx512_bf16"
std::string_view elem_type_name(ElemType type);
inline int elem_size_bytes(ElemType type) { return type == ElemType::kF32 ? 4 : 2; }

// True when this CPU (and OS) can run the kernel: avx2 needs AVX2, FMA and
// F16C; avx512 needs AVX-512 F, BW, VL and DQ; avx512_bf16 also AVX512_BF16.
bool isa_supported(Isa isa);
// The widest supported kernel.
Isa best_isa();

// A typed view of 16- or 32-bit values (gradients, compute copies).
struct TypedSpan {
  void* data = nullptr;
  ElemType type = ElemType::kF32;
  std::int64_t size = 0;  // elements
};
struct ConstTypedSpan {
  const void* data = nullptr;
  ElemType type = ElemType::kF32;
  std::int64_t size = 0;  // elements
};

// One fused step over n elements: read the gradient (fp32, bf16 or fp16),
// scale it by constants.grad_scale, update master, exp_avg and exp_avg_sq in
// place with numerics::adam_step, and write the updated master as bf16 or
// fp16 to copy_out when copy_out.data is set.
struct AdamStepArgs {
  core::numerics::AdamStepConstants constants;
  std::span<float> master;
  std::span<float> exp_avg;
  std::span<float> exp_avg_sq;
  ConstTypedSpan grad;
  TypedSpan copy_out;  // optional: data == nullptr for none; type kBf16 or kF16
};

// Adam/AdamW with bf16 moments: the same step as AdamStepArgs, with exp_avg and
// exp_avg_sq stored as bf16 (their bit patterns in uint16_t; a bf16 is the
// upper half of an fp32). Per element (numerics::adam_step_bf16_moments): widen
// m and v to fp32 (exact), run numerics::adam_step unchanged, and narrow m and v
// back to bf16 with `rounding`: round to nearest even, or stochastic rounding
// with 16 random bits that are a pure function of (seed, step, index_base + i,
// which moment) (numerics::stochastic_rounding_bits), so the result never
// depends on the ISA, the threads or the tiles. State: 8 bytes per element
// (master 4, moments 2 + 2) against AdamStepArgs' 12.
//
// The moments are typed spans of uint16_t rather than a TypedSpan: they have
// one type (bf16) and are updated in place, so a span says all of it and the
// compiler checks it; fp16 moments would not work (v underflows).
struct AdamStepBf16MomentsArgs {
  core::numerics::AdamStepConstants constants;
  std::span<float> master;
  std::span<std::uint16_t> exp_avg;     // bf16 bit patterns, updated in place
  std::span<std::uint16_t> exp_avg_sq;  // bf16 bit patterns, updated in place
  ConstTypedSpan grad;                  // fp32, bf16 or fp16
  TypedSpan copy_out;  // optional: data == nullptr for none; type kBf16 or kF16
  // How m and v are narrowed. Default: round to nearest even (seed, step and
  // index_base are then unused).
  core::numerics::Bf16Rounding rounding = core::numerics::Bf16Rounding::kNearestEven;
  std::uint64_t seed = 0;        // kStochastic: the run's seed (any value)
  std::int64_t step = 0;         // kStochastic: the optimizer step (any value; usually counts from 1)
  std::int64_t index_base = 0;   // the global index of element 0 (>= 0): a chunk's elements draw
                                 // the same bits wherever and however they are updated
};

// Adam/AdamW with 8-bit blockwise moments (numerics.h, "Adam/AdamW with 8-bit
// blockwise moments"): exp_avg (m) and exp_avg_sq (v) are one byte each, in
// blocks of numerics::kQuantBlockElems (256) consecutive elements, each block
// with one fp32 scale per moment. Element 0 starts a block; the last block may
// be short. Per block (numerics::adam_step_int8_block): dequantize m and v
// with the block's scales, run numerics::adam_step unchanged on each element,
// store the new moments' absolute maxima as the block's scales (NaN when one
// is not finite: the block stays NaN from then on), and quantize the moments
// against them. The master stays fp32; the gradient, grad_scale, the compute
// copy, threads and tiles are step()'s. State: 4 + 1 + 1 + 8/256 bytes per
// element against AdamStepArgs' 12. The zero state is all-zero codes and
// scales.
struct AdamStepInt8Args {
  core::numerics::AdamStepConstants constants;
  std::span<float> master;               // n elements
  std::span<std::uint8_t> exp_avg;       // n codes (numerics.h), updated in place
  std::span<std::uint8_t> exp_avg_sq;    // n codes
  std::span<float> exp_avg_scale;        // one per block of 256: ceil(n / 256), updated in place
  std::span<float> exp_avg_sq_scale;     // ceil(n / 256)
  ConstTypedSpan grad;                   // fp32, bf16 or fp16
  TypedSpan copy_out;  // optional: data == nullptr for none; type kBf16 or kF16
};

// One fused Lion step over n elements: read the gradient, scale it by
// constants.grad_scale, update master and exp_avg in place with
// numerics::lion_step, and write the updated master as bf16 or fp16 to
// copy_out when copy_out.data is set.
struct LionStepArgs {
  core::numerics::LionStepConstants constants;
  std::span<float> master;
  std::span<float> exp_avg;
  ConstTypedSpan grad;
  TypedSpan copy_out;  // optional: data == nullptr for none; type kBf16 or kF16
};

// One fused Adagrad step over n elements: read the gradient, scale it by
// constants.grad_scale, update master and the sum of squared gradients in
// place with numerics::adagrad_step, and write the updated master as bf16 or
// fp16 to copy_out when copy_out.data is set.
struct AdagradStepArgs {
  core::numerics::AdagradStepConstants constants;
  std::span<float> master;
  std::span<float> exp_avg_sq;  // the sum of squared gradients (torch's "sum")
  ConstTypedSpan grad;
  TypedSpan copy_out;  // optional: data == nullptr for none; type kBf16 or kF16
};

// The gradient pass: dst = src (assign) or dst = dst + src (accumulate, fp32
// only), converting bf16/fp16 to fp32 when dst is fp32, or keeping bf16/fp16
// when dst has the same type (no accumulation then; src may equal dst). The
// norm partials of the resulting dst values are written per 65536-element
// block (numerics.h order): norm_partials must hold
// numerics::norm_block_count(n) values. The range starts on a block boundary.
struct GradPassArgs {
  ConstTypedSpan src;
  TypedSpan dst;
  bool accumulate = false;
  std::span<double> norm_partials;
};

struct GradPassResult {
  bool nonfinite = false;  // some dst value is inf or NaN
};

// Where the worker threads run. One thread per physical core in every pinned
// mode (never two on the hyperthreads of one core): more threads than the
// chosen cores are cut to that number. Pinning never changes results.
enum class BindMode {
  kAuto,   // kNuma where it can be done; otherwise unpinned, the reason logged
  kNuma,   // the physical cores of one NUMA node (CpuAdamOptions::numa_node);
           // create() fails when they cannot be found or pinned to
  kCores,  // the physical cores of every node, in hwloc's order; create()
           // fails when they cannot be found or pinned to
  kNone,   // not pinned: the OS places the threads
};
std::string_view bind_mode_name(BindMode mode);  // "auto", "numa", "cores", "none"

struct CpuAdamOptions {
  bool auto_isa = true;           // pick best_isa(); else use `isa`
  Isa isa = Isa::kScalar;         // used when auto_isa is false; must be supported
  // Threads of a step, the calling thread among them. 0: one per chosen core
  // (kAuto, kNuma: the node's physical cores; kCores, kNone: every physical
  // core). Capped at the chosen cores when pinned, and at what the process
  // may run at once.
  int threads = 0;
  std::int64_t tile_elems = 0;    // 0: default; else a positive multiple of 65536
  BindMode bind = BindMode::kAuto;
  // kAuto, kNuma: the node whose cores to use, by the OS's number (as
  // numactl and /sys/devices/system/node count); a node that does not exist
  // or has no cores is an error. -1 (default): the node `near_memory` lives
  // on, else the node of the thread that calls create(), else every core.
  int numa_node = -1;
  // kAuto, kNuma with numa_node -1: memory the steps will work on (the
  // pinned buffers), borrowed for the call to create() only; its pages must
  // have been touched. Empty: use the calling thread's node.
  std::span<const std::byte> near_memory = {};
  // One of several data-parallel ranks on this machine (DESIGN.md section
  // 10): local rank `local_rank` of `local_ranks`, each driving the CUDA
  // device of its local rank's index. kAuto and kNuma with numa_node -1 take
  // the NUMA node of that device where hwloc knows it (its "cuda<i>" OS
  // device, or the PCI device `gpu_pci_busids[i]` names, "0000:65:00.0"),
  // before near_memory; the chosen node's physical cores are then split
  // evenly among the local ranks that choose that node, in local rank
  // order, each taking its own (with fewer cores than ranks, one each,
  // shared). One rank: local_ranks 1, every core of the node.
  int local_rank = 0;
  int local_ranks = 1;
  std::vector<std::string> gpu_pci_busids = {};
};

// What create() chose for the threads (CpuAdam::binding()).
struct CoreBinding {
  BindMode mode = BindMode::kAuto;  // as asked
  bool bound = false;     // the worker threads are pinned, each to its own physical core
  int threads = 0;        // threads of a step, the calling thread among them
  int threads_asked = 0;  // CpuAdamOptions::threads (0: the default)
  // The NUMA node (OS number) whose cores were chosen; -1 when the cores are
  // not one node's (kCores on a machine of several nodes, kNone, no topology).
  int numa_node = -1;
  // How the node was found: "numa_node" (given), "GPU <i>" (the node of the
  // local rank's GPU), "memory" (where near_memory lives), "calling thread",
  // or "" when no node was chosen.
  std::string node_from;
  // With several local ranks: the local ranks that chose this node (its
  // cores split among them) and this rank's place among them; 1 and 0 alone.
  int sharing_ranks = 1;
  int share_index = 0;
  // The NUMA node this rank's pinned memory belongs on, so that the threads
  // and the memory they stream meet on one node: the chosen node when it was
  // chosen for the GPU ("GPU <i>") or given ("numa_node"), on a machine of
  // several nodes; -1 otherwise (first touch places the memory: a machine of
  // one node, or a node chosen because the memory or the thread is there).
  int memory_node = -1;
  // The chosen cores, one per thread in thread-slot order, each by its first
  // logical CPU (the OS's number, as taskset and lscpu count). cpus[0] is the
  // calling thread's, which is never pinned (it belongs to the embedder);
  // the worker in slot i is pinned to the whole core of cpus[i]. Empty when
  // no cores were chosen (kNone, no topology).
  std::vector<int> cpus;
  std::string why_unbound;  // when !bound: why (the mode, one thread, a failure)

  // One line, e.g. "2 threads pinned to the physical cores of NUMA node 0
  // (node of the memory; CPUs 0,1)" or "2 threads, not pinned (bind none)".
  std::string describe() const;
};

// The choice create() would make for `options` (cores, node, threads),
// without pinning anything and without creating threads. With
// `synthetic_topology`, an hwloc synthetic description such as
// "pack:1 numa:2 core:4 pu:2", or an hwloc XML topology (text starting with
// '<', which may hold PCI devices and their "cuda<i>" OS devices) stands for
// this machine (tests: then nothing can be pinned, and `bound` says what
// would be). Errors as create()'s for
// the binding: kInvalidArgument for a negative thread count, a numa_node that
// does not exist or has no cores; kUnavailable when kNuma or kCores cannot
// read the topology or finds no cores.
core::Result<CoreBinding> plan_core_binding(const CpuAdamOptions& options,
                                            std::string_view synthetic_topology = {});

// Checks the constants a step would use: betas in [0, 1), eps > 0, every value
// finite, grad_scale > 0. Errors name the field and the value.
core::Status validate_adam_constants(const core::numerics::AdamStepConstants& c);
// Lion: betas in [0, 1), every value finite, grad_scale > 0, neg_lr <= 0 and
// neg_lr_decay <= 0 (lr and weight decay >= 0). Errors name the field and the value.
core::Status validate_lion_constants(const core::numerics::LionStepConstants& c);
// Adagrad: eps > 0, every value finite, grad_scale > 0, neg_lr <= 0 and
// l2_decay >= 0 (lr and weight decay >= 0). Errors name the field and the value.
core::Status validate_adagrad_constants(const core::numerics::AdagradStepConstants& c);

class CpuAdam {
 public:
  // Errors: kInvalidArgument for a bad tile size, thread count or
  // numa_node; kUnimplemented when an explicitly requested ISA is not
  // supported here; with bind kNuma or kCores, kUnavailable when the cores
  // cannot be found or a thread cannot be pinned to them (kAuto runs
  // unpinned instead and logs why at info level).
  static core::Result<std::unique_ptr<CpuAdam>> create(const CpuAdamOptions& options);
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  Isa isa() const;
  // Switches kernels (the override for tests and benchmarks). Errors:
  // kUnimplemented when this CPU does not support `isa`.
  core::Status set_isa(Isa isa);
  int threads() const { return threads_; }
  std::int64_t tile_elems() const { return tile_elems_; }
  // Where the threads run, as chosen at create().
  const CoreBinding& binding() const;

  // The Adam/AdamW step. Errors (nothing is written): kInvalidArgument for
  // zero length, sizes that differ, a copy type other than bf16/fp16,
  // misaligned or overlapping buffers, or bad constants.
  core::Status step(const AdamStepArgs& args);
  // Adam/AdamW with bf16 moments (AdamStepBf16MomentsArgs): the same threads,
  // tiles and errors as step(), plus kInvalidArgument for a negative
  // index_base, an index_base + n past INT64_MAX, or an unknown rounding.
  core::Status step_bf16_moments(const AdamStepBf16MomentsArgs& args);
  // Adam/AdamW with 8-bit blockwise moments (AdamStepInt8Args): the same
  // threads, tiles (multiples of 65536, so of whole blocks) and errors as
  // step(), plus kInvalidArgument when a scale array does not hold
  // ceil(n / 256) values.
  core::Status step_int8_blockwise(const AdamStepInt8Args& args);
  // The Lion and Adagrad steps: the same threads, tiles and errors, their own
  // constants and one state array each.
  core::Status lion_step(const LionStepArgs& args);
  core::Status adagrad_step(const AdagradStepArgs& args);

  // Errors (nothing is written): kInvalidArgument for zero length, sizes or
  // types that do not combine, overlapping buffers (other than src == dst),
  // or too few norm partials.
  core::Result<GradPassResult> grad_pass(const GradPassArgs& args);

  // Runs fn(begin, length) over [0, n) in this object's tiles on this
  // object's threads, the way step() does (benchmarks run their yardsticks
  // through it so both see the same threads). fn must not throw.
  void for_each_tile(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn);

  struct Impl;

 private:
  CpuAdam(int threads, std::int64_t tile_elems, std::unique_ptr<Impl> impl);
  int threads_;
  std::int64_t tile_elems_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::adam
