// safetensors reading and writing. The header is JSON, so this file is behind
// the nlohmann firewall with engine/config* (tests/layering_test.py).
#include "engine/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/aligned_buffer.h"
#include "core/check.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/config/json_bounds.h"
#include "engine/checkpoint/file_io.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
namespace nx = core::numerics;

// Data starts on an 8-byte boundary; the header is padded with spaces.
constexpr std::uint64_t kDataAlignment = 8;

core::Result<TensorDtype> parse_dtype(const std::string& s, const std::string& path, const std::string& name) {
  if (s == "F32") return TensorDtype::kF32;
  if (s == "BF16") return TensorDtype::kBf16;
  if (s == "F16") return TensorDtype::kF16;
  if (s == "U8") return TensorDtype::kU8;
  return Status::unimplemented(str_cat(path, ": tensor '", name, "' has dtype ", json_bounds::preview(s),
                                       "; strata reads F32, BF16 and F16 weights (and U8 codes)"));
}

std::int64_t checked_numel(const std::vector<std::int64_t>& shape, bool* overflow) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0 || (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d)) {
      *overflow = true;
      return 0;
    }
    n *= d;
  }
  return n;
}

}  // namespace

std::string_view to_string(TensorDtype d) {
  switch (d) {
    case TensorDtype::kF32:
      return "F32";
    case TensorDtype::kBf16:
      return "BF16";
    case TensorDtype::kF16:
      return "F16";
    case TensorDtype::kU8:
      return "U8";
  }
  return "?";
}

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// --- reading -------------------------------------------------------------------

core::Result<SafetensorsReader> SafetensorsReader::open(const std::string& path, const IoConfig& io) {
  SafetensorsReader r;
  r.path_ = path;
  r.io_ = io;
  r.fd_.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!r.fd_.valid()) return Status::from_errno(errno, str_cat("open safetensors file ", path));
  struct stat st {};
  if (::fstat(r.fd_.get(), &st) != 0) return Status::from_errno(errno, str_cat("stat ", path));
  STRATA_RETURN_IF_ERROR(r.load_header(static_cast<std::uint64_t>(st.st_size)));
  return r;
}

core::Result<SafetensorsReader> SafetensorsReader::open(std::unique_ptr<nvme::DirectFileReader> file) {
  if (file == nullptr) return Status::invalid_argument("SafetensorsReader::open: no file");
  SafetensorsReader r;
  r.path_ = file->path();
  const std::uint64_t size = file->size_bytes();
  r.direct_ = std::move(file);
  STRATA_RETURN_IF_ERROR(r.load_header(size));
  return r;
}

core::Status SafetensorsReader::read_at(std::uint64_t offset, std::span<std::byte> out) const {
  if (direct_ != nullptr) return direct_->read(offset, out);
  return pread_all(fd_.get(), out.data(), out.size(), offset, path_, io_);
}

core::Result<std::uint64_t> safetensors_header_length(std::span<const std::byte> prefix,
                                                      std::uint64_t file_size, const std::string& path) {
  auto corrupt = [&](const std::string& what) {
    return Status::data_loss(str_cat(path, ": not a valid safetensors file: ", what));
  };
  if (file_size < 8 || prefix.size() < 8) {
    return corrupt(str_cat("only ", std::min<std::uint64_t>(file_size, prefix.size()), " bytes"));
  }
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | std::to_integer<std::uint64_t>(prefix[i]);
  if (header_len > file_size - 8) {
    return corrupt(str_cat("the header length field says ", header_len, " bytes; the file has ", file_size,
                           " bytes (it is truncated, or the field is damaged)"));
  }
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return corrupt(str_cat("the header length field says ", header_len,
                           " bytes; strata reads headers of at most ", kMaxSafetensorsHeaderBytes,
                           " bytes (as the format's own readers do)"));
  }
  return header_len;
}

