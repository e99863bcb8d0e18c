#include "engine/checkpoint/code_tables.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "core/str.h"

namespace strata::engine {

using core::Status;
using core::str_cat;
namespace nx = core::numerics;

core::Status check_code_tables(const SafetensorsReader& reader) {
  bool codes = false;
  for (const TensorInfo& t : reader.tensors()) codes = codes || t.dtype == TensorDtype::kU8;
  const bool tables = reader.find(kCodeTableM) != nullptr || reader.find(kCodeTableV) != nullptr;
  if (!codes && !tables) return Status();
  std::vector<float> m(128), v(256);
  for (auto [name, out] : {std::pair{kCodeTableM, &m}, std::pair{kCodeTableV, &v}}) {
    if (reader.find(name) == nullptr) {
      return Status::not_found(str_cat(reader.path(), ": it holds 8-bit moment codes but not their code table '",
                                       name, "'"));
    }
    STRATA_RETURN_IF_ERROR(reader.read_f32(name, *out));
  }
  if (std::memcmp(m.data(), nx::kQuantTables.m_values, sizeof(float) * 128) != 0 ||
      std::memcmp(v.data(), nx::kQuantTables.v_values, sizeof(float) * 256) != 0) {
    return Status::failed_precondition(str_cat(reader.path(), ": its 8-bit moments use other code tables (", kCodeTableM,
                                               ", ", kCodeTableV, ") than this build's (core/numerics.h)"));
  }
  return Status();
}

core::Status verify_codes(const SafetensorsReader& reader) {
  STRATA_RETURN_IF_ERROR(check_code_tables(reader));
  for (const TensorInfo& t : reader.tensors()) {
    if (t.dtype != TensorDtype::kU8) continue;
    const std::string scales_name = t.name + ".absmax";
    const TensorInfo* s = reader.find(scales_name);
    const auto n = static_cast<std::uint64_t>(t.numel());
    const std::uint64_t blocks = (n + nx::kQuantBlockElems - 1) / nx::kQuantBlockElems;
    if (s == nullptr || s->dtype != TensorDtype::kF32 || static_cast<std::uint64_t>(s->numel()) != blocks) {
      return Status::data_loss(str_cat(reader.path(), ": the codes '", t.name, "' (", n, " of them) need ", blocks,
                                       " F32 scales in '", scales_name, "'"));
    }
    std::vector<std::uint8_t> codes(n);
    std::vector<float> scales(blocks);
    STRATA_RETURN_IF_ERROR(reader.read_raw(t.name, std::as_writable_bytes(std::span<std::uint8_t>(codes))));
    STRATA_RETURN_IF_ERROR(reader.read_f32(scales_name, scales));
    for (std::uint64_t b = 0; b < blocks; ++b) {
      if (!(scales[b] >= 0.0f) && !std::isnan(scales[b])) {
        return Status::data_loss(str_cat(reader.path(), ": '", scales_name, "' block ", b, " has scale ", scales[b],
                                         " (a scale is an absmax: >= 0, or NaN for a poisoned block)"));
      }
    }
    const bool is_signed = t.name.size() >= 8 && t.name.compare(t.name.size() - 8, 8, ".exp_avg") == 0;
    for (std::uint64_t i = 0; is_signed && i < n; ++i) {
      if (codes[i] == 0x80) {
        return Status::data_loss(str_cat(reader.path(), ": '", t.name, "' element ", i,
                                         " has code 0x80 (a negative zero, which quantizing never writes)"));
      }
    }
  }
  return Status();
}

}  // namespace strata::engine
