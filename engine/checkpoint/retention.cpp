// Retention and the removal of interrupted saves (engine/checkpoint/retention.h).
#include "engine/checkpoint/retention.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <system_error>

#include "core/logging.h"
#include "core/str.h"
#include "engine/checkpoint/manifest.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
namespace fs = std::filesystem;

// The names of `root`'s entries.
core::Result<std::vector<std::string>> list_names(const std::string& root) {
  std::error_code ec;
  std::vector<std::string> names;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) return Status::from_errno(ec.value(), str_cat("list checkpoint root ", root));
  std::sort(names.begin(), names.end());
  return names;
}

// Bytes under `path` (for the info line; 0 where it cannot be read).
std::uintmax_t tree_bytes(const fs::path& path) {
  std::error_code ec;
  std::uintmax_t total = 0;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e;
    if (it->is_regular_file(e)) {
      const std::uintmax_t n = it->file_size(e);
      if (!e) total += n;
    }
  }
  return total;
}

Status remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return Status::from_errno(ec.value(), str_cat("remove ", path));
  return Status();
}

}  // namespace

std::vector<std::int64_t> checkpoints_to_remove(std::span<const std::int64_t> steps, std::int64_t latest_step,
                                                const RetentionPolicy& policy) {
  std::vector<std::int64_t> sorted(steps.begin(), steps.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::vector<std::int64_t> out;
  if (policy.keep_last <= 0) return out;
  const std::size_t keep = static_cast<std::size_t>(policy.keep_last);
  for (std::size_t i = 0; i + keep < sorted.size(); ++i) {  // all but the newest keep_last
    const std::int64_t s = sorted[i];
    if (s == latest_step) continue;
    if (policy.keep_every > 0 && s % policy.keep_every == 0) continue;
    out.push_back(s);
  }
  return out;
}

core::Result<std::vector<std::string>> apply_retention(const std::string& root, std::int64_t latest_step,
                                                       const RetentionPolicy& policy) {
  std::vector<std::string> removed;
  if (policy.keep_last <= 0) return removed;
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> names, list_names(root));
  std::vector<std::int64_t> steps;
  for (const std::string& n : names) {
    std::int64_t s = 0;
    if (parse_step_dir_name(n, &s)) steps.push_back(s);
  }
  for (std::int64_t s : checkpoints_to_remove(steps, latest_step, policy)) {
    const std::string dir = str_cat(root, "/step-", s);
    STRATA_RETURN_IF_ERROR(remove_tree(dir));
    STRATA_LOG(kInfo) << "removed checkpoint " << dir << " (strata.checkpoint.keep_last " << policy.keep_last
                      << ", keep_every " << policy.keep_every << ")";
    removed.push_back(dir);
  }
  return removed;
}

core::Result<std::vector<std::string>> remove_interrupted_saves(const std::string& root) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> names, list_names(root));
  std::vector<std::string> removed;
  for (const std::string& n : names) {
    // ".step-<N>.tmp"
    if (!n.starts_with(".") || !n.ends_with(".tmp") || n.size() < 6) continue;
    if (!parse_step_dir_name(std::string_view(n).substr(1, n.size() - 5), nullptr)) continue;
    const std::string dir = str_cat(root, "/", n);
    const std::uintmax_t bytes = tree_bytes(dir);
    STRATA_RETURN_IF_ERROR(remove_tree(dir));
    STRATA_LOG(kInfo) << "removed " << dir << " (" << core::format_bytes(bytes)
                      << "), left by an interrupted checkpoint save";
    removed.push_back(dir);
  }
  return removed;
}

}  // namespace strata::engine
