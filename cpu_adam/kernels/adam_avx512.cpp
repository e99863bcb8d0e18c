// AVX-512 kernels (F, BW, VL, DQ, plus F16C/FMA): 16 floats per vector. The
// same operations in the same order as numerics.h, so results match the scalar
// kernel bit for bit. Tails shorter than a vector go to the scalar kernels.
// Compiled with its own flags (cpu_adam/meson.build); avx512_kernels() is
// called only after isa_supported(Isa::kAvx512), avx512_bf16_kernels(), the
// same loops with the hardware bf16 conversion, only after
// isa_supported(Isa::kAvx512Bf16). The file is compiled with -mavx512bf16, but
// only to_bf16<true> uses those instructions (GCC emits them for no other code).
#include <immintrin.h>

#include <bit>
#include <cstdint>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx512.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 16;
// Constants only: the vector files call no numerics.h function (kernels.h).
constexpr std::int64_t kBlockElems = core::numerics::kNormBlockElems;
constexpr int kLanes = core::numerics::kNormLanes;

using avx512::AdamVectors;
using avx512::adam_update;
using avx512::load16;
using avx512::store16;
using avx512::stream_copy;

// --- Adam --------------------------------------------------------------------

// The compile-time shape of one Adam loop. kCopy == kF32 means "no copy-out".
template <ElemType kGrad, ElemType kCopy, bool kStreamCopy, bool kNativeBf16, bool kL2, bool kDecay>
struct AdamShape {};

// 16 elements of numerics::adam_step, operation for operation.
template <ElemType kGrad, bool kL2, bool kDecay>
inline __m512 adam16(const AdamVectors& k, float* __restrict master, float* __restrict exp_avg,
                     float* __restrict exp_avg_sq, const void* __restrict grad, std::int64_t i) {
  __m512 p = _mm512_loadu_ps(master + i);
  __m512 m = _mm512_loadu_ps(exp_avg + i);
  __m512 v = _mm512_loadu_ps(exp_avg_sq + i);
  adam_update(k, load16<kGrad>(grad, i), p, m, v, kL2, kDecay);
  _mm512_storeu_ps(master + i, p);
  _mm512_storeu_ps(exp_avg + i, m);
  _mm512_storeu_ps(exp_avg_sq + i, v);
  return p;
}

template <ElemType kCopy, bool kStreamCopy, bool kNativeBf16>
inline void copy16(void* __restrict copy_out, std::int64_t i, __m512 p) {
  if constexpr (kCopy != ElemType::kF32) {
    if constexpr (kStreamCopy) {
      stream_copy<kCopy, kNativeBf16>(copy_out, i, p);
    } else {
      store16<kCopy, kNativeBf16>(copy_out, i, p);
    }
  }
}

// Two vectors per iteration: independent chains the core can overlap. The
// pointers are copied out of the argument struct so the compiler knows the
// stores cannot change them.
template <ElemType kGrad, ElemType kCopy, bool kStreamCopy, bool kNativeBf16, bool kL2, bool kDecay>
void adam_loop(const AdamKernelArgs& a, std::int64_t n_vec,
               AdamShape<kGrad, kCopy, kStreamCopy, kNativeBf16, kL2, kDecay>) {
  const AdamVectors k(*a.constants);
  float* __restrict master = a.master;
  float* __restrict exp_avg = a.exp_avg;
  float* __restrict exp_avg_sq = a.exp_avg_sq;
  const void* __restrict grad = a.grad;
  void* __restrict copy_out = a.copy_out;
  const std::int64_t n_pair = n_vec - n_vec % (2 * kWidth);
  std::int64_t i = 0;
  for (; i < n_pair; i += 2 * kWidth) {
    const __m512 p0 = adam16<kGrad, kL2, kDecay>(k, master, exp_avg, exp_avg_sq, grad, i);
    const __m512 p1 = adam16<kGrad, kL2, kDecay>(k, master, exp_avg, exp_avg_sq, grad, i + kWidth);
    copy16<kCopy, kStreamCopy, kNativeBf16>(copy_out, i, p0);
    copy16<kCopy, kStreamCopy, kNativeBf16>(copy_out, i + kWidth, p1);
  }
  for (; i < n_vec; i += kWidth) {
    copy16<kCopy, kStreamCopy, kNativeBf16>(copy_out, i, adam16<kGrad, kL2, kDecay>(k, master, exp_avg, exp_avg_sq, grad, i));
  }
}

