// Forward and backward of the example model, one fetch group at a time, on the
// host with OpenBLAS. It keeps the activations between the two passes; the
// weights and gradients live in the caller's (the engine's) flat group buffers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/result.h"
#include "core/status.h"
#include "examples/model/residual_mlp.h"

namespace strata::examples {

// One pass of the step protocol (DESIGN.md section 3) for one micro-batch:
//   begin(batch, loss_scale);
//   for g in 0..G-1:   forward_group(g, weights of g)        (after fetch(g))
//   loss();
//   for g in G-1..0:   backward_group(g, weights of g, gradient buffer of g)
//                                                           (after fetch(g); then grads_ready(g))
// An evaluation pass stops after the forward groups. A new begin() starts over
// at any point. Calls out of this order fail with FAILED_PRECONDITION and
// change nothing.
//
// Weights and gradients are fp32 views of one group's flat buffer, laid out by
// that group's GroupLayout; the runner reads them only during the call (no
// pointer is kept), so the buffers may move between forward and backward.
// Results are bit-identical for every layout and every run on one machine:
// OpenBLAS runs on the calling thread only (see model_runner.cpp).
//
// Thread-compatible: one thread at a time per runner (which one may change
// between calls). The model passed to create() must outlive the runner.
class ModelRunner {
 public:
  // `layouts[g]` is group g's layout; each is checked with
  // ResidualMlp::check_layout (INVALID_ARGUMENT when one is wrong).
  static core::Result<ModelRunner> create(const ResidualMlp& model,
                                          std::vector<GroupLayout> layouts);

  // Starts a pass over `batch` (copied; it must have the model's batch shape,
  // else INVALID_ARGUMENT). `loss_scale` multiplies every gradient (the fp16
  // loss scale the engine reports; 1 for bf16 and fp32); loss() stays unscaled.
  core::Status begin(const Batch& batch, float loss_scale);

  // Forward through group `group_index`, which must be the next one in order.
  // `weights` is the group's flat buffer (at least its layout's size_elems).
  core::Status forward_group(int group_index, std::span<const float> weights);

  // Mean squared error of the last completed forward pass (unscaled), computed
  // in double. Precondition: all groups were forwarded since begin().
  double loss() const;

  // The student's outputs [batch, output_dim] from the last forward pass.
  std::span<const float> outputs() const;

  // Backward through group `group_index`: after the full forward, the groups
  // in reverse order. `weights` as for forward_group (the same values).
  // `grads` is the group's gradient buffer in the same layout: each
  // parameter's range is overwritten with d(loss_scale * loss)/d(parameter);
  // elements outside every parameter's range are left untouched. An empty
  // `grads` means the group is frozen: only the gradient flowing to the
  // groups below is computed.
  core::Status backward_group(int group_index, std::span<const float> weights,
                              std::span<float> grads);

 private:
  ModelRunner() = default;

  // Where the group's i-th parameter lies in its flat buffer (elements).
  struct Range {
    std::size_t offset;
    std::size_t size;
  };
  Range param_range(int group_index, int i) const;
  // The group's i-th parameter (weights or gradients) inside a checked buffer.
  const float* param(int group_index, std::span<const float> buffer, int i) const;
  float* param_grad(int group_index, std::span<float> buffer, int i) const;
  core::Status check_buffer(int group_index, std::size_t size, const char* what) const;

  void forward_embed(std::span<const float> weights);
  void forward_block(int block, std::span<const float> weights);
  void forward_head(std::span<const float> weights);
  void backward_head(std::span<const float> weights, std::span<float> grads);
  void backward_block(int block, std::span<const float> weights, std::span<float> grads);
  void backward_embed(std::span<float> grads);

  // Activations of one rmsnorm(x) * gain: 1/rms per row, the normalised
  // input and the scaled output.
  struct NormActs {
    std::vector<float> inv_rms;  // [batch]
    std::vector<float> normed;   // [batch, hidden]
    std::vector<float> scaled;   // [batch, hidden]
  };
  struct BlockActs {
    NormActs norm;
    std::vector<float> pre;   // w1 a + b1, [batch, ffn]
    std::vector<float> act;   // gelu(pre), [batch, ffn]
  };

  const ResidualMlp* model_ = nullptr;
  std::vector<GroupLayout> layouts_;
  float loss_scale_ = 1.0f;
  int next_forward_ = 0;    // the group forward_group expects next
  int next_backward_ = -1;  // the group backward_group expects next; -1: none
  bool forward_done_ = false;
  Batch batch_;
  std::vector<std::vector<float>> stream_;  // residual stream h_0..h_L, [batch, hidden] each
  std::vector<BlockActs> blocks_;
  NormActs head_norm_;
  std::vector<float> outputs_;  // [batch, output]
  double loss_ = 0.0;
  // Backward scratch.
  std::vector<float> d_stream_;  // d loss / d h_i, [batch, hidden]
  std::vector<float> d_norm_;    // [batch, hidden]
  std::vector<float> d_ffn_;     // [batch, ffn]
  std::vector<float> d_out_;     // [batch, output]
};

}  // namespace strata::examples
