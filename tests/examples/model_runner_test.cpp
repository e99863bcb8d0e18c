// Forward and backward of the example model: gradients against finite
// differences of an independent double-precision reference, bit-identical
// results across runs and layouts, loss scaling, frozen groups, call order,
// and short training runs (fp32 and bf16 compute copies).
#include "examples/model/model_runner.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/status.h"
#include "examples/model/precision.h"
#include "examples/model/prng.h"
#include "examples/model/residual_mlp.h"
#include "tests/examples/model_harness.h"

namespace strata::examples {
namespace {

using testing::forward_backward;
using testing::forward_only;
using testing::GroupBuffers;
using testing::make_buffers;
using testing::packed_layouts;
using testing::param_view;
using testing::reversed_padded_layouts;
using testing::sgd_step;

ModelSpec tiny_spec() {
  return ModelSpec{.input_dim = 3,
                   .hidden_dim = 4,
                   .ffn_dim = 5,
                   .output_dim = 2,
                   .depth = 2,
                   .teacher_hidden_dim = 3,
                   .batch = 4,
                   .seed = 11};
}

ModelSpec train_spec() {
  return ModelSpec{.input_dim = 16,
                   .hidden_dim = 32,
                   .ffn_dim = 64,
                   .output_dim = 4,
                   .depth = 3,
                   .teacher_hidden_dim = 16,
                   .batch = 64,
                   .seed = 5};
}

ResidualMlp make_model(const ModelSpec& spec) {
  auto model = ResidualMlp::create(spec);
  STRATA_CHECK(model.ok()) << model.status().to_string();
  return std::move(model).value();
}

ModelRunner make_runner(const ResidualMlp& model, std::vector<GroupLayout> layouts) {
  auto runner = ModelRunner::create(model, std::move(layouts));
  STRATA_CHECK(runner.ok()) << runner.status().to_string();
  return std::move(runner).value();
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// ---------------------------------------------------------------------------
// The reference: the model's formula (residual_mlp.h) written directly in
// double, one sample at a time, parameters by name.
// ---------------------------------------------------------------------------

using RefParams = std::map<std::string, std::vector<double>>;

RefParams ref_params(const ResidualMlp& model, GroupBuffers& b) {
  RefParams p;
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    std::span<float> v = param_view(model, b.layouts, b.weights, pi);
    p[model.params()[static_cast<std::size_t>(pi)].name] =
        std::vector<double>(v.begin(), v.end());
  }
  return p;
}

// y = W x + b for W [out, in].
std::vector<double> ref_linear(const std::vector<double>& w, const std::vector<double>& b,
                               const std::vector<double>& x) {
  std::vector<double> y(b);
  for (std::size_t j = 0; j < y.size(); ++j) {
    for (std::size_t k = 0; k < x.size(); ++k) y[j] += w[j * x.size() + k] * x[k];
  }
  return y;
}

std::vector<double> ref_norm(const std::vector<double>& x, const std::vector<double>& gain) {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  const double ir = 1.0 / std::sqrt(ms + static_cast<double>(ResidualMlp::kNormEps));
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * ir * gain[i];
  return y;
}

double ref_gelu(double u) {
  const double c = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * u * (1.0 + std::tanh(c * (u + 0.044715 * u * u * u)));
}

double ref_loss(const ModelSpec& s, const RefParams& p, const Batch& batch) {
  double sum_sq = 0.0;
  for (std::int64_t r = 0; r < s.batch; ++r) {
    std::vector<double> x(batch.inputs.begin() + r * s.input_dim,
                          batch.inputs.begin() + (r + 1) * s.input_dim);
    std::vector<double> h = ref_linear(p.at("embed.w"), p.at("embed.b"), x);
    for (std::int64_t i = 0; i < s.depth; ++i) {
      const std::string g = "blocks." + std::to_string(i);
      std::vector<double> u =
          ref_linear(p.at(g + ".w1"), p.at(g + ".b1"), ref_norm(h, p.at(g + ".norm.gain")));
      for (double& v : u) v = ref_gelu(v);
      const std::vector<double> branch = ref_linear(p.at(g + ".w2"), p.at(g + ".b2"), u);
      for (std::size_t j = 0; j < h.size(); ++j) h[j] += branch[j];
    }
    const std::vector<double> y =
        ref_linear(p.at("head.w"), p.at("head.b"), ref_norm(h, p.at("head.norm.gain")));
    for (std::int64_t j = 0; j < s.output_dim; ++j) {
      const double e = y[static_cast<std::size_t>(j)] - batch.targets[r * s.output_dim + j];
      sum_sq += e * e;
    }
  }
  return sum_sq / static_cast<double>(s.batch * s.output_dim);
}

// Moves every parameter away from its initial value (gains off 1, biases off
// 0) so that no term of the gradient hides behind a special value.
void perturb(const ResidualMlp& model, GroupBuffers& b, float scale) {
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    std::span<float> w = param_view(model, b.layouts, b.weights, pi);
    const std::uint64_t key = stream_key(99, static_cast<std::uint64_t>(pi));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] += scale * gaussian(key, i);
  }
}

