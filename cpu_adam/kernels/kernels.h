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

// Adam with 8-bit blockwise moments over n elements that start on a block
// boundary (numerics::kQuantBlockElems): exp_avg_scale and exp_avg_sq_scale
// hold one scale per block, ceil(n / kQuantBlockElems) of them; the last
// block may be short.
struct AdamInt8KernelArgs {
  const core::numerics::AdamStepConstants* constants;
  float* master;
  std::uint8_t* exp_avg;       // codes (numerics.h)
  std::uint8_t* exp_avg_sq;    // codes
  float* exp_avg_scale;        // one per block
  float* exp_avg_sq_scale;     // one per block
  const void* grad;
  ElemType grad_type;
  void* copy_out;         // nullptr: none
  ElemType copy_type;     // kBf16 or kF16 when copy_out is set
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
  void (*adam_int8)(const AdamInt8KernelArgs& args);
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

// Adam with 8-bit blockwise moments, in files of their own too
// (adam_int8_avx2.cpp, adam_int8_avx512.cpp). Whole blocks are vectorised; a
// short last block goes to the scalar kernel.
void adam_int8_avx2(const AdamInt8KernelArgs& args);
void adam_int8_avx512(const AdamInt8KernelArgs& args);
void adam_int8_avx512_bf16(const AdamInt8KernelArgs& args);
// The AVX-512 kernels above dequantize with AVX512_VBMI's byte lookups where
// avx512_vbmi_supported(), else with vpermt2ps lookups of the float tables;
// these two take the second way on any AVX-512 CPU (the tests run both).
void adam_int8_avx512_no_vbmi(const AdamInt8KernelArgs& args);
void adam_int8_avx512_bf16_no_vbmi(const AdamInt8KernelArgs& args);
// True when this CPU (and OS) has AVX512_VBMI (cpu_adam.cpp, beside isa_supported).
bool avx512_vbmi_supported();

// The 8-bit moments' code tables as the vector kernels read them:
// numerics::kQuantTables' values, and its thresholds regrouped by probe of
// the binary search (quant_search). Probe j (from 0) of a search over
// 2^steps thresholds reads thresholds[s * (2i + 1) - 1], s = 2^(steps - 1 - j),
// where i < 2^j is the count's top j bits found so far. Row j of the levels
// holds those 2^j thresholds in order of i, so each probe is one table lookup
// at i, followed by i = 2i + (threshold < xn); after the last probe i is the
// count. Built from numerics::kQuantTables in the scalar translation unit
// (the vector files call no numerics.h function); rows are 64-byte aligned.
//
// The vector quantizers do not search: they guess the count from lines
// (QuantLines), and search only where a guess could be wrong. The values of
// one decade of the dynamic tree are equally spaced, so the count is a
// piecewise-linear function of xn: with r(x) the line through the decade's
// values (r(values[i]) = i; each threshold, the midpoint of two neighbouring
// values, lies on it at i + 1/2), the count is floor(r(xn) + 1/2). Below
// values[1] the line is r = x / values[1] (from values[0] = 0), steeper than
// every decade's, and each decade's is steeper than the one above it: r is
// concave, the minimum of its lines. QuantLines cuts
// [0, 1] into 16 bins by exponent pairs, bin e = [2^(2e - 31), 2^(2e - 29))
// (bin 0 takes everything below), so a bin meets at most two decades and its
// two lines (the same line twice where it meets one) give
//
//   xc = max(xn, 2^-31), e = (bits(xc) >> 24) mod 16    (a vpermps index)
//   y  = min(fma(xc, a0[e], c0[e]), fma(xc, a1[e], c1[e]))  ~ r(xn) + 1/2 + kQuantGuessDelta
//
// (below 2^-31 the count is 0 and so is the guess). The guess is trunc(y). In float, y is off by less than 2^-15 (the
// constants' and the fma's rounding, and the thresholds' own rounding to
// float), so the guess is the count wherever the fraction of y is at least
// 2 kQuantGuessDelta = 2^-11; below that xn is within 2^-12 of a step of a
// threshold and the kernel takes quant_search's probes instead (about one
// lane in 2000). quant_guess is the same arithmetic on one float, for the
// tests, which check it against quant_search over every bin edge, every
// threshold's neighbours and a dense sample (and every float in [0, 1] in
// the slow suite).
inline constexpr float kQuantGuessDelta = 1.0f / 4096.0f;
struct QuantLines {
  alignas(64) float a0[16];
  alignas(64) float c0[16];
  alignas(64) float a1[16];
  alignas(64) float c1[16];
  std::uint32_t lo;  // bits(2^-31): smaller xn count as 2^-31 when picking the bin
};

// Every line of a table at once (the AVX2 kernel, where a 16-entry lookup
// costs two vpermps and a blend): r is concave, so it is the minimum of all
// its lines, with no bins: y = min over i < count of fma(xn, a[i], c[i]),
// the lines being QuantLines' (the origin line and each decade's but the
// last, whose one value the origin line reaches).
struct QuantAllLines {
  float a[8];
  float c[8];
  int count;  // 7 for m, 8 for v
};

struct QuantKernelTables {
  alignas(64) float m_values[128];   // kQuantTables.m_values
  alignas(64) float v_values[256];   // kQuantTables.v_values
  alignas(64) float m_levels[7][128];  // row j: 2^j thresholds of m, the rest zero
  alignas(64) float v_levels[8][128];  // row j: 2^j thresholds of v, the rest zero
  QuantLines m_lines;
  QuantLines v_lines;
  QuantAllLines m_all_lines;
  QuantAllLines v_all_lines;
  // The values' bit patterns cut into bytes, plane p holding byte p (from the
  // least significant) of every value: AVX512_VBMI's vpermi2b looks up 64
  // codes in 128 bytes at once, so four lookups give the four bytes of 64
  // values (v: eight, the halves picked by the code's top bit).
  alignas(64) std::uint8_t m_value_bytes[4][128];
  alignas(64) std::uint8_t v_value_bytes[4][256];
};
const QuantKernelTables& quant_kernel_tables();

// The lines' guess for one xn in [0, 1] (the vector quantizers' arithmetic,
// lane by lane): `code` is trunc(y), and `exact` is false where the
// fraction of y is below 2 kQuantGuessDelta, where only quant_search knows.
struct QuantGuess {
  std::uint32_t code;
  bool exact;
};
QuantGuess quant_guess(const QuantLines& lines, float xn);
// The same from every line (QuantAllLines), the AVX2 kernel's arithmetic.
QuantGuess quant_guess(const QuantAllLines& lines, float xn);

const KernelTable& avx2_kernels();    // only call when isa_supported(kAvx2)
const KernelTable& avx512_kernels();  // only call when isa_supported(kAvx512)
const KernelTable& avx512_bf16_kernels();  // only call when isa_supported(kAvx512Bf16)

}  // namespace strata::adam::kernels
