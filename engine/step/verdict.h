// Verdict: what a step's gradients decide, written once for step_end and for
// the deferred verdicts that "delayed"'s optimizer jobs take themselves.
//
//   raw norm (sqrt of the block partials' sum, in block order), inf/NaN flag
//     -> skip?   fp16: DeepSpeed's loss scaler (skip and lower on overflow);
//                bf16/fp32: strata.nonfinite (skip and count, error, apply)
//     -> grad_norm = raw / loss_scale / micro-batches (gradient_accumulation_steps
//        x ranks: the gradients are summed over both)
//     -> clip coefficient (gradient_clipping)
//     -> per optimizer group: lr (schedule or set_lr) x lr_scale, its weight
//        decay, and one factor folding 1/loss_scale, clipping and 1/gas
//        (core/numerics.h: make_adam_constants)
//
// It also keeps what the verdicts change: the loss scaler, the applied and
// skipped step counts, the learning-rate override, and the last verdict
// taken (what StepStats report). Thread-compatible: the engine calls it under
// its lock; decide_deferred is a pure function for the optimizer thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/numerics.h"
#include "engine/optimizer_spec.h"
#include "core/result.h"
#include "engine/config.h"
#include "engine/layout.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"

namespace strata::engine {

// One step's verdict as StepStats report it.
struct VerdictRecord {
  std::int64_t norm_step = 0;  // see StepStats::norm_step
  double grad_norm = 0.0;      // unscaled, averaged, before clipping
  double lr = 0.0;             // optimizer group 0's
  bool skipped = false;
};

// One optimizer group's constants of `config`'s optimizer for optimizer step
// `step` (from 1: Adam's bias correction) with hyperparameters `hyper` and
// the combined gradient factor `grad_scale`: what a parameter whose own step
// count differs from the job's uses (strata.no_grad "skip").
UpdateConstants update_constants_at(const Config& config, const core::numerics::AdamHyperparams& hyper,
                                    std::int64_t step, double grad_scale);

class Verdict {
 public:
  Verdict(const Config& config, LossScaler scaler, LrSchedule lr_schedule);

  // step_end's verdict on the step's gradients. fp16 runs the loss scaler
  // (its errors: an overflow at the minimum scale); bf16/fp32 follow
  // strata.nonfinite: kFailedPrecondition with "error" (nothing changes),
  // a warning with "apply". Counts nothing (count() does, once the step is
  // settled).
  struct Decision {
    bool skip = false;
    double grad_norm = 0.0;  // unscaled, averaged, before clipping
    double clip = 1.0;       // the clipping coefficient (1: none)
  };
  core::Result<Decision> decide(double raw_norm, bool nonfinite);
  // The one judgement both take (decide, and decide_deferred without a
  // scaler): the loss scaler's update (fp16; `scaler` null otherwise) or
  // strata.nonfinite for step `step`, the grad norm, the clipping coefficient.
  static core::Result<Decision> judge(const Config& config, double raw_norm, bool nonfinite, LossScaler* scaler,
                                      std::int64_t step);

  // A deferred verdict (Schedule::defers_verdicts: bf16/fp32, nonfinite not
  // "error"), taken once the step's gradients are in, with the
  // hyperparameters step_end captured: the record, and the constants when
  // the step is applied (empty when skipped).
  struct Deferred {
    VerdictRecord record;
    std::vector<UpdateConstants> constants;
    double grad_scale = 1.0;  // the constants' (update_constants_at)
  };
  static Deferred decide_deferred(const Config& config, double raw_norm, bool nonfinite,
                                  std::span<const core::numerics::AdamHyperparams> hyper, std::int64_t step,
                                  std::int64_t norm_step);

  // The next step's learning rate (set_lr's override, or the schedule's).
  double next_lr() const;
  // Per optimizer group, the next step's hyperparameters.
  std::vector<core::numerics::AdamHyperparams> hyperparams(std::span<const OptimizerGroupDesc> groups) const;
  // Per optimizer group, the next step's constants with the current loss
  // scale and clipping coefficient `clip`.
  std::vector<UpdateConstants> constants(std::span<const OptimizerGroupDesc> groups,
                                                           double clip) const;
  // The combined gradient factor those constants carry (the current loss
  // scale, `clip`, the micro-batches).
  double grad_scale(double clip) const;

  // The step counts: step_end counts its own verdict; deferred verdicts are
  // folded in when their jobs have finished (fold).
  enum class Outcome { kApplied, kSkipped };
  void count(Outcome o) { ++(o == Outcome::kSkipped ? skipped_ : applied_); }
  void fold(const VerdictRecord& r) {
    count(r.skipped ? Outcome::kSkipped : Outcome::kApplied);
    last_ = r;
  }
  std::int64_t applied_steps() const { return applied_; }
  std::int64_t skipped_steps() const { return skipped_; }
  // Verdicts taken, applied or skipped: the number of the last one.
  std::int64_t verdicts() const { return applied_ + skipped_; }
  const VerdictRecord& last() const { return last_; }

  double loss_scale() const { return scaler_.scale(); }
  double lr_override() const { return lr_override_; }  // < 0: none
  void set_lr_override(double lr) { lr_override_ = lr; }

  // Checkpoints: what a resumed run needs to go on bit for bit.
  const LossScaler::State& scaler_state() const { return scaler_.state(); }
  core::Status restore(const LossScaler::State& scaler, std::int64_t applied, std::int64_t skipped,
                       double lr_override);
  // What restore would refuse (the scaler's state for this config), changing nothing.
  core::Status check_restore(const LossScaler::State& scaler) const { return scaler_.check(scaler); }

 private:
  const Config& config_;
  LossScaler scaler_;
  LrSchedule lr_schedule_;
  double lr_override_ = -1.0;
  std::int64_t applied_ = 0;
  std::int64_t skipped_ = 0;
  VerdictRecord last_;  // the latest deferred verdict folded in
};

}  // namespace strata::engine