TEST(ModelRunner, ForwardMatchesTheDoubleReference) {
  const ResidualMlp model = make_model(train_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  perturb(model, b, 0.1f);
  ModelRunner runner = make_runner(model, b.layouts);
  for (int step = 0; step < 3; ++step) {
    const Batch batch = model.make_batch(step);
    const double loss = forward_only(runner, b, batch);
    const double want = ref_loss(model.spec(), ref_params(model, b), batch);
    EXPECT_NEAR(loss, want, 1e-5 * want) << "step " << step;
  }
}

TEST(ModelRunner, GradientsMatchFiniteDifferencesInDouble) {
  const ResidualMlp model = make_model(tiny_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  perturb(model, b, 0.3f);
  ModelRunner runner = make_runner(model, b.layouts);
  const Batch batch = model.make_batch(0);
  const double loss = forward_backward(runner, b, batch);

  RefParams p = ref_params(model, b);
  EXPECT_NEAR(loss, ref_loss(model.spec(), p, batch), 1e-5 * loss);
  // Central differences on the double reference: truncation error O(h^2),
  // rounding error O(1e-16 / h); both far below fp32's precision.
  constexpr double kH = 1e-6;
  double max_abs_grad = 0.0;
  std::map<std::string, std::vector<double>> fd;
  for (const ParamDesc& desc : model.params()) {
    std::vector<double>& v = p.at(desc.name);
    std::vector<double>& out = fd[desc.name];
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double saved = v[i];
      v[i] = saved + kH;
      const double up = ref_loss(model.spec(), p, batch);
      v[i] = saved - kH;
      const double down = ref_loss(model.spec(), p, batch);
      v[i] = saved;
      out.push_back((up - down) / (2.0 * kH));
      max_abs_grad = std::max(max_abs_grad, std::abs(out.back()));
    }
  }
  ASSERT_GT(max_abs_grad, 1e-3);
  int checked = 0;
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    const ParamDesc& desc = model.params()[static_cast<std::size_t>(pi)];
    std::span<float> got = param_view(model, b.layouts, b.grads, pi);
    const std::vector<double>& want = fd.at(desc.name);
    double param_max = 0.0;
    for (double w : want) param_max = std::max(param_max, std::abs(w));
    EXPECT_GT(param_max, 1e-6) << desc.name << " has no gradient at all";
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double tol = 1e-3 * std::abs(want[i]) + 1e-5 * max_abs_grad;
      EXPECT_NEAR(got[i], want[i], tol) << desc.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, model.num_params_elems());
}

// Trains `steps` SGD steps; returns the losses. Weights end in `b`.
std::vector<double> train_sgd(const ResidualMlp& model, GroupBuffers& b, int steps) {
  ModelRunner runner = make_runner(model, b.layouts);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    losses.push_back(forward_backward(runner, b, model.make_batch(step)));
    sgd_step(model, b, 0.05f);
  }
  return losses;
}