core::Result<SafetensorsHeader> parse_safetensors_header(std::span<const std::byte> head,
                                                         std::uint64_t file_size, const std::string& path) {
  auto corrupt = [&](const std::string& what) {
    return Status::data_loss(str_cat(path, ": not a valid safetensors file: ", what));
  };
  STRATA_ASSIGN_OR_RETURN(const std::uint64_t header_len, safetensors_header_length(head, file_size, path));
  if (head.size() - 8 < header_len) {
    return Status::invalid_argument(str_cat(path, ": parse_safetensors_header was given ", head.size(),
                                            " bytes; the header ends at byte ", 8 + header_len));
  }
  const std::string_view text(reinterpret_cast<const char*>(head.data()) + 8, header_len);
  nlohmann::json doc;
  const Status parsed = json_bounds::parse_bounded(text, &doc);
  if (!parsed.ok()) return corrupt(str_cat("the header is ", parsed.message()));
  if (!doc.is_object()) return corrupt("the header is not a JSON object");
  SafetensorsHeader out;
  out.data_start = 8 + header_len;
  const std::uint64_t data_size = file_size - out.data_start;
  for (const auto& [key, entry] : doc.items()) {
    const std::string name = json_bounds::preview(key);  // for messages
    if (key == "__metadata__") {
      if (!entry.is_object()) return corrupt("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          return corrupt(str_cat("__metadata__.", json_bounds::preview(k), " is not a string"));
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets")) {
      return corrupt(str_cat("tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    const auto& dt = entry["dtype"];
    const auto& shape = entry["shape"];
    const auto& offs = entry["data_offsets"];
    if (!dt.is_string()) return corrupt(str_cat("tensor '", name, "': dtype is not a string"));
    if (!shape.is_array()) return corrupt(str_cat("tensor '", name, "': shape is not an array"));
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned()) {
      return corrupt(str_cat("tensor '", name, "': data_offsets is not [begin, end]"));
    }
    TensorInfo t;
    t.name = key;
    STRATA_ASSIGN_OR_RETURN(t.dtype, parse_dtype(dt.get<std::string>(), path, name));
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) return corrupt(str_cat("tensor '", name, "': a dimension is not a count >= 0"));
      t.shape.push_back(d.get<std::int64_t>());
    }
    const auto begin = offs[0].get<std::uint64_t>(), end = offs[1].get<std::uint64_t>();
    if (begin > end || end > data_size) {
      return corrupt(str_cat("tensor '", name, "': data_offsets [", begin, ", ", end, "] outside the ", data_size,
                             " data bytes"));
    }
    bool overflow = false;
    const std::int64_t numel = checked_numel(t.shape, &overflow);
    // (numel at most the data's size: its byte count cannot wrap around)
    overflow = overflow || static_cast<std::uint64_t>(numel) > data_size;
    if (overflow || static_cast<std::uint64_t>(numel) * dtype_size(t.dtype) != end - begin) {
      return corrupt(str_cat("tensor '", name, "': ", end - begin, " bytes do not hold its shape of ",
                             overflow ? std::string("overflowing size") : str_cat(numel, " elements"), " of ",
                             to_string(t.dtype)));
    }
    t.offset = out.data_start + begin;
    t.nbytes = end - begin;
    out.tensors.push_back(std::move(t));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.offset < b.offset; });
  for (std::size_t i = 1; i < out.tensors.size(); ++i) {
    const TensorInfo& a = out.tensors[i - 1];
    const TensorInfo& b = out.tensors[i];
    if (a.offset + a.nbytes > b.offset) {
      return corrupt(str_cat("tensors '", json_bounds::preview(a.name), "' and '",
                             json_bounds::preview(b.name), "' overlap"));
    }
  }
  return out;
}

