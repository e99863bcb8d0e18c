// The optimizer seam: what an optimizer keeps per trainable element, read by
// everything that sizes, stores, moves or names the state (layout, state
// store, disk pipeline, working memory, finalize's budgets, checkpoints,
// read_state, the planner) instead of "three fp32 arrays". Its update is
// cpu_adam's (lion_step, adagrad_step, step) on the host and the device's
// optimizer_step on the device, dispatched on `type` by the optimizer's job
// (engine/step/optimizer.cpp).
//
// A chunk's state is `arrays` arrays of its elements, kept together as
// [master | state 1 | state 2]: the fp32 master weight first, then the
// optimizer's own arrays under their checkpoint names, each in the spec's
// format (strata.optimizer_state: fp32; bf16 for Adam's moments, 2 bytes an
// element, their bit patterns as uint16_t; int8_blockwise for Adam's
// moments, a byte of code an element, core/numerics.h). Blockwise arrays
// keep one fp32 scale per block of kQuantBlockElems elements after all the
// arrays: [master | codes 1 | codes 2 | scales 1 | scales 2]. Chunks hold
// whole norm blocks (65536 elements), so every part starts 4096-byte aligned.
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <string_view>

#include "core/numerics.h"
#include "engine/config.h"

namespace strata::engine {

struct OptimizerSpec {
  OptimizerType type = OptimizerType::kAdamW;
  StateFormat format = StateFormat::kFp32;  // of the optimizer's arrays (the master is fp32)
  int arrays = 3;  // arrays per trainable element, the master included
  // The arrays' names in checkpoints, exports and read_state: "master", then
  // the optimizer's (DeepSpeed's names: Adagrad's sum of squares is "exp_avg_sq").
  std::array<std::string_view, 3> names{"master", "exp_avg", "exp_avg_sq"};

  // Bytes of one element of array k: 4 for the master and fp32 state, 2 for
  // bf16, 1 for int8_blockwise codes (their scales apart).
  int elem_bytes(int k) const {
    if (k == 0 || format == StateFormat::kFp32) return 4;
    return format == StateFormat::kBf16 ? 2 : 1;
  }
  // The optimizer's arrays carry one fp32 scale per block of kQuantBlockElems.
  bool blockwise() const { return format == StateFormat::kInt8Blockwise; }
  static std::uint64_t blocks(std::int64_t elems) {
    return (static_cast<std::uint64_t>(elems) + core::numerics::kQuantBlockElems - 1) / core::numerics::kQuantBlockElems;
  }
  // Bytes of the state of `elems` elements (a chunk's), the master and the
  // optimizer's arrays with their scales.
  std::uint64_t state_bytes(std::int64_t elems) const { return array_offset(arrays, elems) + scales_bytes(elems); }
  // Bytes of the optimizer's arrays of `elems` elements (the master apart).
  std::uint64_t moment_bytes(std::int64_t elems) const { return state_bytes(elems) - 4 * static_cast<std::uint64_t>(elems); }
  // Where array k starts in a chunk of `elems` elements, in bytes.
  std::uint64_t array_offset(int k, std::int64_t elems) const {
    std::uint64_t off = 0;
    for (int a = 0; a < k; ++a) off += static_cast<std::uint64_t>(elem_bytes(a)) * static_cast<std::uint64_t>(elems);
    return off;
  }
  // Where array k's scales start (k >= 1, blockwise), in bytes.
  std::uint64_t scales_offset(int k, std::int64_t elems) const {
    return array_offset(arrays, elems) + static_cast<std::uint64_t>(k - 1) * 4 * blocks(elems);
  }
  std::uint64_t scales_bytes(std::int64_t elems) const {
    return blockwise() ? static_cast<std::uint64_t>(arrays - 1) * 4 * blocks(elems) : 0;
  }
  // Which code table blockwise array k uses: exp_avg's signed one, else the unsigned one.
  bool signed_codes(int k) const { return names[static_cast<std::size_t>(k)] == "exp_avg"; }
  // The index of the array called `name` (0: master), or -1.
  int index_of(std::string_view name) const {
    for (int i = 0; i < arrays; ++i) {
      if (names[static_cast<std::size_t>(i)] == name) return i;
    }
    return -1;
  }
};

// n stored elements back to fp32, as a step reads them: `elem_bytes` 4 (fp32,
// copied), 2 (bf16 bit patterns, widened exactly) or 1 (int8_blockwise codes
// dequantized with `scales`, one per block of kQuantBlockElems, element 0
// starting one; `signed_codes`: exp_avg's table).
inline void widen_state(int elem_bytes, bool signed_codes, const std::byte* raw, const float* scales, std::size_t n,
                        float* out) {
  namespace nx = core::numerics;
  if (elem_bytes == 4) {
    std::memcpy(out, raw, n * 4);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (elem_bytes == 2) {
      std::uint16_t h;
      std::memcpy(&h, raw + 2 * i, 2);
      out[i] = nx::bf16_bits_to_fp32(h);
    } else {
      const auto code = static_cast<std::uint8_t>(raw[i]);
      const float s = scales[i / nx::kQuantBlockElems];
      out[i] = signed_codes ? nx::dequantize_m(nx::kQuantTables, code, s) : nx::dequantize_v(nx::kQuantTables, code, s);
    }
  }
}

// One optimizer group's constants for one step: the member of the spec's type
// is used (AdamW and Adam: adam). All floats, so two compare with memcmp.
struct UpdateConstants {
  core::numerics::AdamStepConstants adam;
  core::numerics::LionStepConstants lion;
  core::numerics::AdagradStepConstants adagrad;
};

// The spec of an optimizer whose arrays are kept in `format` (the config
// check allows bf16 for Adam and AdamW only).
inline OptimizerSpec optimizer_spec(OptimizerType type, StateFormat format = StateFormat::kFp32) {
  switch (type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      return {type, format, 3, {"master", "exp_avg", "exp_avg_sq"}};
    case OptimizerType::kLion: return {type, format, 2, {"master", "exp_avg", ""}};
    case OptimizerType::kAdagrad: return {type, format, 2, {"master", "exp_avg_sq", ""}};
  }
  return {};
}

}  // namespace strata::engine
