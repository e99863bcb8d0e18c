// The CUDA device's kernels: element-wise conversion, accumulation, scale,
// fill, AdamW (fp32, bf16 or 8-bit blockwise moments), Lion and Adagrad, and
// the norm partials in the contract's order. Every formula is numerics.h's (STRATA_HD functions
// compiled here for the device), so the results are bit-identical to the
// CPU's for finite values.
#include "gpu/cuda/cuda_kernels.h"

#include <cstdint>
#include <type_traits>

namespace strata::gpu::cuda {
namespace {

namespace nx = core::numerics;

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 8192;  // grid-stride loops cover the rest

int grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

template <ElemType T>
__device__ __forceinline__ float load(const void* p, std::int64_t i) {
  if constexpr (T == ElemType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == ElemType::kBf16) {
    return nx::bf16_bits_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
  } else {
    return nx::fp16_bits_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
  }
}

template <ElemType T>
__device__ __forceinline__ void store(void* p, std::int64_t i, float x) {
  if constexpr (T == ElemType::kF32) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (T == ElemType::kBf16) {
    static_cast<std::uint16_t*>(p)[i] = nx::fp32_to_bf16_bits(x);
  } else {
    static_cast<std::uint16_t*>(p)[i] = nx::fp32_to_fp16_bits(x);
  }
}

__device__ __forceinline__ std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

template <ElemType D, ElemType S>
__global__ void convert_kernel(void* dst, const void* src, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) store<D>(dst, i, load<S>(src, i));
}

template <ElemType S>
__global__ void accumulate_kernel(float* dst, const void* src, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) dst[i] = dst[i] + load<S>(src, i);
}

template <ElemType T>
__global__ void scale_kernel(void* x, std::int64_t n, float factor) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) store<T>(x, i, nx::mul_f32(load<T>(x, i), factor));
}

template <ElemType T>
__global__ void fill_kernel(void* x, std::int64_t n, float value) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) store<T>(x, i, value);
}

// One warp per norm block. Lane l sums the squares (double, exact) of the
// block's elements l, l + 32, l + 64, ... in increasing offset from +0.0; the
// lanes fold by shuffle-down with s = 16, 8, 4, 2, 1 (lane[k] += lane[k + s]),
// which is numerics::norm_block_partial's order exactly.
template <ElemType S>
__global__ void norm_partials_kernel(const void* src, std::int64_t n, double* partials, std::uint32_t* flag) {
  const int lane = static_cast<int>(threadIdx.x) % nx::kNormLanes;
  const std::int64_t warps_per_block = blockDim.x / nx::kNormLanes;
  const std::int64_t block = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / nx::kNormLanes;
  const std::int64_t blocks = nx::norm_block_count(n);
  if (block >= blocks) return;  // the whole warp leaves together
  const std::int64_t begin = block * nx::kNormBlockElems;
  const std::int64_t remaining = n - begin;
  const std::int64_t len = remaining < nx::kNormBlockElems ? remaining : nx::kNormBlockElems;
  double acc = 0.0;
  for (std::int64_t i = lane; i < len; i += nx::kNormLanes) acc = acc + nx::square_f64(load<S>(src, begin + i));
  for (int s = nx::kNormLanes / 2; s >= 1; s /= 2) {
    const double other = __shfl_down_sync(0xffffffffu, acc, s);
    acc = acc + other;
  }
  if (lane == 0) {
    partials[block] = acc;
    // A partial is inf or NaN exactly when one of its values is.
    if (flag != nullptr && !isfinite(acc)) *flag = 1u;
  }
}

template <ElemType G, ElemType C, bool kCopy>
__global__ void adam_kernel(nx::AdamStepConstants c, float* master, float* exp_avg, float* exp_avg_sq,
                            const void* grad, void* copy_out, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    float p = master[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    nx::adam_step(c, load<G>(grad, i), p, m, v);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kCopy) store<C>(copy_out, i, p);
  }
}