core::Status SafetensorsReader::load_header(std::uint64_t file_size) {
  std::byte len_bytes[8] = {};
  if (file_size >= 8) STRATA_RETURN_IF_ERROR(read_at(0, len_bytes));
  STRATA_ASSIGN_OR_RETURN(
      const std::uint64_t header_len,
      safetensors_header_length(std::span<const std::byte>(len_bytes, file_size >= 8 ? 8 : 0), file_size,
                                path_));
  // Read only once the length is known to fit the file and the cap.
  std::vector<std::byte> head(8 + header_len);
  std::copy(std::begin(len_bytes), std::end(len_bytes), head.begin());
  STRATA_RETURN_IF_ERROR(read_at(8, std::span<std::byte>(head).subspan(8)));
  STRATA_ASSIGN_OR_RETURN(SafetensorsHeader header, parse_safetensors_header(head, file_size, path_));
  tensors_ = std::move(header.tensors);
  metadata_ = std::move(header.metadata);
  return Status();
}

const TensorInfo* SafetensorsReader::find(std::string_view name) const {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

core::Status SafetensorsReader::read_raw(std::string_view name, std::span<std::byte> out) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) return Status::not_found(str_cat(path_, ": no tensor named '", name, "'"));
  if (out.size() != t->nbytes) {
    return Status::invalid_argument(str_cat(path_, ": tensor '", name, "' has ", t->nbytes,
                                            " bytes; the buffer has ", out.size()));
  }
  return read_at(t->offset, out);
}

core::Status SafetensorsReader::read_raw_range(std::string_view name, std::uint64_t first,
                                               std::span<std::byte> out) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) return Status::not_found(str_cat(path_, ": no tensor named '", name, "'"));
  if (first > t->nbytes || out.size() > t->nbytes - first) {
    return Status::invalid_argument(str_cat(path_, ": tensor '", name, "' has ", t->nbytes, " bytes; bytes [", first,
                                            ", ", first + out.size(), ") of it were asked for"));
  }
  return read_at(t->offset + first, out);
}

core::Status SafetensorsReader::read_f32(std::string_view name, std::span<float> out) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) return Status::not_found(str_cat(path_, ": no tensor named '", name, "'"));
  if (static_cast<std::int64_t>(out.size()) != t->numel()) {
    return Status::invalid_argument(str_cat(path_, ": tensor '", name, "' has ", t->numel(),
                                            " elements; the destination has ", out.size()));
  }
  return read_f32_range(name, 0, out);
}

core::Status SafetensorsReader::read_f32_range(std::string_view name, std::uint64_t first,
                                               std::span<float> out) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) return Status::not_found(str_cat(path_, ": no tensor named '", name, "'"));
  if (t->dtype == TensorDtype::kU8) {
    return Status::invalid_argument(
        str_cat(path_, ": tensor '", name, "' is U8 (codes without their scales), not values to read as fp32"));
  }
  const std::uint64_t elem = dtype_size(t->dtype);
  if (t->dtype == TensorDtype::kF32) {
    return read_raw_range(name, first * elem, std::as_writable_bytes(out));
  }
  // 16-bit: read into the back half of `out`, widen front to back (exact).
  auto* half = reinterpret_cast<std::uint16_t*>(out.data()) + out.size();
  STRATA_RETURN_IF_ERROR(read_raw_range(name, first * elem,
                                        std::span<std::byte>(reinterpret_cast<std::byte*>(half), out.size() * elem)));
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::uint16_t h;
    std::memcpy(&h, half + i, 2);
    out[i] = t->dtype == TensorDtype::kBf16 ? nx::bf16_bits_to_fp32(h) : nx::fp16_bits_to_fp32(h);
  }
  return Status();
}

// --- writing -------------------------------------------------------------------

