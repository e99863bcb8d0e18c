// The example model's parameters, groups, initial values, teacher and data.
#include "examples/model/residual_mlp.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/check.h"
#include "core/str.h"
#include "examples/model/prng.h"

namespace strata::examples {
namespace {

// Labels that keep the random streams of different purposes apart.
constexpr std::uint64_t kParamStream = 0x706172616d73ull;    // "params"
constexpr std::uint64_t kTeacherStream = 0x746561636872ull;  // "teachr"
constexpr std::uint64_t kBatchStream = 0x6261746368ull;      // "batch"

void fill_gaussian(std::uint64_t key, float scale, std::span<float> out) {
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = gaussian(key, i) * scale;
  }
}

}  // namespace

core::Result<ResidualMlp> ResidualMlp::create(const ModelSpec& spec) {
  const std::pair<const char*, std::int64_t> sizes[] = {
      {"input_dim", spec.input_dim},   {"hidden_dim", spec.hidden_dim},
      {"ffn_dim", spec.ffn_dim},       {"output_dim", spec.output_dim},
      {"depth", spec.depth},           {"teacher_hidden_dim", spec.teacher_hidden_dim},
      {"batch", spec.batch}};
  for (const auto& [name, value] : sizes) {
    if (value <= 0) {
      return core::Status::invalid_argument(
          core::str_cat("ModelSpec.", name, " must be positive, got ", value));
    }
  }
  ResidualMlp m;
  m.spec_ = spec;
  const std::int64_t d = spec.input_dim, h = spec.hidden_dim, f = spec.ffn_dim,
                     o = spec.output_dim;

  m.groups_.push_back(GroupDesc{.name = "embed", .param_indices = {}, .num_elems = 0});
  m.add_param("embed.w", {h, d}, false);
  m.add_param("embed.b", {h}, true);
  for (std::int64_t i = 0; i < spec.depth; ++i) {
    const std::string g = core::str_cat("blocks.", i);
    m.groups_.push_back(GroupDesc{.name = g, .param_indices = {}, .num_elems = 0});
    m.add_param(g + ".norm.gain", {h}, true);
    m.add_param(g + ".w1", {f, h}, false);
    m.add_param(g + ".b1", {f}, true);
    m.add_param(g + ".w2", {h, f}, false);
    m.add_param(g + ".b2", {h}, true);
  }
  m.groups_.push_back(GroupDesc{.name = "head", .param_indices = {}, .num_elems = 0});
  m.add_param("head.norm.gain", {h}, true);
  m.add_param("head.w", {o, h}, false);
  m.add_param("head.b", {o}, true);

  // The teacher: V1 ~ N(0, 1/D), c1 ~ N(0, 1/4), V2 ~ N(0, 1/teacher_hidden).
  const std::int64_t th = spec.teacher_hidden_dim;
  m.teacher_v1_.resize(static_cast<std::size_t>(th * d));
  m.teacher_c1_.resize(static_cast<std::size_t>(th));
  m.teacher_v2_.resize(static_cast<std::size_t>(o * th));
  fill_gaussian(stream_key(spec.seed, kTeacherStream, 1),
                static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))), m.teacher_v1_);
  fill_gaussian(stream_key(spec.seed, kTeacherStream, 2), 0.5f, m.teacher_c1_);
  fill_gaussian(stream_key(spec.seed, kTeacherStream, 3),
                static_cast<float>(1.0 / std::sqrt(static_cast<double>(th))), m.teacher_v2_);
  return m;
}

void ResidualMlp::add_param(const std::string& name, std::vector<std::int64_t> shape,
                            bool no_decay) {
  std::int64_t n = 1;
  for (const std::int64_t s : shape) n *= s;
  const int group_index = static_cast<int>(groups_.size()) - 1;
  groups_.back().param_indices.push_back(static_cast<int>(params_.size()));
  groups_.back().num_elems += n;
  params_.push_back(ParamDesc{.name = name,
                              .shape = std::move(shape),
                              .num_elems = n,
                              .group_index = group_index,
                              .no_decay = no_decay});
}

std::int64_t ResidualMlp::num_params_elems() const {
  std::int64_t n = 0;
  for (const ParamDesc& p : params_) n += p.num_elems;
  return n;
}

