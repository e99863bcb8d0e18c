// AVX-512 Lion and Adagrad kernels (F, BW, VL, DQ, plus F16C/FMA): 16 floats
// per vector, numerics::lion_step and numerics::adagrad_step operation for
// operation, so results match the scalar kernels bit for bit. Tails shorter
// than a vector go to the scalar kernels. Compiled in the AVX-512 library
// (cpu_adam/meson.build); the *_bf16 entry points, which write a bf16 compute
// copy with AVX512_BF16's conversion, are called only after
// isa_supported(Isa::kAvx512Bf16), the others only after
// isa_supported(Isa::kAvx512).
//
// A file of its own, apart from adam_avx512.cpp, so that these loops do not
// change how the compiler inlines Adam's; the loads and conversions are both
// files' (vec_avx512.h).
#include <immintrin.h>

#include <bit>
#include <cstdint>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx512.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 16;

using avx512::load16;
using avx512::stream_copy;
using avx512::store16;

// Writes 16 elements of the compute copy (kCopy == kF32: no copy). Aligned
// destinations take non-temporal stores (the copy is not read again here);
// the bits are the same either way. F16C's conversion rounds to nearest even
// and keeps subnormals (FTZ is off), as numerics::fp32_to_fp16_bits does.
template <ElemType kCopy, bool kStream, bool kNativeBf16>
inline void copy16(void* __restrict copy_out, std::int64_t i, __m512 p) {
  if constexpr (kCopy != ElemType::kF32) {
    if constexpr (kStream) {
      stream_copy<kCopy, kNativeBf16>(copy_out, i, p);
    } else {
      store16<kCopy, kNativeBf16>(copy_out, i, p);
    }
  }
}

// --- one loop for both optimizers ----------------------------------------------------
//
// An update object (Lion16, Adagrad16) holds the pointers and the constants,
// updates 16 elements of the master and its state at i, and returns the new
// master for the compute copy. It is taken by value and its call forced
// inline, so the constants stay in registers and no store can make the
// compiler reload a pointer. The optional decay line is a template flag:
// numerics.h runs it only when its constant is non-zero, and so must every
// kernel (with a zero constant it would still change the sign of some zeros).

template <class Update, ElemType kCopy, bool kStream, bool kNativeBf16>
void update_loop(const Update update, void* __restrict copy_out, std::int64_t n_vec) {
  const std::int64_t n_pair = n_vec - n_vec % (2 * kWidth);
  std::int64_t i = 0;
  for (; i < n_pair; i += 2 * kWidth) {  // two independent chains per iteration
    const __m512 p0 = update(i);
    const __m512 p1 = update(i + kWidth);
    copy16<kCopy, kStream, kNativeBf16>(copy_out, i, p0);
    copy16<kCopy, kStream, kNativeBf16>(copy_out, i + kWidth, p1);
  }
  for (; i < n_vec; i += kWidth) copy16<kCopy, kStream, kNativeBf16>(copy_out, i, update(i));
}

