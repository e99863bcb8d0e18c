// The e2e framework's arithmetic (mlp_harness.h's Framework): the MLP's
// forward and backward and the compute-dtype conversions, on raw pointers
// sized by mlp_harness.h's constants. Compiled apart from the tests
// (mlp_kernels.cpp, a library without test_cpp_args): the sanitizer builds
// compile the test executables at -O0, and this is the code they spend their
// time in. Each output element sums in the same order as ever (fp
// contraction is off), so the bits are the same in every build.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::engine::e2e {

inline constexpr int kIn = 256, kHidden = 512, kOut = 32, kBatch = 32;

// splitmix64: the same stream on every platform.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }  // [-1, 1)
};

// One batch of the teacher-student task: x (kBatch x kIn) drawn from `seed`,
// y (kBatch x kOut) the teacher's answer.
void mlp_batch(std::uint64_t seed, float* x, float* y);
// pre, h: kBatch x kHidden; out: kBatch x kOut; all written.
void mlp_forward(const float* w1, const float* b1, const float* w2, const float* b2, const float* x, float* pre,
                 float* h, float* out);
// The gradients of the loss times `scale` into every g*; dh (kBatch x kHidden)
// is scratch. All of them written.
void mlp_backward(float scale, const float* w2, const float* x, const float* pre, const float* h, const float* out,
                  const float* y, float* dh, float* g1w, float* g1b, float* g2w, float* g2b);

// Compute copies of `bytes` bytes per element (4: fp32; 2: fp16 when `fp16`,
// else bf16) to fp32, and back (round to nearest even).
void copies_to_fp32(const std::byte* src, std::size_t n, int bytes, bool fp16, float* dst);
void fp32_to_copies(const float* src, std::size_t n, int bytes, bool fp16, std::byte* dst);
// n zero bytes at p.
void zero_bytes(std::byte* p, std::size_t n);

}  // namespace strata::engine::e2e
