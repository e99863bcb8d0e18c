#include "engine/step/verdict.h"

#include <cmath>

#include "core/logging.h"
#include "core/str.h"

namespace strata::engine {

using core::Status;
using core::str_cat;
namespace nx = core::numerics;

namespace {

// bf16/fp32 non-finite gradients under strata.nonfinite: true to skip the
// step; "error" fails it; "apply" warns and applies. `step` names it.
core::Result<bool> skip_nonfinite(NonfinitePolicy policy, std::int64_t step) {
  switch (policy) {
    case NonfinitePolicy::kError:
      return Status::failed_precondition(
          str_cat("non-finite gradients at step ", step, " (strata.nonfinite is \"error\"); the step was not applied"));
    case NonfinitePolicy::kApply:
      STRATA_LOG(kWarn) << "non-finite gradients at step " << step << "; applied (strata.nonfinite is \"apply\")";
      return false;
    case NonfinitePolicy::kSkip:
      break;
  }
  return true;
}

// Per optimizer group, the constants of `config`'s optimizer (the Adam
// hyperparameters carry every group's lr, betas, eps and weight decay).
std::vector<UpdateConstants> update_constants(const Config& config, std::span<const nx::AdamHyperparams> hyper,
                                              std::int64_t step, double grad_scale) {
  std::vector<UpdateConstants> constants;
  constants.reserve(hyper.size());
  for (const nx::AdamHyperparams& h : hyper) constants.push_back(update_constants_at(config, h, step, grad_scale));
  return constants;
}

}  // namespace

UpdateConstants update_constants_at(const Config& config, const nx::AdamHyperparams& h, std::int64_t step,
                                    double grad_scale) {
  UpdateConstants k;
  switch (config.optimizer.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      k.adam = nx::make_adam_constants(h, step, grad_scale);
      break;
    case OptimizerType::kLion:
      k.lion = nx::make_lion_constants({.lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .weight_decay = h.weight_decay},
                                       grad_scale);
      break;
    case OptimizerType::kAdagrad:
      k.adagrad = nx::make_adagrad_constants({.lr = h.lr, .eps = h.eps, .weight_decay = h.weight_decay}, grad_scale);
      break;
  }
  return k;
}

Verdict::Verdict(const Config& config, LossScaler scaler, LrSchedule lr_schedule)
    : config_(config), scaler_(std::move(scaler)), lr_schedule_(std::move(lr_schedule)) {}

core::Result<Verdict::Decision> Verdict::judge(const Config& config, double raw_norm, bool nonfinite,
                                               LossScaler* scaler, std::int64_t step) {
  // The norm the device summed is of the scaled gradients (the loss scale
  // before this step's update), accumulated over the micro-batches.
  const double loss_scale = scaler != nullptr ? scaler->scale() : 1.0;
  const bool overflow = nonfinite || !std::isfinite(raw_norm);
  Decision d;
  if (scaler != nullptr) {
    STRATA_ASSIGN_OR_RETURN(LossScaler::Outcome o, scaler->update(overflow));
    d.skip = o == LossScaler::Outcome::kSkip;
  } else if (overflow) {
    STRATA_ASSIGN_OR_RETURN(d.skip, skip_nonfinite(config.strata.nonfinite, step));
  }
  d.grad_norm = raw_norm / loss_scale / static_cast<double>(config.micro_batches_per_step());
  if (!d.skip) d.clip = nx::clip_coefficient(d.grad_norm, config.gradient_clipping);
  return d;
}

core::Result<Verdict::Decision> Verdict::decide(double raw_norm, bool nonfinite) {
  return judge(config_, raw_norm, nonfinite, config_.precision == Precision::kFp16 ? &scaler_ : nullptr,
               applied_ + 1);
}

Verdict::Deferred Verdict::decide_deferred(const Config& config, double raw_norm, bool nonfinite,
                                           std::span<const nx::AdamHyperparams> hyper, std::int64_t step,
                                           std::int64_t norm_step) {
  // The same judgement without a loss scaler (never deferred with one); nor
  // is "error" (a failure here would be a skip).
  const core::Result<Decision> d = judge(config, raw_norm, nonfinite, nullptr, step);
  Deferred out;
  out.record.norm_step = norm_step;
  out.record.grad_norm = raw_norm / static_cast<double>(config.micro_batches_per_step());
  if (!d.ok() || d->skip) {
    out.record.skipped = true;
    return out;
  }
  out.grad_scale = nx::combined_grad_scale(1.0, d->clip, config.micro_batches_per_step());
  out.constants = update_constants(config, hyper, step, out.grad_scale);
  out.record.lr = hyper.front().lr;
  return out;
}

double Verdict::next_lr() const {
  return lr_override_ >= 0.0 ? lr_override_ : lr_schedule_.lr_for_step(applied_ + 1);
}

std::vector<nx::AdamHyperparams> Verdict::hyperparams(std::span<const OptimizerGroupDesc> groups) const {
  const double lr = next_lr();
  std::vector<nx::AdamHyperparams> hyper;
  hyper.reserve(groups.size());
  for (const OptimizerGroupDesc& og : groups) {
    hyper.push_back({.lr = lr * og.lr_scale,
                     .beta1 = config_.optimizer.beta1,
                     .beta2 = config_.optimizer.beta2,
                     .eps = config_.optimizer.eps,
                     .weight_decay = og.weight_decay,
                     .adamw_mode = config_.optimizer.adam_w_mode,
                     .bias_correction = config_.optimizer.bias_correction});
  }
  return hyper;
}

std::vector<UpdateConstants> Verdict::constants(std::span<const OptimizerGroupDesc> groups, double clip) const {
  // The loss scale after this step's scaler update, as DeepSpeed's fp16
  // optimizers unscale (docs/training.md).
  return update_constants(config_, hyperparams(groups), applied_ + 1, grad_scale(clip));
}

double Verdict::grad_scale(double clip) const {
  return nx::combined_grad_scale(scaler_.scale(), clip, config_.micro_batches_per_step());
}

core::Status Verdict::restore(const LossScaler::State& scaler, std::int64_t applied, std::int64_t skipped,
                              double lr_override) {
  STRATA_RETURN_IF_ERROR(scaler_.restore(scaler));
  applied_ = applied;
  skipped_ = skipped;
  last_ = {};
  lr_override_ = lr_override;
  return Status();
}

}  // namespace strata::engine
