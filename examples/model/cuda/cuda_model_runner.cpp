// The example model's forward and backward on a CUDA GPU (cuda_model_runner.h):
// matrix products through cuBLAS's cublasSgemm, everything else through
// model_kernels.cu. Every CUDA and cuBLAS call is checked and named.
#include "examples/model/cuda_model_runner.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "core/check.h"
#include "core/str.h"
#include "examples/model/cuda/cuda_check.h"
#include "examples/model/cuda/model_kernels.h"

namespace strata::examples {
namespace {

using core::Status;
using core::str_cat;
using cuda::cublas_check;
using cuda::cuda_check;

constexpr std::size_t kAlignBytes = 256;  // every buffer of the runner starts on this
constexpr std::int64_t kAlignFloats = static_cast<std::int64_t>(kAlignBytes / sizeof(float));
// cuBLAS's workspace, owned by the runner so that its kernels' choice does
// not depend on a pool shared with other streams (cuBLAS's reproducibility
// notes); 32 MiB is what cuBLAS itself reserves on Hopper.
constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

cuda::Elem elem_of(ComputeType type) {
  switch (type) {
    case ComputeType::kF32: return cuda::Elem::kF32;
    case ComputeType::kBf16: return cuda::Elem::kBf16;
    case ComputeType::kF16: return cuda::Elem::kF16;
  }
  return cuda::Elem::kF32;
}

}  // namespace

class CudaModelRunner::Impl {
 public:
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  Status init(const ResidualMlp& model, std::vector<GroupLayout> layouts, const CudaRunnerOptions& options);

  Status begin(const Batch& batch, float loss_scale);
  Status forward_group(int group_index, const CudaWeights& weights);
  Status backward_group(int group_index, const CudaWeights& weights, const CudaGrads& grads);
  Status outputs(std::span<float> out) const;
  double loss() const {
    STRATA_CHECK(forward_done_) << "loss() before the forward pass completed";
    return loss_;
  }
  void* native_stream() const { return stream_; }
  int device_ordinal() const { return ordinal_; }

 private:
  // rmsnorm(x) * gain activations: 1/rms per row, normalised and scaled input.
  struct NormActs {
    float* inv_rms = nullptr;  // [batch]
    float* normed = nullptr;   // [batch, hidden]
    float* scaled = nullptr;   // [batch, hidden]
  };
  struct BlockActs {
    NormActs norm;
    float* pre = nullptr;  // w1 a + b1, [batch, ffn]
    float* act = nullptr;  // gelu(pre), [batch, ffn]
  };

