// safetensors files: read pretrained weights tensor by tensor (the host never
// holds the whole model) and export trained weights, single-file or sharded
// with the index file fine-tuning tools load
// (model-00001-of-00003.safetensors + model.safetensors.index.json).
//
// The format: an 8-byte little-endian header length, a JSON header mapping
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the end of the header) plus an optional
// "__metadata__" of strings, then the data. strata reads F32, BF16 and F16
// tensors and rejects a header that does not describe the file exactly
// (offsets outside the data, overlapping tensors, a size that does not match
// the shape) with an error naming the file and the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "core/unique_fd.h"
#include "engine/config.h"
#include "nvme/direct_file.h"
#include "nvme/io_backend.h"

namespace strata::engine {

// kU8: bytes that are not values by themselves (int8_blockwise moments' codes,
// checkpoints only): read_raw/write_raw only.
enum class TensorDtype { kF32, kBf16, kF16, kU8 };
std::string_view to_string(TensorDtype d);  // "F32", "BF16", "F16", "U8" (the format's names)
inline std::size_t dtype_size(TensorDtype d) {
  return d == TensorDtype::kF32 ? 4 : d == TensorDtype::kU8 ? 1 : 2;
}
// The dtype of compute copies of `bytes` bytes an element under precision `p`.
inline TensorDtype dtype_of(int bytes, Precision p) {
  if (bytes == 4) return TensorDtype::kF32;
  return p == Precision::kFp16 ? TensorDtype::kF16 : TensorDtype::kBf16;
}

struct TensorInfo {
  std::string name;
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;  // absolute, in the file
  std::uint64_t nbytes = 0;
  std::int64_t numel() const;
};

// A header larger than this is refused (the format's own readers cap it at 100 MB too).
inline constexpr std::uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// A parsed header.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by offset (file order)
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;  // 8 + the header's length
};

// The header's length from the file's first 8 bytes (`prefix`; fewer when the
// file is shorter). kDataLoss naming `path` for a file under 8 bytes, a length
// beyond the file's `file_size` (truncated, or a damaged field), or one over
// kMaxSafetensorsHeaderBytes. Pure; thread-safe.
core::Result<std::uint64_t> safetensors_header_length(std::span<const std::byte> prefix,
                                                      std::uint64_t file_size, const std::string& path);
// Parses and checks the header of a safetensors file of `file_size` bytes
// whose first bytes are `head` (at least the 8-byte length and the header it
// announces; bytes after it are ignored, so a fuzzer may pass a whole file
// with file_size = head.size()). Nesting is bounded (engine/config/json_bounds.h)
// and names in messages are cut to a preview, so no input crashes, recurses
// deeply or costs more than a small multiple of the header's size. Errors:
// kDataLoss naming `path` (and the tensor) for a header that is malformed or
// does not describe the file exactly; kUnimplemented for a dtype strata does
// not read; kInvalidArgument when `head` is shorter than the header it announces.
// Pure; thread-safe.
core::Result<SafetensorsHeader> parse_safetensors_header(std::span<const std::byte> head,
                                                         std::uint64_t file_size, const std::string& path);

class SafetensorsReader {
 public:
  // Opens and validates the header. Errors: kNotFound/kPermissionDenied for
  // the file, kDataLoss for a header that is malformed or inconsistent with
  // the file, kUnimplemented for a dtype strata does not read; the file's
  // read errors (engine/checkpoint/file_io.h; `io`'s fault injector sees them).
  static core::Result<SafetensorsReader> open(const std::string& path, const IoConfig& io = IoConfig{});
  // The same over a file opened with the nvme engine (owned from here on):
  // the header and every tensor are read with direct reads of the aligned
  // blocks around them. Its backend must outlive the reader. Errors as above
  // (the size is the one the file had when `file` was opened).
  static core::Result<SafetensorsReader> open(std::unique_ptr<nvme::DirectFileReader> file);

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in file order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(std::string_view name) const;

  // Reads `name` converted to fp32 (exact for BF16 and F16) into `out`, whose
  // size must equal the tensor's element count. Thread-safe with pread; over a
  // direct file, owner-thread-only.
  core::Status read_f32(std::string_view name, std::span<float> out) const;
  // Reads the raw bytes of `name` into `out` (size must equal nbytes).
  core::Status read_raw(std::string_view name, std::span<std::byte> out) const;
  // Part of a tensor: out.size() raw bytes of `name` from byte `first`, or
  // out.size() elements from element `first` converted to fp32. Errors
  // (kInvalidArgument) for a range past the tensor's end, naming both.
  core::Status read_raw_range(std::string_view name, std::uint64_t first, std::span<std::byte> out) const;
  core::Status read_f32_range(std::string_view name, std::uint64_t first, std::span<float> out) const;

 private:
  // Parses and checks the header of a file of `file_size` bytes.
  core::Status load_header(std::uint64_t file_size);
  core::Status read_at(std::uint64_t offset, std::span<std::byte> out) const;

