// The code tables of a checkpoint with 8-bit blockwise moments
// (strata.optimizer_state int8_blockwise): core/numerics.h's QuantTables
// values, saved in state.safetensors beside the codes so that a build with
// other tables refuses the codes instead of reading them wrong, and the
// checks `strata inspect --verify` runs over the codes and their scales.
#pragma once

#include <string_view>

#include "core/result.h"
#include "engine/checkpoint/safetensors.h"

namespace strata::engine {

inline constexpr std::string_view kCodeTableM = "__strata__.int8_code.exp_avg";     // F32[128]
inline constexpr std::string_view kCodeTableV = "__strata__.int8_code.exp_avg_sq";  // F32[256]

// A state file with U8 tensors (codes) or code tables holds both tables, and
// they are this build's; else kFailedPrecondition (other tables) or
// kNotFound (codes without tables), naming the file. A file without either
// passes.
core::Status check_code_tables(const SafetensorsReader& reader);

// check_code_tables, then every U8 tensor's codes and scales
// ("<tensor>.absmax", F32, one per block of 256): an exp_avg's code is never
// 0x80 (a negative zero magnitude), each scale is >= 0 or NaN (a poisoned
// block), and the scales' count matches the codes'. kDataLoss naming the
// tensor and the first bad index. Reads every U8 tensor.
core::Status verify_codes(const SafetensorsReader& reader);

}  // namespace strata::engine