// Peels the run-time choices into template arguments, one at a time.
template <ElemType kGrad, ElemType kCopy, bool kStreamCopy, bool kNativeBf16>
void adam_dispatch_decay(const AdamKernelArgs& a, std::int64_t n_vec) {
  const bool l2 = a.constants->l2_decay != 0.0f, decay = a.constants->neg_lr_decay != 0.0f;
  if (l2 && decay) return adam_loop(a, n_vec, AdamShape<kGrad, kCopy, kStreamCopy, kNativeBf16, true, true>{});
  if (l2) return adam_loop(a, n_vec, AdamShape<kGrad, kCopy, kStreamCopy, kNativeBf16, true, false>{});
  if (decay) return adam_loop(a, n_vec, AdamShape<kGrad, kCopy, kStreamCopy, kNativeBf16, false, true>{});
  return adam_loop(a, n_vec, AdamShape<kGrad, kCopy, kStreamCopy, kNativeBf16, false, false>{});
}

template <ElemType kGrad, bool kNativeBf16>
void adam_dispatch_copy(const AdamKernelArgs& a, std::int64_t n_vec) {
  if (a.copy_out == nullptr) return adam_dispatch_decay<kGrad, ElemType::kF32, false, false>(a, n_vec);
  const bool stream = reinterpret_cast<std::uintptr_t>(a.copy_out) % 32 == 0;
  if (a.copy_type == ElemType::kBf16) {
    stream ? adam_dispatch_decay<kGrad, ElemType::kBf16, true, kNativeBf16>(a, n_vec)
           : adam_dispatch_decay<kGrad, ElemType::kBf16, false, kNativeBf16>(a, n_vec);
  } else {
    stream ? adam_dispatch_decay<kGrad, ElemType::kF16, true, false>(a, n_vec)
           : adam_dispatch_decay<kGrad, ElemType::kF16, false, false>(a, n_vec);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads or hands off the copy
}

template <bool kNativeBf16>
void adam_avx512(const AdamKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: adam_dispatch_copy<ElemType::kF32, kNativeBf16>(a, n_vec); break;
    case ElemType::kBf16: adam_dispatch_copy<ElemType::kBf16, kNativeBf16>(a, n_vec); break;
    case ElemType::kF16: adam_dispatch_copy<ElemType::kF16, kNativeBf16>(a, n_vec); break;
  }
  if (n_vec == a.n) return;
  AdamKernelArgs tail = a;
  const int grad_bytes = elem_size_bytes(a.grad_type);
  tail.master += n_vec;
  tail.exp_avg += n_vec;
  tail.exp_avg_sq += n_vec;
  tail.grad = static_cast<const std::byte*>(a.grad) + n_vec * grad_bytes;
  if (a.copy_out != nullptr) {
    tail.copy_out = static_cast<std::byte*>(a.copy_out) + n_vec * elem_size_bytes(a.copy_type);
  }
  tail.n = a.n - n_vec;
  scalar_kernels().adam(tail);
}

// --- gradient pass -------------------------------------------------------------

// Adds the exact double squares of x's 16 elements to two 8-lane accumulators.
inline void add_squares(__m512 x, __m512d& lo, __m512d& hi) {
  const __m512d dlo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d dhi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
  lo = _mm512_add_pd(lo, _mm512_mul_pd(dlo, dlo));
  hi = _mm512_add_pd(hi, _mm512_mul_pd(dhi, dhi));
}

// One half (16 elements) of a 32-element step: produce dst and return its fp32 values.
template <ElemType kSrc, ElemType kDst, bool kAccumulate>
inline __m512 grad16(const GradKernelArgs& a, std::int64_t i) {
  if constexpr (kSrc == kDst && !kAccumulate) {
    if constexpr (kDst == ElemType::kF32) {
      const __m512 x = _mm512_loadu_ps(static_cast<const float*>(a.src) + i);
      _mm512_storeu_ps(static_cast<float*>(a.dst) + i, x);
      return x;
    } else {
      // Raw 16-bit copy, then widen the copied pattern for the norm.
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(a.src) + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(a.dst) + i), h);
      return load16<kDst>(a.dst, i);
    }
  } else {
    static_assert(kDst == ElemType::kF32, "conversion and accumulation produce fp32");
    __m512 x = load16<kSrc>(a.src, i);
    if constexpr (kAccumulate) x = _mm512_add_ps(_mm512_loadu_ps(static_cast<float*>(a.dst) + i), x);
    _mm512_storeu_ps(static_cast<float*>(a.dst) + i, x);
    return x;
  }
}

