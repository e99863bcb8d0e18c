// inspect_checkpoint (engine/checkpoint/inspect.h): the manifest, the saved
// config's placement keys (JSON, so behind the nlohmann firewall), the state
// file's header, and the files' CRC64s.
#include "engine/checkpoint/inspect.h"

#include "engine/checkpoint/code_tables.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>

#include "core/str.h"
#include "core/unique_fd.h"
#include "engine/checkpoint/manifest_json.h"
#include "engine/config/json_bounds.h"
#include "engine/checkpoint/file_io.h"
#include "engine/checkpoint/safetensors.h"
#include "nvme/crc64.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;

constexpr std::uint64_t kCrcPieceBytes = 4ull << 20;

// The placement keys of a saved config (engine/config.h: to_json), in this order.
constexpr const char* kPlacementKeys[][3] = {
    {"zero_optimization", "stage", nullptr},
    {"zero_optimization", "offload_optimizer", "device"},
    {"zero_optimization", "offload_param", "device"},
    {"strata", "optimizer_cpu_fraction", nullptr},
    {"strata", "device", nullptr},
    {"strata", "overlap", nullptr},
};

std::vector<std::pair<std::string, std::string>> placement_of(const std::string& config_json) {
  std::vector<std::pair<std::string, std::string>> out;
  nlohmann::json config;
  if (!json_bounds::parse_bounded(config_json, &config).ok() || !config.is_object()) return out;
  for (const auto& path : kPlacementKeys) {
    const nlohmann::json* v = &config;
    std::string key;
    for (const char* part : path) {
      if (part == nullptr) break;
      if (!v->is_object() || !v->contains(part)) {
        v = nullptr;
        break;
      }
      v = &(*v)[part];
      key += key.empty() ? part : str_cat(".", part);
    }
    if (v != nullptr)
      out.emplace_back(
          key, json_bounds::preview(v->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
  }
  return out;
}

core::Result<std::uint64_t> size_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::from_errno(errno, str_cat("stat ", path));
  return static_cast<std::uint64_t>(st.st_size);
}

Status check_crc(const std::string& path, std::uint64_t want) {
  STRATA_ASSIGN_OR_RETURN(const auto crc_and_size, file_crc64(path));
  if (crc_and_size.first != want) {
    return Status::data_loss(str_cat(path, ": CRC64 mismatch: its ", crc_and_size.second, " bytes give ",
                                     crc64_hex(crc_and_size.first), ", the manifest records ",
                                     crc64_hex(want), " (the file is damaged or truncated)"));
  }
  return Status();
}

}  // namespace

