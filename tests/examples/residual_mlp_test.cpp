// The example model's description: parameters, groups, initial values,
// batches and layouts.
#include "examples/model/residual_mlp.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/status.h"

namespace strata::examples {
namespace {

ModelSpec small_spec() {
  return ModelSpec{.input_dim = 5,
                   .hidden_dim = 8,
                   .ffn_dim = 12,
                   .output_dim = 3,
                   .depth = 2,
                   .teacher_hidden_dim = 4,
                   .batch = 6,
                   .seed = 7};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ResidualMlp, ParamsAndGroupsFollowTheSpec) {
  auto model = ResidualMlp::create(small_spec());
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const std::vector<std::string> groups = {"embed", "blocks.0", "blocks.1", "head"};
  ASSERT_EQ(model->num_groups(), 4);
  for (int g = 0; g < 4; ++g) EXPECT_EQ(model->groups()[g].name, groups[g]);

  struct Want {
    const char* name;
    std::vector<std::int64_t> shape;
    int group;
    bool no_decay;
  };
  const std::vector<Want> want = {
      {"embed.w", {8, 5}, 0, false},          {"embed.b", {8}, 0, true},
      {"blocks.0.norm.gain", {8}, 1, true},   {"blocks.0.w1", {12, 8}, 1, false},
      {"blocks.0.b1", {12}, 1, true},         {"blocks.0.w2", {8, 12}, 1, false},
      {"blocks.0.b2", {8}, 1, true},          {"blocks.1.norm.gain", {8}, 2, true},
      {"blocks.1.w1", {12, 8}, 2, false},     {"blocks.1.b1", {12}, 2, true},
      {"blocks.1.w2", {8, 12}, 2, false},     {"blocks.1.b2", {8}, 2, true},
      {"head.norm.gain", {8}, 3, true},       {"head.w", {3, 8}, 3, false},
      {"head.b", {3}, 3, true}};
  ASSERT_EQ(model->params().size(), want.size());
  std::int64_t total = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const ParamDesc& p = model->params()[i];
    EXPECT_EQ(p.name, want[i].name);
    EXPECT_EQ(p.shape, want[i].shape) << p.name;
    EXPECT_EQ(p.group_index, want[i].group) << p.name;
    EXPECT_EQ(p.no_decay, want[i].no_decay) << p.name;
    std::int64_t n = 1;
    for (auto s : p.shape) n *= s;
    EXPECT_EQ(p.num_elems, n) << p.name;
    total += n;
  }
  EXPECT_EQ(model->num_params_elems(), total);
  std::int64_t in_groups = 0;
  for (const GroupDesc& g : model->groups()) in_groups += g.num_elems;
  EXPECT_EQ(in_groups, total);
}

TEST(ResidualMlp, CreateRejectsNonPositiveSizes) {
  ModelSpec spec = small_spec();
  spec.depth = 0;
  auto model = ResidualMlp::create(spec);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), core::StatusCode::kInvalidArgument);
  EXPECT_NE(model.status().message().find("depth"), std::string_view::npos);
}

TEST(ResidualMlp, InitIsAPureFunctionOfSeedAndIndex) {
  auto a = ResidualMlp::create(small_spec());
  auto b = ResidualMlp::create(small_spec());
  ModelSpec other = small_spec();
  other.seed = 8;
  auto c = ResidualMlp::create(other);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (int pi = static_cast<int>(a->params().size()) - 1; pi >= 0; --pi) {  // any order
    const ParamDesc& p = a->params()[static_cast<std::size_t>(pi)];
    std::vector<float> va(static_cast<std::size_t>(p.num_elems));
    std::vector<float> vb(va.size()), vc(va.size());
    ASSERT_TRUE(a->init_param(pi, va).ok());
    ASSERT_TRUE(b->init_param(pi, vb).ok());
    ASSERT_TRUE(c->init_param(pi, vc).ok());
    EXPECT_TRUE(same_bits(va, vb)) << p.name;
    if (p.no_decay) {
      const float want = p.name.ends_with(".gain") ? 1.0f : 0.0f;
      for (float v : va) EXPECT_EQ(v, want) << p.name;
    } else {
      EXPECT_FALSE(same_bits(va, vc)) << p.name << " ignores the seed";
      double sum_sq = 0.0;
      for (float v : va) sum_sq += static_cast<double>(v) * v;
      const double rms = std::sqrt(sum_sq / static_cast<double>(va.size()));
      double want = 1.0 / std::sqrt(static_cast<double>(p.shape[1]));
      if (p.name.ends_with(".w2")) want /= std::sqrt(2.0 * 2);
      EXPECT_GT(rms, 0.4 * want) << p.name;
      EXPECT_LT(rms, 1.6 * want) << p.name;
    }
  }
}

