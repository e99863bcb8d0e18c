// Views of device memory and the argument structs of the device kernels.
// DeviceSpan is to device memory what std::span<std::byte> is to host memory:
// a non-owning byte range of one DeviceBuffer. Value types, thread-compatible.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/numerics.h"

namespace strata::gpu {

class Device;

// Element types the kernels read and write.
enum class ElemType { kF32, kBf16, kF16 };

std::string_view elem_type_name(ElemType type);  // "fp32", "bf16", "fp16"
inline constexpr std::uint64_t elem_size_bytes(ElemType type) { return type == ElemType::kF32 ? 4 : 2; }

// A byte range [offset, offset + size) of one device buffer. It remembers the
// buffer (its id and size) so the device can reject a range past the buffer's
// end or a buffer that was freed; building an out-of-range view is allowed,
// using it is an error. Does not own: the DeviceBuffer must outlive the work
// that uses the view.
class DeviceSpan {
 public:
  DeviceSpan() = default;

  // The device address of the first byte (a CUDA pointer on the CUDA device, a
  // host address on the host device). Only the device's own operations, or a
  // framework's kernels on the same device, may dereference it.
  void* data() const {
    return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(base_) + offset_bytes_);
  }
  std::uint64_t size_bytes() const { return size_bytes_; }
  bool empty() const { return size_bytes_ == 0; }
  // Where the view starts inside its buffer, and the buffer's size.
  std::uint64_t offset_bytes() const { return offset_bytes_; }
  std::uint64_t buffer_size_bytes() const { return buffer_size_bytes_; }
  // Unique per allocation within a process (0: no buffer).
  std::uint64_t buffer_id() const { return buffer_id_; }
  const Device* device() const { return device_; }
  // True when the view lies inside its buffer.
  bool in_bounds() const {
    return offset_bytes_ <= buffer_size_bytes_ && size_bytes_ <= buffer_size_bytes_ - offset_bytes_;
  }

  // [offset, offset + size) relative to this view. Not checked here: the
  // device checks the range when the view is used.
  DeviceSpan subspan(std::uint64_t offset_bytes, std::uint64_t size_bytes) const {
    DeviceSpan s = *this;
    s.offset_bytes_ = offset_bytes_ + offset_bytes;
    s.size_bytes_ = size_bytes;
    return s;
  }
  // From `offset` to the end of this view (empty when offset is past it).
  DeviceSpan subspan(std::uint64_t offset_bytes) const {
    return subspan(offset_bytes, offset_bytes <= size_bytes_ ? size_bytes_ - offset_bytes : 0);
  }

 private:
  friend class Device;
  DeviceSpan(const Device* device, std::uint64_t buffer_id, void* base, std::uint64_t buffer_size_bytes)
      : device_(device), buffer_id_(buffer_id), base_(base), buffer_size_bytes_(buffer_size_bytes),
        size_bytes_(buffer_size_bytes) {}

  const Device* device_ = nullptr;
  std::uint64_t buffer_id_ = 0;
  void* base_ = nullptr;  // the buffer's first byte
  std::uint64_t buffer_size_bytes_ = 0;
  std::uint64_t offset_bytes_ = 0;
  std::uint64_t size_bytes_ = 0;
};

// A device view read as elements of one type. The byte size must be a
// multiple of the element size and the address aligned to it.
struct DeviceTypedSpan {
  DeviceSpan bytes;
  ElemType type = ElemType::kF32;
  std::int64_t size() const { return static_cast<std::int64_t>(bytes.size_bytes() / elem_size_bytes(type)); }
};

inline DeviceTypedSpan typed(DeviceSpan bytes, ElemType type) { return {bytes, type}; }

// --- kernel arguments (formulas in core/numerics.h) -------------------

// One fused AdamW/Adam step on the device, element by element with
// numerics::adam_step: master, exp_avg and exp_avg_sq (fp32, n elements each)
// are updated in place from the gradient (fp32, bf16 or fp16, n elements);
// when copy_out has a buffer, the updated master is also written to it as
// bf16 or fp16 (numerics.h rounding). No two views may overlap.
struct AdamStepArgs {
  core::numerics::AdamStepConstants constants;  // from numerics::make_adam_constants
  DeviceSpan master;                            // fp32
  DeviceSpan exp_avg;                           // fp32
  DeviceSpan exp_avg_sq;                        // fp32
  DeviceTypedSpan grad;                         // fp32, bf16 or fp16
  DeviceTypedSpan copy_out;                     // optional (empty bytes: none); bf16 or fp16
};

