// manifest.json and latest: checksummed writers, bounded parsers, and the
// lookup of a checkpoint from its root or step folder. The manifest is JSON,
// so this file is behind the nlohmann firewall (tests/layering_test.py).
#include "engine/checkpoint/manifest.h"

#include <sys/stat.h>

#include <cerrno>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "core/logging.h"
#include "core/str.h"
#include "engine/checkpoint/manifest_json.h"
#include "engine/config/json_bounds.h"
#include "engine/checkpoint/file_io.h"
#include "engine/checkpoint/inspect.h"
#include "nvme/crc64.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
using json_bounds::preview;
using Json = nlohmann::json;

// The manifest's last member, whose value is the CRC64 of the bytes before kCrcHead.
constexpr std::string_view kCrcHead = ",\n  \"manifest_crc64\": \"";
constexpr std::string_view kCrcTail = "\"\n}\n";
constexpr std::size_t kCrcTrailerBytes = kCrcHead.size() + 16 + kCrcTail.size();
// A latest pointer is a line of a few dozen bytes.
constexpr std::uint64_t kMaxLatestBytes = 4096;

std::string_view as_text(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

std::uint64_t crc64_of(std::string_view text) {
  return nvme::crc64(0, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

// Exactly 16 lowercase hex digits (what crc64_hex writes).
bool parse_hex16(std::string_view s, std::uint64_t* out) {
  if (s.size() != 16) return false;
  std::uint64_t v = 0;
  for (char c : s) {
    int d = 0;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return false;
    }
    v = (v << 4) | static_cast<std::uint64_t>(d);
  }
  *out = v;
  return true;
}

// Reads a small file whole, refusing one over `max_bytes` before reading it.
core::Result<std::vector<std::byte>> read_small_file(const std::string& path, std::uint64_t max_bytes,
                                                     const IoConfig& io) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::from_errno(errno, str_cat("stat ", path));
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    return Status::data_loss(str_cat(path, ": ", st.st_size, " bytes; this file is at most ", max_bytes,
                                     " bytes in a checkpoint (it is damaged or not a checkpoint's)"));
  }
  return read_file(path, io);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Reads manifest.json's members into a CheckpointManifest; errors are
// returned through `fail` (the caller adds the path).
class ManifestFields {
 public:
  explicit ManifestFields(std::string* error) : error_(error) {}

  const Json* member(const Json& object, const char* key, const char* where) {
    const auto it = object.find(key);
    if (it == object.end()) return fail(str_cat(where, key, " is missing"));
    return &*it;
  }
  bool integer(const Json& object, const char* key, const char* where, std::int64_t* out) {
    const Json* v = member(object, key, where);
    if (v == nullptr) return false;
    if (!v->is_number_integer()) return fail(str_cat(where, key, " is not an integer")) != nullptr;
    *out = v->get<std::int64_t>();
    return true;
  }
  bool unsigned_integer(const Json& object, const char* key, const char* where, std::uint64_t* out) {
    const Json* v = member(object, key, where);
    if (v == nullptr) return false;
    if (!v->is_number_unsigned()) return fail(str_cat(where, key, " is not an unsigned integer")) != nullptr;
    *out = v->get<std::uint64_t>();
    return true;
  }
  bool number(const Json& object, const char* key, const char* where, double* out) {
    const Json* v = member(object, key, where);
    if (v == nullptr) return false;
    if (!v->is_number()) return fail(str_cat(where, key, " is not a number")) != nullptr;
    *out = v->get<double>();
    return true;
  }
  bool string(const Json& object, const char* key, const char* where, std::string* out) {
    const Json* v = member(object, key, where);
    if (v == nullptr) return false;
    if (!v->is_string()) return fail(str_cat(where, key, " is not a string")) != nullptr;
    *out = v->get<std::string>();
    return true;
  }
  bool boolean(const Json& object, const char* key, const char* where, bool* out) {
    const Json* v = member(object, key, where);
    if (v == nullptr) return false;
    if (!v->is_boolean()) return fail(str_cat(where, key, " is not true or false")) != nullptr;
    *out = v->get<bool>();
    return true;
  }
  const Json* object(const Json& parent, const char* key, const char* where) {
    const Json* v = member(parent, key, where);
    if (v != nullptr && !v->is_object()) return fail(str_cat(where, key, " is not an object"));
    return v;
  }

 private:
  const Json* fail(std::string message) {
    if (error_->empty()) *error_ = std::move(message);
    return nullptr;
  }
  std::string* error_;
};

bool read_params(const Json& doc, ManifestFields& f, std::string* error, std::vector<CheckpointParam>* out) {
  const Json* params = f.member(doc, "params", "");
  if (params == nullptr) return false;
  if (!params->is_array()) {
    *error = "params is not an array";
    return false;
  }
  out->reserve(params->size());
  for (std::size_t i = 0; i < params->size(); ++i) {
    const Json& p = (*params)[i];
    const std::string where = str_cat("params[", i, "].");
    if (!p.is_object()) {
      *error = str_cat("params[", i, "] is not an object");
      return false;
    }
    CheckpointParam cp;
    if (!f.string(p, "name", where.c_str(), &cp.name) || !f.string(p, "group", where.c_str(), &cp.group) ||
        !f.boolean(p, "trainable", where.c_str(), &cp.trainable) ||
        !f.integer(p, "optimizer_group", where.c_str(), &cp.optimizer_group)) {
      return false;
    }
    if (p.contains("missed_steps") && !f.integer(p, "missed_steps", where.c_str(), &cp.missed_steps)) return false;
    const Json* shape = f.member(p, "shape", where.c_str());
    if (shape == nullptr) return false;
    if (!shape->is_array()) {
      *error = str_cat(where, "shape is not an array");
      return false;
    }
    for (const Json& d : *shape) {
      if (!d.is_number_unsigned()) {
        *error = str_cat(where, "shape holds something other than a count >= 0");
        return false;
      }
      cp.shape.push_back(d.get<std::int64_t>());
    }
    out->push_back(std::move(cp));
  }
  return true;
}

// Version 3's "ranks" and "shards": one file per rank, named as a save names
// it, its CRC64 in "files", its ranges [param, lo, hi] counts >= 0 (checked
// against the parameters by uncovered_elements).
bool read_shards(const Json& doc, const Json& files, ManifestFields& f, std::string* error, CheckpointManifest* m) {
  std::int64_t ranks = 0;
  if (!f.integer(doc, "ranks", "", &ranks)) return false;
  if (ranks < 2 || ranks > kMaxCheckpointRanks) {
    *error = str_cat("ranks ", ranks, " is outside [2, ", kMaxCheckpointRanks, "] (a version-3 checkpoint is saved by several ranks)");
    return false;
  }
  m->ranks = static_cast<int>(ranks);
  const Json* shards = f.member(doc, "shards", "");
  if (shards == nullptr) return false;
  if (!shards->is_array() || shards->size() != static_cast<std::size_t>(ranks)) {
    *error = str_cat("shards is not an array of one entry per rank (", ranks, ")");
    return false;
  }
  for (std::size_t r = 0; r < shards->size(); ++r) {
    const Json& s = (*shards)[r];
    const std::string where = str_cat("shards[", r, "].");
    if (!s.is_object()) {
      *error = str_cat("shards[", r, "] is not an object");
      return false;
    }
    CheckpointStateFile file;
    if (!f.string(s, "file", where.c_str(), &file.file)) return false;
    const std::string want = checkpoint_shard_file(static_cast<int>(r), m->ranks);
    if (file.file != want) {
      *error = str_cat(where, "file \"", preview(file.file), "\" is not ", want);
      return false;
    }
    if (!f.unsigned_integer(files, file.file.c_str(), "files.", &file.crc64)) return false;
    const Json* ranges = f.member(s, "ranges", where.c_str());
    if (ranges == nullptr) return false;
    if (!ranges->is_array()) {
      *error = str_cat(where, "ranges is not an array");
      return false;
    }
    for (const Json& range : *ranges) {
      if (!range.is_array() || range.size() != 3 || !range[0].is_number_unsigned() ||
          !range[1].is_number_unsigned() || !range[2].is_number_unsigned()) {
        *error = str_cat(where, "ranges holds something other than [param, lo, hi] counts >= 0");
        return false;
      }
      file.ranges.push_back({range[0].get<std::int64_t>(), range[1].get<std::int64_t>(), range[2].get<std::int64_t>()});
    }
    m->shards.push_back(std::move(file));
  }
  return true;
}

// Version 4's "frozen_base": [{"group", "crc64", "files": [...]}, ...], at
// least one, each group named once and holding a frozen parameter.
bool read_frozen_base(const Json& doc, ManifestFields& f, std::string* error, CheckpointManifest* m) {
  const Json* groups = f.member(doc, "frozen_base", "");
  if (groups == nullptr) return false;
  if (!groups->is_array() || groups->empty()) {
    *error = "frozen_base is not an array of at least one group";
    return false;
  }
  for (std::size_t i = 0; i < groups->size(); ++i) {
    const Json& g = (*groups)[i];
    const std::string where = str_cat("frozen_base[", i, "].");
    if (!g.is_object()) {
      *error = str_cat("frozen_base[", i, "] is not an object");
      return false;
    }
    CheckpointFrozenBase b;
    if (!f.string(g, "group", where.c_str(), &b.group) || !f.unsigned_integer(g, "crc64", where.c_str(), &b.crc64)) {
      return false;
    }
    const Json* files = f.member(g, "files", where.c_str());
    if (files == nullptr) return false;
    if (!files->is_array()) {
      *error = str_cat(where, "files is not an array");
      return false;
    }
    for (const Json& file : *files) {
      if (!file.is_string()) {
        *error = str_cat(where, "files holds something other than a file name");
        return false;
      }
      b.files.push_back(file.get<std::string>());
    }
    for (const CheckpointFrozenBase& seen : m->frozen_base) {
      if (seen.group == b.group) {
        *error = str_cat(where, "group \"", preview(b.group), "\" is named twice");
        return false;
      }
    }
    const bool holds_frozen = std::any_of(m->params.begin(), m->params.end(), [&](const CheckpointParam& p) {
      return p.group == b.group && !p.trainable;
    });
    if (!holds_frozen) {
      *error = str_cat(where, "group \"", preview(b.group), "\" has no frozen parameter");
      return false;
    }
    m->frozen_base.push_back(std::move(b));
  }
  return true;
}

// Version 3's other ranks' framework blobs in "files": each rank's from 1 to
// ranks - 1, or none (a checkpoint saved before they were kept).
bool read_rank_frameworks(const Json& files, ManifestFields& f, std::string* error, CheckpointManifest* m) {
  int present = 0;
  for (int r = 1; r < m->ranks; ++r) present += files.contains(checkpoint_framework_file(r, m->ranks)) ? 1 : 0;
  if (present == 0) return true;
  if (present != m->ranks - 1) {
    *error = str_cat("files names the framework blobs of ", present, " of the ", m->ranks - 1,
                     " ranks after rank 0 (all or none)");
    return false;
  }
  m->rank_framework_crc64.assign(1, m->framework_crc64);
  for (int r = 1; r < m->ranks; ++r) {
    std::uint64_t crc = 0;
    if (!f.unsigned_integer(files, checkpoint_framework_file(r, m->ranks).c_str(), "files.", &crc)) return false;
    m->rank_framework_crc64.push_back(crc);
  }
  return true;
}

// The element count of a shape, or -1 past 2^62 (no parameter is that large).
std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0 || (d > 0 && n > (std::int64_t{1} << 62) / d)) return -1;
    n *= d;
  }
  return n;
}