template <ElemType kSrc, ElemType kDst, bool kAccumulate>
void grad_loop(const GradKernelArgs& a) {
  for (std::int64_t begin = 0, b = 0; begin < a.n; begin += kBlockElems, ++b) {
    const std::int64_t end = begin + kBlockElems < a.n ? begin + kBlockElems : a.n;
    const std::int64_t end_vec = begin + ((end - begin) / kLanes) * kLanes;
    // Lanes 0-7, 8-15, 16-23, 24-31 of the contract.
    __m512d l0 = _mm512_setzero_pd(), l1 = _mm512_setzero_pd();
    __m512d l2 = _mm512_setzero_pd(), l3 = _mm512_setzero_pd();
    for (std::int64_t i = begin; i < end_vec; i += kLanes) {
      add_squares(grad16<kSrc, kDst, kAccumulate>(a, i), l0, l1);
      add_squares(grad16<kSrc, kDst, kAccumulate>(a, i + kWidth), l2, l3);
    }
    alignas(64) double lanes[kLanes];
    _mm512_store_pd(lanes, l0);
    _mm512_store_pd(lanes + 8, l1);
    _mm512_store_pd(lanes + 16, l2);
    _mm512_store_pd(lanes + 24, l3);
    if (end_vec < end) {
      GradKernelArgs tail = a;
      tail.src = static_cast<const std::byte*>(a.src) + end_vec * elem_size_bytes(a.src_type);
      tail.dst = static_cast<std::byte*>(a.dst) + end_vec * elem_size_bytes(a.dst_type);
      tail.n = end - end_vec;
      grad_tail_scalar(tail, lanes, 0);
    }
    a.norm_partials[b] = fold_lanes_scalar(lanes);
  }
}

void grad_pass_avx512(const GradKernelArgs& a) {
  if (a.src_type == a.dst_type && !a.accumulate) {
    switch (a.dst_type) {
      case ElemType::kF32: return grad_loop<ElemType::kF32, ElemType::kF32, false>(a);
      case ElemType::kBf16: return grad_loop<ElemType::kBf16, ElemType::kBf16, false>(a);
      case ElemType::kF16: return grad_loop<ElemType::kF16, ElemType::kF16, false>(a);
    }
  }
  // dst is fp32 (CpuAdam validated the combination).
  switch (a.src_type) {
    case ElemType::kF32:
      return a.accumulate ? grad_loop<ElemType::kF32, ElemType::kF32, true>(a)
                          : grad_loop<ElemType::kF32, ElemType::kF32, false>(a);
    case ElemType::kBf16:
      return a.accumulate ? grad_loop<ElemType::kBf16, ElemType::kF32, true>(a)
                          : grad_loop<ElemType::kBf16, ElemType::kF32, false>(a);
    case ElemType::kF16:
      return a.accumulate ? grad_loop<ElemType::kF16, ElemType::kF32, true>(a)
                          : grad_loop<ElemType::kF16, ElemType::kF32, false>(a);
  }
}

}  // namespace

const KernelTable& avx512_kernels() {
  static constexpr KernelTable kTable{Isa::kAvx512, adam_avx512<false>, grad_pass_avx512, lion_avx512,
                                      adagrad_avx512, adam_bf16_moments_avx512, adam_int8_avx512};
  return kTable;
}

const KernelTable& avx512_bf16_kernels() {
  static constexpr KernelTable kTable{Isa::kAvx512Bf16, adam_avx512<true>, grad_pass_avx512, lion_avx512_bf16,
                                      adagrad_avx512_bf16, adam_bf16_moments_avx512_bf16,
                                      adam_int8_avx512_bf16};
  return kTable;
}

}  // namespace strata::adam::kernels
