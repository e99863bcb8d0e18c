#include "engine/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "core/str.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

LossScaler::LossScaler(const Fp16Config& config, bool dynamic) : config_(config), dynamic_(dynamic) {
  if (!config.enabled) {
    state_.scale = 1.0;
  } else if (!dynamic) {
    state_.scale = config.loss_scale;
  } else {
    state_.scale = std::ldexp(1.0, config.initial_scale_power);
    state_.hysteresis_left = config.hysteresis;
  }
}

core::Result<LossScaler> LossScaler::create(const Fp16Config& c) {
  if (!c.enabled) return LossScaler(c, false);
  if (!(c.loss_scale >= 0.0) || !std::isfinite(c.loss_scale)) {
    return Status::invalid_argument(
        str_cat("fp16.loss_scale = ", c.loss_scale, ": expected 0 (dynamic) or a finite static scale > 0"));
  }
  if (c.loss_scale > 0.0) return LossScaler(c, false);
  if (c.initial_scale_power < 0 || c.initial_scale_power > 126) {
    return Status::invalid_argument(
        str_cat("fp16.initial_scale_power = ", c.initial_scale_power, ": expected 0 to 126 (the scale is 2^power)"));
  }
  if (c.loss_scale_window < 1) {
    return Status::invalid_argument(str_cat("fp16.loss_scale_window = ", c.loss_scale_window, ": expected >= 1"));
  }
  if (c.hysteresis < 1) {
    return Status::invalid_argument(str_cat("fp16.hysteresis = ", c.hysteresis, ": expected >= 1"));
  }
  if (!(c.min_loss_scale > 0.0) || !std::isfinite(c.min_loss_scale)) {
    return Status::invalid_argument(str_cat("fp16.min_loss_scale = ", c.min_loss_scale, ": expected a finite scale > 0"));
  }
  return LossScaler(c, true);
}

Status LossScaler::check(const State& s) const {
  if (!(s.scale > 0.0) || !std::isfinite(s.scale)) {
    return Status::invalid_argument(str_cat("loss scaler state: scale ", s.scale, " is not a finite value > 0"));
  }
  const std::int64_t max_hysteresis = dynamic_ ? config_.hysteresis : 1;
  if (s.hysteresis_left < 1 || s.hysteresis_left > max_hysteresis) {
    return Status::invalid_argument(str_cat("loss scaler state: hysteresis_left ", s.hysteresis_left,
                                            " is outside [1, ", max_hysteresis,
                                            "] (fp16.hysteresis when the scale is dynamic, else 1)"));
  }
  if (s.iteration < 0 || s.last_overflow_iteration < -1 || s.last_overflow_iteration >= s.iteration) {
    return Status::invalid_argument(str_cat("loss scaler state: iteration ", s.iteration, " and last overflow ",
                                            s.last_overflow_iteration, " are inconsistent"));
  }
  return Status();
}

Status LossScaler::restore(const State& s) {
  STRATA_RETURN_IF_ERROR(check(s));
  state_ = s;
  return Status();
}

core::Result<LossScaler::Outcome> LossScaler::update(bool overflow) {
  State next = state_;
  if (!dynamic_) {
    ++next.iteration;
    if (overflow) next.last_overflow_iteration = state_.iteration;
    state_ = next;
    return overflow ? Outcome::kSkip : Outcome::kApply;
  }
  if (overflow) {
    if (config_.hysteresis == 1 || next.hysteresis_left == 1) {
      if (next.scale == config_.min_loss_scale) {  // DeepSpeed compares for equality
        return Status::failed_precondition(
            str_cat("fp16 gradients overflow with the loss scale already at its minimum ", next.scale,
                    " (fp16.min_loss_scale): the run cannot make progress. The step was not applied; "
                    "check the model for inf/NaN, or lower fp16.min_loss_scale"));
      }
      next.scale = std::max(next.scale / 2.0, config_.min_loss_scale);
    } else {
      --next.hysteresis_left;
    }
    next.last_overflow_iteration = next.iteration;
  } else {
    if (config_.consecutive_hysteresis) next.hysteresis_left = config_.hysteresis;
    if ((next.iteration - next.last_overflow_iteration) % config_.loss_scale_window == 0) {
      if (!config_.consecutive_hysteresis) next.hysteresis_left = config_.hysteresis;
      next.scale *= 2.0;
    }
  }
  ++next.iteration;
  state_ = next;
  return overflow ? Outcome::kSkip : Outcome::kApply;
}

}  // namespace strata::engine
