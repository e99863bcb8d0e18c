// The example model's CUDA runner: loss, outputs and every gradient against
// the host ModelRunner (fp32 within 1e-4, bf16 and fp16 within their
// rounding), bit-identical results run to run and across layouts, frozen
// groups, call order and bad views. Without a usable CUDA device (or without
// the CUDA runner in the build) the GPU tests skip, saying why.
#include "examples/model/cuda_model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/check.h"
#include "core/status.h"
#include "examples/model/cuda_buffer.h"
#include "examples/model/model_runner.h"
#include "examples/model/precision.h"
#include "examples/model/prng.h"
#include "examples/model/residual_mlp.h"
#include "tests/examples/model_harness.h"

namespace strata::examples {
namespace {

using core::StatusCode;
using testing::GroupBuffers;
using testing::make_buffers;
using testing::packed_layouts;
using testing::param_view;
using testing::reversed_padded_layouts;

ModelSpec test_spec() {
  return ModelSpec{.input_dim = 16,
                   .hidden_dim = 48,
                   .ffn_dim = 96,
                   .output_dim = 6,
                   .depth = 3,
                   .teacher_hidden_dim = 16,
                   .batch = 40,
                   .seed = 7};
}

ResidualMlp make_model(const ModelSpec& spec) {
  auto model = ResidualMlp::create(spec);
  STRATA_CHECK(model.ok()) << model.status().to_string();
  return std::move(model).value();
}

// The build has no CUDA runner, or the machine no usable GPU.
bool no_cuda(const core::Status& s) {
  return s.code() == StatusCode::kUnimplemented || s.code() == StatusCode::kUnavailable;
}

// Moves every parameter off its initial value (gains off 1, biases off 0) so
// that no gradient term hides behind a special value.
void perturb(const ResidualMlp& model, GroupBuffers& b, float scale) {
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    std::span<float> w = param_view(model, b.layouts, b.weights, pi);
    const std::uint64_t key = stream_key(1234, static_cast<std::uint64_t>(pi));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] += scale * gaussian(key, i);
  }
}