// "" when the shards' ranges cover every element of every parameter exactly
// once, else the first fault, naming the parameter.
std::string uncovered_elements(const CheckpointManifest& m) {
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> by_param(m.params.size());
  for (std::size_t r = 0; r < m.shards.size(); ++r) {
    for (const CheckpointRange& range : m.shards[r].ranges) {
      if (range.param < 0 || static_cast<std::size_t>(range.param) >= m.params.size()) {
        return str_cat("shards[", r, "] holds a range of parameter #", range.param, "; there are ", m.params.size());
      }
      if (m.compute_in_base(static_cast<std::size_t>(range.param))) {
        return str_cat("shards[", r, "] holds a range of parameter #", range.param, " (",
                       preview(m.params[static_cast<std::size_t>(range.param)].name),
                       "), whose compute copies frozen_base says no state file holds");
      }
      if (range.lo < 0 || range.lo >= range.hi) {
        return str_cat("shards[", r, "] holds an empty or reversed range [", range.lo, ", ", range.hi,
                       ") of parameter #", range.param);
      }
      by_param[static_cast<std::size_t>(range.param)].emplace_back(range.lo, range.hi);
    }
  }
  for (std::size_t i = 0; i < by_param.size(); ++i) {
    if (m.compute_in_base(i)) continue;
    auto& ranges = by_param[i];
    std::sort(ranges.begin(), ranges.end());
    std::int64_t next = 0;
    for (const auto& [lo, hi] : ranges) {
      if (lo != next) {
        return str_cat("the shards' ranges of parameter #", i, " (", preview(m.params[i].name), ") ",
                       lo < next ? "overlap" : "leave a gap", " at element ", std::min(lo, next));
      }
      next = hi;
    }
    if (next != numel_of(m.params[i].shape)) {
      return str_cat("the shards' ranges of parameter #", i, " (", preview(m.params[i].name), ") end at element ",
                     next, "; it has ", numel_of(m.params[i].shape));
    }
  }
  return "";
}

