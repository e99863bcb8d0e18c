// CRC64 of swap blocks: CRC-64/XZ (ECMA-182 polynomial, reflected, initial
// value and final XOR all ones), computed by ISA-L's crc64_ecma_refl when
// ISA-L is built in and by a portable table otherwise (same values, slower).
// Thread-safe (pure functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace strata::nvme {

// Extends `crc` (0 to start) over `data`: crc64(crc64(0, a), b) == crc64(0, a + b).
// crc64(0, "123456789") == 0x995dc9bbdf1939fa.
std::uint64_t crc64(std::uint64_t crc, std::span<const std::byte> data);

// True when ISA-L computes it (else the portable table).
bool crc64_accelerated();

}  // namespace strata::nvme