core::Result<SafetensorsWriter> SafetensorsWriter::prepare(std::string path, std::vector<Declared> tensors,
                                                           const std::map<std::string, std::string>& metadata,
                                                           std::string* header_bytes) {
  SafetensorsWriter w;
  w.path_ = std::move(path);
  w.tmp_path_ = w.path_ + ".tmp";
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::uint64_t offset = 0;
  for (Declared& d : tensors) {
    if (d.name.empty() || d.name == "__metadata__") {
      return Status::invalid_argument(str_cat(w.path_, ": tensor name '", d.name, "' is not allowed"));
    }
    if (header.contains(d.name)) {
      return Status::invalid_argument(str_cat(w.path_, ": tensor '", d.name, "' declared twice"));
    }
    bool overflow = false;
    const std::int64_t numel = checked_numel(d.shape, &overflow);
    if (overflow) return Status::invalid_argument(str_cat(w.path_, ": tensor '", d.name, "' has a bad shape"));
    TensorInfo t{d.name, d.dtype, d.shape, offset, static_cast<std::uint64_t>(numel) * dtype_size(d.dtype)};
    header[d.name] = {{"dtype", std::string(to_string(d.dtype))},
                      {"shape", d.shape},
                      {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
    w.tensors_.push_back(std::move(t));
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // invalid UTF-8 in a name or metadata
    return Status::invalid_argument(str_cat(w.path_, ": cannot write the header: ", e.what()));
  }
  text.append(core::align_up(text.size(), kDataAlignment) - text.size(), ' ');
  const std::uint64_t data_start = 8 + text.size();
  for (TensorInfo& t : w.tensors_) t.offset += data_start;
  w.written_.assign(w.tensors_.size(), false);
  w.file_bytes_ = data_start + offset;
  // The 8-byte little-endian header length, then the header.
  header_bytes->clear();
  for (int i = 0; i < 8; ++i) header_bytes->push_back(static_cast<char>(text.size() >> (8 * i)));
  header_bytes->append(text);
  return w;
}

core::Result<SafetensorsWriter> SafetensorsWriter::create(std::string path, std::vector<Declared> tensors,
                                                          std::map<std::string, std::string> metadata) {
  std::string head;
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter w, prepare(std::move(path), std::move(tensors), metadata, &head));
  w.fd_.reset(::open(w.tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!w.fd_.valid()) return Status::from_errno(errno, str_cat("create ", w.tmp_path_));
  STRATA_RETURN_IF_ERROR(pwrite_all(w.fd_.get(), head.data(), head.size(), 0, w.tmp_path_));
  if (::ftruncate(w.fd_.get(), static_cast<off_t>(w.file_bytes_)) != 0) {
    return Status::from_errno(errno, str_cat("size ", w.tmp_path_, " to ", w.file_bytes_, " bytes"));
  }
  return w;
}

core::Result<SafetensorsWriter> SafetensorsWriter::create_sequential(std::string path, std::vector<Declared> tensors,
                                                                     std::map<std::string, std::string> metadata,
                                                                     nvme::IoBackend& backend,
                                                                     const nvme::DirectFileOptions& options) {
  std::string head;
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter w, prepare(std::move(path), std::move(tensors), metadata, &head));
  auto file = nvme::DirectFileWriter::create(backend, w.tmp_path_, options);
  if (!file.ok()) return std::move(file).status();
  w.direct_ = std::move(file).value();
  STRATA_RETURN_IF_ERROR(w.direct_->append(std::as_bytes(std::span<const char>(head))));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (open() && !finished_) {  // (a moved-from writer owns nothing)
    direct_.reset();  // waits for its writes
    fd_.reset();
    ::unlink(tmp_path_.c_str());
  }
}

const TensorInfo* SafetensorsWriter::find(std::string_view name) const {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

core::Result<std::size_t> SafetensorsWriter::check_write(std::string_view name, std::uint64_t bytes) const {
  if (finished_ || !open()) return Status::failed_precondition(str_cat(path_, ": writer already finished"));
  const TensorInfo* t = nullptr;
  if (direct_ != nullptr) {
    // Sequential: only the next declared tensor (checked by name first: O(1)).
    if (next_ < tensors_.size() && tensors_[next_].name == name) {
      t = &tensors_[next_];
    } else {
      t = find(name);
      if (t == nullptr) return Status::not_found(str_cat(path_, ": tensor '", name, "' was not declared"));
      return Status::failed_precondition(
          next_ < tensors_.size()
              ? str_cat(path_, ": tensor '", name, "' written out of order; the sequential writer expects '",
                        tensors_[next_].name, "' next (declare tensors in the order they are written)")
              : str_cat(path_, ": tensor '", name, "' written twice"));
    }
  } else {
    t = find(name);
    if (t == nullptr) return Status::not_found(str_cat(path_, ": tensor '", name, "' was not declared"));
  }
  if (bytes != t->nbytes) {
    return Status::invalid_argument(str_cat(path_, ": tensor '", name, "' takes ", t->nbytes, " bytes, got ", bytes));
  }
  return static_cast<std::size_t>(t - tensors_.data());
}

core::Status SafetensorsWriter::write_raw(std::string_view name, std::span<const std::byte> bytes) {
  STRATA_ASSIGN_OR_RETURN(const std::size_t i, check_write(name, bytes.size()));
  if (direct_ != nullptr) {
    STRATA_RETURN_IF_ERROR(direct_->append(bytes));
    ++next_;
  } else {
    STRATA_RETURN_IF_ERROR(pwrite_all(fd_.get(), bytes.data(), bytes.size(), tensors_[i].offset, tmp_path_));
  }
  written_[i] = true;
  return Status();
}

core::Status SafetensorsWriter::write_f32(std::string_view name, std::span<const float> values) {
  // Sequential writers look at the expected tensor first (no scan of the list).
  const TensorInfo* t = direct_ != nullptr && next_ < tensors_.size() && tensors_[next_].name == name
                            ? &tensors_[next_]
                            : find(name);
  if (t == nullptr) return Status::not_found(str_cat(path_, ": tensor '", name, "' was not declared"));
  if (t->dtype == TensorDtype::kF32) return write_raw(name, std::as_bytes(values));
  if (t->dtype == TensorDtype::kU8) {
    return Status::invalid_argument(str_cat(path_, ": tensor '", name, "' is U8: write its codes with write_raw"));
  }
  auto convert = [dtype = t->dtype](std::span<const float> in, std::uint16_t* out) {
    for (std::size_t i = 0; i < in.size(); ++i) {
      out[i] = dtype == TensorDtype::kBf16 ? nx::fp32_to_bf16_bits(in[i]) : nx::fp32_to_fp16_bits(in[i]);
    }
  };
  if (direct_ == nullptr) {
    std::vector<std::uint16_t> half(values.size());
    convert(values, half.data());
    return write_raw(name, std::as_bytes(std::span<const std::uint16_t>(half)));
  }
  // Sequential: convert a piece at a time straight into the stream.
  STRATA_ASSIGN_OR_RETURN(const std::size_t i, check_write(name, values.size() * 2));
  constexpr std::size_t kPiece = 1u << 16;
  std::vector<std::uint16_t> half(std::min(values.size(), kPiece));
  for (std::size_t at = 0; at < values.size(); at += kPiece) {
    const std::span<const float> in = values.subspan(at, std::min(kPiece, values.size() - at));
    convert(in, half.data());
    STRATA_RETURN_IF_ERROR(direct_->append(std::as_bytes(std::span<const std::uint16_t>(half.data(), in.size()))));
  }
  ++next_;
  written_[i] = true;
  return Status();
}

core::Status SafetensorsWriter::finish() {
  if (finished_ || !open()) return Status::failed_precondition(str_cat(path_, ": writer already finished"));
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (!written_[i]) {
      return Status::failed_precondition(str_cat(path_, ": tensor '", tensors_[i].name, "' was never written"));
    }
  }
  if (direct_ != nullptr) {
    // Writes the rest, truncates to the logical size, fsyncs and closes.
    STRATA_RETURN_IF_ERROR(direct_->finish());
    STRATA_CHECK(direct_->size_bytes() == file_bytes_) << path_ << ": wrote " << direct_->size_bytes()
                                                       << " bytes, the header describes " << file_bytes_;
  } else {
    if (::fsync(fd_.get()) != 0) return Status::from_errno(errno, str_cat("fsync ", tmp_path_));
    STRATA_RETURN_IF_ERROR(fd_.close(tmp_path_));
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    return Status::from_errno(errno, str_cat("rename ", tmp_path_, " to ", path_));
  }
  finished_ = true;
  return fsync_dir_of(path_);
}

core::Result<std::uint64_t> SafetensorsWriter::crc64() const {
  if (direct_ == nullptr || !finished_) {
    return Status::failed_precondition(str_cat(path_, ": the CRC64 is known only after finish() of a sequential writer"));
  }
  return direct_->crc64();
}

// --- finding a model's files ---------------------------------------------------

std::string SafetensorsFiles::describe() const {
  if (index.empty()) return files.empty() ? std::string("no files") : files.front();
  std::string names;
  for (const std::string& f : files) {
    if (!names.empty()) names += ", ";
    names += f.substr(f.find_last_of('/') + 1);
  }
  return str_cat(index, " (", names, ")");
}

core::Result<SafetensorsFiles> find_safetensors(const std::string& path, const IoConfig& io) {
  SafetensorsFiles out;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::from_errno(errno, str_cat("safetensors path ", path));
  if (!S_ISDIR(st.st_mode)) {
    out.files.push_back(path);
    return out;
  }
  const std::string dir = path.ends_with('/') ? path.substr(0, path.size() - 1) : path;
  const std::string index = dir + "/model.safetensors.index.json";
  if (::stat(index.c_str(), &st) != 0) {
    const std::string single = dir + "/model.safetensors";
    if (::stat(single.c_str(), &st) == 0) {
      out.files.push_back(single);
      return out;
    }
    return Status::not_found(
        str_cat(dir, ": no model.safetensors.index.json and no model.safetensors (a safetensors model directory "
                     "holds one of them)"));
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, read_file(index, io));
  nlohmann::json doc;
  const Status parsed = json_bounds::parse_bounded(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), &doc);
  auto corrupt = [&](const std::string& what) {
    return Status::data_loss(str_cat(index, ": not a safetensors index: ", what));
  };
  if (!parsed.ok()) return corrupt(std::string(parsed.message()));
  if (!doc.is_object()) return corrupt("not a JSON object");
  const auto wm = doc.find("weight_map");
  if (wm == doc.end() || !wm->is_object()) return corrupt("no \"weight_map\" object");
  std::set<std::string> names;
  for (const auto& [tensor, file] : wm->items()) {
    if (!file.is_string()) {
      return corrupt(str_cat("the file of tensor '", json_bounds::preview(tensor), "' is not a string"));
    }
    const std::string name = file.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      return corrupt(str_cat("tensor '", json_bounds::preview(tensor), "' maps to '",
                             json_bounds::preview(name), "', not a file name in ", dir));
    }
    out.weight_map[tensor] = dir + "/" + name;
    names.insert(name);
  }
  if (names.empty()) return corrupt("\"weight_map\" is empty");
  out.index = index;
  for (const std::string& n : names) out.files.push_back(dir + "/" + n);
  return out;
}

// --- sharded export ------------------------------------------------------------

std::vector<std::vector<std::size_t>> plan_shards(std::span<const std::uint64_t> sizes,
                                                  std::uint64_t max_shard_bytes) {
  std::vector<std::vector<std::size_t>> shards;
  std::uint64_t used = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (shards.empty() || (used > 0 && used + sizes[i] > max_shard_bytes)) {
      shards.emplace_back();
      used = 0;
    }
    shards.back().push_back(i);
    used += sizes[i];
  }
  return shards;
}

std::string shard_file_name(std::size_t index, std::size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", index, count);
  return buf;
}

core::Status write_shard_index(const std::string& dir, std::uint64_t total_size,
                               const std::map<std::string, std::string>& weight_map, const IoConfig& io) {
  nlohmann::ordered_json doc;
  doc["metadata"] = {{"total_size", total_size}};
  doc["weight_map"] = nlohmann::ordered_json::object();
  for (const auto& [name, file] : weight_map) doc["weight_map"][name] = file;
  const std::string text = doc.dump(2) + "\n";
  return replace_file(dir + "/model.safetensors.index.json", std::as_bytes(std::span<const char>(text)), io);
}

}  // namespace strata::engine