// The first value of `m` no save can write, as "<field> <value> <why>", or ""
// when every one is possible (the ranges of Verdict and LossScaler; the bounds
// that depend on the config, such as fp16.hysteresis, are checked at load).
std::string impossible_value(const CheckpointManifest& m) {
  if (m.step < 0) return str_cat("step ", m.step, " is below 0 (it counts applied steps)");
  if (m.skipped_steps < 0) return str_cat("skipped_steps ", m.skipped_steps, " is below 0 (it counts skipped steps)");
  if (m.lr_override != -1.0 && !(std::isfinite(m.lr_override) && m.lr_override >= 0.0)) {
    return str_cat("lr_override ", m.lr_override, " is neither -1 (no override) nor a finite rate >= 0 (set_lr's range)");
  }
  const CheckpointScaler& ls = m.loss_scaler;
  if (!(std::isfinite(ls.scale) && ls.scale > 0.0)) {
    return str_cat("loss_scaler.scale ", ls.scale, " is not a finite value > 0");
  }
  if (ls.iteration < 0) return str_cat("loss_scaler.iteration ", ls.iteration, " is below 0");
  if (ls.last_overflow_iteration < -1 || ls.last_overflow_iteration >= ls.iteration) {
    return str_cat("loss_scaler.last_overflow_iteration ", ls.last_overflow_iteration,
                   " is outside [-1, iteration ", ls.iteration, ") (-1: no overflow yet)");
  }
  if (ls.hysteresis_left < 1) return str_cat("loss_scaler.hysteresis_left ", ls.hysteresis_left, " is below 1");
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    if (m.params[i].optimizer_group < 0) {
      return str_cat("params[", i, "].optimizer_group ", m.params[i].optimizer_group, " is below 0");
    }
    if (m.params[i].missed_steps < 0 || m.params[i].missed_steps > m.step) {
      return str_cat("params[", i, "].missed_steps ", m.params[i].missed_steps, " is outside [0, step ", m.step, "]");
    }
  }
  return "";
}

