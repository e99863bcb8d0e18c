// The swap index file format (version 1), little-endian throughout:
//   magic "STRATASW" | u32 version | u32 flags (0) | u64 stripe_bytes
//   u32 path count, per path: u32 length, bytes, u64 swap file bytes
//   u64 block count, per block (sorted by id): u32 id length, id bytes,
//     u64 size, u8 written, u8 crc_valid, u32 extent count,
//     per extent: u32 path index, u64 file offset, u64 length, u64 crc64
//   u64 CRC64 (nvme/crc64.h) of every byte before it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace strata::nvme::internal {

inline constexpr std::uint32_t kSwapIndexVersion = 1;

struct IndexExtent {
  std::uint32_t path = 0;
  std::uint64_t file_offset = 0;
  std::uint64_t length = 0;
  std::uint64_t crc = 0;
};

struct IndexBlock {
  std::string id;
  std::uint64_t size = 0;
  bool written = false;
  bool crc_valid = false;
  std::vector<IndexExtent> extents;
};

struct SwapIndex {
  std::uint64_t stripe_bytes = 0;
  std::vector<std::string> paths;
  std::vector<std::uint64_t> file_bytes;  // one per path
  std::vector<IndexBlock> blocks;
};

std::string encode_index(const SwapIndex& index);
// Errors: kInvalidArgument when `bytes` is not a swap index; kFailedPrecondition
// for another version (both named); kDataLoss for a truncated or corrupt one, and
// for one no store writes: a stripe that is not a positive multiple of 4096, an
// extent that is empty, unaligned or past its file's end, or a block whose extents
// do not hold exactly its size.
// `name` (the file) is used in messages.
core::Result<SwapIndex> decode_index(std::string_view bytes, std::string_view name);

}  // namespace strata::nvme::internal