  std::string path_;
  IoConfig io_;                                   // for pread: its fault injector
  core::UniqueFd fd_;                             // pread, or
  std::unique_ptr<nvme::DirectFileReader> direct_;  // the nvme engine
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes one safetensors file: declare every tensor first (the header comes
// first in the file), then write each tensor's data (in any order with
// create(), in declared order with create_sequential()), then finish(),
// which fsyncs, renames the file into place and fsyncs the directory. Until
// finish() succeeds the data sits in "<path>.tmp"; a writer destroyed before
// that removes it, so a crash never leaves a truncated file under the final
// name. Owner-thread-only.
class SafetensorsWriter {
 public:
  struct Declared {
    std::string name;
    TensorDtype dtype;
    std::vector<std::int64_t> shape;
  };
  // Errors: kInvalidArgument for an empty or duplicate name, a negative
  // dimension; errors of creating the file (naming it).
  static core::Result<SafetensorsWriter> create(std::string path, std::vector<Declared> tensors,
                                                std::map<std::string, std::string> metadata = {});
  // A writer that streams the file front to back through the nvme engine
  // (O_DIRECT per `options.direct_io`) on `backend` (borrowed; must outlive
  // the writer): tensors must be written in the order they were declared
  // (otherwise kFailedPrecondition naming the one expected), and crc64()
  // gives the file's CRC64 after finish() without reading it back. Errors as
  // create, plus the direct file's (nvme/direct_file.h).
  static core::Result<SafetensorsWriter> create_sequential(std::string path, std::vector<Declared> tensors,
                                                           std::map<std::string, std::string> metadata,
                                                           nvme::IoBackend& backend,
                                                           const nvme::DirectFileOptions& options);
  SafetensorsWriter(SafetensorsWriter&&) noexcept = default;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept = default;
  ~SafetensorsWriter();

  // Writes fp32 values as the tensor's dtype (round to nearest even, as numerics.h).
  core::Status write_f32(std::string_view name, std::span<const float> values);
  // Writes raw bytes (already in the tensor's dtype).
  core::Status write_raw(std::string_view name, std::span<const std::byte> bytes);
  // Every tensor must have been written once.
  core::Status finish();

  std::uint64_t file_bytes() const { return file_bytes_; }
  // CRC64 (nvme/crc64.h) of the whole file, computed while it was written.
  // kFailedPrecondition unless this is a sequential writer that finished.
  core::Result<std::uint64_t> crc64() const;

 private:
  SafetensorsWriter() = default;
  // The header (declared tensors, metadata) as it goes into the file, with
  // every tensor's absolute offset set.
  static core::Result<SafetensorsWriter> prepare(std::string path, std::vector<Declared> tensors,
                                                 const std::map<std::string, std::string>& metadata,
                                                 std::string* header_bytes);
  const TensorInfo* find(std::string_view name) const;
  // The index of tensor `name` if it may be written now with `bytes` bytes.
  core::Result<std::size_t> check_write(std::string_view name, std::uint64_t bytes) const;
  bool open() const { return fd_.valid() || direct_ != nullptr; }

  std::string path_, tmp_path_;
  core::UniqueFd fd_;                             // pwrite at each tensor's offset, or
  std::unique_ptr<nvme::DirectFileWriter> direct_;  // the nvme engine, front to back
  std::vector<TensorInfo> tensors_;
  std::vector<bool> written_;
  std::size_t next_ = 0;  // sequential: the tensor to write next
  std::uint64_t file_bytes_ = 0;
  bool finished_ = false;
};

// The files of a model in safetensors, as Hugging Face lays them out.
struct SafetensorsFiles {
  std::string index;               // "<dir>/model.safetensors.index.json" when sharded, else ""
  std::vector<std::string> files;  // the shards the index names (sorted), or the one file
  std::map<std::string, std::string> weight_map;  // sharded: tensor -> its file (a path in `files`)
  // For messages: the file, or the index and its shards' names.
  std::string describe() const;
};
// `path` is a directory holding model.safetensors.index.json (sharded; it
// wins) or model.safetensors, or a safetensors file itself. Reads only the
// index. Errors: kNotFound for a path that does not exist or a directory
// with neither file (naming both); kDataLoss for an index that is not
// {"weight_map": {tensor: file}} with plain file names, naming it.
core::Result<SafetensorsFiles> find_safetensors(const std::string& path, const IoConfig& io = IoConfig{});

// Plans a sharded export: tensors in the given order, a new shard whenever
// the next tensor would push a shard past `max_shard_bytes` (a tensor larger
// than that gets a shard of its own). Returns, per shard, the indices into
// `sizes`.
std::vector<std::vector<std::size_t>> plan_shards(std::span<const std::uint64_t> sizes,
                                                  std::uint64_t max_shard_bytes);
// "model-00002-of-00005.safetensors" (1-based shard index).
std::string shard_file_name(std::size_t index, std::size_t count);
// Writes "<dir>/model.safetensors.index.json" atomically: {"metadata":
// {"total_size": N}, "weight_map": {tensor: file}}.
core::Status write_shard_index(const std::string& dir, std::uint64_t total_size,
                               const std::map<std::string, std::string>& weight_map, const IoConfig& io = IoConfig{});

}  // namespace strata::engine