// Whether <dir> (a step folder) is a whole checkpoint: its manifest parses and
// the CRC64s of its state and framework files match it (read whole).
core::Result<CheckpointManifest> complete_checkpoint(const std::string& dir, const IoConfig& io) {
  const std::string manifest = dir + "/manifest.json";
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes,
                          read_small_file(manifest, kMaxCheckpointManifestBytes, io));
  STRATA_ASSIGN_OR_RETURN(CheckpointManifest m, parse_checkpoint_manifest(bytes, manifest));
  std::vector<std::pair<std::string, std::uint64_t>> files = checkpoint_framework_files(m);
  for (const CheckpointStateFile& f : checkpoint_state_files(m)) files.emplace_back(f.file, f.crc64);
  for (const auto& [file, want] : files) {
    const std::string path = dir + "/" + file;
    STRATA_ASSIGN_OR_RETURN(const auto crc_and_size, file_crc64(path));
    if (crc_and_size.first != want) {
      return Status::data_loss(str_cat(path, ": CRC64 mismatch: its ", crc_and_size.second, " bytes give ",
                                       crc64_hex(crc_and_size.first), ", the manifest records ", crc64_hex(want),
                                       " (the file is damaged or truncated)"));
    }
  }
  return m;
}

// The step-<N> folders in `root` (N, name), in no order; none when it cannot be listed.
std::vector<std::pair<std::int64_t, std::string>> step_folders(const std::string& root) {
  std::vector<std::pair<std::int64_t, std::string>> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::int64_t step = 0;
    const std::string name = it->path().filename().string();
    std::error_code dir_ec;
    if (parse_step_dir_name(name, &step) && it->is_directory(dir_ec)) out.emplace_back(step, name);
  }
  return out;
}