TEST(ModelRunner, SameSeedGivesSameBitsTwice) {
  const ResidualMlp model_a = make_model(train_spec());
  const ResidualMlp model_b = make_model(train_spec());
  GroupBuffers a = make_buffers(model_a, packed_layouts(model_a));
  GroupBuffers b = make_buffers(model_b, packed_layouts(model_b));
  const std::vector<double> losses_a = train_sgd(model_a, a, 5);
  const std::vector<double> losses_b = train_sgd(model_b, b, 5);
  ASSERT_EQ(losses_a.size(), losses_b.size());
  for (std::size_t i = 0; i < losses_a.size(); ++i) {
    EXPECT_EQ(std::memcmp(&losses_a[i], &losses_b[i], sizeof(double)), 0) << "step " << i;
  }
  for (int g = 0; g < model_a.num_groups(); ++g) {
    EXPECT_TRUE(same_bits(a.weights[static_cast<std::size_t>(g)],
                          b.weights[static_cast<std::size_t>(g)]))
        << model_a.groups()[static_cast<std::size_t>(g)].name;
    EXPECT_TRUE(same_bits(a.grads[static_cast<std::size_t>(g)],
                          b.grads[static_cast<std::size_t>(g)]))
        << model_a.groups()[static_cast<std::size_t>(g)].name;
  }
}

TEST(ModelRunner, LayoutDoesNotChangeAnyBit) {
  const ResidualMlp model = make_model(train_spec());
  GroupBuffers packed = make_buffers(model, packed_layouts(model));
  // Reversed order with 3 padding elements before each parameter: different
  // offsets and alignments; the weight padding is NaN, so reading it would show.
  GroupBuffers padded = make_buffers(model, reversed_padded_layouts(model, 3));
  const std::vector<double> losses_packed = train_sgd(model, packed, 4);
  const std::vector<double> losses_padded = train_sgd(model, padded, 4);
  for (std::size_t i = 0; i < losses_packed.size(); ++i) {
    EXPECT_EQ(std::memcmp(&losses_packed[i], &losses_padded[i], sizeof(double)), 0)
        << "step " << i;
  }
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    const std::string& name = model.params()[static_cast<std::size_t>(pi)].name;
    EXPECT_TRUE(same_bits(param_view(model, packed.layouts, packed.weights, pi),
                          param_view(model, padded.layouts, padded.weights, pi)))
        << name;
    EXPECT_TRUE(same_bits(param_view(model, packed.layouts, packed.grads, pi),
                          param_view(model, padded.layouts, padded.grads, pi)))
        << name;
  }
  // The gradient padding was never written.
  for (int g = 0; g < model.num_groups(); ++g) {
    const GroupLayout& layout = padded.layouts[static_cast<std::size_t>(g)];
    const std::vector<float>& grads = padded.grads[static_cast<std::size_t>(g)];
    std::vector<bool> inside(grads.size(), false);
    const GroupDesc& desc = model.groups()[static_cast<std::size_t>(g)];
    for (std::size_t i = 0; i < desc.param_indices.size(); ++i) {
      const std::int64_t n =
          model.params()[static_cast<std::size_t>(desc.param_indices[i])].num_elems;
      for (std::int64_t k = 0; k < n; ++k) {
        inside[static_cast<std::size_t>(layout.offset_elems[i] + k)] = true;
      }
    }
    for (std::size_t k = 0; k < grads.size(); ++k) {
      if (!inside[k]) {
        EXPECT_EQ(grads[k], testing::kGradPadding) << desc.name << " at " << k;
      }
    }
  }
}

TEST(ModelRunner, LossScaleScalesGradientsExactly) {
  const ResidualMlp model = make_model(train_spec());
  GroupBuffers one = make_buffers(model, packed_layouts(model));
  GroupBuffers scaled = make_buffers(model, packed_layouts(model));
  ModelRunner runner = make_runner(model, one.layouts);
  const Batch batch = model.make_batch(0);
  const double loss_one = forward_backward(runner, one, batch, 1.0f);
  const double loss_scaled = forward_backward(runner, scaled, batch, 1024.0f);
  EXPECT_EQ(loss_one, loss_scaled);  // the reported loss is never scaled
  for (std::size_t g = 0; g < one.grads.size(); ++g) {
    for (std::size_t i = 0; i < one.grads[g].size(); ++i) {
      // A power of two scales every product and sum exactly.
      ASSERT_EQ(one.grads[g][i] * 1024.0f, scaled.grads[g][i]) << "group " << g << " at " << i;
    }
  }
}