// Adam/AdamW with bf16 moments (numerics::adam_step_bf16_moments), the device
// twin of cpu_adam's step_bf16_moments: the step of AdamStepArgs with exp_avg
// and exp_avg_sq stored as bf16 bit patterns. Per element i: widen m and v to
// fp32 (exact), run numerics::adam_step unchanged, narrow m and v back to bf16
// with `rounding` (nearest even, or stochastic with the 16 bits
// stochastic_rounding_bits(stochastic_rounding_key(seed, step), index_base + i,
// moment)), and write the master to copy_out as AdamStepArgs does. The bits
// depend on the global index only, so a range updated in several calls (each
// with its own index_base) gets the bits of one call. State: 8 bytes per
// element (master 4, m 2, v 2) against AdamStepArgs' 12. No two views may
// overlap.
struct AdamStepBf16MomentsArgs {
  core::numerics::AdamStepConstants constants;  // from numerics::make_adam_constants
  DeviceSpan master;                            // fp32, n elements
  DeviceSpan exp_avg;        // bf16 bit patterns, n elements (2 bytes each), updated in place
  DeviceSpan exp_avg_sq;     // bf16 bit patterns, n elements
  DeviceTypedSpan grad;      // fp32, bf16 or fp16
  DeviceTypedSpan copy_out;  // optional (empty bytes: none); bf16 or fp16
  // How m and v are narrowed. Default: round to nearest even (seed, step and
  // index_base are then unused).
  core::numerics::Bf16Rounding rounding = core::numerics::Bf16Rounding::kNearestEven;
  std::uint64_t seed = 0;  // kStochastic: the run's seed (any value); default 0
  std::int64_t step = 0;   // kStochastic: the optimizer step (any value, usually from 1); default 0
  // Global index of element 0 (>= 0; default 0); element i draws
  // stochastic_rounding_bits(key, index_base + i, moment), key =
  // stochastic_rounding_key(seed, step).
  std::int64_t index_base = 0;
};

// Adam/AdamW with 8-bit blockwise moments (numerics.h, "Adam/AdamW with 8-bit
// blockwise moments"): the step of AdamStepArgs with exp_avg and exp_avg_sq
// stored as one byte of code each, in blocks of numerics::kQuantBlockElems
// (256) consecutive elements, each block with one fp32 scale per moment.
// Element 0 starts block 0 and the last block may be short: blocks =
// ceil(n / 256). Each block is numerics::adam_step_int8_block: dequantize m
// and v with the block's scales, run numerics::adam_step unchanged, take the
// new scales (block_scale of each moment's absmax: NaN when a moment is not
// finite) and quantize m and v against them; the master goes to copy_out as
// AdamStepArgs does. Blocks are counted from each call's element 0, so a
// range stepped in several calls that split it at multiples of 256 elements
// gets the results of one call over it. The all-zero state (codes and scales)
// is zero moments. State: 4 + 1 + 1 bytes per element plus 8 per
// block, against AdamStepArgs' 12. No two views may overlap.
struct AdamStepInt8Args {
  core::numerics::AdamStepConstants constants;  // from numerics::make_adam_constants
  DeviceSpan master;                            // fp32, n elements
  DeviceSpan exp_avg;                           // n bytes of codes (numerics::quantize_m), updated in place
  DeviceSpan exp_avg_sq;                        // n bytes of codes (numerics::quantize_v), updated in place
  DeviceSpan exp_avg_scale;                     // fp32, ceil(n / 256): one per block, updated in place
  DeviceSpan exp_avg_sq_scale;                  // fp32, ceil(n / 256), updated in place
  DeviceTypedSpan grad;                         // fp32, bf16 or fp16, n elements
  DeviceTypedSpan copy_out;                     // optional (empty bytes: none); bf16 or fp16
};

// One fused Lion step (numerics::lion_step): master and exp_avg updated in
// place; the rest as AdamStepArgs.
struct LionStepArgs {
  core::numerics::LionStepConstants constants;  // from numerics::make_lion_constants
  DeviceSpan master;                            // fp32
  DeviceSpan exp_avg;                           // fp32
  DeviceTypedSpan grad;                         // fp32, bf16 or fp16
  DeviceTypedSpan copy_out;                     // optional (empty bytes: none); bf16 or fp16
};

// One fused Adagrad step (numerics::adagrad_step): master and the sum of
// squared gradients (exp_avg_sq) updated in place; the rest as AdamStepArgs.
struct AdagradStepArgs {
  core::numerics::AdagradStepConstants constants;  // from numerics::make_adagrad_constants
  DeviceSpan master;                               // fp32
  DeviceSpan exp_avg_sq;                           // fp32
  DeviceTypedSpan grad;                            // fp32, bf16 or fp16
  DeviceTypedSpan copy_out;                        // optional (empty bytes: none); bf16 or fp16
};

// Norm partials of n values in the contract's order (numerics.h): the first
// element starts norm block 0; partials receives numerics::norm_block_count(n)
// doubles, block b's partial at index b. When nonfinite_flag has a buffer (4
// bytes, a uint32), 1 is stored there if any value is inf or NaN; otherwise it
// is left as it was (fill it with 0 first: the flag is sticky across calls).
struct NormPartialsArgs {
  DeviceTypedSpan src;         // fp32, bf16 or fp16
  DeviceSpan partials;         // at least norm_block_count(n) * 8 bytes, 8-byte aligned
  DeviceSpan nonfinite_flag;   // optional: exactly 4 bytes, 4-byte aligned
};

}  // namespace strata::gpu
