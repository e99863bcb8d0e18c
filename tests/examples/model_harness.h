// Test helpers for the example model: flat group buffers in a given layout
// (the engine's role), one full forward + backward, and parameter access.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "examples/model/model_runner.h"
#include "examples/model/residual_mlp.h"

namespace strata::examples::testing {

// Padding in weight buffers holds NaN (the model must never read it); padding
// in gradient buffers holds this sentinel (the model must never write it).
inline constexpr float kGradPadding = -12345.0f;

struct GroupBuffers {
  std::vector<GroupLayout> layouts;
  std::vector<std::vector<float>> weights;  // one flat buffer per group
  std::vector<std::vector<float>> grads;    // same layout
};

// Weights initialised with init_param at the layouts' offsets.
inline GroupBuffers make_buffers(const ResidualMlp& model, std::vector<GroupLayout> layouts) {
  GroupBuffers b;
  b.layouts = std::move(layouts);
  for (int g = 0; g < model.num_groups(); ++g) {
    const GroupLayout& layout = b.layouts[static_cast<std::size_t>(g)];
    std::vector<float> w(static_cast<std::size_t>(layout.size_elems),
                         std::numeric_limits<float>::quiet_NaN());
    const GroupDesc& desc = model.groups()[static_cast<std::size_t>(g)];
    for (std::size_t i = 0; i < desc.param_indices.size(); ++i) {
      const ParamDesc& p = model.params()[static_cast<std::size_t>(desc.param_indices[i])];
      std::span<float> dst(w.data() + layout.offset_elems[i],
                           static_cast<std::size_t>(p.num_elems));
      EXPECT_TRUE(model.init_param(desc.param_indices[i], dst).ok());
    }
    b.weights.push_back(std::move(w));
    b.grads.emplace_back(static_cast<std::size_t>(layout.size_elems), kGradPadding);
  }
  return b;
}

inline std::vector<GroupLayout> packed_layouts(const ResidualMlp& model) {
  std::vector<GroupLayout> layouts;
  for (int g = 0; g < model.num_groups(); ++g) layouts.push_back(model.packed_layout(g));
  return layouts;
}

// Parameters in reverse order, each preceded by `gap` padding elements (a
// layout unlike the packed one, with odd alignments when gap is odd).
inline std::vector<GroupLayout> reversed_padded_layouts(const ResidualMlp& model,
                                                        std::int64_t gap) {
  std::vector<GroupLayout> layouts;
  for (const GroupDesc& desc : model.groups()) {
    GroupLayout layout;
    layout.offset_elems.resize(desc.param_indices.size());
    for (std::size_t k = desc.param_indices.size(); k-- > 0;) {
      layout.size_elems += gap;
      layout.offset_elems[k] = layout.size_elems;
      layout.size_elems += model.params()[static_cast<std::size_t>(desc.param_indices[k])].num_elems;
    }
    layout.size_elems += gap;
    layouts.push_back(std::move(layout));
  }
  return layouts;
}

// A view of parameter `param_index` inside a group buffer.
template <typename T>
std::span<T> param_view(const ResidualMlp& model, const std::vector<GroupLayout>& layouts,
                        std::vector<std::vector<T>>& buffers, int param_index) {
  const ParamDesc& p = model.params()[static_cast<std::size_t>(param_index)];
  const GroupDesc& desc = model.groups()[static_cast<std::size_t>(p.group_index)];
  std::size_t local = 0;
  while (desc.param_indices[local] != param_index) ++local;
  const std::int64_t off = layouts[static_cast<std::size_t>(p.group_index)].offset_elems[local];
  return std::span<T>(buffers[static_cast<std::size_t>(p.group_index)].data() + off,
                      static_cast<std::size_t>(p.num_elems));
}

// One full forward and backward over `batch`; returns the loss.
inline double forward_backward(ModelRunner& runner, GroupBuffers& b, const Batch& batch,
                               float loss_scale = 1.0f) {
  EXPECT_TRUE(runner.begin(batch, loss_scale).ok());
  const int n = static_cast<int>(b.weights.size());
  for (int g = 0; g < n; ++g) {
    EXPECT_TRUE(runner.forward_group(g, b.weights[static_cast<std::size_t>(g)]).ok());
  }
  const double loss = runner.loss();
  for (int g = n - 1; g >= 0; --g) {
    EXPECT_TRUE(runner
                    .backward_group(g, b.weights[static_cast<std::size_t>(g)],
                                    b.grads[static_cast<std::size_t>(g)])
                    .ok());
  }
  return loss;
}

// Forward only (an evaluation pass); returns the loss.
inline double forward_only(ModelRunner& runner, const GroupBuffers& b, const Batch& batch) {
  EXPECT_TRUE(runner.begin(batch, 1.0f).ok());
  for (int g = 0; g < static_cast<int>(b.weights.size()); ++g) {
    EXPECT_TRUE(runner.forward_group(g, b.weights[static_cast<std::size_t>(g)]).ok());
  }
  return runner.loss();
}

// Plain SGD over every parameter (padding untouched): w -= lr * g.
inline void sgd_step(const ResidualMlp& model, GroupBuffers& b, float lr) {
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    std::span<float> w = param_view(model, b.layouts, b.weights, pi);
    std::span<float> g = param_view(model, b.layouts, b.grads, pi);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= lr * g[i];
  }
}

}  // namespace strata::examples::testing