// fp32 values as `type`'s bytes (numerics.h rounding), and back.
std::vector<std::byte> encode(std::span<const float> v, ComputeType type) {
  std::vector<std::byte> out(v.size() * compute_type_bytes(type));
  if (type == ComputeType::kF32) {
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  std::vector<std::uint16_t> half(v.size());
  EXPECT_TRUE((type == ComputeType::kBf16 ? fp32_to_bf16(v, half) : fp32_to_fp16(v, half)).ok());
  std::memcpy(out.data(), half.data(), out.size());
  return out;
}

std::vector<float> decode(std::span<const std::byte> bytes, ComputeType type) {
  std::vector<float> out(bytes.size() / compute_type_bytes(type));
  if (type == ComputeType::kF32) {
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }
  std::vector<std::uint16_t> half(out.size());
  std::memcpy(half.data(), bytes.data(), bytes.size());
  EXPECT_TRUE((type == ComputeType::kBf16 ? bf16_to_fp32(half, out) : fp16_to_fp32(half, out)).ok());
  return out;
}

// Every value of the host buffers rounded to `type` (what the engine's
// compute copies hold).
void round_weights(GroupBuffers& b, ComputeType type) {
  for (std::vector<float>& w : b.weights) w = decode(encode(w, type), type);
}

// The engine's side on the GPU: each group's weights and gradient buffer in
// device memory, in `type`, with the host buffers' layouts and padding.
struct DeviceGroups {
  ComputeType type = ComputeType::kF32;
  std::vector<GroupLayout> layouts;
  std::vector<CudaBuffer> weights;
  std::vector<CudaBuffer> grads;
  std::vector<std::vector<std::byte>> grads_initial;  // what each gradient buffer held before backward

  CudaWeights weights_of(int g) const {
    const auto i = static_cast<std::size_t>(g);
    return CudaWeights{.data = weights[i].data(), .size_elems = layouts[i].size_elems, .type = type};
  }
  CudaGrads grads_of(int g) const {
    const auto i = static_cast<std::size_t>(g);
    return CudaGrads{.data = grads[i].data(), .size_elems = layouts[i].size_elems, .type = type};
  }
  // Group g's gradient buffer, as fp32.
  std::vector<float> grads_host(int g) const {
    const auto i = static_cast<std::size_t>(g);
    std::vector<std::byte> bytes(grads[i].size_bytes());
    EXPECT_TRUE(grads[i].download(bytes).ok());
    return decode(bytes, type);
  }
  std::vector<std::byte> grads_bytes(int g) const {
    const auto i = static_cast<std::size_t>(g);
    std::vector<std::byte> bytes(grads[i].size_bytes());
    EXPECT_TRUE(grads[i].download(bytes).ok());
    return bytes;
  }
};

DeviceGroups upload(const GroupBuffers& b, ComputeType type) {
  DeviceGroups d;
  d.type = type;
  d.layouts = b.layouts;
  for (std::size_t g = 0; g < b.weights.size(); ++g) {
    const std::vector<std::byte> w = encode(b.weights[g], type);
    const std::vector<std::byte> gr = encode(b.grads[g], type);
    auto wb = CudaBuffer::create(w.size());
    auto gb = CudaBuffer::create(gr.size());
    STRATA_CHECK(wb.ok() && gb.ok()) << wb.status() << " " << gb.status();
    EXPECT_TRUE(wb->upload(w).ok());
    EXPECT_TRUE(gb->upload(gr).ok());
    d.weights.push_back(std::move(wb).value());
    d.grads.push_back(std::move(gb).value());
    d.grads_initial.push_back(gr);
  }
  return d;
}

CudaModelRunner make_cuda_runner(const ResidualMlp& model, std::vector<GroupLayout> layouts) {
  auto runner = CudaModelRunner::create(model, std::move(layouts));
  STRATA_CHECK(runner.ok()) << runner.status().to_string();
  return std::move(runner).value();
}

// One full forward and backward on the GPU; returns the loss. Groups in
// `frozen` get an empty gradient view.
double cuda_forward_backward(CudaModelRunner& runner, const DeviceGroups& d, const Batch& batch,
                             float loss_scale = 1.0f, const std::vector<int>& frozen = {}) {
  EXPECT_TRUE(runner.begin(batch, loss_scale).ok());
  const int n = static_cast<int>(d.weights.size());
  for (int g = 0; g < n; ++g) {
    const core::Status s = runner.forward_group(g, d.weights_of(g));
    EXPECT_TRUE(s.ok()) << s;
  }
  const double loss = runner.loss();
  for (int g = n - 1; g >= 0; --g) {
    const bool is_frozen = std::find(frozen.begin(), frozen.end(), g) != frozen.end();
    const core::Status s = runner.backward_group(g, d.weights_of(g), is_frozen ? CudaGrads{} : d.grads_of(g));
    EXPECT_TRUE(s.ok()) << s;
  }
  return loss;
}

// Parameter `pi`'s values inside a flat group buffer (host copy).
std::span<const float> param_in(const ResidualMlp& model, const std::vector<GroupLayout>& layouts,
                                const std::vector<float>& buffer, int pi) {
  const ParamDesc& p = model.params()[static_cast<std::size_t>(pi)];
  const GroupDesc& desc = model.groups()[static_cast<std::size_t>(p.group_index)];
  std::size_t local = 0;
  while (desc.param_indices[local] != pi) ++local;
  const std::int64_t off = layouts[static_cast<std::size_t>(p.group_index)].offset_elems[local];
  return std::span<const float>(buffer.data() + off, static_cast<std::size_t>(p.num_elems));
}

// got[i] within rel * |want[i]| + abs_rel * max|want| of want[i], element by
// element (abs_rel covers sums that cancel, whose rounding error follows the
// size of their terms rather than of their result).
void expect_close(std::span<const float> got, std::span<const float> want, double rel, double abs_rel,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_abs = 0.0;
  for (float w : want) max_abs = std::max(max_abs, std::abs(static_cast<double>(w)));
  EXPECT_GT(max_abs, 0.0) << what << " is all zeros";
  int reported = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tol = rel * std::abs(static_cast<double>(want[i])) + abs_rel * max_abs;
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: cuda " << got[i] << ", host " << want[i] << " (error " << err
                    << ", tolerance " << tol << ")";
    }
  }
}

