// The example model's element-wise and reduction kernels on CUDA (formulas
// in model_kernels.h, the same as model_runner.cpp's host loops). Reductions
// are deterministic: fixed thread assignment, a fixed tree, no atomics.
#include "examples/model/cuda/model_kernels.h"

#include <cstdint>

#include "core/numerics.h"

namespace strata::examples::cuda {
namespace {

namespace nx = core::numerics;

constexpr int kThreads = 256;  // a power of two: block_sum's tree needs it
constexpr std::int64_t kMaxBlocks = 4096;  // grid-stride loops cover the rest

int grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

__device__ __forceinline__ std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

// The block's threads' values summed in a fixed tree: thread t adds thread
// t + s for s = 128, 64, ..., 1. Every thread gets the total. `scratch`
// holds kThreads doubles.
__device__ double block_sum(double v, double* scratch) {
  const unsigned t = threadIdx.x;
  scratch[t] = v;
  __syncthreads();
  for (unsigned s = kThreads / 2; s > 0; s /= 2) {
    if (t < s) scratch[t] = scratch[t] + scratch[t + s];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();  // scratch may be reused after the return
  return total;
}

// gelu, tanh form: the constants and operation order of model_runner.cpp.
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluK = 0.044715f;

__device__ __forceinline__ float gelu(float u) {
  const float t = tanhf(kGeluC * (u + kGeluK * u * u * u));
  return 0.5f * u * (1.0f + t);
}

__device__ __forceinline__ float gelu_grad(float u) {
  const float t = tanhf(kGeluC * (u + kGeluK * u * u * u));
  return 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluK * u * u);
}

template <Elem T>
__device__ __forceinline__ float load(const void* p, std::int64_t i) {
  if constexpr (T == Elem::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == Elem::kBf16) {
    return nx::bf16_bits_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
  } else {
    return nx::fp16_bits_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
  }
}

template <Elem T>
__device__ __forceinline__ void store(void* p, std::int64_t i, float x) {
  if constexpr (T == Elem::kF32) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (T == Elem::kBf16) {
    static_cast<std::uint16_t*>(p)[i] = nx::fp32_to_bf16_bits(x);
  } else {
    static_cast<std::uint16_t*>(p)[i] = nx::fp32_to_fp16_bits(x);
  }
}

template <Elem T>
__global__ void to_fp32_kernel(float* dst, const void* src, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) dst[i] = load<T>(src, i);
}

template <Elem T>
__global__ void from_fp32_kernel(void* dst, const float* src, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) store<T>(dst, i, src[i]);
}

__global__ void add_bias_kernel(float* y, const float* b, std::int64_t rows, std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) y[i] = y[i] + b[i % cols];
}

__global__ void bias_gelu_kernel(float* pre, float* act, const float* b, std::int64_t rows, std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const float u = pre[i] + b[i % cols];
    pre[i] = u;
    act[i] = gelu(u);
  }
}

__global__ void residual_bias_kernel(float* h_out, const float* h_in, const float* b, std::int64_t rows,
                                     std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) h_out[i] = h_in[i] + (h_out[i] + b[i % cols]);
}

__global__ void gelu_backward_kernel(float* d, const float* pre, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) d[i] = d[i] * gelu_grad(pre[i]);
}

// One block per row.
__global__ void rmsnorm_forward_kernel(const float* x, const float* gain, std::int64_t cols, float eps,
                                       float* inv_rms, float* normed, float* scaled) {
  __shared__ double scratch[kThreads];
  const std::int64_t r = blockIdx.x;
  const float* xr = x + r * cols;
  double acc = 0.0;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) acc = acc + static_cast<double>(xr[c]) * xr[c];
  const double sum_sq = block_sum(acc, scratch);
  const float ir = static_cast<float>(1.0 / sqrt(sum_sq / static_cast<double>(cols) + eps));
  if (threadIdx.x == 0) inv_rms[r] = ir;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const float v = xr[c] * ir;
    normed[r * cols + c] = v;
    scaled[r * cols + c] = v * gain[c];
  }
}

// One block per row.
__global__ void rmsnorm_backward_kernel(const float* d_scaled, const float* gain, const float* inv_rms,
                                        const float* normed, std::int64_t cols, float* d_x) {
  __shared__ double scratch[kThreads];
  const std::int64_t r = blockIdx.x;
  const float* ds = d_scaled + r * cols;
  const float* nr = normed + r * cols;
  double acc = 0.0;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    acc = acc + static_cast<double>(ds[c]) * gain[c] * nr[c];
  }
  const double dot = block_sum(acc, scratch);
  const float mean_dot = static_cast<float>(dot / static_cast<double>(cols));
  const float ir = inv_rms[r];
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const float dn = ds[c] * gain[c];
    d_x[r * cols + c] = d_x[r * cols + c] + ir * (dn - nr[c] * mean_dot);
  }
}

