// The element types of the compute dtype (2 or 4 bytes) for cpu_adam and the
// device. Private to engine/.
#pragma once

#include "cpu_adam/cpu_adam.h"
#include "engine/config.h"
#include "gpu/device.h"

namespace strata::engine {

inline adam::ElemType adam_type(int bytes, Precision p) {
  if (bytes == 4) return adam::ElemType::kF32;
  return p == Precision::kFp16 ? adam::ElemType::kF16 : adam::ElemType::kBf16;
}
inline gpu::ElemType gpu_type(int bytes, Precision p) {
  if (bytes == 4) return gpu::ElemType::kF32;
  return p == Precision::kFp16 ? gpu::ElemType::kF16 : gpu::ElemType::kBf16;
}

}  // namespace strata::engine
