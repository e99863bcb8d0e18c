// The example model's forward and backward passes; matrix products through
// OpenBLAS's cblas_sgemm, everything else in plain loops.
#include "examples/model/model_runner.h"

#include <cblas.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <utility>

#include "core/check.h"
#include "core/str.h"

namespace strata::examples {
namespace {

// Bit-identical training across placements, thread counts and runs is a
// project contract (DESIGN.md section 6). A multi-threaded sgemm splits its
// work by the pool size and the matrix shape, and its threads would also
// compete with the engine's own (cpu_adam, I/O) for the cores. So OpenBLAS
// runs on the calling thread only. This sets a process-wide OpenBLAS setting
// once; an embedding program that wants threaded OpenBLAS elsewhere should
// not share the process with this model.
void pin_openblas_to_one_thread() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

int blas_int(std::int64_t n) {
  STRATA_CHECK(n >= 0 && n <= std::numeric_limits<int>::max()) << "BLAS dimension " << n;
  return static_cast<int>(n);
}

// out[m, n] = x[m, k] * w[n, k]^T (a linear layer without its bias).
void matmul_xwt(const float* x, const float* w, float* out, std::int64_t m, std::int64_t n,
                std::int64_t k) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(m), blas_int(n), blas_int(k),
              1.0f, x, blas_int(k), w, blas_int(k), 0.0f, out, blas_int(n));
}

// dw[n, k] = dy[m, n]^T * x[m, k] (a linear layer's weight gradient).
void matmul_dytx(const float* dy, const float* x, float* dw, std::int64_t m, std::int64_t n,
                 std::int64_t k) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, blas_int(n), blas_int(k), blas_int(m),
              1.0f, dy, blas_int(n), x, blas_int(k), 0.0f, dw, blas_int(k));
}

// dx[m, k] = dy[m, n] * w[n, k] (a linear layer's input gradient).
void matmul_dyw(const float* dy, const float* w, float* dx, std::int64_t m, std::int64_t n,
                std::int64_t k) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas_int(m), blas_int(k), blas_int(n),
              1.0f, dy, blas_int(n), w, blas_int(k), 0.0f, dx, blas_int(k));
}

// y[r, :] += b for every row.
void add_bias(float* y, const float* b, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) y[r * cols + c] += b[c];
  }
}

// db[c] = sum over rows of dy[r, c], accumulated in double in row order.
void column_sums(const float* dy, float* db, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t c = 0; c < cols; ++c) {
    double acc = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) acc += dy[r * cols + c];
    db[c] = static_cast<float>(acc);
  }
}

// gelu, tanh form (Hendrycks & Gimpel 2016, eq. in section 2):
//   gelu(u)  = 0.5 u (1 + t),  t = tanh(c (u + k u^3)),  c = sqrt(2/pi), k = 0.044715
//   gelu'(u) = 0.5 (1 + t) + 0.5 u (1 - t^2) c (1 + 3 k u^2)
constexpr float kGeluC = 0.7978845608028654f;
constexpr float kGeluK = 0.044715f;

float gelu(float u) {
  const float t = std::tanh(kGeluC * (u + kGeluK * u * u * u));
  return 0.5f * u * (1.0f + t);
}

float gelu_grad(float u) {
  const float t = std::tanh(kGeluC * (u + kGeluK * u * u * u));
  return 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluK * u * u);
}

}  // namespace

core::Result<ModelRunner> ModelRunner::create(const ResidualMlp& model,
                                              std::vector<GroupLayout> layouts) {
  if (static_cast<int>(layouts.size()) != model.num_groups()) {
    return core::Status::invalid_argument(core::str_cat(
        "ModelRunner: ", layouts.size(), " layouts for ", model.num_groups(), " groups"));
  }
  for (int g = 0; g < model.num_groups(); ++g) {
    STRATA_RETURN_IF_ERROR(model.check_layout(g, layouts[static_cast<std::size_t>(g)]));
  }
  pin_openblas_to_one_thread();

  ModelRunner r;
  r.model_ = &model;
  r.layouts_ = std::move(layouts);
  const ModelSpec& s = model.spec();
  const auto bh = static_cast<std::size_t>(s.batch * s.hidden_dim);
  const auto bf = static_cast<std::size_t>(s.batch * s.ffn_dim);
  const auto b = static_cast<std::size_t>(s.batch);
  auto make_norm = [&] {
    return NormActs{.inv_rms = std::vector<float>(b),
                    .normed = std::vector<float>(bh),
                    .scaled = std::vector<float>(bh)};
  };
  r.stream_.assign(static_cast<std::size_t>(s.depth + 1), std::vector<float>(bh));
  for (std::int64_t i = 0; i < s.depth; ++i) {
    r.blocks_.push_back(BlockActs{.norm = make_norm(),
                                  .pre = std::vector<float>(bf),
                                  .act = std::vector<float>(bf)});
  }
  r.head_norm_ = make_norm();
  r.outputs_.resize(static_cast<std::size_t>(s.batch * s.output_dim));
  r.d_stream_.resize(bh);
  r.d_norm_.resize(bh);
  r.d_ffn_.resize(bf);
  r.d_out_.resize(r.outputs_.size());
  return r;
}