// `latest` is the commit point of a save: a newer step-<N> folder beside the
// one it names (a save that ended between its rename and replacing latest, or
// a run resumed from an older checkpoint that saved below it) is not loaded
// in its place, but named at warn level.
void warn_of_newer_folders(const std::string& root, const std::string& latest, const std::string& named) {
  std::int64_t named_step = 0;
  if (!parse_step_dir_name(named, &named_step)) return;
  std::int64_t newest = named_step;
  for (const auto& [step, name] : step_folders(root)) {
    if (step > newest && exists(root + "/" + name + "/manifest.json")) newest = step;
  }
  if (newest == named_step) return;
  STRATA_LOG(kWarn) << latest << " names " << named << ", and " << root << "/step-" << newest
                    << " is newer but was never made latest (a save ended before replacing latest, or a run "
                       "resumed from an older checkpoint saved below it): loading "
                    << named << " as latest says; name the folder to load the other";
}

// A root without `latest` (a save killed before it wrote the first one, or a
// pointer removed): the newest step-<N> folder that is complete, logged at warn
// level with the reason and the folders passed over. kNotFound naming the root
// when none is.
core::Result<CheckpointLocation> newest_complete_checkpoint(const std::string& root_or_dir, const std::string& root,
                                                            const IoConfig& io) {
  const std::string latest = root + "/latest";
  std::vector<std::pair<std::int64_t, std::string>> steps = step_folders(root);
  if (steps.empty()) {
    return Status::not_found(str_cat("no checkpoint at ", root_or_dir, " (neither ", latest, " nor ", root,
                                     "/manifest.json exists)"));
  }
  std::sort(steps.begin(), steps.end(), std::greater<>());
  std::string passed_over;
  for (const auto& [step, name] : steps) {
    const std::string dir = root + "/" + name;
    auto m = complete_checkpoint(dir, io);
    if (!m.ok()) {
      passed_over += str_cat(passed_over.empty() ? "" : "; ", name, ": ", m.status().message());
      continue;
    }
    STRATA_LOG(kWarn) << latest << " is missing (a save ended before writing it, or it was removed): loading "
                      << dir << ", the newest complete checkpoint"
                      << (passed_over.empty() ? "" : str_cat(" (passed over, incomplete: ", passed_over, ")"));
    CheckpointLocation loc;
    loc.dir = dir;
    loc.manifest = *std::move(m);
    return loc;
  }
  return Status::not_found(str_cat("no complete checkpoint at ", root_or_dir, ": ", latest,
                                   " does not exist and no step-<N> folder is complete (", passed_over, ")"));
}

}  // namespace

bool parse_step_dir_name(std::string_view name, std::int64_t* step) {
  constexpr std::string_view kPrefix = "step-";
  if (!name.starts_with(kPrefix) || name.size() == kPrefix.size()) return false;
  const std::string_view digits = name.substr(kPrefix.size());
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
  }
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || end != digits.data() + digits.size()) return false;
  if (step != nullptr) *step = v;
  return true;
}

std::string crc64_hex(std::uint64_t crc) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(crc));
  return buf;
}

std::string checkpoint_shard_file(int rank, int ranks) {
  return str_cat("state-rank-", rank, "-of-", ranks, ".safetensors");
}

std::string checkpoint_framework_file(int rank, int ranks) {
  return str_cat("framework-rank-", rank, "-of-", ranks, ".bin");
}

std::vector<std::pair<std::string, std::uint64_t>> checkpoint_framework_files(const CheckpointManifest& m) {
  std::vector<std::pair<std::string, std::uint64_t>> out{{"framework.bin", m.framework_crc64}};
  for (std::size_t r = 1; r < m.rank_framework_crc64.size(); ++r) {
    out.emplace_back(checkpoint_framework_file(static_cast<int>(r), m.ranks), m.rank_framework_crc64[r]);
  }
  return out;
}

std::pair<std::string, std::uint64_t> checkpoint_framework_file_for(const CheckpointManifest& m, int rank, int ranks) {
  if (rank > 0 && ranks == m.ranks && static_cast<std::size_t>(rank) < m.rank_framework_crc64.size()) {
    return {checkpoint_framework_file(rank, ranks), m.rank_framework_crc64[static_cast<std::size_t>(rank)]};
  }
  return {"framework.bin", m.framework_crc64};
}

bool CheckpointManifest::compute_in_base(std::size_t i) const {
  const CheckpointParam& p = params[i];
  if (p.trainable) return false;
  return std::any_of(frozen_base.begin(), frozen_base.end(),
                     [&](const CheckpointFrozenBase& b) { return b.group == p.group; });
}