// Elements of group g's buffer outside every parameter's range.
std::vector<bool> padding_mask(const ResidualMlp& model, const GroupLayout& layout, int g) {
  std::vector<bool> pad(static_cast<std::size_t>(layout.size_elems), true);
  const GroupDesc& desc = model.groups()[static_cast<std::size_t>(g)];
  for (std::size_t i = 0; i < desc.param_indices.size(); ++i) {
    const std::int64_t n = model.params()[static_cast<std::size_t>(desc.param_indices[i])].num_elems;
    for (std::int64_t k = 0; k < n; ++k) pad[static_cast<std::size_t>(layout.offset_elems[i] + k)] = false;
  }
  return pad;
}

// Tests that need a GPU: skipped, with the reason, when there is none.
class CudaModelRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto probe = CudaBuffer::create(256);
    if (!probe.ok()) {
      if (no_cuda(probe.status())) GTEST_SKIP() << "no usable CUDA device: " << probe.status();
      FAIL() << "cannot allocate device memory: " << probe.status();
    }
  }

  // Forward and backward of one batch on the host (fp32 views of weights
  // rounded to `type`) and on the GPU (the same weights in `type`); every
  // result compared.
  void compare_with_host(ComputeType type, float loss_scale, double rel, double abs_rel) {
    const ResidualMlp model = make_model(test_spec());
    // An odd gap: parameters start at odd element offsets (2-byte aligned for 16-bit types).
    GroupBuffers b = make_buffers(model, reversed_padded_layouts(model, 3));
    perturb(model, b, 0.2f);
    round_weights(b, type);
    DeviceGroups d = upload(b, type);

    auto host_or = ModelRunner::create(model, b.layouts);
    ASSERT_TRUE(host_or.ok()) << host_or.status();
    ModelRunner& host = *host_or;
    CudaModelRunner cuda = make_cuda_runner(model, b.layouts);

    for (int step = 0; step < 2; ++step) {
      const Batch batch = model.make_batch(step);
      const double want_loss = testing::forward_backward(host, b, batch, loss_scale);
      const double got_loss = cuda_forward_backward(cuda, d, batch, loss_scale);
      EXPECT_NEAR(got_loss, want_loss, 1e-5 * want_loss) << "step " << step;

      std::vector<float> got_out(host.outputs().size());
      ASSERT_TRUE(cuda.outputs(got_out).ok());
      expect_close(got_out, host.outputs(), rel, abs_rel, "outputs");

      std::vector<std::vector<float>> got(b.grads.size());
      for (int g = 0; g < model.num_groups(); ++g) got[static_cast<std::size_t>(g)] = d.grads_host(g);
      for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
        const ParamDesc& p = model.params()[static_cast<std::size_t>(pi)];
        const std::span<const float> host_grad = param_in(model, b.layouts, b.grads[static_cast<std::size_t>(p.group_index)], pi);
        // The engine would receive the host's gradients in `type`.
        const std::vector<float> want = decode(encode(host_grad, type), type);
        expect_close(param_in(model, b.layouts, got[static_cast<std::size_t>(p.group_index)], pi), want, rel,
                     abs_rel, p.name + " gradient, step " + std::to_string(step));
      }
      for (int g = 0; g < model.num_groups(); ++g) {
        const std::vector<bool> pad = padding_mask(model, b.layouts[static_cast<std::size_t>(g)], g);
        const std::vector<std::byte> bytes = d.grads_bytes(g);
        const std::vector<std::byte>& initial = d.grads_initial[static_cast<std::size_t>(g)];
        const std::size_t es = compute_type_bytes(type);
        for (std::size_t i = 0; i < pad.size(); ++i) {
          if (!pad[i]) continue;
          ASSERT_EQ(std::memcmp(bytes.data() + i * es, initial.data() + i * es, es), 0)
              << "group " << g << ": padding element " << i << " was written";
        }
      }
    }
  }
};

TEST_F(CudaModelRunnerTest, Fp32MatchesTheHostRunner) { compare_with_host(ComputeType::kF32, 1.0f, 1e-4, 1e-4); }

// One bf16 ulp is 2^-8 to 2^-7 of a value: two fp32 results a hair apart
// may round to neighbours.
TEST_F(CudaModelRunnerTest, Bf16MatchesTheHostRunner) { compare_with_host(ComputeType::kBf16, 1.0f, 1e-2, 1e-3); }

// fp16 with a loss scale (gradients scaled by 1024, loss unscaled).
TEST_F(CudaModelRunnerTest, Fp16WithLossScaleMatchesTheHostRunner) {
  compare_with_host(ComputeType::kF16, 1024.0f, 2e-3, 2e-4);
}

