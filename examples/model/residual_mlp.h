// The native example model: a residual MLP student learning a fixed random
// teacher network on Gaussian inputs (synthetic regression, MSE loss). This
// header describes the model (its parameters, fetch groups, initial values,
// layouts) and its data; model_runner.h runs forward and backward group by group.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "core/status.h"

namespace strata::examples {

// Shape of the student, the teacher and the batch. All sizes count elements.
struct ModelSpec {
  std::int64_t input_dim = 32;           // D: features per sample. Default 32.
  std::int64_t hidden_dim = 64;          // H: width of the residual stream. Default 64.
  std::int64_t ffn_dim = 128;            // F: width inside each block. Default 128.
  std::int64_t output_dim = 8;           // O: regression targets per sample. Default 8.
  std::int64_t depth = 4;                // L: residual blocks. Default 4.
  std::int64_t teacher_hidden_dim = 32;  // width of the teacher's hidden layer. Default 32.
  std::int64_t batch = 64;               // samples per micro-batch. Default 64.
  std::uint64_t seed = 1;                // everything (init, teacher, data) derives from it. Default 1.
};

// One trainable tensor. Row-major; a weight matrix is [out, in] (y = x W^T + b).
struct ParamDesc {
  std::string name;                  // "embed.w", "blocks.3.w1", "head.norm.gain"
  std::vector<std::int64_t> shape;   // row-major dimensions
  std::int64_t num_elems = 0;        // product of shape
  int group_index = 0;               // index into ResidualMlp::groups()
  bool no_decay = false;             // norm gains and biases: no weight decay
};

// One fetch group: the parameters the framework needs together (one layer).
struct GroupDesc {
  std::string name;                      // "embed", "blocks.3", "head"
  std::vector<int> param_indices;        // indices into ResidualMlp::params(), in order
  std::int64_t num_elems = 0;            // sum of the parameters' elements (no padding)
};

// Where each parameter of one group lives in the group's flat buffer (weights
// and gradients share it). The engine decides it; packed() is the dense one.
struct GroupLayout {
  // offset_elems[i]: element offset of the group's i-th parameter
  // (GroupDesc::param_indices[i]) in the flat buffer.
  std::vector<std::int64_t> offset_elems;
  // Elements of the flat buffer (at least the end of the last parameter;
  // may include padding, which the model neither reads nor writes).
  std::int64_t size_elems = 0;
};

// One micro-batch: inputs [batch, input_dim] and the teacher's targets
// [batch, output_dim], row-major fp32.
struct Batch {
  std::vector<float> inputs;
  std::vector<float> targets;
};

// The model: student parameters and groups, the teacher, the data.
//
// Student (H = hidden_dim, every linear is y = x W^T + b):
//   h_0 = embed.w x + embed.b                                   group "embed"
//   for i in 0..L-1:                                            group "blocks.i"
//     a   = rmsnorm(h_i) * blocks.i.norm.gain
//     h_{i+1} = h_i + blocks.i.w2 gelu(blocks.i.w1 a + blocks.i.b1) + blocks.i.b2
//   y = head.w (rmsnorm(h_L) * head.norm.gain) + head.b         group "head"
//   loss = mean over batch and outputs of (y - target)^2
// rmsnorm(x) = x / sqrt(mean(x^2) + 1e-5); gelu is the tanh form
// 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))) (Hendrycks & Gimpel, 2016).
// Teacher (fixed, not trained): target = V2 tanh(V1 x + c1), x ~ N(0, I).
//
// Groups are 0 = "embed", 1..L = "blocks.0".."blocks.{L-1}", L+1 = "head";
// forward visits them in that order, backward in reverse.
//
// Immutable after create(): thread-safe.
class ResidualMlp {
 public:
  static constexpr float kNormEps = 1e-5f;

  // Fails with INVALID_ARGUMENT when a size is not positive.
  static core::Result<ResidualMlp> create(const ModelSpec& spec);

  const ModelSpec& spec() const { return spec_; }
  const std::vector<ParamDesc>& params() const { return params_; }
  const std::vector<GroupDesc>& groups() const { return groups_; }
  int num_groups() const { return static_cast<int>(groups_.size()); }
  std::int64_t num_params_elems() const;

  // Initial value of parameter `param_index` (a pure function of the seed and
  // the index): weights N(0, 1/fan_in), the blocks' w2 further scaled by
  // 1/sqrt(2 L), gains 1, biases 0. `out` must hold exactly num_elems values.
  core::Status init_param(int param_index, std::span<float> out) const;

  // Micro-batch number `step` (any integer, negative too): a pure function of
  // the seed and `step`. Inputs are N(0, 1); targets are the teacher's outputs.
  Batch make_batch(std::int64_t step) const;

  // The dense layout of a group: its parameters back to back in order.
  GroupLayout packed_layout(int group_index) const;

  // OK when `layout` has one offset per parameter of the group, each parameter
  // lies inside [0, size_elems) and no two overlap; else INVALID_ARGUMENT
  // naming the group and the parameter.
  core::Status check_layout(int group_index, const GroupLayout& layout) const;

 private:
  ResidualMlp() = default;
  void add_param(const std::string& name, std::vector<std::int64_t> shape, bool no_decay);

  ModelSpec spec_;
  std::vector<ParamDesc> params_;
  std::vector<GroupDesc> groups_;
  // Teacher: v1 [teacher_hidden, input], c1 [teacher_hidden], v2 [output, teacher_hidden].
  std::vector<float> teacher_v1_;
  std::vector<float> teacher_c1_;
  std::vector<float> teacher_v2_;
};

}  // namespace strata::examples