// numerics::adam_step_bf16_moments: m and v are widened from bf16, stepped in
// fp32 and narrowed back. Stochastic rounding draws its bits from the element's
// global index (index_base + i) under the step's key, so the grid's shape
// never changes them.
template <ElemType G, ElemType C, bool kCopy, nx::Bf16Rounding R>
__global__ void adam_bf16_moments_kernel(nx::AdamStepConstants c, float* master, std::uint16_t* exp_avg,
                                         std::uint16_t* exp_avg_sq, const void* grad, void* copy_out,
                                         std::uint64_t key, std::int64_t index_base, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    float p = master[i];
    std::uint16_t m = exp_avg[i];
    std::uint16_t v = exp_avg_sq[i];
    std::uint32_t bits_m = 0;
    std::uint32_t bits_v = 0;
    if constexpr (R == nx::Bf16Rounding::kStochastic) {
      bits_m = nx::stochastic_rounding_bits(key, index_base + i, nx::AdamMoment::kExpAvg);
      bits_v = nx::stochastic_rounding_bits(key, index_base + i, nx::AdamMoment::kExpAvgSq);
    }
    nx::adam_step_bf16_moments(c, load<G>(grad, i), p, m, v, R, bits_m, bits_v);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kCopy) store<C>(copy_out, i, p);
  }
}

// The 8-bit code tables (numerics::QuantTables), written once per device by
// upload_quant_tables from the host's numerics::kQuantTables, so that the
// host and the device search the same floats.
__constant__ nx::QuantTables device_quant_tables;

static_assert(nx::kQuantBlockElems == kThreads, "one thread per element of a quantization block");
constexpr int kQuantWarps = nx::kQuantBlockElems / 32;

// numerics::adam_step_int8_block with one thread block per quantization block
// (grid-stride over the blocks) and one thread per element: dequantize m and
// v with the block's scales, run numerics::adam_step, take each moment's
// absmax over the block, then quantize against block_scale(absmax). The
// absmax is folded with numerics::absmax_step, first over each warp by
// shuffles, then over the warps through shared memory; its operands are
// absolute values (a NaN already counted as +inf), for which absmax_step is
// max, exact in any order, so the fold gives the contract's sequential
// absmax. The tables are copied to shared memory first: quant_search and the
// dequantizing lookups index them per thread, which constant memory would
// serialize.
template <ElemType G, ElemType C, bool kCopy>
__global__ void __launch_bounds__(kThreads)
    adam_int8_kernel(nx::AdamStepConstants c, float* master, std::uint8_t* exp_avg, std::uint8_t* exp_avg_sq,
                     float* exp_avg_scale, float* exp_avg_sq_scale, const void* grad, void* copy_out,
                     std::int64_t n) {
  __shared__ nx::QuantTables tables;
  __shared__ float warp_absmax[2][kQuantWarps];
  {
    constexpr int kWords = static_cast<int>(sizeof(nx::QuantTables) / sizeof(float));
    const float* src = reinterpret_cast<const float*>(&device_quant_tables);
    float* dst = reinterpret_cast<float*>(&tables);
    for (int k = static_cast<int>(threadIdx.x); k < kWords; k += static_cast<int>(blockDim.x))
      dst[k] = src[k];
  }
  __syncthreads();
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const std::int64_t blocks = (n + nx::kQuantBlockElems - 1) / nx::kQuantBlockElems;
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::int64_t i = b * nx::kQuantBlockElems + tid;
    const bool active = i < n;  // the last block may be short
    float p = 0.0f;
    float m = 0.0f;  // a thread past the end adds 0 to the absmax: the fold's start
    float v = 0.0f;
    if (active) {
      p = master[i];
      m = nx::dequantize_m(tables, exp_avg[i], exp_avg_scale[b]);
      v = nx::dequantize_v(tables, exp_avg_sq[i], exp_avg_sq_scale[b]);
      nx::adam_step(c, load<G>(grad, i), p, m, v);
    }
    float am = nx::absmax_step(0.0f, m);
    float av = nx::absmax_step(0.0f, v);
    for (int s = 16; s >= 1; s /= 2) {
      am = nx::absmax_step(am, __shfl_xor_sync(0xffffffffu, am, s));
      av = nx::absmax_step(av, __shfl_xor_sync(0xffffffffu, av, s));
    }
    if (lane == 0) {
      warp_absmax[0][warp] = am;
      warp_absmax[1][warp] = av;
    }
    // Past this barrier every thread has read the block's old scales, so
    // thread 0 may overwrite them.
    __syncthreads();
    am = 0.0f;
    av = 0.0f;
    for (int w = 0; w < kQuantWarps; ++w) {
      am = nx::absmax_step(am, warp_absmax[0][w]);
      av = nx::absmax_step(av, warp_absmax[1][w]);
    }
    const float m_scale = nx::block_scale(am);
    const float v_scale = nx::block_scale(av);
    if (active) {
      master[i] = p;
      exp_avg[i] = nx::quantize_m(tables, m, m_scale);
      exp_avg_sq[i] = nx::quantize_v(tables, v, v_scale);
      if constexpr (kCopy) store<C>(copy_out, i, p);
    }
    if (tid == 0) {
      exp_avg_scale[b] = m_scale;
      exp_avg_sq_scale[b] = v_scale;
    }
    // warp_absmax is read by every thread before the next block writes it.
    __syncthreads();
  }
}

