// AVX2 kernels (with FMA and F16C): 8 floats per vector. The same operations in
// the same order as numerics.h, so results match the scalar kernel bit for bit.
// Tails shorter than a vector go to the scalar kernels. Compiled with its own
// flags (cpu_adam/meson.build); called only after isa_supported(Isa::kAvx2).
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx2.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 8;
// Constants only: the vector files call no numerics.h function (kernels.h).
constexpr std::int64_t kBlockElems = core::numerics::kNormBlockElems;
constexpr int kLanes = core::numerics::kNormLanes;

using avx2::AdamVectors;
using avx2::adam_update;
using avx2::load8;
using avx2::store8;
using avx2::stream_copy;

// --- Adam --------------------------------------------------------------------

// kCopy: kF32 means "no copy-out".
template <ElemType kGrad, ElemType kCopy, bool kStreamCopy>
void adam_loop(const AdamKernelArgs& a, std::int64_t n_vec) {
  const AdamVectors k(*a.constants);
  for (std::int64_t i = 0; i < n_vec; i += kWidth) {
    __m256 p = _mm256_loadu_ps(a.master + i);
    __m256 m = _mm256_loadu_ps(a.exp_avg + i);
    __m256 v = _mm256_loadu_ps(a.exp_avg_sq + i);
    adam_update(k, load8<kGrad>(a.grad, i), p, m, v);
    _mm256_storeu_ps(a.master + i, p);
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    if constexpr (kCopy != ElemType::kF32) {
      if constexpr (kStreamCopy) {
        stream_copy<kCopy>(a.copy_out, i, p);
      } else {
        store8<kCopy>(a.copy_out, i, p);
      }
    }
  }
}

template <ElemType kGrad>
void adam_dispatch_copy(const AdamKernelArgs& a, std::int64_t n_vec) {
  if (a.copy_out == nullptr) return adam_loop<kGrad, ElemType::kF32, false>(a, n_vec);
  const bool stream = reinterpret_cast<std::uintptr_t>(a.copy_out) % 16 == 0;
  if (a.copy_type == ElemType::kBf16) {
    stream ? adam_loop<kGrad, ElemType::kBf16, true>(a, n_vec) : adam_loop<kGrad, ElemType::kBf16, false>(a, n_vec);
  } else {
    stream ? adam_loop<kGrad, ElemType::kF16, true>(a, n_vec) : adam_loop<kGrad, ElemType::kF16, false>(a, n_vec);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads or hands off the copy
}

void adam_avx2(const AdamKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: adam_dispatch_copy<ElemType::kF32>(a, n_vec); break;
    case ElemType::kBf16: adam_dispatch_copy<ElemType::kBf16>(a, n_vec); break;
    case ElemType::kF16: adam_dispatch_copy<ElemType::kF16>(a, n_vec); break;
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

// Adds the exact double squares of x's 8 elements to two 4-lane accumulators.
inline void add_squares(__m256 x, __m256d& lo, __m256d& hi) {
  const __m256d dlo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d dhi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  lo = _mm256_add_pd(lo, _mm256_mul_pd(dlo, dlo));
  hi = _mm256_add_pd(hi, _mm256_mul_pd(dhi, dhi));
}

// 8 elements: produce dst and return its fp32 values.
template <ElemType kSrc, ElemType kDst, bool kAccumulate>
inline __m256 grad8(const GradKernelArgs& a, std::int64_t i) {
  if constexpr (kSrc == kDst && !kAccumulate) {
    if constexpr (kDst == ElemType::kF32) {
      const __m256 x = _mm256_loadu_ps(static_cast<const float*>(a.src) + i);
      _mm256_storeu_ps(static_cast<float*>(a.dst) + i, x);
      return x;
    } else {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(a.src) + i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(a.dst) + i), h);
      return load8<kDst>(a.dst, i);
    }
  } else {
    static_assert(kDst == ElemType::kF32, "conversion and accumulation produce fp32");
    __m256 x = load8<kSrc>(a.src, i);
    if constexpr (kAccumulate) x = _mm256_add_ps(_mm256_loadu_ps(static_cast<float*>(a.dst) + i), x);
    _mm256_storeu_ps(static_cast<float*>(a.dst) + i, x);
    return x;
  }
}

template <ElemType kSrc, ElemType kDst, bool kAccumulate>
void grad_loop(const GradKernelArgs& a) {
  for (std::int64_t begin = 0, b = 0; begin < a.n; begin += kBlockElems, ++b) {
    const std::int64_t end = begin + kBlockElems < a.n ? begin + kBlockElems : a.n;
    const std::int64_t end_vec = begin + ((end - begin) / kLanes) * kLanes;
    // l[j] holds contract lanes 4j .. 4j+3.
    __m256d l[8];
    for (auto& x : l) x = _mm256_setzero_pd();
    for (std::int64_t i = begin; i < end_vec; i += kLanes) {
      add_squares(grad8<kSrc, kDst, kAccumulate>(a, i), l[0], l[1]);
      add_squares(grad8<kSrc, kDst, kAccumulate>(a, i + 8), l[2], l[3]);
      add_squares(grad8<kSrc, kDst, kAccumulate>(a, i + 16), l[4], l[5]);
      add_squares(grad8<kSrc, kDst, kAccumulate>(a, i + 24), l[6], l[7]);
    }
    alignas(32) double lanes[kLanes];
    for (int j = 0; j < 8; ++j) _mm256_store_pd(lanes + 4 * j, l[j]);
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

void grad_pass_avx2(const GradKernelArgs& a) {
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

const KernelTable& avx2_kernels() {
  static constexpr KernelTable kTable{Isa::kAvx2, adam_avx2, grad_pass_avx2, lion_avx2, adagrad_avx2,
                                      adam_bf16_moments_avx2, adam_int8_avx2};
  return kTable;
}

}  // namespace strata::adam::kernels
