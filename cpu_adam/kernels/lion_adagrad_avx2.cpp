// AVX2 Lion and Adagrad kernels (with FMA and F16C): 8 floats per vector,
// numerics::lion_step and numerics::adagrad_step operation for operation, so
// results match the scalar kernels bit for bit. Tails shorter than a vector go
// to the scalar kernels. Compiled in the AVX2 library (cpu_adam/meson.build);
// called only after isa_supported(Isa::kAvx2).
//
// A file of its own, apart from adam_avx2.cpp, so that these loops do not
// change how the compiler inlines Adam's; the loads and conversions are both
// files' (vec_avx2.h).
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx2.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 8;

using avx2::load8;
using avx2::store8;
using avx2::stream_copy;

// Writes 8 elements of the compute copy (kCopy == kF32: no copy). Aligned
// destinations take non-temporal stores (the copy is not read again here);
// the bits are the same either way. F16C's conversion rounds to nearest even
// and keeps subnormals (FTZ is off), as numerics::fp32_to_fp16_bits does.
template <ElemType kCopy, bool kStream>
inline void copy8(void* __restrict copy_out, std::int64_t i, __m256 p) {
  if constexpr (kCopy != ElemType::kF32) {
    if constexpr (kStream) {
      stream_copy<kCopy>(copy_out, i, p);
    } else {
      store8<kCopy>(copy_out, i, p);
    }
  }
}

// --- one loop for both optimizers ----------------------------------------------------
//
// An update object (Lion8, Adagrad8) holds the pointers and the constants,
// updates 8 elements of the master and its state at i, and returns the new
// master for the compute copy. It is taken by value and its call forced
// inline, so the constants stay in registers and no store can make the
// compiler reload a pointer. The optional decay line is a template flag:
// numerics.h runs it only when its constant is non-zero, and so must every
// kernel (with a zero constant it would still change the sign of some zeros).

template <class Update, ElemType kCopy, bool kStream>
void update_loop(const Update update, void* __restrict copy_out, std::int64_t n_vec) {
  for (std::int64_t i = 0; i < n_vec; i += kWidth) copy8<kCopy, kStream>(copy_out, i, update(i));
}