TEST(ResidualMlp, InitRejectsWrongSizeAndIndex) {
  auto model = ResidualMlp::create(small_spec());
  ASSERT_TRUE(model.ok());
  std::vector<float> v(3);
  EXPECT_EQ(model->init_param(0, v).code(), core::StatusCode::kInvalidArgument);
  EXPECT_EQ(model->init_param(99, v).code(), core::StatusCode::kOutOfRange);
  EXPECT_EQ(model->init_param(-1, v).code(), core::StatusCode::kOutOfRange);
}

TEST(ResidualMlp, BatchesArePureFunctionsOfSeedAndStep) {
  auto a = ResidualMlp::create(small_spec());
  auto b = ResidualMlp::create(small_spec());
  ModelSpec other = small_spec();
  other.seed = 8;
  auto c = ResidualMlp::create(other);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const Batch a3 = a->make_batch(3);
  const Batch b3 = b->make_batch(3);
  EXPECT_EQ(a3.inputs.size(), 6u * 5u);
  EXPECT_EQ(a3.targets.size(), 6u * 3u);
  EXPECT_TRUE(same_bits(a3.inputs, b3.inputs));
  EXPECT_TRUE(same_bits(a3.targets, b3.targets));
  EXPECT_FALSE(same_bits(a3.inputs, a->make_batch(4).inputs));
  EXPECT_FALSE(same_bits(a3.inputs, a->make_batch(-3).inputs));
  EXPECT_FALSE(same_bits(a3.inputs, c->make_batch(3).inputs));
  // Gaussian inputs: mean near 0, variance near 1 over a larger sample.
  double sum = 0.0, sum_sq = 0.0;
  std::size_t n = 0;
  for (int step = 0; step < 200; ++step) {
    for (float x : a->make_batch(step).inputs) {
      sum += x;
      sum_sq += static_cast<double>(x) * x;
      ++n;
    }
  }
  const double mean = sum / static_cast<double>(n);
  EXPECT_NEAR(mean, 0.0, 0.05);
  EXPECT_NEAR(sum_sq / static_cast<double>(n) - mean * mean, 1.0, 0.05);
}

TEST(ResidualMlp, PackedLayoutIsDense) {
  auto model = ResidualMlp::create(small_spec());
  ASSERT_TRUE(model.ok());
  const GroupLayout l = model->packed_layout(1);
  EXPECT_EQ(l.offset_elems, (std::vector<std::int64_t>{0, 8, 8 + 96, 8 + 96 + 12, 8 + 96 + 12 + 96}));
  EXPECT_EQ(l.size_elems, model->groups()[1].num_elems);
  for (int g = 0; g < model->num_groups(); ++g) {
    EXPECT_TRUE(model->check_layout(g, model->packed_layout(g)).ok());
  }
}

TEST(ResidualMlp, CheckLayoutRejectsOverlapOverflowAndMissingOffsets) {
  auto model = ResidualMlp::create(small_spec());
  ASSERT_TRUE(model.ok());
  GroupLayout overlap = model->packed_layout(0);  // embed.w [40], embed.b [8]
  overlap.offset_elems[1] = 39;
  overlap.size_elems = 100;
  core::Status s = model->check_layout(0, overlap);
  EXPECT_EQ(s.code(), core::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("embed.w overlaps embed.b"), std::string_view::npos) << s.to_string();

  GroupLayout past_end = model->packed_layout(0);
  past_end.size_elems -= 1;
  s = model->check_layout(0, past_end);
  EXPECT_EQ(s.code(), core::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("embed.b"), std::string_view::npos) << s.to_string();

  GroupLayout negative = model->packed_layout(0);
  negative.offset_elems[0] = -1;
  EXPECT_EQ(model->check_layout(0, negative).code(), core::StatusCode::kInvalidArgument);

  GroupLayout missing = model->packed_layout(0);
  missing.offset_elems.pop_back();
  EXPECT_EQ(model->check_layout(0, missing).code(), core::StatusCode::kInvalidArgument);
  EXPECT_EQ(model->check_layout(4, model->packed_layout(0)).code(),
            core::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace strata::examples