  Status activate() const { return cuda_check(cudaSetDevice(ordinal_), "cudaSetDevice"); }
  Status sync() const { return cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  // A caller's view: large enough for the group's layout, aligned, and
  // device memory of this runner's GPU.
  Status check_view(int group_index, const void* data, std::int64_t size_elems, ComputeType type,
                    const char* what) const;
  // The group's parameters from the caller's buffer into weights_f32_.
  Status load_weights(int group_index, const CudaWeights& weights);
  // The group's gradients from grads_f32_ into the caller's buffer.
  Status store_grads(int group_index, const CudaGrads& grads);

  // The group's i-th parameter in the fp32 scratches (weights or gradients).
  const float* w(int group_index, int i) const { return weights_f32_ + slot(group_index, i); }
  float* g(int group_index, int i) const { return grads_f32_ + slot(group_index, i); }
  std::int64_t slot(int group_index, int i) const {
    return slots_[static_cast<std::size_t>(group_index)][static_cast<std::size_t>(i)];
  }

  // Row-major products through cublasSgemm (column-major: each row-major
  // matrix is read as its transpose).
  // out[m, n] = x[m, k] w[n, k]^T           (a linear layer without its bias)
  Status matmul_xwt(const float* x, const float* wt, float* out, std::int64_t m, std::int64_t n,
                    std::int64_t k) const;
  // dw[n, k] = dy[m, n]^T x[m, k]            (a linear layer's weight gradient)
  Status matmul_dytx(const float* dy, const float* x, float* dw, std::int64_t m, std::int64_t n,
                     std::int64_t k) const;
  // dx[m, k] = dy[m, n] w[n, k]              (a linear layer's input gradient)
  Status matmul_dyw(const float* dy, const float* wt, float* dx, std::int64_t m, std::int64_t n,
                    std::int64_t k) const;

  Status forward_embed();
  Status forward_block(int block);
  Status forward_head();
  Status backward_head(bool frozen);
  Status backward_block(int block, bool frozen);
  Status backward_embed(bool frozen);

  const ResidualMlp* model_ = nullptr;
  std::vector<GroupLayout> layouts_;
  // slots_[g][i]: float offset of group g's i-th parameter in the fp32
  // scratches (each slot starts on kAlignBytes, whatever the layout).
  std::vector<std::vector<std::int64_t>> slots_;
  int ordinal_ = 0;

  // Release order (~Impl): wait for the stream, destroy the cuBLAS handle,
  // free the memory, destroy the stream when it is ours.
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cublasHandle_t blas_ = nullptr;
  void* memory_ = nullptr;  // one cudaMalloc holding every buffer below

  // Device buffers (views into memory_), fp32 unless said otherwise.
  double* loss_dev_ = nullptr;      // 1 double
  void* workspace_ = nullptr;       // cuBLAS workspace, kWorkspaceBytes
  float* inputs_ = nullptr;         // [batch, input]
  float* targets_ = nullptr;        // [batch, output]
  std::vector<float*> h_;           // residual stream h_0..h_L, [batch, hidden] each
  std::vector<BlockActs> blocks_;
  NormActs head_norm_;
  float* outputs_ = nullptr;        // [batch, output]
  float* d_stream_ = nullptr;       // d loss / d h_i, [batch, hidden]
  float* d_norm_ = nullptr;         // [batch, hidden]
  float* d_ffn_ = nullptr;          // [batch, ffn]
  float* d_out_ = nullptr;          // [batch, output]
  float* weights_f32_ = nullptr;    // one group's parameters, in slots
  float* grads_f32_ = nullptr;      // one group's gradients, in slots

  // The pass.
  float loss_scale_ = 1.0f;
  int next_forward_ = 0;    // the group forward_group expects next
  int next_backward_ = -1;  // the group backward_group expects next; -1: none
  bool forward_done_ = false;
  double loss_ = 0.0;
};

CudaModelRunner::Impl::~Impl() {
  if (stream_ == nullptr && blas_ == nullptr && memory_ == nullptr) return;  // init failed early
  cuda::log_cuda_error(cudaSetDevice(ordinal_), "cudaSetDevice");
  if (stream_ != nullptr) cuda::log_cuda_error(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  if (blas_ != nullptr) cuda::log_cublas_error(cublasDestroy(blas_), "cublasDestroy");
  if (memory_ != nullptr) cuda::log_cuda_error(cudaFree(memory_), "cudaFree");
  if (owns_stream_) cuda::log_cuda_error(cudaStreamDestroy(stream_), "cudaStreamDestroy");
}

Status CudaModelRunner::Impl::init(const ResidualMlp& model, std::vector<GroupLayout> layouts,
                                   const CudaRunnerOptions& options) {
  model_ = &model;
  layouts_ = std::move(layouts);
  ordinal_ = options.device_ordinal;
  const ModelSpec& s = model.spec();
  for (const std::int64_t dim : {s.batch, s.input_dim, s.hidden_dim, s.ffn_dim, s.output_dim}) {
    if (dim > INT_MAX) {
      return Status::invalid_argument(str_cat("CudaModelRunner: dimension ", dim, " is past cuBLAS's int range"));
    }
  }

  int count = 0;
  STRATA_RETURN_IF_ERROR(cuda_check(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  if (count == 0) return Status::unavailable("CudaModelRunner: no CUDA device is visible");
  if (ordinal_ < 0 || ordinal_ >= count) {
    return Status::invalid_argument(
        str_cat("CudaModelRunner: device ordinal ", ordinal_, " is not in [0, ", count, ")"));
  }
  STRATA_RETURN_IF_ERROR(activate());

  if (options.stream != nullptr) {
    stream_ = static_cast<cudaStream_t>(options.stream);
  } else {
    STRATA_RETURN_IF_ERROR(
        cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
    owns_stream_ = true;
  }

  // Parameter slots: each parameter of a group 256-byte aligned in the fp32
  // scratch, so cuBLAS sees the same alignment for every layout.
  std::int64_t scratch_floats = 0;
  for (const GroupDesc& gd : model.groups()) {
    std::vector<std::int64_t> slots;
    std::int64_t used = 0;
    for (const int pi : gd.param_indices) {
      slots.push_back(used);
      const std::int64_t n = model.params()[static_cast<std::size_t>(pi)].num_elems;
      used += (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
    }
    scratch_floats = std::max(scratch_floats, used);
    slots_.push_back(std::move(slots));
  }

  // Every buffer in one allocation: first sizes, then addresses.
  const std::int64_t bh = s.batch * s.hidden_dim;
  const std::int64_t bf = s.batch * s.ffn_dim;
  h_.assign(static_cast<std::size_t>(s.depth + 1), nullptr);
  blocks_.assign(static_cast<std::size_t>(s.depth), BlockActs{});
  std::vector<std::pair<float**, std::int64_t>> fp32_buffers = {
      {&inputs_, s.batch * s.input_dim}, {&targets_, s.batch * s.output_dim},
      {&outputs_, s.batch * s.output_dim}, {&d_stream_, bh}, {&d_norm_, bh}, {&d_ffn_, bf},
      {&d_out_, s.batch * s.output_dim}, {&weights_f32_, scratch_floats}, {&grads_f32_, scratch_floats},
      {&head_norm_.inv_rms, s.batch}, {&head_norm_.normed, bh}, {&head_norm_.scaled, bh}};
  for (float*& h : h_) fp32_buffers.emplace_back(&h, bh);
  for (BlockActs& b : blocks_) {
    fp32_buffers.emplace_back(&b.norm.inv_rms, s.batch);
    fp32_buffers.emplace_back(&b.norm.normed, bh);
    fp32_buffers.emplace_back(&b.norm.scaled, bh);
    fp32_buffers.emplace_back(&b.pre, bf);
    fp32_buffers.emplace_back(&b.act, bf);
  }
  std::size_t total = kAlignBytes + kWorkspaceBytes;  // the loss, then the workspace
  for (const auto& [ptr, elems] : fp32_buffers) total += round_up(static_cast<std::size_t>(elems) * 4, kAlignBytes);
  const cudaError_t err = cudaMalloc(&memory_, total);
  if (err != cudaSuccess) {
    memory_ = nullptr;
    return cuda_check(err, "cudaMalloc").annotate(
        str_cat("CudaModelRunner: ", core::format_bytes(total), " of activations and scratch"));
  }
  auto* base = static_cast<std::byte*>(memory_);
  loss_dev_ = reinterpret_cast<double*>(base);
  workspace_ = base + kAlignBytes;
  std::size_t used = kAlignBytes + kWorkspaceBytes;
  for (const auto& [ptr, elems] : fp32_buffers) {
    *ptr = reinterpret_cast<float*>(base + used);
    used += round_up(static_cast<std::size_t>(elems) * 4, kAlignBytes);
  }

  // cuBLAS: on our stream with our workspace (cublasSetStream resets the
  // workspace, so it comes second), pedantic math (the prescribed fp32
  // arithmetic in every phase: no TF32), no atomics.
  STRATA_RETURN_IF_ERROR(cublas_check(cublasCreate(&blas_), "cublasCreate"));
  STRATA_RETURN_IF_ERROR(cublas_check(cublasSetStream(blas_, stream_), "cublasSetStream"));
  STRATA_RETURN_IF_ERROR(
      cublas_check(cublasSetWorkspace(blas_, workspace_, kWorkspaceBytes), "cublasSetWorkspace"));
  STRATA_RETURN_IF_ERROR(cublas_check(cublasSetMathMode(blas_, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode"));
  STRATA_RETURN_IF_ERROR(
      cublas_check(cublasSetAtomicsMode(blas_, CUBLAS_ATOMICS_NOT_ALLOWED), "cublasSetAtomicsMode"));
  STRATA_RETURN_IF_ERROR(
      cublas_check(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode"));
  return Status();
}

Status CudaModelRunner::Impl::check_view(int group_index, const void* data, std::int64_t size_elems,
                                         ComputeType type, const char* what) const {
  const GroupLayout& layout = layouts_[static_cast<std::size_t>(group_index)];
  const std::string& name = model_->groups()[static_cast<std::size_t>(group_index)].name;
  if (data == nullptr) {
    return Status::invalid_argument(str_cat("group ", name, ": the ", what, " buffer is null"));
  }
  if (size_elems < layout.size_elems) {
    return Status::invalid_argument(str_cat("group ", name, ": ", what, " buffer holds ", size_elems,
                                            " elements, its layout needs ", layout.size_elems));
  }
  if (reinterpret_cast<std::uintptr_t>(data) % compute_type_bytes(type) != 0) {
    return Status::invalid_argument(str_cat("group ", name, ": ", what, " buffer at ", data,
                                            " is not aligned to its element type (", compute_type_name(type),
                                            ")"));
  }
  cudaPointerAttributes attr{};
  STRATA_RETURN_IF_ERROR(cuda_check(cudaPointerGetAttributes(&attr, data), "cudaPointerGetAttributes"));
  const bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (!on_device || attr.device != ordinal_) {
    return Status::invalid_argument(str_cat("group ", name, ": ", what, " buffer at ", data,
                                            " is not device memory of CUDA device ", ordinal_,
                                            " (the runner's; use the *_host path for host memory)"));
  }
  return Status();
}

Status CudaModelRunner::Impl::load_weights(int group_index, const CudaWeights& weights) {
  const GroupDesc& gd = model_->groups()[static_cast<std::size_t>(group_index)];
  const GroupLayout& layout = layouts_[static_cast<std::size_t>(group_index)];
  const auto* src = static_cast<const std::byte*>(weights.data);
  for (std::size_t i = 0; i < gd.param_indices.size(); ++i) {
    const std::int64_t n = model_->params()[static_cast<std::size_t>(gd.param_indices[i])].num_elems;
    const std::byte* p = src + static_cast<std::size_t>(layout.offset_elems[i]) * compute_type_bytes(weights.type);
    STRATA_RETURN_IF_ERROR(cuda_check(
        cuda::launch_to_fp32(weights_f32_ + slots_[static_cast<std::size_t>(group_index)][i], p,
                             elem_of(weights.type), n, stream_),
        "launch_to_fp32"));
  }
  return Status();
}

Status CudaModelRunner::Impl::store_grads(int group_index, const CudaGrads& grads) {
  const GroupDesc& gd = model_->groups()[static_cast<std::size_t>(group_index)];
  const GroupLayout& layout = layouts_[static_cast<std::size_t>(group_index)];
  auto* dst = static_cast<std::byte*>(grads.data);
  for (std::size_t i = 0; i < gd.param_indices.size(); ++i) {
    const std::int64_t n = model_->params()[static_cast<std::size_t>(gd.param_indices[i])].num_elems;
    std::byte* p = dst + static_cast<std::size_t>(layout.offset_elems[i]) * compute_type_bytes(grads.type);
    STRATA_RETURN_IF_ERROR(cuda_check(
        cuda::launch_from_fp32(p, elem_of(grads.type), grads_f32_ + slots_[static_cast<std::size_t>(group_index)][i],
                               n, stream_),
        "launch_from_fp32"));
  }
  return Status();
}

Status CudaModelRunner::Impl::matmul_xwt(const float* x, const float* wt, float* out, std::int64_t m,
                                         std::int64_t n, std::int64_t k) const {
  // Column-major: out^T[n, m] = w[n, k] x^T[k, m]; w is stored as w^T (k x n).
  const float one = 1.0f, zero = 0.0f;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  return cublas_check(
      cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, ni, mi, ki, &one, wt, ki, x, ki, &zero, out, ni),
      "cublasSgemm");
}

Status CudaModelRunner::Impl::matmul_dytx(const float* dy, const float* x, float* dw, std::int64_t m,
                                          std::int64_t n, std::int64_t k) const {
  // Column-major: dw^T[k, n] = x^T[k, m] dy[m, n]; dy is stored as dy^T (n x m).
  const float one = 1.0f, zero = 0.0f;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  return cublas_check(
      cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, ki, ni, mi, &one, x, ki, dy, ni, &zero, dw, ki),
      "cublasSgemm");
}

Status CudaModelRunner::Impl::matmul_dyw(const float* dy, const float* wt, float* dx, std::int64_t m,
                                         std::int64_t n, std::int64_t k) const {
  // Column-major: dx^T[k, m] = w^T[k, n] dy^T[n, m].
  const float one = 1.0f, zero = 0.0f;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  return cublas_check(
      cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, ki, mi, ni, &one, wt, ki, dy, ni, &zero, dx, ki),
      "cublasSgemm");
}

Status CudaModelRunner::Impl::begin(const Batch& batch, float loss_scale) {
  const ModelSpec& s = model_->spec();
  if (static_cast<std::int64_t>(batch.inputs.size()) != s.batch * s.input_dim ||
      static_cast<std::int64_t>(batch.targets.size()) != s.batch * s.output_dim) {
    return Status::invalid_argument(str_cat("CudaModelRunner::begin: batch has ", batch.inputs.size(),
                                            " inputs and ", batch.targets.size(), " targets, the model wants ",
                                            s.batch * s.input_dim, " and ", s.batch * s.output_dim));
  }
  STRATA_RETURN_IF_ERROR(activate());
  STRATA_RETURN_IF_ERROR(cuda_check(cudaMemcpyAsync(inputs_, batch.inputs.data(), batch.inputs.size() * 4,
                                                    cudaMemcpyHostToDevice, stream_),
                                    "cudaMemcpyAsync"));
  STRATA_RETURN_IF_ERROR(cuda_check(cudaMemcpyAsync(targets_, batch.targets.data(), batch.targets.size() * 4,
                                                    cudaMemcpyHostToDevice, stream_),
                                    "cudaMemcpyAsync"));
  STRATA_RETURN_IF_ERROR(sync());
  loss_scale_ = loss_scale;
  next_forward_ = 0;
  next_backward_ = -1;
  forward_done_ = false;
  return Status();
}

Status CudaModelRunner::Impl::forward_group(int group_index, const CudaWeights& weights) {
  if (group_index != next_forward_) {
    return Status::failed_precondition(str_cat(
        "forward_group(", group_index, "): expected group ", next_forward_,
        next_forward_ == model_->num_groups() ? " (none: forward is complete; call begin)" : ""));
  }
  STRATA_RETURN_IF_ERROR(activate());
  STRATA_RETURN_IF_ERROR(check_view(group_index, weights.data, weights.size_elems, weights.type, "weight"));
  STRATA_RETURN_IF_ERROR(load_weights(group_index, weights));
  const int last = model_->num_groups() - 1;
  if (group_index == 0) {
    STRATA_RETURN_IF_ERROR(forward_embed());
  } else if (group_index == last) {
    STRATA_RETURN_IF_ERROR(forward_head());
  } else {
    STRATA_RETURN_IF_ERROR(forward_block(group_index - 1));
  }
  if (group_index == last) {
    STRATA_RETURN_IF_ERROR(
        cuda_check(cudaMemcpyAsync(&loss_, loss_dev_, sizeof(double), cudaMemcpyDeviceToHost, stream_),
                   "cudaMemcpyAsync"));
  }
  STRATA_RETURN_IF_ERROR(sync());
  ++next_forward_;
  if (group_index == last) {
    forward_done_ = true;
    next_backward_ = last;
  }
  return Status();
}

Status CudaModelRunner::Impl::backward_group(int group_index, const CudaWeights& weights, const CudaGrads& grads) {
  if (!forward_done_ || group_index != next_backward_) {
    return Status::failed_precondition(
        forward_done_ ? str_cat("backward_group(", group_index, "): expected group ", next_backward_)
                      : str_cat("backward_group(", group_index, "): the forward pass is not complete"));
  }
  STRATA_RETURN_IF_ERROR(activate());
  STRATA_RETURN_IF_ERROR(check_view(group_index, weights.data, weights.size_elems, weights.type, "weight"));
  const bool frozen = grads.empty();
  if (!frozen) {
    STRATA_RETURN_IF_ERROR(check_view(group_index, grads.data, grads.size_elems, grads.type, "gradient"));
  }
  const int last = model_->num_groups() - 1;
  if (group_index != 0) STRATA_RETURN_IF_ERROR(load_weights(group_index, weights));  // embed's are not needed
  if (group_index == last) {
    STRATA_RETURN_IF_ERROR(backward_head(frozen));
  } else if (group_index == 0) {
    STRATA_RETURN_IF_ERROR(backward_embed(frozen));
  } else {
    STRATA_RETURN_IF_ERROR(backward_block(group_index - 1, frozen));
  }
  if (!frozen) STRATA_RETURN_IF_ERROR(store_grads(group_index, grads));
  STRATA_RETURN_IF_ERROR(sync());
  --next_backward_;
  return Status();
}

Status CudaModelRunner::Impl::outputs(std::span<float> out) const {
  const ModelSpec& s = model_->spec();
  if (static_cast<std::int64_t>(out.size()) != s.batch * s.output_dim) {
    return Status::invalid_argument(str_cat("CudaModelRunner::outputs: ", out.size(), " values, the outputs are ",
                                            s.batch * s.output_dim));
  }
  STRATA_RETURN_IF_ERROR(activate());
  STRATA_RETURN_IF_ERROR(cuda_check(
      cudaMemcpyAsync(out.data(), outputs_, out.size_bytes(), cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync"));
  return sync();
}

// Parameter order inside each group follows ResidualMlp::create:
//   embed: w, b;  block: norm.gain, w1, b1, w2, b2;  head: norm.gain, w, b.

Status CudaModelRunner::Impl::forward_embed() {
  const ModelSpec& s = model_->spec();
  STRATA_RETURN_IF_ERROR(matmul_xwt(inputs_, w(0, 0), h_[0], s.batch, s.hidden_dim, s.input_dim));
  return cuda_check(cuda::launch_add_bias(h_[0], w(0, 1), s.batch, s.hidden_dim, stream_), "launch_add_bias");
}

Status CudaModelRunner::Impl::forward_block(int block) {
  const ModelSpec& s = model_->spec();
  const int gi = block + 1;
  BlockActs& a = blocks_[static_cast<std::size_t>(block)];
  const float* h_in = h_[static_cast<std::size_t>(block)];
  float* h_out = h_[static_cast<std::size_t>(block + 1)];
  STRATA_RETURN_IF_ERROR(cuda_check(cuda::launch_rmsnorm_forward(h_in, w(gi, 0), s.batch, s.hidden_dim,
                                                                 ResidualMlp::kNormEps, a.norm.inv_rms,
                                                                 a.norm.normed, a.norm.scaled, stream_),
                                    "launch_rmsnorm_forward"));
  STRATA_RETURN_IF_ERROR(matmul_xwt(a.norm.scaled, w(gi, 1), a.pre, s.batch, s.ffn_dim, s.hidden_dim));
  STRATA_RETURN_IF_ERROR(
      cuda_check(cuda::launch_bias_gelu(a.pre, a.act, w(gi, 2), s.batch, s.ffn_dim, stream_), "launch_bias_gelu"));
  STRATA_RETURN_IF_ERROR(matmul_xwt(a.act, w(gi, 3), h_out, s.batch, s.hidden_dim, s.ffn_dim));
  return cuda_check(cuda::launch_residual_bias(h_out, h_in, w(gi, 4), s.batch, s.hidden_dim, stream_),
                    "launch_residual_bias");
}

Status CudaModelRunner::Impl::forward_head() {
  const ModelSpec& s = model_->spec();
  const int gi = model_->num_groups() - 1;
  STRATA_RETURN_IF_ERROR(cuda_check(
      cuda::launch_rmsnorm_forward(h_.back(), w(gi, 0), s.batch, s.hidden_dim, ResidualMlp::kNormEps,
                                   head_norm_.inv_rms, head_norm_.normed, head_norm_.scaled, stream_),
      "launch_rmsnorm_forward"));
  STRATA_RETURN_IF_ERROR(matmul_xwt(head_norm_.scaled, w(gi, 1), outputs_, s.batch, s.output_dim, s.hidden_dim));
  STRATA_RETURN_IF_ERROR(
      cuda_check(cuda::launch_add_bias(outputs_, w(gi, 2), s.batch, s.output_dim, stream_), "launch_add_bias"));
  return cuda_check(cuda::launch_mse_loss(outputs_, targets_, s.batch * s.output_dim, loss_dev_, stream_),
                    "launch_mse_loss");
}

Status CudaModelRunner::Impl::backward_head(bool frozen) {
  const ModelSpec& s = model_->spec();
  const int gi = model_->num_groups() - 1;
  const std::int64_t n_out = s.batch * s.output_dim;
  // d(loss_scale * loss)/dy = loss_scale * 2 (y - t) / (batch * outputs).
  const auto coef = static_cast<float>(2.0 * loss_scale_ / static_cast<double>(n_out));
  STRATA_RETURN_IF_ERROR(
      cuda_check(cuda::launch_mse_grad(outputs_, targets_, n_out, coef, d_out_, stream_), "launch_mse_grad"));
  if (!frozen) {
    STRATA_RETURN_IF_ERROR(matmul_dytx(d_out_, head_norm_.scaled, g(gi, 1), s.batch, s.output_dim, s.hidden_dim));
    STRATA_RETURN_IF_ERROR(cuda_check(cuda::launch_column_sums(d_out_, nullptr, s.batch, s.output_dim, g(gi, 2),
                                                               stream_),
                                      "launch_column_sums"));
  }
  STRATA_RETURN_IF_ERROR(matmul_dyw(d_out_, w(gi, 1), d_norm_, s.batch, s.output_dim, s.hidden_dim));
  if (!frozen) {
    STRATA_RETURN_IF_ERROR(cuda_check(
        cuda::launch_column_sums(d_norm_, head_norm_.normed, s.batch, s.hidden_dim, g(gi, 0), stream_),
        "launch_column_sums"));
  }
  STRATA_RETURN_IF_ERROR(cuda_check(
      cudaMemsetAsync(d_stream_, 0, static_cast<std::size_t>(s.batch * s.hidden_dim) * 4, stream_),
      "cudaMemsetAsync"));
  return cuda_check(cuda::launch_rmsnorm_backward(d_norm_, w(gi, 0), head_norm_.inv_rms, head_norm_.normed,
                                                  s.batch, s.hidden_dim, d_stream_, stream_),
                    "launch_rmsnorm_backward");
}

Status CudaModelRunner::Impl::backward_block(int block, bool frozen) {
  const ModelSpec& s = model_->spec();
  const int gi = block + 1;
  const BlockActs& a = blocks_[static_cast<std::size_t>(block)];
  // h_out = h_in + w2 act + b2: d_stream_ (d h_out) is the branch's output
  // gradient and, unchanged, part of d h_in.
  if (!frozen) {
    STRATA_RETURN_IF_ERROR(cuda_check(
        cuda::launch_column_sums(d_stream_, nullptr, s.batch, s.hidden_dim, g(gi, 4), stream_),
        "launch_column_sums"));
    STRATA_RETURN_IF_ERROR(matmul_dytx(d_stream_, a.act, g(gi, 3), s.batch, s.hidden_dim, s.ffn_dim));
  }
  STRATA_RETURN_IF_ERROR(matmul_dyw(d_stream_, w(gi, 3), d_ffn_, s.batch, s.hidden_dim, s.ffn_dim));
  STRATA_RETURN_IF_ERROR(
      cuda_check(cuda::launch_gelu_backward(d_ffn_, a.pre, s.batch * s.ffn_dim, stream_), "launch_gelu_backward"));
  if (!frozen) {
    STRATA_RETURN_IF_ERROR(cuda_check(
        cuda::launch_column_sums(d_ffn_, nullptr, s.batch, s.ffn_dim, g(gi, 2), stream_), "launch_column_sums"));
    STRATA_RETURN_IF_ERROR(matmul_dytx(d_ffn_, a.norm.scaled, g(gi, 1), s.batch, s.ffn_dim, s.hidden_dim));
  }
  STRATA_RETURN_IF_ERROR(matmul_dyw(d_ffn_, w(gi, 1), d_norm_, s.batch, s.ffn_dim, s.hidden_dim));
  if (!frozen) {
    STRATA_RETURN_IF_ERROR(cuda_check(
        cuda::launch_column_sums(d_norm_, a.norm.normed, s.batch, s.hidden_dim, g(gi, 0), stream_),
        "launch_column_sums"));
  }
  return cuda_check(cuda::launch_rmsnorm_backward(d_norm_, w(gi, 0), a.norm.inv_rms, a.norm.normed, s.batch,
                                                  s.hidden_dim, d_stream_, stream_),
                    "launch_rmsnorm_backward");
}

Status CudaModelRunner::Impl::backward_embed(bool frozen) {
  if (frozen) return Status();  // and nothing lies below
  const ModelSpec& s = model_->spec();
  STRATA_RETURN_IF_ERROR(matmul_dytx(d_stream_, inputs_, g(0, 0), s.batch, s.hidden_dim, s.input_dim));
  return cuda_check(cuda::launch_column_sums(d_stream_, nullptr, s.batch, s.hidden_dim, g(0, 1), stream_),
                    "launch_column_sums");
}

// --- the public class ---------------------------------------------------------

core::Result<CudaModelRunner> CudaModelRunner::create(const ResidualMlp& model, std::vector<GroupLayout> layouts,
                                                      const CudaRunnerOptions& options) {
  if (static_cast<int>(layouts.size()) != model.num_groups()) {
    return Status::invalid_argument(str_cat("CudaModelRunner: ", layouts.size(), " layouts for ",
                                            model.num_groups(), " groups"));
  }
  for (int gi = 0; gi < model.num_groups(); ++gi) {
    STRATA_RETURN_IF_ERROR(model.check_layout(gi, layouts[static_cast<std::size_t>(gi)]));
  }
  auto impl = std::make_unique<Impl>();
  STRATA_RETURN_IF_ERROR(impl->init(model, std::move(layouts), options));
  return CudaModelRunner(std::move(impl));
}

CudaModelRunner::CudaModelRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModelRunner::CudaModelRunner(CudaModelRunner&& other) noexcept = default;
CudaModelRunner& CudaModelRunner::operator=(CudaModelRunner&& other) noexcept = default;
CudaModelRunner::~CudaModelRunner() = default;

void* CudaModelRunner::native_stream() const { return impl_->native_stream(); }
int CudaModelRunner::device_ordinal() const { return impl_->device_ordinal(); }
core::Status CudaModelRunner::begin(const Batch& batch, float loss_scale) { return impl_->begin(batch, loss_scale); }
core::Status CudaModelRunner::forward_group(int group_index, const CudaWeights& weights) {
  return impl_->forward_group(group_index, weights);
}
double CudaModelRunner::loss() const { return impl_->loss(); }
core::Status CudaModelRunner::outputs(std::span<float> out) const { return impl_->outputs(out); }
core::Status CudaModelRunner::backward_group(int group_index, const CudaWeights& weights, const CudaGrads& grads) {
  return impl_->backward_group(group_index, weights, grads);
}

}  // namespace strata::examples