core::Status ModelRunner::begin(const Batch& batch, float loss_scale) {
  const ModelSpec& s = model_->spec();
  if (static_cast<std::int64_t>(batch.inputs.size()) != s.batch * s.input_dim ||
      static_cast<std::int64_t>(batch.targets.size()) != s.batch * s.output_dim) {
    return core::Status::invalid_argument(core::str_cat(
        "ModelRunner::begin: batch has ", batch.inputs.size(), " inputs and ",
        batch.targets.size(), " targets, the model wants ", s.batch * s.input_dim, " and ",
        s.batch * s.output_dim));
  }
  batch_ = batch;
  loss_scale_ = loss_scale;
  next_forward_ = 0;
  next_backward_ = -1;
  forward_done_ = false;
  return core::Status();
}

ModelRunner::Range ModelRunner::param_range(int group_index, int i) const {
  const GroupDesc& g = model_->groups()[static_cast<std::size_t>(group_index)];
  const ParamDesc& p =
      model_->params()[static_cast<std::size_t>(g.param_indices[static_cast<std::size_t>(i)])];
  const std::int64_t off =
      layouts_[static_cast<std::size_t>(group_index)].offset_elems[static_cast<std::size_t>(i)];
  return Range{static_cast<std::size_t>(off), static_cast<std::size_t>(p.num_elems)};
}

const float* ModelRunner::param(int group_index, std::span<const float> buffer, int i) const {
  const Range r = param_range(group_index, i);
  return buffer.subspan(r.offset, r.size).data();
}

float* ModelRunner::param_grad(int group_index, std::span<float> buffer, int i) const {
  const Range r = param_range(group_index, i);
  return buffer.subspan(r.offset, r.size).data();
}

core::Status ModelRunner::check_buffer(int group_index, std::size_t size, const char* what) const {
  const GroupLayout& layout = layouts_[static_cast<std::size_t>(group_index)];
  if (static_cast<std::int64_t>(size) < layout.size_elems) {
    return core::Status::invalid_argument(
        core::str_cat("group ", model_->groups()[static_cast<std::size_t>(group_index)].name,
                      ": ", what, " buffer holds ", size, " elements, its layout needs ",
                      layout.size_elems));
  }
  return core::Status();
}

core::Status ModelRunner::forward_group(int group_index, std::span<const float> weights) {
  if (group_index != next_forward_) {
    return core::Status::failed_precondition(core::str_cat(
        "forward_group(", group_index, "): expected group ", next_forward_,
        next_forward_ == model_->num_groups() ? " (none: forward is complete; call begin)"
                                              : ""));
  }
  STRATA_RETURN_IF_ERROR(check_buffer(group_index, weights.size(), "weight"));
  const int last = model_->num_groups() - 1;
  if (group_index == 0) {
    forward_embed(weights);
  } else if (group_index == last) {
    forward_head(weights);
  } else {
    forward_block(group_index - 1, weights);
  }
  ++next_forward_;
  if (group_index == last) {
    forward_done_ = true;
    next_backward_ = last;
  }
  return core::Status();
}

core::Status ModelRunner::backward_group(int group_index, std::span<const float> weights,
                                         std::span<float> grads) {
  if (!forward_done_ || group_index != next_backward_) {
    return core::Status::failed_precondition(
        forward_done_ ? core::str_cat("backward_group(", group_index, "): expected group ",
                                      next_backward_)
                      : core::str_cat("backward_group(", group_index,
                                      "): the forward pass is not complete"));
  }
  STRATA_RETURN_IF_ERROR(check_buffer(group_index, weights.size(), "weight"));
  if (!grads.empty()) {
    STRATA_RETURN_IF_ERROR(check_buffer(group_index, grads.size(), "gradient"));
  }
  const int last = model_->num_groups() - 1;
  if (group_index == last) {
    backward_head(weights, grads);
  } else if (group_index == 0) {
    backward_embed(grads);
  } else {
    backward_block(group_index - 1, weights, grads);
  }
  --next_backward_;
  return core::Status();
}