std::vector<CheckpointStateFile> checkpoint_state_files(const CheckpointManifest& m) {
  if (!m.shards.empty()) return m.shards;
  return {CheckpointStateFile{.file = "state.safetensors", .crc64 = m.state_crc64, .ranges = {}, .whole = true}};
}

std::string format_checkpoint_manifest(const CheckpointManifest& m) {
  nlohmann::ordered_json j;
  j["format"] = "strata-checkpoint";
  const bool ranked = !m.shards.empty();
  j["version"] = !m.frozen_base.empty() ? kCheckpointFormatVersion
                 : ranked               ? kCheckpointFormatRanks
                                        : kCheckpointFormatOneRank;
  j["step"] = m.step;
  j["skipped_steps"] = m.skipped_steps;
  j["lr_override"] = m.lr_override;
  j["loss_scaler"] = checkpoint_scaler_json(m.loss_scaler);
  j["compute_dtype"] = m.compute_dtype;
  j["params"] = checkpoint_params_json(m.params);
  if (ranked) {
    j["ranks"] = m.ranks;
    nlohmann::ordered_json files = nlohmann::ordered_json::object();
    for (const auto& [file, crc] : checkpoint_framework_files(m)) files[file] = crc;
    nlohmann::ordered_json shards = nlohmann::ordered_json::array();
    for (const CheckpointStateFile& f : m.shards) {
      files[f.file] = f.crc64;
      nlohmann::ordered_json ranges = nlohmann::ordered_json::array();
      for (const CheckpointRange& r : f.ranges) ranges.push_back({r.param, r.lo, r.hi});
      shards.push_back({{"file", f.file}, {"ranges", std::move(ranges)}});
    }
    j["files"] = std::move(files);
    j["shards"] = std::move(shards);
  } else {
    j["files"] = {{"state.safetensors", m.state_crc64}, {"framework.bin", m.framework_crc64}};
  }
  if (!m.frozen_base.empty()) {
    nlohmann::ordered_json groups = nlohmann::ordered_json::array();
    for (const CheckpointFrozenBase& b : m.frozen_base) {
      groups.push_back({{"group", b.group}, {"crc64", b.crc64}, {"files", b.files}});
    }
    j["frozen_base"] = std::move(groups);
  }
  nlohmann::ordered_json config;
  if (!json_bounds::parse_bounded(m.config_json, &config).ok() || !config.is_object()) {
    config = nlohmann::ordered_json::object();
  }
  j["config"] = std::move(config);
  // Names that are not valid UTF-8 are written with U+FFFD (and then do not
  // match at load, which names the parameter).
  std::string text = j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  // dump ends the object with "\n}"; the checksum member goes after the last one.
  text.resize(text.size() - 2);
  const std::uint64_t crc = crc64_of(text);
  text += kCrcHead;
  text += crc64_hex(crc);
  text += kCrcTail;
  return text;
}