TEST_F(CudaModelRunnerTest, RunsAreBitIdentical) {
  const ResidualMlp model = make_model(test_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  perturb(model, b, 0.2f);
  // Two runners on their own buffers, two batches each, plus the first
  // runner again on the first batch: every loss and gradient bit equal.
  DeviceGroups d1 = upload(b, ComputeType::kF32);
  DeviceGroups d2 = upload(b, ComputeType::kF32);
  CudaModelRunner r1 = make_cuda_runner(model, b.layouts);
  CudaModelRunner r2 = make_cuda_runner(model, b.layouts);
  std::vector<std::vector<std::byte>> first_grads;
  double first_loss = 0.0;
  for (int step = 0; step < 2; ++step) {
    const Batch batch = model.make_batch(step);
    const double l1 = cuda_forward_backward(r1, d1, batch);
    const double l2 = cuda_forward_backward(r2, d2, batch);
    EXPECT_EQ(std::memcmp(&l1, &l2, sizeof l1), 0) << "step " << step << ": " << l1 << " vs " << l2;
    for (int g = 0; g < model.num_groups(); ++g) {
      const std::vector<std::byte> g1 = d1.grads_bytes(g);
      EXPECT_EQ(g1, d2.grads_bytes(g)) << "step " << step << ", group " << g;
      if (step == 0) first_grads.push_back(g1);
    }
    if (step == 0) first_loss = l1;
  }
  const double again = cuda_forward_backward(r1, d1, model.make_batch(0));
  EXPECT_EQ(std::memcmp(&again, &first_loss, sizeof again), 0);
  for (int g = 0; g < model.num_groups(); ++g) {
    EXPECT_EQ(d1.grads_bytes(g), first_grads[static_cast<std::size_t>(g)]) << "group " << g << ", repeated";
  }
}

TEST_F(CudaModelRunnerTest, LayoutDoesNotChangeAnyBit) {
  const ResidualMlp model = make_model(test_spec());
  GroupBuffers packed = make_buffers(model, packed_layouts(model));
  perturb(model, packed, 0.2f);
  GroupBuffers padded = make_buffers(model, reversed_padded_layouts(model, 5));
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    std::span<float> src = param_view(model, packed.layouts, packed.weights, pi);
    std::span<float> dst = param_view(model, padded.layouts, padded.weights, pi);
    std::copy(src.begin(), src.end(), dst.begin());
  }
  DeviceGroups dp = upload(packed, ComputeType::kBf16);
  DeviceGroups dq = upload(padded, ComputeType::kBf16);
  CudaModelRunner rp = make_cuda_runner(model, packed.layouts);
  CudaModelRunner rq = make_cuda_runner(model, padded.layouts);
  const Batch batch = model.make_batch(3);
  const double lp = cuda_forward_backward(rp, dp, batch);
  const double lq = cuda_forward_backward(rq, dq, batch);
  EXPECT_EQ(std::memcmp(&lp, &lq, sizeof lp), 0) << lp << " vs " << lq;
  std::vector<std::vector<float>> gp, gq;
  for (int g = 0; g < model.num_groups(); ++g) {
    gp.push_back(dp.grads_host(g));
    gq.push_back(dq.grads_host(g));
  }
  for (int pi = 0; pi < static_cast<int>(model.params().size()); ++pi) {
    const int g = model.params()[static_cast<std::size_t>(pi)].group_index;
    const std::span<const float> a = param_in(model, packed.layouts, gp[static_cast<std::size_t>(g)], pi);
    const std::span<const float> c = param_in(model, padded.layouts, gq[static_cast<std::size_t>(g)], pi);
    EXPECT_EQ(std::memcmp(a.data(), c.data(), a.size_bytes()), 0) << model.params()[static_cast<std::size_t>(pi)].name;
  }
}