double ModelRunner::loss() const {
  STRATA_CHECK(forward_done_) << "loss() before the forward pass completed";
  return loss_;
}

std::span<const float> ModelRunner::outputs() const { return outputs_; }

namespace {

// out = rmsnorm(x) * gain, row by row; sums in double.
//   inv_rms = 1 / sqrt(mean(x^2) + eps), normed = x * inv_rms, scaled = normed * gain
void norm_forward(const float* x, const float* gain, std::int64_t rows, std::int64_t cols,
                  float* inv_rms, float* normed, float* scaled) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    double sum_sq = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) sum_sq += static_cast<double>(xr[c]) * xr[c];
    const float ir = static_cast<float>(
        1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + ResidualMlp::kNormEps));
    inv_rms[r] = ir;
    for (std::int64_t c = 0; c < cols; ++c) {
      normed[r * cols + c] = xr[c] * ir;
      scaled[r * cols + c] = normed[r * cols + c] * gain[c];
    }
  }
}

// Backward of norm_forward. Given d_scaled, writes d_gain (unless null) and
// adds dx to d_x:
//   d_gain[c] = sum_r d_scaled[r, c] * normed[r, c]
//   dn = d_scaled * gain
//   dx = inv_rms * (dn - normed * mean_c(dn * normed))
void norm_backward(const float* d_scaled, const float* gain, const float* inv_rms,
                   const float* normed, std::int64_t rows, std::int64_t cols, float* d_gain,
                   float* d_x) {
  if (d_gain != nullptr) {
    for (std::int64_t c = 0; c < cols; ++c) {
      double acc = 0.0;
      for (std::int64_t r = 0; r < rows; ++r) {
        acc += static_cast<double>(d_scaled[r * cols + c]) * normed[r * cols + c];
      }
      d_gain[c] = static_cast<float>(acc);
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    double dot = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) {
      dot += static_cast<double>(d_scaled[r * cols + c]) * gain[c] * normed[r * cols + c];
    }
    const float mean_dot = static_cast<float>(dot / static_cast<double>(cols));
    for (std::int64_t c = 0; c < cols; ++c) {
      const float dn = d_scaled[r * cols + c] * gain[c];
      d_x[r * cols + c] += inv_rms[r] * (dn - normed[r * cols + c] * mean_dot);
    }
  }
}

}  // namespace

// Parameter order inside each group follows ResidualMlp::create:
//   embed: w, b;  block: norm.gain, w1, b1, w2, b2;  head: norm.gain, w, b.

void ModelRunner::forward_embed(std::span<const float> weights) {
  const ModelSpec& s = model_->spec();
  const float* w = param(0, weights, 0);
  const float* b = param(0, weights, 1);
  float* h0 = stream_[0].data();
  matmul_xwt(batch_.inputs.data(), w, h0, s.batch, s.hidden_dim, s.input_dim);
  add_bias(h0, b, s.batch, s.hidden_dim);
}

void ModelRunner::forward_block(int block, std::span<const float> weights) {
  const ModelSpec& s = model_->spec();
  const int g = block + 1;
  const float* gain = param(g, weights, 0);
  const float* w1 = param(g, weights, 1);
  const float* b1 = param(g, weights, 2);
  const float* w2 = param(g, weights, 3);
  const float* b2 = param(g, weights, 4);
  BlockActs& a = blocks_[static_cast<std::size_t>(block)];
  const float* h_in = stream_[static_cast<std::size_t>(block)].data();
  float* h_out = stream_[static_cast<std::size_t>(block + 1)].data();
  norm_forward(h_in, gain, s.batch, s.hidden_dim, a.norm.inv_rms.data(), a.norm.normed.data(),
               a.norm.scaled.data());
  matmul_xwt(a.norm.scaled.data(), w1, a.pre.data(), s.batch, s.ffn_dim, s.hidden_dim);
  add_bias(a.pre.data(), b1, s.batch, s.ffn_dim);
  for (std::size_t i = 0; i < a.pre.size(); ++i) a.act[i] = gelu(a.pre[i]);
  matmul_xwt(a.act.data(), w2, h_out, s.batch, s.hidden_dim, s.ffn_dim);
  for (std::int64_t r = 0; r < s.batch; ++r) {
    for (std::int64_t c = 0; c < s.hidden_dim; ++c) {
      const std::int64_t i = r * s.hidden_dim + c;
      h_out[i] = h_in[i] + (h_out[i] + b2[c]);
    }
  }
}

