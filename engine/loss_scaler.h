// The loss scale of mixed-precision training, as DeepSpeed's fp16 scaler
// keeps it (docs/training.md writes the state machine out):
//
// - fp16 with fp16.loss_scale = 0: dynamic. The scale starts at
//   2^initial_scale_power. A step whose gradients hold an inf or NaN is
//   skipped; it spends one unit of hysteresis, and when none is left (or
//   hysteresis is 1) the scale is divided by 2, never below min_loss_scale.
//   An overflow with the scale already at min_loss_scale is an error (the run
//   cannot make progress; nothing has been changed). After loss_scale_window
//   steps since the last overflow the scale doubles and hysteresis refills;
//   with consecutive_hysteresis it refills after every good step.
// - fp16 with loss_scale > 0: that static scale; an overflowing step is
//   skipped and the scale never changes.
// - bf16 and fp32: scale 1. Non-finite gradients follow
//   strata.nonfinite (skip and count, or error); this class only reports.
#pragma once

#include <cstdint>

#include "engine/config.h"
#include "core/result.h"

namespace strata::engine {

class LossScaler {
 public:
  // Everything a checkpoint needs to resume the scaler bit for bit.
  struct State {
    double scale = 1.0;
    std::int64_t iteration = 0;              // updates seen (DeepSpeed's cur_iter)
    std::int64_t last_overflow_iteration = -1;
    std::int64_t hysteresis_left = 1;        // DeepSpeed's cur_hysteresis
    friend bool operator==(const State&, const State&) = default;
  };

  enum class Outcome {
    kApply,  // gradients finite: apply the step
    kSkip,   // overflow: skip the step (the scale may have dropped)
  };

  // Errors (kInvalidArgument, naming the fp16.* key): initial_scale_power
  // outside [0, 126], loss_scale_window < 1, hysteresis < 1, min_loss_scale
  // <= 0 or not finite, a negative static loss_scale.
  // `fp16_enabled` false gives the constant scale 1 (bf16, fp32).
  static core::Result<LossScaler> create(const Fp16Config& config);

  double scale() const { return state_.scale; }
  bool dynamic() const { return dynamic_; }
  const State& state() const { return state_; }
  // Restores a checkpointed state. kInvalidArgument if it is not one this
  // configuration could reach (scale <= 0, hysteresis outside [1, hysteresis]).
  core::Status restore(const State& state);
  // What restore would refuse, without changing anything.
  core::Status check(const State& state) const;

  // Records one step's verdict on its gradients and says what to do with the
  // step. Error (kFailedPrecondition, state unchanged): an overflow with a
  // dynamic scale already at min_loss_scale.
  core::Result<Outcome> update(bool overflow);

 private:
  LossScaler(const Fp16Config& config, bool dynamic);

  Fp16Config config_;
  bool dynamic_ = false;
  State state_;
};

}  // namespace strata::engine