core::Result<CheckpointManifest> parse_checkpoint_manifest(std::span<const std::byte> bytes,
                                                           const std::string& path) {
  auto corrupt = [&](std::string_view what) { return Status::data_loss(str_cat(path, ": ", what)); };
  if (bytes.size() > kMaxCheckpointManifestBytes) {
    return corrupt(
        str_cat(bytes.size(), " bytes; a manifest is at most ", kMaxCheckpointManifestBytes, " bytes"));
  }
  const std::string_view text = as_text(bytes);
  // The checksum first, on the exact bytes: nothing of a damaged file is parsed.
  bool checksummed = false;
  if (text.size() >= kCrcTrailerBytes) {
    const std::string_view trailer = text.substr(text.size() - kCrcTrailerBytes);
    std::uint64_t want = 0;
    if (trailer.starts_with(kCrcHead) && trailer.ends_with(kCrcTail) &&
        parse_hex16(trailer.substr(kCrcHead.size(), 16), &want)) {
      const std::uint64_t got = crc64_of(text.substr(0, text.size() - kCrcTrailerBytes));
      if (got != want) {
        return corrupt(str_cat("CRC64 mismatch: its bytes give ", crc64_hex(got),
                               ", its manifest_crc64 says ", crc64_hex(want), " (the file is damaged)"));
      }
      checksummed = true;
    }
  }
  Json doc;
  const Status parsed = json_bounds::parse_bounded(text, &doc);
  if (!parsed.ok()) {
    return corrupt(str_cat("damaged or not a checkpoint manifest: ", parsed.message()));
  }
  if (!doc.is_object()) return corrupt("damaged or not a checkpoint manifest: not a JSON object");
  const auto format = doc.find("format");
  if (format == doc.end() || !format->is_string() ||
      format->get_ref<const std::string&>() != "strata-checkpoint") {
    return corrupt("damaged or not a checkpoint manifest (\"format\" is not \"strata-checkpoint\")");
  }
  const auto version = doc.find("version");
  if (version == doc.end() || !version->is_number_integer()) {
    return corrupt("damaged: \"version\" is missing or not an integer");
  }
  const std::int64_t v = version->get<std::int64_t>();
  if (v > kCheckpointFormatVersion) {
    return Status::failed_precondition(str_cat(path, ": checkpoint format version ", v,
                                               "; this build reads versions 1 to ", kCheckpointFormatVersion,
                                               " (a newer strata wrote it)"));
  }
  if (v < 1) return corrupt(str_cat("damaged: version ", v));
  if (v >= 2 && !checksummed) {
    return corrupt(str_cat("damaged: a version-", v,
                           " manifest ends with its checksum (\"manifest_crc64\": \"<16 hex "
                           "digits>\" as the last member, then \"}\" and a newline), and this one does not"));
  }
  if (v == 1 && checksummed) return corrupt("damaged: a version-1 manifest with a version-2 checksum");

  CheckpointManifest m;
  m.version = static_cast<int>(v);
  std::string error;
  ManifestFields f(&error);
  bool ok = f.integer(doc, "step", "", &m.step) && f.integer(doc, "skipped_steps", "", &m.skipped_steps) &&
            f.number(doc, "lr_override", "", &m.lr_override) &&
            f.string(doc, "compute_dtype", "", &m.compute_dtype);
  if (ok) {
    const Json* ls = f.object(doc, "loss_scaler", "");
    ok = ls != nullptr && f.number(*ls, "scale", "loss_scaler.", &m.loss_scaler.scale) &&
         f.integer(*ls, "iteration", "loss_scaler.", &m.loss_scaler.iteration) &&
         f.integer(*ls, "last_overflow_iteration", "loss_scaler.", &m.loss_scaler.last_overflow_iteration) &&
         f.integer(*ls, "hysteresis_left", "loss_scaler.", &m.loss_scaler.hysteresis_left);
  }
  if (ok) {
    const Json* files = f.object(doc, "files", "");
    ok = files != nullptr && f.unsigned_integer(*files, "framework.bin", "files.", &m.framework_crc64);
    const bool ranked = v == 3 || (v >= 4 && doc.contains("shards"));
    if (ok && !ranked) ok = f.unsigned_integer(*files, "state.safetensors", "files.", &m.state_crc64);
    if (ok && ranked) ok = read_shards(doc, *files, f, &error, &m);
    if (ok && ranked) ok = read_rank_frameworks(*files, f, &error, &m);
  }
  ok = ok && read_params(doc, f, &error, &m.params);
  if (ok && v >= 4) ok = read_frozen_base(doc, f, &error, &m);
  if (ok && !m.shards.empty()) {
    if (const std::string uncovered = uncovered_elements(m); !uncovered.empty()) {
      return corrupt(str_cat("damaged: ", preview(uncovered, json_bounds::kMaxParserMessageChars)));
    }
  }
  if (ok) {
    const Json* config = f.object(doc, "config", "");
    ok = config != nullptr;
    if (ok) m.config_json = config->dump(-1, ' ', false, Json::error_handler_t::replace);
  }
  if (!ok) return corrupt(str_cat("damaged: ", preview(error, json_bounds::kMaxParserMessageChars)));
  if (m.compute_dtype != "F32" && m.compute_dtype != "BF16" && m.compute_dtype != "F16") {
    return corrupt(
        str_cat("damaged: compute_dtype \"", preview(m.compute_dtype), "\" is not F32, BF16 or F16"));
  }
  if (const std::string impossible = impossible_value(m); !impossible.empty()) {
    return corrupt(str_cat("damaged: ", impossible));
  }
  return m;
}

std::string format_latest_pointer(std::string_view step_dir_name) {
  return str_cat(step_dir_name, " ", crc64_hex(crc64_of(step_dir_name)), "\n");
}

