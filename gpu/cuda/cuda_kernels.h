// Launchers of the CUDA device's kernels (private to gpu/cuda/). Each enqueues
// one kernel on `stream` and returns the launch's error (cudaGetLastError).
// Arguments are validated by gpu::Device before they get here; n > 0.
// Formulas: core/numerics.h, bit for bit (built with --fmad=false).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/numerics.h"
#include "gpu/device_span.h"

namespace strata::gpu::cuda {

// dst[i] = convert(src[i]); dst and src do not overlap; dt != st.
cudaError_t launch_convert(void* dst, ElemType dt, const void* src, ElemType st, std::int64_t n,
                           cudaStream_t stream);
// dst[i] = dst[i] + fp32(src[i]).
cudaError_t launch_accumulate(float* dst, const void* src, ElemType st, std::int64_t n, cudaStream_t stream);
// partials[b] for b < norm_block_count(n); *flag = 1 when a value is not finite (flag may be null).
cudaError_t launch_norm_partials(const void* src, ElemType st, std::int64_t n, double* partials,
                                 std::uint32_t* flag, cudaStream_t stream);
// x[i] = type(fp32(x[i]) * factor).
cudaError_t launch_scale(void* x, ElemType t, std::int64_t n, float factor, cudaStream_t stream);
// x[i] = type(value).
cudaError_t launch_fill(void* x, ElemType t, std::int64_t n, float value, cudaStream_t stream);
// numerics::adam_step per element; copy_out (bf16/fp16) may be null.
cudaError_t launch_adam_step(const core::numerics::AdamStepConstants& constants, float* master, float* exp_avg,
                             float* exp_avg_sq, const void* grad, ElemType grad_type, void* copy_out,
                             ElemType copy_type, std::int64_t n, cudaStream_t stream);
// numerics::adam_step_bf16_moments per element: exp_avg and exp_avg_sq are
// bf16 bit patterns; with kStochastic, element i narrows m and v with
// stochastic_rounding_bits(key, index_base + i, moment), where key is
// stochastic_rounding_key(seed, step) computed once on the host. copy_out
// (bf16/fp16) may be null.
cudaError_t launch_adam_step_bf16_moments(const core::numerics::AdamStepConstants& constants, float* master,
                                          std::uint16_t* exp_avg, std::uint16_t* exp_avg_sq, const void* grad,
                                          ElemType grad_type, void* copy_out, ElemType copy_type,
                                          core::numerics::Bf16Rounding rounding, std::uint64_t key,
                                          std::int64_t index_base, std::int64_t n, cudaStream_t stream);
// numerics::adam_step_int8_block per block of kQuantBlockElems elements (the
// last may be short), element 0 starting block 0: exp_avg and exp_avg_sq are
// n bytes of codes, exp_avg_scale and exp_avg_sq_scale ceil(n / 256) fp32
// scales, all updated in place; copy_out (bf16/fp16) may be null. Reads the
// code tables that upload_quant_tables wrote to the current device.
cudaError_t launch_adam_step_int8_blockwise(const core::numerics::AdamStepConstants& constants, float* master,
                                            std::uint8_t* exp_avg, std::uint8_t* exp_avg_sq,
                                            float* exp_avg_scale, float* exp_avg_sq_scale, const void* grad,
                                            ElemType grad_type, void* copy_out, ElemType copy_type,
                                            std::int64_t n, cudaStream_t stream);
// Copies `tables` (numerics::kQuantTables) to the current device's constant
// memory, where the 8-bit Adam kernel reads them: once per device, before its
// first launch (synchronous; make_cuda_device calls it).
cudaError_t upload_quant_tables(const core::numerics::QuantTables& tables);
// numerics::lion_step / adagrad_step per element; copy_out (bf16/fp16) may be null.
cudaError_t launch_lion_step(const core::numerics::LionStepConstants& constants, float* master, float* exp_avg,
                             const void* grad, ElemType grad_type, void* copy_out, ElemType copy_type, std::int64_t n,
                             cudaStream_t stream);
cudaError_t launch_adagrad_step(const core::numerics::AdagradStepConstants& constants, float* master, float* sum,
                                const void* grad, ElemType grad_type, void* copy_out, ElemType copy_type,
                                std::int64_t n, cudaStream_t stream);

}  // namespace strata::gpu::cuda