TEST(ModelRunner, FrozenGroupsStillPassGradientsDown) {
  const ResidualMlp model = make_model(train_spec());
  GroupBuffers full = make_buffers(model, packed_layouts(model));
  GroupBuffers frozen = make_buffers(model, packed_layouts(model));
  ModelRunner runner = make_runner(model, full.layouts);
  const Batch batch = model.make_batch(2);
  forward_backward(runner, full, batch);

  // Everything but the embedding frozen: no gradient buffers above it.
  ASSERT_TRUE(runner.begin(batch, 1.0f).ok());
  const int n = model.num_groups();
  for (int g = 0; g < n; ++g) ASSERT_TRUE(runner.forward_group(g, frozen.weights[g]).ok());
  for (int g = n - 1; g >= 1; --g) {
    ASSERT_TRUE(runner.backward_group(g, frozen.weights[g], {}).ok());
    for (float v : frozen.grads[g]) ASSERT_EQ(v, testing::kGradPadding);
  }
  ASSERT_TRUE(runner.backward_group(0, frozen.weights[0], frozen.grads[0]).ok());
  EXPECT_TRUE(same_bits(full.grads[0], frozen.grads[0]));
}

TEST(ModelRunner, OutOfOrderCallsFailWithoutEffect) {
  const ResidualMlp model = make_model(tiny_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  ModelRunner runner = make_runner(model, b.layouts);
  const Batch batch = model.make_batch(0);
  ASSERT_TRUE(runner.begin(batch, 1.0f).ok());
  EXPECT_EQ(runner.forward_group(1, b.weights[1]).code(), core::StatusCode::kFailedPrecondition);
  EXPECT_EQ(runner.backward_group(0, b.weights[0], b.grads[0]).code(),
            core::StatusCode::kFailedPrecondition);
  const int n = model.num_groups();
  for (int g = 0; g < n; ++g) ASSERT_TRUE(runner.forward_group(g, b.weights[g]).ok());
  EXPECT_EQ(runner.forward_group(0, b.weights[0]).code(), core::StatusCode::kFailedPrecondition);
  EXPECT_EQ(runner.backward_group(0, b.weights[0], b.grads[0]).code(),
            core::StatusCode::kFailedPrecondition);
  // A buffer smaller than the layout.
  std::span<const float> short_weights(b.weights[n - 1].data(), b.weights[n - 1].size() - 1);
  core::Status s = runner.backward_group(n - 1, short_weights, b.grads[n - 1]);
  EXPECT_EQ(s.code(), core::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("head"), std::string_view::npos) << s.to_string();
  for (int g = n - 1; g >= 0; --g) {
    ASSERT_TRUE(runner.backward_group(g, b.weights[g], b.grads[g]).ok()) << g;
  }
  // A batch of the wrong shape; bad layouts.
  Batch wrong = batch;
  wrong.inputs.pop_back();
  EXPECT_EQ(runner.begin(wrong, 1.0f).code(), core::StatusCode::kInvalidArgument);
  std::vector<GroupLayout> layouts = packed_layouts(model);
  layouts.pop_back();
  EXPECT_EQ(ModelRunner::create(model, layouts).status().code(),
            core::StatusCode::kInvalidArgument);
}

// Adam written here in fp32 (Kingma & Ba 2015, Algorithm 1), no weight decay.
struct AdamState {
  std::vector<std::vector<float>> m, v;
};

void adam_step(const ResidualMlp& model, GroupBuffers& b, AdamState& st, int t, float lr) {
  constexpr float kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f;
  if (st.m.empty()) {
    for (const auto& w : b.weights) {
      st.m.emplace_back(w.size(), 0.0f);
      st.v.emplace_back(w.size(), 0.0f);
    }
  }
  const float bc1 = 1.0f - std::pow(kBeta1, static_cast<float>(t));
  const float bc2 = 1.0f - std::pow(kBeta2, static_cast<float>(t));
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    std::span<float> w = param_view(model, b.layouts, b.weights, pi);
    std::span<float> g = param_view(model, b.layouts, b.grads, pi);
    std::span<float> m = param_view(model, b.layouts, st.m, pi);
    std::span<float> v = param_view(model, b.layouts, st.v, pi);
    for (std::size_t i = 0; i < w.size(); ++i) {
      m[i] = kBeta1 * m[i] + (1.0f - kBeta1) * g[i];
      v[i] = kBeta2 * v[i] + (1.0f - kBeta2) * g[i] * g[i];
      w[i] -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + kEps);
    }
  }
}

