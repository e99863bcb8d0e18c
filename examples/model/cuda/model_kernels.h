// Launchers of the example model's element-wise and reduction kernels
// (private to the CUDA runner; the matrix products are cuBLAS's). Each
// enqueues one kernel on `stream` and returns the launch's error
// (cudaGetLastError). Matrices are row-major fp32 [rows, cols]; sizes > 0.
//
// Every reduction is deterministic: double accumulators, a fixed assignment
// of elements to threads and a fixed combining tree, no atomics. The
// element-wise formulas are model_runner.cpp's, operation for operation
// (built with --fmad=false, so nothing is contracted into an fma).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace strata::examples::cuda {

// Element types of the engine's buffers (ComputeType, without its header).
enum class Elem { kF32, kBf16, kF16 };

// dst[i] = fp32(src[i]) (exact); src is `type`.
cudaError_t launch_to_fp32(float* dst, const void* src, Elem type, std::int64_t n, cudaStream_t stream);
// dst[i] = type(src[i]), rounded to nearest even (numerics.h's conversions).
cudaError_t launch_from_fp32(void* dst, Elem type, const float* src, std::int64_t n, cudaStream_t stream);

// y[r, c] = y[r, c] + b[c].
cudaError_t launch_add_bias(float* y, const float* b, std::int64_t rows, std::int64_t cols, cudaStream_t stream);
// pre[r, c] = pre[r, c] + b[c]; act[r, c] = gelu(pre[r, c]), tanh form
// (Hendrycks & Gimpel 2016): 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))).
cudaError_t launch_bias_gelu(float* pre, float* act, const float* b, std::int64_t rows, std::int64_t cols,
                             cudaStream_t stream);
// h_out[r, c] = h_in[r, c] + (h_out[r, c] + b[c]) (the block's residual).
cudaError_t launch_residual_bias(float* h_out, const float* h_in, const float* b, std::int64_t rows,
                                 std::int64_t cols, cudaStream_t stream);
// d[i] = d[i] * gelu'(pre[i]), with
// gelu'(u) = 0.5 (1 + t) + 0.5 u (1 - t^2) c (1 + 3 k u^2), t = tanh(c (u + k u^3)).
cudaError_t launch_gelu_backward(float* d, const float* pre, std::int64_t n, cudaStream_t stream);

// Per row r (one thread block each):
//   inv_rms[r] = float(1 / sqrt(sum_c double(x[r, c])^2 / cols + eps))   (in double)
//   normed = x * inv_rms,  scaled = normed * gain[c]
cudaError_t launch_rmsnorm_forward(const float* x, const float* gain, std::int64_t rows, std::int64_t cols,
                                   float eps, float* inv_rms, float* normed, float* scaled, cudaStream_t stream);
// Backward of the rmsnorm (without the gain's gradient), per row r:
//   mean_dot = float(sum_c double(d_scaled) * gain * normed / cols)       (in double)
//   d_x[r, c] = d_x[r, c] + inv_rms[r] * (d_scaled * gain[c] - normed * mean_dot)
cudaError_t launch_rmsnorm_backward(const float* d_scaled, const float* gain, const float* inv_rms,
                                    const float* normed, std::int64_t rows, std::int64_t cols, float* d_x,
                                    cudaStream_t stream);

// out[c] = float(sum over r, in row order, of double(a[r, c]) or, when b is
// not null, double(a[r, c]) * b[r, c]): bias gradients (b null) and norm
// gains' gradients. One thread per column, so the order is model_runner.cpp's.
cudaError_t launch_column_sums(const float* a, const float* b, std::int64_t rows, std::int64_t cols, float* out,
                               cudaStream_t stream);

// *loss = sum_i (double(y[i]) - t[i])^2 / n, in double (one thread block).
cudaError_t launch_mse_loss(const float* y, const float* t, std::int64_t n, double* loss, cudaStream_t stream);
// d_out[i] = coef * (y[i] - t[i]) (coef = 2 loss_scale / n, from the caller).
cudaError_t launch_mse_grad(const float* y, const float* t, std::int64_t n, float coef, float* d_out,
                            cudaStream_t stream);

}  // namespace strata::examples::cuda
