// Streaming yardsticks for cpu_adam_bench: kernels that read and write exactly
// the arrays of the fused Adam step (same element sizes) with trivial
// arithmetic, in two store flavours, plus STREAM triad and a naive Adam loop.
#pragma once

#include <cstdint>

namespace strata::bench {

struct PatternArrays {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;       // fp32 or bf16
  bool grad_bf16;
  std::uint16_t* copy_out;  // nullptr: the pattern has no copy-out
  std::int64_t n;
};

// How the streaming yardstick stores.
enum class StoreKind {
  kOrdinary,     // every array with ordinary stores
  kNontemporal,  // every array with streaming (non-temporal) stores
  kMixed,        // in-place arrays ordinary (their lines are cached by the read),
                 // the write-only copy-out streaming (no read for ownership)
};

// How the streaming yardstick's loop is shaped. No one shape is the fastest
// on every CPU (docs/benchmarks.md, cpu_adam): the yardstick runs them all.
enum class LoopShape {
  kZmm,          // 512-bit vectors, two per iteration (the fused step's shape)
  kZmmPrefetch,  // the same, with software prefetches 1 KiB ahead on every read stream
  kYmm,          // 256-bit vectors, two per iteration
};

// Reads grad, master, exp_avg, exp_avg_sq; writes master, exp_avg, exp_avg_sq
// (and copy_out). AVX-512 (and AVX-512VL for kYmm).
void stream_pattern_avx512(const PatternArrays& a, StoreKind stores, LoopShape shape = LoopShape::kZmm);

// The access pattern of the steps with compact moments: Adam with bf16
// moments (2 bytes each) or with 8-bit blockwise moments (1 byte each, plus
// one fp32 scale per 256 elements and moment, read and written).
struct CompactPatternArrays {
  float* master;
  void* exp_avg;              // bf16 bit patterns or 8-bit codes
  void* exp_avg_sq;
  int moment_bytes;           // 2 or 1
  float* exp_avg_scale;       // 8-bit moments: one per 256 elements; else nullptr
  float* exp_avg_sq_scale;
  const void* grad;           // fp32 or bf16
  bool grad_bf16;
  std::uint16_t* copy_out;    // nullptr: the pattern has no copy-out
  std::int64_t n;             // a multiple of 256 except in the last tile
};

// Reads grad, master, the moments (and scales); writes master, the moments
// (and scales) and copy_out, with the same store kinds and loop shapes as
// stream_pattern_avx512. AVX-512 (and AVX-512VL for kYmm).
void stream_compact_pattern_avx512(const CompactPatternArrays& a, StoreKind stores,
                                   LoopShape shape = LoopShape::kZmm);

// a[i] = b[i] + s * c[i] (STREAM triad, fp32). AVX-512.
void stream_triad_avx512(float* a, const float* b, const float* c, float s, std::int64_t n);

// A textbook AdamW loop as a user would write it: no intrinsics, no fused
// conversions, compiled without vector flags (and without vectorisation).
void naive_adamw(float* p, float* m, float* v, const float* g, std::int64_t n, float lr, float beta1,
                 float beta2, float eps, float weight_decay, int step);

}  // namespace strata::bench