template <ElemType G, ElemType C, bool kCopy>
__global__ void lion_kernel(nx::LionStepConstants c, float* master, float* exp_avg, const void* grad, void* copy_out,
                            std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    float p = master[i];
    float m = exp_avg[i];
    nx::lion_step(c, load<G>(grad, i), p, m);
    master[i] = p;
    exp_avg[i] = m;
    if constexpr (kCopy) store<C>(copy_out, i, p);
  }
}

template <ElemType G, ElemType C, bool kCopy>
__global__ void adagrad_kernel(nx::AdagradStepConstants c, float* master, float* sum, const void* grad,
                               void* copy_out, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    float p = master[i];
    float v = sum[i];
    nx::adagrad_step(c, load<G>(grad, i), p, v);
    master[i] = p;
    sum[i] = v;
    if constexpr (kCopy) store<C>(copy_out, i, p);
  }
}

// Calls fn with an integral constant for `t`.
template <typename Fn>
void dispatch(ElemType t, Fn&& fn) {
  switch (t) {
    case ElemType::kF32: fn(std::integral_constant<ElemType, ElemType::kF32>()); break;
    case ElemType::kBf16: fn(std::integral_constant<ElemType, ElemType::kBf16>()); break;
    case ElemType::kF16: fn(std::integral_constant<ElemType, ElemType::kF16>()); break;
  }
}

}  // namespace

cudaError_t launch_convert(void* dst, ElemType dt, const void* src, ElemType st, std::int64_t n,
                           cudaStream_t stream) {
  dispatch(dt, [&](auto d) {
    dispatch(st, [&](auto s) { convert_kernel<decltype(d)::value, decltype(s)::value><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); });
  });
  return cudaGetLastError();
}

cudaError_t launch_accumulate(float* dst, const void* src, ElemType st, std::int64_t n, cudaStream_t stream) {
  dispatch(st, [&](auto s) { accumulate_kernel<decltype(s)::value><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); });
  return cudaGetLastError();
}

cudaError_t launch_norm_partials(const void* src, ElemType st, std::int64_t n, double* partials,
                                 std::uint32_t* flag, cudaStream_t stream) {
  const std::int64_t blocks = nx::norm_block_count(n);
  const int warps_per_block = kThreads / nx::kNormLanes;
  const int grid = static_cast<int>((blocks + warps_per_block - 1) / warps_per_block);
  dispatch(st, [&](auto s) {
    norm_partials_kernel<decltype(s)::value><<<grid, kThreads, 0, stream>>>(src, n, partials, flag);
  });
  return cudaGetLastError();
}

cudaError_t launch_scale(void* x, ElemType t, std::int64_t n, float factor, cudaStream_t stream) {
  dispatch(t, [&](auto tt) { scale_kernel<decltype(tt)::value><<<grid_for(n), kThreads, 0, stream>>>(x, n, factor); });
  return cudaGetLastError();
}

cudaError_t launch_fill(void* x, ElemType t, std::int64_t n, float value, cudaStream_t stream) {
  dispatch(t, [&](auto tt) { fill_kernel<decltype(tt)::value><<<grid_for(n), kThreads, 0, stream>>>(x, n, value); });
  return cudaGetLastError();
}