// One thread per column, rows in order.
__global__ void column_sums_kernel(const float* a, const float* b, std::int64_t rows, std::int64_t cols,
                                   float* out) {
  for (std::int64_t c = first_index(); c < cols; c += grid_stride()) {
    double acc = 0.0;
    if (b == nullptr) {
      for (std::int64_t r = 0; r < rows; ++r) acc = acc + a[r * cols + c];
    } else {
      for (std::int64_t r = 0; r < rows; ++r) acc = acc + static_cast<double>(a[r * cols + c]) * b[r * cols + c];
    }
    out[c] = static_cast<float>(acc);
  }
}

// One block.
__global__ void mse_loss_kernel(const float* y, const float* t, std::int64_t n, double* loss) {
  __shared__ double scratch[kThreads];
  double acc = 0.0;
  for (std::int64_t i = threadIdx.x; i < n; i += kThreads) {
    const double e = static_cast<double>(y[i]) - t[i];
    acc = acc + e * e;
  }
  const double sum_sq = block_sum(acc, scratch);
  if (threadIdx.x == 0) *loss = sum_sq / static_cast<double>(n);
}

__global__ void mse_grad_kernel(const float* y, const float* t, std::int64_t n, float coef, float* d_out) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) d_out[i] = coef * (y[i] - t[i]);
}

}  // namespace

cudaError_t launch_to_fp32(float* dst, const void* src, Elem type, std::int64_t n, cudaStream_t stream) {
  switch (type) {
    case Elem::kF32: to_fp32_kernel<Elem::kF32><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); break;
    case Elem::kBf16: to_fp32_kernel<Elem::kBf16><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); break;
    case Elem::kF16: to_fp32_kernel<Elem::kF16><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_from_fp32(void* dst, Elem type, const float* src, std::int64_t n, cudaStream_t stream) {
  switch (type) {
    case Elem::kF32: from_fp32_kernel<Elem::kF32><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); break;
    case Elem::kBf16: from_fp32_kernel<Elem::kBf16><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); break;
    case Elem::kF16: from_fp32_kernel<Elem::kF16><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_add_bias(float* y, const float* b, std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  add_bias_kernel<<<grid_for(rows * cols), kThreads, 0, stream>>>(y, b, rows, cols);
  return cudaGetLastError();
}

cudaError_t launch_bias_gelu(float* pre, float* act, const float* b, std::int64_t rows, std::int64_t cols,
                             cudaStream_t stream) {
  bias_gelu_kernel<<<grid_for(rows * cols), kThreads, 0, stream>>>(pre, act, b, rows, cols);
  return cudaGetLastError();
}

cudaError_t launch_residual_bias(float* h_out, const float* h_in, const float* b, std::int64_t rows,
                                 std::int64_t cols, cudaStream_t stream) {
  residual_bias_kernel<<<grid_for(rows * cols), kThreads, 0, stream>>>(h_out, h_in, b, rows, cols);
  return cudaGetLastError();
}

cudaError_t launch_gelu_backward(float* d, const float* pre, std::int64_t n, cudaStream_t stream) {
  gelu_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(d, pre, n);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm_forward(const float* x, const float* gain, std::int64_t rows, std::int64_t cols,
                                   float eps, float* inv_rms, float* normed, float* scaled, cudaStream_t stream) {
  rmsnorm_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, gain, cols, eps, inv_rms, normed,
                                                                              scaled);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm_backward(const float* d_scaled, const float* gain, const float* inv_rms,
                                    const float* normed, std::int64_t rows, std::int64_t cols, float* d_x,
                                    cudaStream_t stream) {
  rmsnorm_backward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(d_scaled, gain, inv_rms, normed,
                                                                               cols, d_x);
  return cudaGetLastError();
}

cudaError_t launch_column_sums(const float* a, const float* b, std::int64_t rows, std::int64_t cols, float* out,
                               cudaStream_t stream) {
  column_sums_kernel<<<grid_for(cols), kThreads, 0, stream>>>(a, b, rows, cols, out);
  return cudaGetLastError();
}

cudaError_t launch_mse_loss(const float* y, const float* t, std::int64_t n, double* loss, cudaStream_t stream) {
  mse_loss_kernel<<<1, kThreads, 0, stream>>>(y, t, n, loss);
  return cudaGetLastError();
}

cudaError_t launch_mse_grad(const float* y, const float* t, std::int64_t n, float coef, float* d_out,
                            cudaStream_t stream) {
  mse_grad_kernel<<<grid_for(n), kThreads, 0, stream>>>(y, t, n, coef, d_out);
  return cudaGetLastError();
}

}  // namespace strata::examples::cuda
