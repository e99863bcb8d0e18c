// The members manifest.json and `strata inspect --json` write alike: the loss
// scaler and the parameter list. Header-only; behind the nlohmann firewall
// (engine/checkpoint/: tests/layering_test.py).
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "engine/checkpoint/manifest.h"

namespace strata::engine {

inline nlohmann::ordered_json checkpoint_scaler_json(const CheckpointScaler& s) {
  return {{"scale", s.scale},
          {"iteration", s.iteration},
          {"last_overflow_iteration", s.last_overflow_iteration},
          {"hysteresis_left", s.hysteresis_left}};
}

inline nlohmann::ordered_json checkpoint_params_json(const std::vector<CheckpointParam>& params) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const CheckpointParam& p : params) {
    out.push_back({{"name", p.name},
                   {"shape", p.shape},
                   {"group", p.group},
                   {"trainable", p.trainable},
                   {"optimizer_group", p.optimizer_group}});
    if (p.missed_steps != 0) out.back()["missed_steps"] = p.missed_steps;  // (written only when not 0)
  }
  return out;
}

}  // namespace strata::engine