core::Status ResidualMlp::init_param(int param_index, std::span<float> out) const {
  if (param_index < 0 || param_index >= static_cast<int>(params_.size())) {
    return core::Status::out_of_range(core::str_cat("init_param: parameter index ", param_index,
                                                    " not in [0, ", params_.size(), ")"));
  }
  const ParamDesc& p = params_[static_cast<std::size_t>(param_index)];
  if (static_cast<std::int64_t>(out.size()) != p.num_elems) {
    return core::Status::invalid_argument(core::str_cat("init_param: ", p.name, " has ",
                                                        p.num_elems, " elements, out holds ",
                                                        out.size()));
  }
  if (p.shape.size() == 1) {
    // Gains start at 1 (identity norm), biases at 0.
    const bool is_gain = p.name.ends_with(".gain");
    std::fill(out.begin(), out.end(), is_gain ? 1.0f : 0.0f);
    return core::Status();
  }
  const double fan_in = static_cast<double>(p.shape[1]);
  double scale = 1.0 / std::sqrt(fan_in);
  if (p.name.ends_with(".w2")) {
    // Keeps the residual stream's variance bounded as depth grows.
    scale /= std::sqrt(2.0 * static_cast<double>(spec_.depth));
  }
  fill_gaussian(stream_key(spec_.seed, kParamStream, static_cast<std::uint64_t>(param_index)),
                static_cast<float>(scale), out);
  return core::Status();
}

Batch ResidualMlp::make_batch(std::int64_t step) const {
  const std::int64_t b = spec_.batch, d = spec_.input_dim, o = spec_.output_dim,
                     th = spec_.teacher_hidden_dim;
  Batch batch;
  batch.inputs.resize(static_cast<std::size_t>(b * d));
  batch.targets.resize(static_cast<std::size_t>(b * o));
  fill_gaussian(stream_key(spec_.seed, kBatchStream, static_cast<std::uint64_t>(step)), 1.0f,
                batch.inputs);
  // The teacher in double with plain loops: small, and the same on every machine.
  std::vector<double> hidden(static_cast<std::size_t>(th));
  for (std::int64_t r = 0; r < b; ++r) {
    const float* x = batch.inputs.data() + r * d;
    for (std::int64_t j = 0; j < th; ++j) {
      double acc = teacher_c1_[static_cast<std::size_t>(j)];
      for (std::int64_t k = 0; k < d; ++k) {
        acc += static_cast<double>(teacher_v1_[static_cast<std::size_t>(j * d + k)]) * x[k];
      }
      hidden[static_cast<std::size_t>(j)] = std::tanh(acc);
    }
    for (std::int64_t j = 0; j < o; ++j) {
      double acc = 0.0;
      for (std::int64_t k = 0; k < th; ++k) {
        acc += static_cast<double>(teacher_v2_[static_cast<std::size_t>(j * th + k)]) *
               hidden[static_cast<std::size_t>(k)];
      }
      batch.targets[static_cast<std::size_t>(r * o + j)] = static_cast<float>(acc);
    }
  }
  return batch;
}

GroupLayout ResidualMlp::packed_layout(int group_index) const {
  STRATA_CHECK(group_index >= 0 && group_index < num_groups()) << "group " << group_index;
  GroupLayout layout;
  for (const int pi : groups_[static_cast<std::size_t>(group_index)].param_indices) {
    layout.offset_elems.push_back(layout.size_elems);
    layout.size_elems += params_[static_cast<std::size_t>(pi)].num_elems;
  }
  return layout;
}

core::Status ResidualMlp::check_layout(int group_index, const GroupLayout& layout) const {
  if (group_index < 0 || group_index >= num_groups()) {
    return core::Status::out_of_range(
        core::str_cat("group index ", group_index, " not in [0, ", num_groups(), ")"));
  }
  const GroupDesc& g = groups_[static_cast<std::size_t>(group_index)];
  if (layout.offset_elems.size() != g.param_indices.size()) {
    return core::Status::invalid_argument(
        core::str_cat("layout of group ", g.name, ": ", layout.offset_elems.size(),
                      " offsets for ", g.param_indices.size(), " parameters"));
  }
  std::vector<std::pair<std::int64_t, std::size_t>> ranges;  // (offset, i), sorted below
  for (std::size_t i = 0; i < g.param_indices.size(); ++i) {
    const ParamDesc& p = params_[static_cast<std::size_t>(g.param_indices[i])];
    const std::int64_t off = layout.offset_elems[i];
    if (off < 0 || off > layout.size_elems || p.num_elems > layout.size_elems - off) {
      return core::Status::invalid_argument(
          core::str_cat("layout of group ", g.name, ": ", p.name, " at offset ", off, " with ",
                        p.num_elems, " elements does not fit in ", layout.size_elems));
    }
    ranges.emplace_back(off, i);
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t k = 1; k < ranges.size(); ++k) {
    const std::size_t prev = ranges[k - 1].second;
    const ParamDesc& p = params_[static_cast<std::size_t>(g.param_indices[prev])];
    if (ranges[k - 1].first + p.num_elems > ranges[k].first) {
      const ParamDesc& q =
          params_[static_cast<std::size_t>(g.param_indices[ranges[k].second])];
      return core::Status::invalid_argument(core::str_cat("layout of group ", g.name, ": ",
                                                          p.name, " overlaps ", q.name));
    }
  }
  return core::Status();
}

}  // namespace strata::examples
