// CRC-64/XZ through ISA-L, or a byte-at-a-time table when ISA-L is missing.
#include "nvme/crc64.h"

#include <array>

#include "strata_build_config.h"

#if STRATA_HAVE_ISAL
#include <isa-l/crc64.h>
#endif

namespace strata::nvme {

#if STRATA_HAVE_ISAL

std::uint64_t crc64(std::uint64_t crc, std::span<const std::byte> data) {
  return crc64_ecma_refl(crc, reinterpret_cast<const unsigned char*>(data.data()), data.size());
}
bool crc64_accelerated() { return true; }

#else

namespace {
constexpr std::uint64_t kReflectedPoly = 0xc96c5795d7870f42ull;  // ECMA-182, bit-reversed

constexpr std::array<std::uint64_t, 256> make_table() {
  std::array<std::uint64_t, 256> t{};
  for (std::uint64_t i = 0; i < 256; ++i) {
    std::uint64_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kReflectedPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<std::uint64_t, 256> kTable = make_table();
}  // namespace

std::uint64_t crc64(std::uint64_t crc, std::span<const std::byte> data) {
  crc = ~crc;
  for (std::byte b : data) crc = kTable[(crc ^ static_cast<std::uint64_t>(b)) & 0xff] ^ (crc >> 8);
  return ~crc;
}
bool crc64_accelerated() { return false; }

#endif

}  // namespace strata::nvme
