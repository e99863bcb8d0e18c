// Kernel table shared by the ISA-specific translation units (private to cpu_adam/).
// Kernels do no validation and no threading: CpuAdam does both.
#pragma once

#include <cstdint>

#include "cpu_adam/cpu_adam.h"
#include "core/numerics.h"

namespace strata::adam::kernels {

struct AdamKernelArgs {
  const core::numerics::AdamStepConstants* constants;
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  ElemType grad_type;
  void* copy_out;         // nullptr: none
  ElemType copy_type;     // kBf16 or kF16 when copy_out is set
  std::int64_t n;
};

// Adam with bf16 moments over n elements whose global indices are
// index_base .. index_base + n - 1.
struct AdamBf16MomentsKernelArgs {
  const core::numerics::AdamStepConstants* constants;
  float* master;
  std::uint16_t* exp_avg;     // bf16 bit patterns
  std::uint16_t* exp_avg_sq;  // bf16 bit patterns
  const void* grad;
  ElemType grad_type;
  void* copy_out;         // nullptr: none
  ElemType copy_type;     // kBf16 or kF16 when copy_out is set
  core::numerics::Bf16Rounding rounding;
  std::uint64_t seed;     // kStochastic: the scalar kernel derives the key from seed and step
  std::int64_t step;
  std::uint64_t key;      // kStochastic: numerics::stochastic_rounding_key(seed, step), for the
                          // vector kernels (which call no numerics.h function)
  std::int64_t index_base;
  std::int64_t n;
};

struct LionKernelArgs {
  const core::numerics::LionStepConstants* constants;
  float* master;
  float* exp_avg;
  const void* grad;
  ElemType grad_type;
  void* copy_out;         // nullptr: none
  ElemType copy_type;     // kBf16 or kF16 when copy_out is set
  std::int64_t n;
};

struct AdagradKernelArgs {
  const core::numerics::AdagradStepConstants* constants;
  float* master;
  float* exp_avg_sq;      // the sum of squared gradients
  const void* grad;
  ElemType grad_type;
  void* copy_out;         // nullptr: none
  ElemType copy_type;     // kBf16 or kF16 when copy_out is set
  std::int64_t n;
};

// Gradient pass over n elements starting on a norm-block boundary; writes
// norm_block_count(n) partials.
struct GradKernelArgs {
  const void* src;
  ElemType src_type;
  void* dst;
  ElemType dst_type;
  bool accumulate;
  double* norm_partials;
  std::int64_t n;
};

struct KernelTable {
  Isa isa;
  void (*adam)(const AdamKernelArgs& args);
  void (*grad_pass)(const GradKernelArgs& args);
  void (*lion)(const LionKernelArgs& args);
  void (*adagrad)(const AdagradKernelArgs& args);
  void (*adam_bf16_moments)(const AdamBf16MomentsKernelArgs& args);
};

const KernelTable& scalar_kernels();

// Scalar continuation of a norm block for the vector kernels' tails: processes
// args.n elements like grad_pass (store into dst, accumulate when asked),
// adding each stored value's square into lanes[local index % 32], where the
// first element has local index `first_lane` (a multiple of 32). Does not fold.
void grad_tail_scalar(const GradKernelArgs& args, double* lanes, std::int64_t first_lane);
// numerics::fold_norm_lanes, from the scalar translation unit.
double fold_lanes_scalar(double* lanes);

// Vector kernel files must not call numerics.h's inline functions: the linker
// may keep one out-of-line copy for the whole program, and a copy compiled
// with AVX-512 flags would then run on the scalar path. Their tails call the
// scalar table instead.

// Lion and Adagrad live in their own translation units (lion_adagrad_avx2.cpp,
// lion_adagrad_avx512.cpp), so that adding them does not change how the
// compiler inlines the Adam loops; avx2_kernels() and the avx512 tables list them.
// Same preconditions as the tables they belong to.
void lion_avx2(const LionKernelArgs& args);
void adagrad_avx2(const AdagradKernelArgs& args);
void lion_avx512(const LionKernelArgs& args);
void adagrad_avx512(const AdagradKernelArgs& args);
void lion_avx512_bf16(const LionKernelArgs& args);
void adagrad_avx512_bf16(const AdagradKernelArgs& args);

// Adam with bf16 moments, likewise in files of their own
// (adam_bf16_moments_avx2.cpp, adam_bf16_moments_avx512.cpp).
void adam_bf16_moments_avx2(const AdamBf16MomentsKernelArgs& args);
void adam_bf16_moments_avx512(const AdamBf16MomentsKernelArgs& args);
void adam_bf16_moments_avx512_bf16(const AdamBf16MomentsKernelArgs& args);

const KernelTable& avx2_kernels();    // only call when isa_supported(kAvx2)
const KernelTable& avx512_kernels();  // only call when isa_supported(kAvx512)
const KernelTable& avx512_bf16_kernels();  // only call when isa_supported(kAvx512Bf16)

}  // namespace strata::adam::kernels