std::string format_inspection_json(const CheckpointInspection& in) {
  using OJson = nlohmann::ordered_json;
  const CheckpointManifest& m = in.manifest;
  OJson j;
  j["dir"] = in.dir;
  j["latest"] = in.latest_path.empty() ? OJson(nullptr) : OJson(in.latest_path);
  j["format_version"] = m.version;
  j["step"] = m.step;
  j["skipped_steps"] = m.skipped_steps;
  j["lr_override"] = m.lr_override < 0 ? OJson(nullptr) : OJson(m.lr_override);
  j["loss_scaler"] = checkpoint_scaler_json(m.loss_scaler);
  j["compute_dtype"] = m.compute_dtype;
  j["ranks"] = m.ranks;
  OJson placement = OJson::object();
  for (const auto& [key, value] : in.placement) {
    OJson v;
    placement[key] = json_bounds::parse_bounded(value, &v).ok() ? v : OJson(value);
  }
  j["placement"] = std::move(placement);
  j["params"] = checkpoint_params_json(m.params);
  OJson frozen = OJson::array();
  for (const CheckpointFrozenBase& b : m.frozen_base) {
    frozen.push_back({{"group", b.group}, {"crc64", crc64_hex(b.crc64)}, {"files", b.files}});
  }
  j["frozen_base"] = std::move(frozen);
  OJson files = OJson::array();
  for (const InspectedFile& f : in.files) {
    OJson e = {{"name", f.name}, {"bytes", f.bytes}};
    if (f.name != "manifest.json") e["crc64"] = crc64_hex(f.crc64);
    files.push_back(std::move(e));
  }
  j["files"] = std::move(files);
  OJson tensors = OJson::array();
  for (const InspectedTensor& t : in.tensors) {
    tensors.push_back(
        {{"file", t.file}, {"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"bytes", t.bytes}});
  }
  j["tensors"] = std::move(tensors);
  j["verified"] = in.verified;
  OJson config;
  if (!json_bounds::parse_bounded(m.config_json, &config).ok()) config = OJson::object();
  j["config"] = std::move(config);
  return j.dump(2, ' ', false, OJson::error_handler_t::replace) + "\n";
}

core::Result<std::pair<std::uint64_t, std::uint64_t>> file_crc64(const std::string& path) {
  core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Status::from_errno(errno, str_cat("open ", path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::from_errno(errno, str_cat("stat ", path));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  std::vector<std::byte> piece(static_cast<std::size_t>(std::min(size, kCrcPieceBytes)));
  std::uint64_t crc = 0;
  for (std::uint64_t at = 0; at < size;) {
    const std::uint64_t n = std::min<std::uint64_t>(piece.size(), size - at);
    STRATA_RETURN_IF_ERROR(pread_all(fd.get(), piece.data(), n, at, path));
    crc = nvme::crc64(crc, std::span<const std::byte>(piece.data(), static_cast<std::size_t>(n)));
    at += n;
  }
  return std::make_pair(crc, size);
}

core::Result<CheckpointInspection> inspect_checkpoint(const std::string& dir, bool verify) {
  STRATA_ASSIGN_OR_RETURN(CheckpointLocation loc, locate_checkpoint(dir));
  CheckpointInspection out;
  out.dir = loc.dir;
  out.latest_path = loc.latest_path;
  out.manifest = std::move(loc.manifest);
  out.placement = placement_of(out.manifest.config_json);
  const std::string manifest_path = out.dir + "/manifest.json";
  const std::vector<CheckpointStateFile> state_files = checkpoint_state_files(out.manifest);
  STRATA_ASSIGN_OR_RETURN(const std::uint64_t manifest_bytes, size_of(manifest_path));
  out.files.push_back({"manifest.json", manifest_bytes, 0});
  for (const CheckpointStateFile& f : state_files) {
    STRATA_ASSIGN_OR_RETURN(const std::uint64_t bytes, size_of(out.dir + "/" + f.file));
    out.files.push_back({f.file, bytes, f.crc64});
  }
  const auto framework_files = checkpoint_framework_files(out.manifest);  // framework.bin, other ranks' blobs
  for (const auto& [file, crc] : framework_files) {
    STRATA_ASSIGN_OR_RETURN(const std::uint64_t bytes, size_of(out.dir + "/" + file));
    out.files.push_back({file, bytes, crc});
  }
  if (verify) {
    // The CRC64s first: a damaged header is reported as the file's mismatch.
    for (const CheckpointStateFile& f : state_files) STRATA_RETURN_IF_ERROR(check_crc(out.dir + "/" + f.file, f.crc64));
    for (const auto& [file, crc] : framework_files) STRATA_RETURN_IF_ERROR(check_crc(out.dir + "/" + file, crc));
  }
  for (const CheckpointStateFile& f : state_files) {
    STRATA_ASSIGN_OR_RETURN(const SafetensorsReader reader, SafetensorsReader::open(out.dir + "/" + f.file));
    if (verify) STRATA_RETURN_IF_ERROR(verify_codes(reader));  // 8-bit moments: their tables, codes and scales
    for (const TensorInfo& t : reader.tensors()) {
      out.tensors.push_back({f.file, t.name, std::string(to_string(t.dtype)), t.shape, t.nbytes});
    }
  }
  out.verified = verify;
  return out;
}

}  // namespace strata::engine
