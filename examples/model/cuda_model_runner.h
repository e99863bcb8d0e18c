// Forward and backward of the example model on a CUDA GPU, one fetch group at
// a time: the same protocol as ModelRunner (model_runner.h), but the weights
// and gradients are the engine's group buffers in device memory, in the
// engine's compute type. Matrix products go through cuBLAS; the element-wise
// steps and reductions are this example's own kernels (cuda/model_kernels.cu).
// In a build without CUDA or cuBLAS, create() returns UNIMPLEMENTED.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/result.h"
#include "core/status.h"
#include "examples/model/precision.h"
#include "examples/model/residual_mlp.h"

namespace strata::examples {

// A borrowed view of one group's flat weight buffer in CUDA device memory, as
// the engine hands it out (strata_group_fetch's strata_group_view): read only.
struct CudaWeights {
  const void* data = nullptr;               // device address, aligned to the element size
  std::int64_t size_elems = 0;              // elements of `type` (the layout's size_elems or more)
  ComputeType type = ComputeType::kF32;     // the engine's compute type. Default fp32.
};

// A borrowed view of one group's flat gradient buffer in CUDA device memory
// (strata_group_grad_buffer's view). A view with no data means "frozen".
struct CudaGrads {
  void* data = nullptr;                     // device address, aligned to the element size; null: frozen
  std::int64_t size_elems = 0;              // elements of `type`
  ComputeType type = ComputeType::kF32;     // the engine's compute type. Default fp32.
  bool empty() const { return data == nullptr; }
};

struct CudaRunnerOptions {
  int device_ordinal = 0;     // CUDA device index; the engine's device is 0. Default 0.
  // A cudaStream_t (as void*) the caller owns and keeps alive for the
  // runner's lifetime: the runner enqueues all its work on it and never
  // destroys it. nullptr (default): the runner creates its own stream.
  void* stream = nullptr;
};

// One pass of the step protocol for one micro-batch, as ModelRunner:
//   begin(batch, loss_scale);
//   for g in 0..G-1:   forward_group(g, weights of g)
//   loss();
//   for g in G-1..0:   backward_group(g, weights of g, gradients of g)
// Out-of-order calls fail with FAILED_PRECONDITION and change nothing.
//
// Device memory: the runner owns its activations and scratch (one cudaMalloc
// in create(), sized by the model spec; a cuBLAS handle and its 32 MiB
// workspace). Every call that takes a caller's buffer converts the group's
// parameters into an fp32 scratch of its own (each parameter 256-byte
// aligned), computes in fp32, and writes gradients back in the buffer's type
// (round to nearest even, numerics.h); elements outside the parameters'
// ranges are never read or written.
//
// Synchronisation: work goes to the runner's stream (native_stream()), and
// begin/forward_group/backward_group wait for it before they return. So the
// caller's buffers are not used after a call returns (release them at once),
// and an asynchronous CUDA fault is reported by the call that caused it. The
// caller's buffers must be complete when the call is made: nothing pending on
// another stream may still write them (the engine's fetch blocks, so its
// views qualify).
//
// Numerics: fp32 throughout; cuBLAS in pedantic math (no TF32, no reduced
// precision) with atomics off and a fixed workspace on one stream; every
// reduction (norms, bias and gain gradients, the loss) in double in a fixed
// order, no atomics. Results are bit-identical run to run on one GPU model
// and toolkit, and for every layout; they match ModelRunner's within the
// rounding of a different summation order (not bit for bit).
//
// Thread-compatible: one thread at a time per runner. The model passed to
// create() must outlive the runner. Move-only.
class CudaModelRunner {
 public:
  // `layouts[g]` is group g's layout (ResidualMlp::check_layout: INVALID_ARGUMENT
  // when one is wrong). Errors: UNIMPLEMENTED in a build without the CUDA
  // runner; UNAVAILABLE with no driver or no device; INVALID_ARGUMENT for a
  // bad ordinal; OUT_OF_MEMORY when the activations do not fit; every failed
  // CUDA or cuBLAS call names itself and its error.
  static core::Result<CudaModelRunner> create(const ResidualMlp& model, std::vector<GroupLayout> layouts,
                                              const CudaRunnerOptions& options = {});

  CudaModelRunner(CudaModelRunner&& other) noexcept;
  CudaModelRunner& operator=(CudaModelRunner&& other) noexcept;
  CudaModelRunner(const CudaModelRunner&) = delete;
  CudaModelRunner& operator=(const CudaModelRunner&) = delete;
  // Waits for the stream, then frees the device memory, the cuBLAS handle and
  // the stream (when the runner created it); failures there are logged.
  ~CudaModelRunner();

  // The stream the runner computes on (a cudaStream_t), for the C API's
  // stream arguments (strata_group_fetch, strata_group_grads_ready).
  void* native_stream() const;
  int device_ordinal() const;

  // Starts a pass over `batch` (copied to the device; it must have the
  // model's batch shape, else INVALID_ARGUMENT). `loss_scale` multiplies
  // every gradient; loss() stays unscaled.
  core::Status begin(const Batch& batch, float loss_scale);

  // Forward through group `group_index`, the next one in order. INVALID_ARGUMENT
  // when `weights` is smaller than the group's layout, misaligned, or not
  // device memory of this runner's GPU.
  core::Status forward_group(int group_index, const CudaWeights& weights);

  // Mean squared error of the last completed forward pass (unscaled), reduced
  // in double on the device. Precondition: all groups were forwarded since begin().
  double loss() const;

  // Copies the student's outputs [batch, output_dim] of the last forward pass
  // into `out` (exactly batch * output_dim values, else INVALID_ARGUMENT).
  core::Status outputs(std::span<float> out) const;

  // Backward through group `group_index`: after the full forward, the groups
  // in reverse order. Each parameter's range of `grads` is overwritten with
  // d(loss_scale * loss)/d(parameter) in grads.type; an empty `grads` means
  // the group is frozen (only the gradient flowing below is computed).
  // INVALID_ARGUMENT as forward_group for either view.
  core::Status backward_group(int group_index, const CudaWeights& weights, const CudaGrads& grads);

 private:
  class Impl;
  explicit CudaModelRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::examples