core::Result<LatestPointer> parse_latest_pointer(std::span<const std::byte> bytes, const std::string& path) {
  const std::string_view text = as_text(bytes);
  auto corrupt = [&](std::string_view what) {
    return Status::data_loss(str_cat(path, ": damaged: ", what, " (it holds \"", preview(text), "\")"));
  };
  if (text.empty() || text.back() != '\n')
    return corrupt("a checkpoint pointer is one line \"step-<N> <CRC64>\"");
  const std::string_view line = text.substr(0, text.size() - 1);
  const std::size_t space = line.find(' ');
  if (space == std::string_view::npos) {
    // Version 1: "step-<N>\n", no checksum.
    if (!parse_step_dir_name(line, nullptr))
      return corrupt("a checkpoint pointer is one line \"step-<N> <CRC64>\"");
    return LatestPointer{.step_dir_name = std::string(line), .checksummed = false};
  }
  const std::string_view name = line.substr(0, space);
  std::uint64_t want = 0;
  if (!parse_step_dir_name(name, nullptr) || !parse_hex16(line.substr(space + 1), &want)) {
    return corrupt("a checkpoint pointer is one line \"step-<N> <CRC64 as 16 hex digits>\"");
  }
  if (crc64_of(name) != want)
    return corrupt(str_cat("CRC64 mismatch: \"", name, "\" gives ", crc64_hex(crc64_of(name))));
  return LatestPointer{.step_dir_name = std::string(name), .checksummed = true};
}

core::Result<CheckpointLocation> locate_checkpoint(const std::string& root_or_dir, const IoConfig& io) {
  std::string root = root_or_dir;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  CheckpointLocation loc;
  const std::string latest = root + "/latest";
  LatestPointer pointer;
  if (exists(latest)) {
    STRATA_ASSIGN_OR_RETURN(const std::vector<std::byte> p, read_small_file(latest, kMaxLatestBytes, io));
    STRATA_ASSIGN_OR_RETURN(pointer, parse_latest_pointer(p, latest));
    loc.latest_path = latest;
    loc.dir = root + "/" + pointer.step_dir_name;
    warn_of_newer_folders(root, latest, pointer.step_dir_name);
    // A save of a step that already had a folder moves the old one aside
    // (step-<N>.old) before renaming the new one in: a crash between the two
    // renames leaves latest naming a folder that is not there yet, and the
    // same step's previous copy beside it.
    const std::string aside = loc.dir + ".old";
    if (!exists(loc.dir) && exists(aside + "/manifest.json")) {
      STRATA_LOG(kWarn) << latest << ": names " << pointer.step_dir_name << ", which is missing: a save of that "
                        << "step was interrupted after moving the previous copy aside; loading it from " << aside;
      loc.dir = aside;
    }
    if (!exists(loc.dir + "/manifest.json")) {
      return Status::data_loss(
          str_cat(latest, ": names ", pointer.step_dir_name, ", but ", loc.dir,
                  "/manifest.json does not exist (the checkpoint it points to is gone, or the "
                  "pointer is damaged)"));
    }
  } else if (exists(root + "/manifest.json")) {
    loc.dir = root;
  } else {
    // Its manifest is read again below, so that a version-1 one is named as such.
    STRATA_ASSIGN_OR_RETURN(const CheckpointLocation found, newest_complete_checkpoint(root_or_dir, root, io));
    loc.dir = found.dir;
  }
  const std::string manifest = loc.dir + "/manifest.json";
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes,
                          read_small_file(manifest, kMaxCheckpointManifestBytes, io));
  STRATA_ASSIGN_OR_RETURN(loc.manifest, parse_checkpoint_manifest(bytes, manifest));
  if (!loc.latest_path.empty() && !pointer.checksummed && loc.manifest.version >= 2) {
    return Status::data_loss(
        str_cat(latest, ": damaged: it has no checksum (the version-1 form) but names a version-",
                loc.manifest.version, " checkpoint, whose pointer carries one"));
  }
  if (loc.manifest.version == 1) {
    STRATA_LOG(kWarn)
        << loc.dir
        << ": a version-1 checkpoint: its manifest.json and latest carry no checksum of their own, so "
           "they are read unverified (the state and framework files are still checked); the next save "
           "writes a checksummed version ("
        << kCheckpointFormatOneRank << ", or " << kCheckpointFormatRanks << " with several ranks, "
        << kCheckpointFormatVersion << " with a frozen base left out)";
  }
  return loc;
}

}  // namespace strata::engine