void ModelRunner::forward_head(std::span<const float> weights) {
  const ModelSpec& s = model_->spec();
  const int g = model_->num_groups() - 1;
  const float* gain = param(g, weights, 0);
  const float* w = param(g, weights, 1);
  const float* b = param(g, weights, 2);
  norm_forward(stream_.back().data(), gain, s.batch, s.hidden_dim, head_norm_.inv_rms.data(),
               head_norm_.normed.data(), head_norm_.scaled.data());
  matmul_xwt(head_norm_.scaled.data(), w, outputs_.data(), s.batch, s.output_dim, s.hidden_dim);
  add_bias(outputs_.data(), b, s.batch, s.output_dim);
  double sum_sq = 0.0;
  for (std::size_t i = 0; i < outputs_.size(); ++i) {
    const double e = static_cast<double>(outputs_[i]) - batch_.targets[i];
    sum_sq += e * e;
  }
  loss_ = sum_sq / static_cast<double>(outputs_.size());
}

void ModelRunner::backward_head(std::span<const float> weights, std::span<float> grads) {
  const ModelSpec& s = model_->spec();
  const int g = model_->num_groups() - 1;
  const bool frozen = grads.empty();
  const float* gain = param(g, weights, 0);
  const float* w = param(g, weights, 1);
  // d(loss_scale * loss)/dy = loss_scale * 2 (y - t) / (batch * outputs).
  const float coef =
      static_cast<float>(2.0 * loss_scale_ / static_cast<double>(outputs_.size()));
  for (std::size_t i = 0; i < outputs_.size(); ++i) {
    d_out_[i] = coef * (outputs_[i] - batch_.targets[i]);
  }
  if (!frozen) {
    matmul_dytx(d_out_.data(), head_norm_.scaled.data(), param_grad(g, grads, 1), s.batch,
                s.output_dim, s.hidden_dim);
    column_sums(d_out_.data(), param_grad(g, grads, 2), s.batch, s.output_dim);
  }
  matmul_dyw(d_out_.data(), w, d_norm_.data(), s.batch, s.output_dim, s.hidden_dim);
  std::fill(d_stream_.begin(), d_stream_.end(), 0.0f);
  norm_backward(d_norm_.data(), gain, head_norm_.inv_rms.data(), head_norm_.normed.data(),
                s.batch, s.hidden_dim, frozen ? nullptr : param_grad(g, grads, 0),
                d_stream_.data());
}

void ModelRunner::backward_block(int block, std::span<const float> weights,
                                 std::span<float> grads) {
  const ModelSpec& s = model_->spec();
  const int g = block + 1;
  const bool frozen = grads.empty();
  const float* gain = param(g, weights, 0);
  const float* w1 = param(g, weights, 1);
  const float* w2 = param(g, weights, 3);
  const BlockActs& a = blocks_[static_cast<std::size_t>(block)];
  // h_out = h_in + w2 act + b2: d_stream_ (d h_out) is the branch's output
  // gradient and, unchanged, part of d h_in.
  if (!frozen) {
    column_sums(d_stream_.data(), param_grad(g, grads, 4), s.batch, s.hidden_dim);
    matmul_dytx(d_stream_.data(), a.act.data(), param_grad(g, grads, 3), s.batch,
                s.hidden_dim, s.ffn_dim);
  }
  matmul_dyw(d_stream_.data(), w2, d_ffn_.data(), s.batch, s.hidden_dim, s.ffn_dim);
  for (std::size_t i = 0; i < d_ffn_.size(); ++i) d_ffn_[i] *= gelu_grad(a.pre[i]);
  if (!frozen) {
    column_sums(d_ffn_.data(), param_grad(g, grads, 2), s.batch, s.ffn_dim);
    matmul_dytx(d_ffn_.data(), a.norm.scaled.data(), param_grad(g, grads, 1), s.batch,
                s.ffn_dim, s.hidden_dim);
  }
  matmul_dyw(d_ffn_.data(), w1, d_norm_.data(), s.batch, s.ffn_dim, s.hidden_dim);
  norm_backward(d_norm_.data(), gain, a.norm.inv_rms.data(), a.norm.normed.data(), s.batch,
                s.hidden_dim, frozen ? nullptr : param_grad(g, grads, 0),
                d_stream_.data());
}

void ModelRunner::backward_embed(std::span<float> grads) {
  if (grads.empty()) return;  // frozen, and nothing lies below
  const ModelSpec& s = model_->spec();
  matmul_dytx(d_stream_.data(), batch_.inputs.data(), param_grad(0, grads, 0), s.batch,
              s.hidden_dim, s.input_dim);
  column_sums(d_stream_.data(), param_grad(0, grads, 1), s.batch, s.hidden_dim);
}

}  // namespace strata::examples