template <class Update>
void update_dispatch_copy(const Update& update, void* copy_out, ElemType copy_type, std::int64_t n_vec) {
  if (copy_out == nullptr) return update_loop<Update, ElemType::kF32, false>(update, nullptr, n_vec);
  const bool stream = reinterpret_cast<std::uintptr_t>(copy_out) % 16 == 0;
  if (copy_type == ElemType::kBf16) {
    stream ? update_loop<Update, ElemType::kBf16, true>(update, copy_out, n_vec)
           : update_loop<Update, ElemType::kBf16, false>(update, copy_out, n_vec);
  } else {
    stream ? update_loop<Update, ElemType::kF16, true>(update, copy_out, n_vec)
           : update_loop<Update, ElemType::kF16, false>(update, copy_out, n_vec);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads or hands off the copy
}

// The arguments of the elements after the last whole vector, for the scalar
// kernel; the caller advances its state array.
template <class Args>
Args tail_args(const Args& a, std::int64_t n_vec) {
  Args tail = a;
  tail.master += n_vec;
  tail.grad = static_cast<const std::byte*>(a.grad) + n_vec * elem_size_bytes(a.grad_type);
  if (a.copy_out != nullptr) {
    tail.copy_out = static_cast<std::byte*>(a.copy_out) + n_vec * elem_size_bytes(a.copy_type);
  }
  tail.n = a.n - n_vec;
  return tail;
}

// --- Lion ------------------------------------------------------------------------------

// numerics::sign_f32, 8 wide: +-1 from the sign bit, +0 where c is a zero, c
// itself where it is a NaN.
inline __m256 sign8(__m256 c) {
  const __m256 unit = _mm256_or_ps(_mm256_and_ps(c, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
  const __m256 zero = _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 nan = _mm256_cmp_ps(c, c, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_andnot_ps(zero, unit), c, nan);
}

template <ElemType kGrad, bool kDecay>
class Lion8 {
 public:
  explicit Lion8(const LionKernelArgs& a)
      : master_(a.master),
        exp_avg_(a.exp_avg),
        grad_(a.grad),
        grad_scale_(_mm256_set1_ps(a.constants->grad_scale)),
        beta1_(_mm256_set1_ps(a.constants->beta1)),
        beta2_(_mm256_set1_ps(a.constants->beta2)),
        one_minus_beta1_(_mm256_set1_ps(a.constants->one_minus_beta1)),
        one_minus_beta2_(_mm256_set1_ps(a.constants->one_minus_beta2)),
        neg_lr_(_mm256_set1_ps(a.constants->neg_lr)),
        neg_lr_decay_(_mm256_set1_ps(a.constants->neg_lr_decay)) {}

  // 8 elements of numerics::lion_step.
  [[gnu::always_inline]] inline __m256 operator()(std::int64_t i) const {
    __m256 p = _mm256_loadu_ps(master_ + i);
    __m256 m = _mm256_loadu_ps(exp_avg_ + i);
    const __m256 g = _mm256_mul_ps(load8<kGrad>(grad_, i), grad_scale_);
    const __m256 s = sign8(_mm256_fmadd_ps(beta1_, m, _mm256_mul_ps(one_minus_beta1_, g)));
    if constexpr (kDecay) p = _mm256_fmadd_ps(neg_lr_decay_, p, p);
    p = _mm256_fmadd_ps(neg_lr_, s, p);
    m = _mm256_fmadd_ps(beta2_, m, _mm256_mul_ps(one_minus_beta2_, g));
    _mm256_storeu_ps(master_ + i, p);
    _mm256_storeu_ps(exp_avg_ + i, m);
    return p;
  }

 private:
  float* __restrict master_;
  float* __restrict exp_avg_;
  const void* __restrict grad_;
  __m256 grad_scale_, beta1_, beta2_, one_minus_beta1_, one_minus_beta2_, neg_lr_, neg_lr_decay_;
};

template <ElemType kGrad>
void lion_dispatch(const LionKernelArgs& a, std::int64_t n_vec) {
  if (a.constants->neg_lr_decay != 0.0f) {
    update_dispatch_copy(Lion8<kGrad, true>(a), a.copy_out, a.copy_type, n_vec);
  } else {
    update_dispatch_copy(Lion8<kGrad, false>(a), a.copy_out, a.copy_type, n_vec);
  }
}

// --- Adagrad ---------------------------------------------------------------------------

template <ElemType kGrad, bool kDecay>
class Adagrad8 {
 public:
  explicit Adagrad8(const AdagradKernelArgs& a)
      : master_(a.master),
        exp_avg_sq_(a.exp_avg_sq),
        grad_(a.grad),
        grad_scale_(_mm256_set1_ps(a.constants->grad_scale)),
        eps_(_mm256_set1_ps(a.constants->eps)),
        neg_lr_(_mm256_set1_ps(a.constants->neg_lr)),
        l2_decay_(_mm256_set1_ps(a.constants->l2_decay)) {}

  // 8 elements of numerics::adagrad_step.
  [[gnu::always_inline]] inline __m256 operator()(std::int64_t i) const {
    __m256 p = _mm256_loadu_ps(master_ + i);
    __m256 v = _mm256_loadu_ps(exp_avg_sq_ + i);
    __m256 g = _mm256_mul_ps(load8<kGrad>(grad_, i), grad_scale_);
    if constexpr (kDecay) g = _mm256_fmadd_ps(p, l2_decay_, g);
    v = _mm256_fmadd_ps(g, g, v);
    const __m256 d = _mm256_add_ps(_mm256_sqrt_ps(v), eps_);
    p = _mm256_fmadd_ps(neg_lr_, _mm256_div_ps(g, d), p);
    _mm256_storeu_ps(master_ + i, p);
    _mm256_storeu_ps(exp_avg_sq_ + i, v);
    return p;
  }

 private:
  float* __restrict master_;
  float* __restrict exp_avg_sq_;
  const void* __restrict grad_;
  __m256 grad_scale_, eps_, neg_lr_, l2_decay_;
};

template <ElemType kGrad>
void adagrad_dispatch(const AdagradKernelArgs& a, std::int64_t n_vec) {
  if (a.constants->l2_decay != 0.0f) {
    update_dispatch_copy(Adagrad8<kGrad, true>(a), a.copy_out, a.copy_type, n_vec);
  } else {
    update_dispatch_copy(Adagrad8<kGrad, false>(a), a.copy_out, a.copy_type, n_vec);
  }
}

}  // namespace

void lion_avx2(const LionKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: lion_dispatch<ElemType::kF32>(a, n_vec); break;
    case ElemType::kBf16: lion_dispatch<ElemType::kBf16>(a, n_vec); break;
    case ElemType::kF16: lion_dispatch<ElemType::kF16>(a, n_vec); break;
  }
  if (n_vec == a.n) return;
  LionKernelArgs tail = tail_args(a, n_vec);
  tail.exp_avg += n_vec;
  scalar_kernels().lion(tail);
}

void adagrad_avx2(const AdagradKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: adagrad_dispatch<ElemType::kF32>(a, n_vec); break;
    case ElemType::kBf16: adagrad_dispatch<ElemType::kBf16>(a, n_vec); break;
    case ElemType::kF16: adagrad_dispatch<ElemType::kF16>(a, n_vec); break;
  }
  if (n_vec == a.n) return;
  AdagradKernelArgs tail = tail_args(a, n_vec);
  tail.exp_avg_sq += n_vec;
  scalar_kernels().adagrad(tail);
}

}  // namespace strata::adam::kernels