// Mean loss over a few held-out batches (negative steps are never trained on).
double eval_loss(const ResidualMlp& model, ModelRunner& runner, const GroupBuffers& b) {
  double sum = 0.0;
  for (int k = 1; k <= 4; ++k) sum += forward_only(runner, b, model.make_batch(-k));
  return sum / 4.0;
}

// The loss of always predicting 0 on the same held-out batches (the targets'
// mean square): a student below half of it has learned the teacher, not just
// shrunk its own initial outputs.
double zero_predictor_loss(const ResidualMlp& model) {
  double sum = 0.0;
  std::size_t n = 0;
  for (int k = 1; k <= 4; ++k) {
    for (float t : model.make_batch(-k).targets) {
      sum += static_cast<double>(t) * t;
      ++n;
    }
  }
  return sum / static_cast<double>(n);
}

TEST(ModelRunner, AdamHalvesTheLossWithin100Steps) {
  const ResidualMlp model = make_model(train_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  ModelRunner runner = make_runner(model, b.layouts);
  AdamState st;
  const double initial = eval_loss(model, runner, b);
  for (int step = 0; step < 100; ++step) {
    forward_backward(runner, b, model.make_batch(step));
    adam_step(model, b, st, step + 1, 3e-3f);
  }
  const double final_loss = eval_loss(model, runner, b);
  EXPECT_LT(final_loss, 0.5 * initial) << "initial " << initial << ", final " << final_loss;
  EXPECT_LT(final_loss, 0.5 * zero_predictor_loss(model)) << "final " << final_loss;
}

// The engine's mixed-precision shape: fp32 master weights, bf16 compute copies
// fetched and converted, gradients handed back as bf16.
TEST(ModelRunner, Bf16ComputeCopiesTrainToo) {
  const ResidualMlp model = make_model(train_spec());
  GroupBuffers master = make_buffers(model, packed_layouts(model));
  GroupBuffers compute = make_buffers(model, packed_layouts(model));  // fp32 views of bf16
  ModelRunner runner = make_runner(model, compute.layouts);
  AdamState st;
  auto refresh_compute_copies = [&] {
    for (std::size_t g = 0; g < master.weights.size(); ++g) {
      std::vector<std::uint16_t> bits(master.weights[g].size());
      ASSERT_TRUE(fp32_to_bf16(master.weights[g], bits).ok());
      ASSERT_TRUE(bf16_to_fp32(bits, compute.weights[g]).ok());
    }
  };
  refresh_compute_copies();
  const double initial = eval_loss(model, runner, compute);
  for (int step = 0; step < 100; ++step) {
    forward_backward(runner, compute, model.make_batch(step));
    for (std::size_t g = 0; g < compute.grads.size(); ++g) {
      std::vector<std::uint16_t> bits(compute.grads[g].size());
      ASSERT_TRUE(fp32_to_bf16(compute.grads[g], bits).ok());
      ASSERT_TRUE(bf16_to_fp32(bits, master.grads[g]).ok());
    }
    adam_step(model, master, st, step + 1, 3e-3f);
    refresh_compute_copies();
  }
  const double final_loss = eval_loss(model, runner, compute);
  EXPECT_LT(final_loss, 0.5 * initial) << "initial " << initial << ", final " << final_loss;
  EXPECT_LT(final_loss, 0.5 * zero_predictor_loss(model)) << "final " << final_loss;
}

}  // namespace
}  // namespace strata::examples