cudaError_t launch_adam_step(const core::numerics::AdamStepConstants& constants, float* master, float* exp_avg,
                             float* exp_avg_sq, const void* grad, ElemType grad_type, void* copy_out,
                             ElemType copy_type, std::int64_t n, cudaStream_t stream) {
  dispatch(grad_type, [&](auto g) {
    if (copy_out == nullptr) {
      adam_kernel<decltype(g)::value, ElemType::kBf16, false><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, grad, nullptr, n);
    } else if (copy_type == ElemType::kBf16) {
      adam_kernel<decltype(g)::value, ElemType::kBf16, true><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, grad, copy_out, n);
    } else {
      adam_kernel<decltype(g)::value, ElemType::kF16, true><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, grad, copy_out, n);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_adam_step_bf16_moments(const core::numerics::AdamStepConstants& constants, float* master,
                                          std::uint16_t* exp_avg, std::uint16_t* exp_avg_sq, const void* grad,
                                          ElemType grad_type, void* copy_out, ElemType copy_type,
                                          core::numerics::Bf16Rounding rounding, std::uint64_t key,
                                          std::int64_t index_base, std::int64_t n, cudaStream_t stream) {
  auto launch = [&](auto g, auto r) {
    constexpr ElemType kG = decltype(g)::value;
    constexpr nx::Bf16Rounding kR = decltype(r)::value;
    if (copy_out == nullptr) {
      adam_bf16_moments_kernel<kG, ElemType::kBf16, false, kR><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, grad, nullptr, key, index_base, n);
    } else if (copy_type == ElemType::kBf16) {
      adam_bf16_moments_kernel<kG, ElemType::kBf16, true, kR><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, grad, copy_out, key, index_base, n);
    } else {
      adam_bf16_moments_kernel<kG, ElemType::kF16, true, kR><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, grad, copy_out, key, index_base, n);
    }
  };
  dispatch(grad_type, [&](auto g) {
    if (rounding == nx::Bf16Rounding::kStochastic) {
      launch(g, std::integral_constant<nx::Bf16Rounding, nx::Bf16Rounding::kStochastic>());
    } else {
      launch(g, std::integral_constant<nx::Bf16Rounding, nx::Bf16Rounding::kNearestEven>());
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_adam_step_int8_blockwise(const core::numerics::AdamStepConstants& constants, float* master,
                                            std::uint8_t* exp_avg, std::uint8_t* exp_avg_sq,
                                            float* exp_avg_scale, float* exp_avg_sq_scale, const void* grad,
                                            ElemType grad_type, void* copy_out, ElemType copy_type,
                                            std::int64_t n, cudaStream_t stream) {
  const std::int64_t blocks = (n + nx::kQuantBlockElems - 1) / nx::kQuantBlockElems;
  const int grid = static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
  dispatch(grad_type, [&](auto g) {
    constexpr ElemType kG = decltype(g)::value;
    if (copy_out == nullptr) {
      adam_int8_kernel<kG, ElemType::kBf16, false><<<grid, kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, grad, nullptr, n);
    } else if (copy_type == ElemType::kBf16) {
      adam_int8_kernel<kG, ElemType::kBf16, true><<<grid, kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, grad, copy_out, n);
    } else {
      adam_int8_kernel<kG, ElemType::kF16, true><<<grid, kThreads, 0, stream>>>(
          constants, master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, grad, copy_out, n);
    }
  });
  return cudaGetLastError();
}

cudaError_t upload_quant_tables(const core::numerics::QuantTables& tables) {
  return cudaMemcpyToSymbol(device_quant_tables, &tables, sizeof(tables));
}

cudaError_t launch_lion_step(const core::numerics::LionStepConstants& constants, float* master, float* exp_avg,
                             const void* grad, ElemType grad_type, void* copy_out, ElemType copy_type, std::int64_t n,
                             cudaStream_t stream) {
  dispatch(grad_type, [&](auto g) {
    if (copy_out == nullptr) {
      lion_kernel<decltype(g)::value, ElemType::kBf16, false><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, grad, nullptr, n);
    } else if (copy_type == ElemType::kBf16) {
      lion_kernel<decltype(g)::value, ElemType::kBf16, true><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, grad, copy_out, n);
    } else {
      lion_kernel<decltype(g)::value, ElemType::kF16, true><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, exp_avg, grad, copy_out, n);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_adagrad_step(const core::numerics::AdagradStepConstants& constants, float* master, float* sum,
                                const void* grad, ElemType grad_type, void* copy_out, ElemType copy_type,
                                std::int64_t n, cudaStream_t stream) {
  dispatch(grad_type, [&](auto g) {
    if (copy_out == nullptr) {
      adagrad_kernel<decltype(g)::value, ElemType::kBf16, false><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, sum, grad, nullptr, n);
    } else if (copy_type == ElemType::kBf16) {
      adagrad_kernel<decltype(g)::value, ElemType::kBf16, true><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, sum, grad, copy_out, n);
    } else {
      adagrad_kernel<decltype(g)::value, ElemType::kF16, true><<<grid_for(n), kThreads, 0, stream>>>(
          constants, master, sum, grad, copy_out, n);
    }
  });
  return cudaGetLastError();
}

}  // namespace strata::gpu::cuda