template <bool kNativeBf16, class Update>
void update_dispatch_copy(const Update& update, void* copy_out, ElemType copy_type, std::int64_t n_vec) {
  if (copy_out == nullptr) return update_loop<Update, ElemType::kF32, false, false>(update, nullptr, n_vec);
  const bool stream = reinterpret_cast<std::uintptr_t>(copy_out) % 32 == 0;
  if (copy_type == ElemType::kBf16) {
    stream ? update_loop<Update, ElemType::kBf16, true, kNativeBf16>(update, copy_out, n_vec)
           : update_loop<Update, ElemType::kBf16, false, kNativeBf16>(update, copy_out, n_vec);
  } else {
    stream ? update_loop<Update, ElemType::kF16, true, false>(update, copy_out, n_vec)
           : update_loop<Update, ElemType::kF16, false, false>(update, copy_out, n_vec);
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

// numerics::sign_f32, 16 wide: +-1 from the sign bit, +0 where c is a zero, c
// itself where it is a NaN.
inline __m512 sign16(__m512 c) {
  const __m512 unit = _mm512_or_ps(_mm512_and_ps(c, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(1.0f));
  const __mmask16 zero = _mm512_cmp_ps_mask(c, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_mask_mov_ps(unit, zero, _mm512_setzero_ps()), nan, c);
}

template <ElemType kGrad, bool kDecay>
class Lion16 {
 public:
  explicit Lion16(const LionKernelArgs& a)
      : master_(a.master),
        exp_avg_(a.exp_avg),
        grad_(a.grad),
        grad_scale_(_mm512_set1_ps(a.constants->grad_scale)),
        beta1_(_mm512_set1_ps(a.constants->beta1)),
        beta2_(_mm512_set1_ps(a.constants->beta2)),
        one_minus_beta1_(_mm512_set1_ps(a.constants->one_minus_beta1)),
        one_minus_beta2_(_mm512_set1_ps(a.constants->one_minus_beta2)),
        neg_lr_(_mm512_set1_ps(a.constants->neg_lr)),
        neg_lr_decay_(_mm512_set1_ps(a.constants->neg_lr_decay)) {}

  // 16 elements of numerics::lion_step.
  [[gnu::always_inline]] inline __m512 operator()(std::int64_t i) const {
    __m512 p = _mm512_loadu_ps(master_ + i);
    __m512 m = _mm512_loadu_ps(exp_avg_ + i);
    const __m512 g = _mm512_mul_ps(load16<kGrad>(grad_, i), grad_scale_);
    const __m512 s = sign16(_mm512_fmadd_ps(beta1_, m, _mm512_mul_ps(one_minus_beta1_, g)));
    if constexpr (kDecay) p = _mm512_fmadd_ps(neg_lr_decay_, p, p);
    p = _mm512_fmadd_ps(neg_lr_, s, p);
    m = _mm512_fmadd_ps(beta2_, m, _mm512_mul_ps(one_minus_beta2_, g));
    _mm512_storeu_ps(master_ + i, p);
    _mm512_storeu_ps(exp_avg_ + i, m);
    return p;
  }

 private:
  float* __restrict master_;
  float* __restrict exp_avg_;
  const void* __restrict grad_;
  __m512 grad_scale_, beta1_, beta2_, one_minus_beta1_, one_minus_beta2_, neg_lr_, neg_lr_decay_;
};

template <ElemType kGrad, bool kNativeBf16>
void lion_dispatch(const LionKernelArgs& a, std::int64_t n_vec) {
  if (a.constants->neg_lr_decay != 0.0f) {
    update_dispatch_copy<kNativeBf16>(Lion16<kGrad, true>(a), a.copy_out, a.copy_type, n_vec);
  } else {
    update_dispatch_copy<kNativeBf16>(Lion16<kGrad, false>(a), a.copy_out, a.copy_type, n_vec);
  }
}

template <bool kNativeBf16>
void lion(const LionKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: lion_dispatch<ElemType::kF32, kNativeBf16>(a, n_vec); break;
    case ElemType::kBf16: lion_dispatch<ElemType::kBf16, kNativeBf16>(a, n_vec); break;
    case ElemType::kF16: lion_dispatch<ElemType::kF16, kNativeBf16>(a, n_vec); break;
  }
  if (n_vec == a.n) return;
  LionKernelArgs tail = tail_args(a, n_vec);
  tail.exp_avg += n_vec;
  scalar_kernels().lion(tail);
}

// --- Adagrad ---------------------------------------------------------------------------

template <ElemType kGrad, bool kDecay>
class Adagrad16 {
 public:
  explicit Adagrad16(const AdagradKernelArgs& a)
      : master_(a.master),
        exp_avg_sq_(a.exp_avg_sq),
        grad_(a.grad),
        grad_scale_(_mm512_set1_ps(a.constants->grad_scale)),
        eps_(_mm512_set1_ps(a.constants->eps)),
        neg_lr_(_mm512_set1_ps(a.constants->neg_lr)),
        l2_decay_(_mm512_set1_ps(a.constants->l2_decay)) {}

  // 16 elements of numerics::adagrad_step.
  [[gnu::always_inline]] inline __m512 operator()(std::int64_t i) const {
    __m512 p = _mm512_loadu_ps(master_ + i);
    __m512 v = _mm512_loadu_ps(exp_avg_sq_ + i);
    __m512 g = _mm512_mul_ps(load16<kGrad>(grad_, i), grad_scale_);
    if constexpr (kDecay) g = _mm512_fmadd_ps(p, l2_decay_, g);
    v = _mm512_fmadd_ps(g, g, v);
    const __m512 d = _mm512_add_ps(_mm512_sqrt_ps(v), eps_);
    p = _mm512_fmadd_ps(neg_lr_, _mm512_div_ps(g, d), p);
    _mm512_storeu_ps(master_ + i, p);
    _mm512_storeu_ps(exp_avg_sq_ + i, v);
    return p;
  }

 private:
  float* __restrict master_;
  float* __restrict exp_avg_sq_;
  const void* __restrict grad_;
  __m512 grad_scale_, eps_, neg_lr_, l2_decay_;
};

template <ElemType kGrad, bool kNativeBf16>
void adagrad_dispatch(const AdagradKernelArgs& a, std::int64_t n_vec) {
  if (a.constants->l2_decay != 0.0f) {
    update_dispatch_copy<kNativeBf16>(Adagrad16<kGrad, true>(a), a.copy_out, a.copy_type, n_vec);
  } else {
    update_dispatch_copy<kNativeBf16>(Adagrad16<kGrad, false>(a), a.copy_out, a.copy_type, n_vec);
  }
}

template <bool kNativeBf16>
void adagrad(const AdagradKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: adagrad_dispatch<ElemType::kF32, kNativeBf16>(a, n_vec); break;
    case ElemType::kBf16: adagrad_dispatch<ElemType::kBf16, kNativeBf16>(a, n_vec); break;
    case ElemType::kF16: adagrad_dispatch<ElemType::kF16, kNativeBf16>(a, n_vec); break;
  }
  if (n_vec == a.n) return;
  AdagradKernelArgs tail = tail_args(a, n_vec);
  tail.exp_avg_sq += n_vec;
  scalar_kernels().adagrad(tail);
}

}  // namespace

void lion_avx512(const LionKernelArgs& args) { lion<false>(args); }
void lion_avx512_bf16(const LionKernelArgs& args) { lion<true>(args); }
void adagrad_avx512(const AdagradKernelArgs& args) { adagrad<false>(args); }
void adagrad_avx512_bf16(const AdagradKernelArgs& args) { adagrad<true>(args); }

}  // namespace strata::adam::kernels
