// Encoding and decoding of the swap index (format in swap_index.h).
#include "nvme/internal/swap_index.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>

#include "core/aligned_buffer.h"
#include "core/str.h"
#include "nvme/crc64.h"

namespace strata::nvme::internal {
namespace {

using core::Status;
using core::str_cat;

std::string hex(std::uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

constexpr std::uint64_t kAlign = core::kDirectIoAlignment;
constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'S', 'W'};

class Writer {
 public:
  void u8(std::uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    out_.append(s);
  }
  void raw(const char* p, std::size_t n) { out_.append(p, n); }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(std::string_view in, std::string_view name) : in_(in), name_(name) {}
  bool u8(std::uint8_t* v) {
    if (!need(1)) return false;
    *v = static_cast<std::uint8_t>(in_[pos_++]);
    return true;
  }
  bool u32(std::uint32_t* v) {
    if (!need(4)) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= std::uint32_t{static_cast<std::uint8_t>(in_[pos_++])} << (8 * i);
    return true;
  }
  bool u64(std::uint64_t* v) {
    if (!need(8)) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i) *v |= std::uint64_t{static_cast<std::uint8_t>(in_[pos_++])} << (8 * i);
    return true;
  }
  bool str(std::string* s) {
    std::uint32_t n = 0;
    if (!u32(&n) || !need(n)) return false;
    s->assign(in_.substr(pos_, n));
    pos_ += n;
    return true;
  }
  Status truncated() const {
    return Status::data_loss(str_cat("swap index '", name_, "' is truncated or corrupt at byte ", pos_));
  }
  std::size_t pos() const { return pos_; }

 private:
  bool need(std::size_t n) const { return in_.size() - pos_ >= n; }
  std::string_view in_;
  std::string_view name_;
  std::size_t pos_ = 0;
};

}  // namespace

std::string encode_index(const SwapIndex& index) {
  Writer w;
  w.raw(kMagic, sizeof kMagic);
  w.u32(kSwapIndexVersion);
  w.u32(0);
  w.u64(index.stripe_bytes);
  w.u32(static_cast<std::uint32_t>(index.paths.size()));
  for (std::size_t i = 0; i < index.paths.size(); ++i) {
    w.str(index.paths[i]);
    w.u64(index.file_bytes[i]);
  }
  std::vector<const IndexBlock*> sorted;
  for (const auto& b : index.blocks) sorted.push_back(&b);
  std::sort(sorted.begin(), sorted.end(), [](const IndexBlock* a, const IndexBlock* b) { return a->id < b->id; });
  w.u64(sorted.size());
  for (const IndexBlock* b : sorted) {
    w.str(b->id);
    w.u64(b->size);
    w.u8(b->written ? 1 : 0);
    w.u8(b->crc_valid ? 1 : 0);
    w.u32(static_cast<std::uint32_t>(b->extents.size()));
    for (const auto& e : b->extents) {
      w.u32(e.path);
      w.u64(e.file_offset);
      w.u64(e.length);
      w.u64(e.crc);
    }
  }
  const std::string& body = w.out();
  w.u64(crc64(0, std::as_bytes(std::span<const char>(body.data(), body.size()))));
  return std::move(w.out());
}

core::Result<SwapIndex> decode_index(std::string_view bytes, std::string_view name) {
  if (bytes.size() < sizeof kMagic || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    return Status::invalid_argument(str_cat("'", name, "' is not a strata swap index (bad magic)"));
  }
  Reader r(bytes.substr(sizeof kMagic), name);
  std::uint32_t version = 0, flags = 0;
  if (!r.u32(&version)) return r.truncated();
  if (version != kSwapIndexVersion) {
    return Status::failed_precondition(str_cat("swap index '", name, "' has format version ", version,
                                               "; this build reads version ", kSwapIndexVersion));
  }
  if (bytes.size() < sizeof kMagic + 12 + 8) return r.truncated();
  const std::string_view body = bytes.substr(0, bytes.size() - 8);
  std::uint64_t stored = 0;
  for (int i = 0; i < 8; ++i) {
    stored |= std::uint64_t{static_cast<std::uint8_t>(bytes[bytes.size() - 8 + i])} << (8 * i);
  }
  const std::uint64_t computed = crc64(0, std::as_bytes(std::span<const char>(body.data(), body.size())));
  if (stored != computed) {
    return Status::data_loss(str_cat("swap index '", name, "' is corrupt: CRC64 stored ", hex(stored),
                                     ", computed ", hex(computed)));
  }
  Reader b(body.substr(sizeof kMagic + 4), name);
  SwapIndex index;
  std::uint32_t path_count = 0;
  if (!b.u32(&flags) || !b.u64(&index.stripe_bytes) || !b.u32(&path_count)) return b.truncated();
  if (index.stripe_bytes == 0 || index.stripe_bytes % kAlign != 0) {
    return Status::data_loss(str_cat("swap index '", name, "': stripe size ", index.stripe_bytes,
                                     " is not a positive multiple of ", kAlign));
  }
  for (std::uint32_t i = 0; i < path_count; ++i) {
    std::string p;
    std::uint64_t size = 0;
    if (!b.str(&p) || !b.u64(&size)) return b.truncated();
    index.paths.push_back(std::move(p));
    index.file_bytes.push_back(size);
  }
  std::uint64_t block_count = 0;
  if (!b.u64(&block_count)) return b.truncated();
  // A block's extents hold exactly its bytes (reads and writes fill the caller's buffer from them).
  auto extents_mismatch = [&](const IndexBlock& blk, const std::string& how) {
    return Status::data_loss(str_cat("swap index '", name, "': the extents of block '", blk.id, "' hold ",
                                     how, " its ", blk.size, " bytes"));
  };
  for (std::uint64_t i = 0; i < block_count; ++i) {
    IndexBlock blk;
    std::uint8_t written = 0, crc_valid = 0;
    std::uint32_t extent_count = 0;
    if (!b.str(&blk.id) || !b.u64(&blk.size) || !b.u8(&written) || !b.u8(&crc_valid) || !b.u32(&extent_count)) {
      return b.truncated();
    }
    blk.written = written != 0;
    blk.crc_valid = crc_valid != 0;
    std::uint64_t extent_bytes = 0;
    for (std::uint32_t k = 0; k < extent_count; ++k) {
      IndexExtent e;
      if (!b.u32(&e.path) || !b.u64(&e.file_offset) || !b.u64(&e.length) || !b.u64(&e.crc)) return b.truncated();
      if (e.path >= path_count) {
        return Status::data_loss(str_cat("swap index '", name, "': block '", blk.id, "' names path ", e.path,
                                         " of ", path_count));
      }
      // Where a store puts extents: aligned, non-empty, inside their file.
      const std::uint64_t file_bytes = index.file_bytes[e.path];
      if (e.length == 0 || e.file_offset % kAlign != 0 || e.file_offset > file_bytes ||
          e.length > file_bytes - e.file_offset) {
        return Status::data_loss(str_cat("swap index '", name, "': block '", blk.id, "' extent of ", e.length,
                                         " bytes at offset ", e.file_offset,
                                         " does not fit in its swap file of ", file_bytes, " bytes"));
      }
      if (e.length > blk.size - extent_bytes) return extents_mismatch(blk, "more than");
      extent_bytes += e.length;
      blk.extents.push_back(e);
    }
    if (blk.size == 0 || extent_bytes != blk.size) {
      return extents_mismatch(blk, str_cat(extent_bytes, " bytes, not"));
    }
    index.blocks.push_back(std::move(blk));
  }
  return index;
}

}  // namespace strata::nvme::internal