TEST_F(CudaModelRunnerTest, FrozenGroupsStillPassGradientsDown) {
  const ResidualMlp model = make_model(test_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  perturb(model, b, 0.2f);
  DeviceGroups all = upload(b, ComputeType::kF32);
  DeviceGroups some = upload(b, ComputeType::kF32);
  CudaModelRunner runner = make_cuda_runner(model, b.layouts);
  const Batch batch = model.make_batch(1);
  const int head = model.num_groups() - 1;
  cuda_forward_backward(runner, all, batch);
  cuda_forward_backward(runner, some, batch, 1.0f, {head, 2});
  for (int g = 0; g < model.num_groups(); ++g) {
    if (g == head || g == 2) {
      EXPECT_EQ(some.grads_bytes(g), some.grads_initial[static_cast<std::size_t>(g)]) << "frozen group " << g;
    } else {
      EXPECT_EQ(some.grads_bytes(g), all.grads_bytes(g)) << "group " << g;
    }
  }
}

TEST_F(CudaModelRunnerTest, OutOfOrderCallsFailWithoutEffect) {
  const ResidualMlp model = make_model(test_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  DeviceGroups d = upload(b, ComputeType::kF32);
  CudaModelRunner runner = make_cuda_runner(model, b.layouts);
  const Batch batch = model.make_batch(0);
  ASSERT_TRUE(runner.begin(batch, 1.0f).ok());
  EXPECT_EQ(runner.forward_group(1, d.weights_of(1)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(runner.backward_group(0, d.weights_of(0), d.grads_of(0)).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(runner.forward_group(0, d.weights_of(0)).ok());
  const Batch wrong{.inputs = std::vector<float>(3), .targets = {}};
  EXPECT_EQ(runner.begin(wrong, 1.0f).code(), StatusCode::kInvalidArgument);
  // The failures changed nothing: the pass goes on at group 1.
  for (int g = 1; g < model.num_groups(); ++g) ASSERT_TRUE(runner.forward_group(g, d.weights_of(g)).ok());
  EXPECT_EQ(runner.forward_group(0, d.weights_of(0)).code(), StatusCode::kFailedPrecondition);
  const int head = model.num_groups() - 1;
  EXPECT_EQ(runner.backward_group(0, d.weights_of(0), d.grads_of(0)).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(runner.backward_group(head, d.weights_of(head), d.grads_of(head)).ok());
}

TEST_F(CudaModelRunnerTest, RejectsViewsItCannotUse) {
  const ResidualMlp model = make_model(test_spec());
  GroupBuffers b = make_buffers(model, packed_layouts(model));
  DeviceGroups d = upload(b, ComputeType::kBf16);
  CudaModelRunner runner = make_cuda_runner(model, b.layouts);
  ASSERT_TRUE(runner.begin(model.make_batch(0), 1.0f).ok());

  CudaWeights host_memory = d.weights_of(0);
  std::vector<std::uint16_t> on_host(static_cast<std::size_t>(host_memory.size_elems));
  host_memory.data = on_host.data();
  const core::Status s = runner.forward_group(0, host_memory);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("not device memory"), std::string::npos) << s;

  CudaWeights short_view = d.weights_of(0);
  short_view.size_elems -= 1;
  EXPECT_EQ(runner.forward_group(0, short_view).code(), StatusCode::kInvalidArgument);

  CudaWeights misaligned = d.weights_of(0);
  misaligned.data = static_cast<const std::byte*>(misaligned.data) + 1;
  EXPECT_EQ(runner.forward_group(0, misaligned).code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(runner.forward_group(0, CudaWeights{}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(runner.forward_group(0, d.weights_of(0)).ok());
}

// --- without a GPU too ----------------------------------------------------------

TEST(CudaModelRunner, CreateChecksLayoutsFirst) {
  const ResidualMlp model = make_model(test_spec());
  std::vector<GroupLayout> layouts = packed_layouts(model);
  layouts.pop_back();
  EXPECT_EQ(CudaModelRunner::create(model, layouts).status().code(), StatusCode::kInvalidArgument);
  layouts = packed_layouts(model);
  layouts[0].size_elems -= 1;  // the last parameter passes the end
  EXPECT_EQ(CudaModelRunner::create(model, layouts).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaModelRunner, CreateSaysWhyWhenItCannotRun) {
  const ResidualMlp model = make_model(test_spec());
  auto runner = CudaModelRunner::create(model, packed_layouts(model));
  if (runner.ok()) GTEST_SKIP() << "a CUDA device is usable here (the other tests cover it)";
  EXPECT_TRUE(no_cuda(runner.status())) << runner.status();
  EXPECT_FALSE(runner.status().message().empty());
}

}  // namespace
}  // namespace strata::examples
