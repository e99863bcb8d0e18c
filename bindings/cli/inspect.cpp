// `strata inspect`: prints engine::inspect_checkpoint's findings as a table or JSON.
#include "bindings/cli/inspect.h"

#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

#include "core/str.h"
#include "engine/checkpoint/inspect.h"

namespace strata::cli {
namespace {

namespace engine = strata::engine;

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += core::str_cat(i == 0 ? "" : ", ", shape[i]);
  return s + "]";
}

void print_table(const engine::CheckpointInspection& in, std::ostream& out) {
  const engine::CheckpointManifest& m = in.manifest;
  auto row = [&out](const char* key, const std::string& value) {
    out << std::left << std::setw(14) << key << value << "\n";
  };
  row("checkpoint",
      in.latest_path.empty() ? in.dir : core::str_cat(in.dir, " (named by ", in.latest_path, ")"));
  row("format",
      core::str_cat("strata-checkpoint version ", m.version,
                    m.version == 1 ? " (no checksum on manifest.json)" : ""));
  row("step", core::str_cat(m.step, " (", m.skipped_steps, " skipped)"));
  row("lr override", m.lr_override < 0 ? std::string("none") : core::str_cat(m.lr_override));
  row("loss scaler", core::str_cat("scale ", m.loss_scaler.scale, ", iteration ", m.loss_scaler.iteration,
                                   ", last overflow ", m.loss_scaler.last_overflow_iteration,
                                   ", hysteresis left ", m.loss_scaler.hysteresis_left));
  row("compute dtype", m.compute_dtype);
  row("ranks", m.ranks == 1 ? std::string("1 (one state file)")
                            : core::str_cat(m.ranks, " (one state file per rank; loads with any number of ranks)"));
  for (const auto& [key, value] : in.placement)
    row(key == in.placement.front().first ? "placement" : "", key + " " + value);
  std::size_t trainable = 0;
  for (const engine::CheckpointParam& p : m.params) trainable += p.trainable ? 1 : 0;
  row("parameters", core::str_cat(m.params.size(), " (", trainable, " trainable)"));
  for (const engine::CheckpointFrozenBase& b : m.frozen_base) {
    std::string files;
    for (const std::string& f : b.files) files += (files.empty() ? "" : ", ") + f;
    row(&b == &m.frozen_base.front() ? "frozen base" : "",
        core::str_cat("group ", b.group, ": not in the state files; read from ", files, " (CRC64 ",
                      engine::crc64_hex(b.crc64), " in the compute dtype)"));
  }
  for (const engine::InspectedFile& f : in.files) {
    row(&f == &in.files.front() ? "files" : "",
        core::str_cat(f.name, "  ", f.bytes, " bytes (", core::format_bytes(f.bytes), ")",
                      f.name == "manifest.json" ? std::string("  carries its own CRC64")
                                                : core::str_cat("  CRC64 ", engine::crc64_hex(f.crc64))));
  }
  row("verified", in.verified ? std::string("yes: every file's CRC64 matches")
                              : std::string("manifest.json and latest only (--verify checks every file)"));
  out << "\ntensors (" << in.tensors.size() << ")\n";
  std::size_t name_width = 4;
  for (const engine::InspectedTensor& t : in.tensors) name_width = std::max(name_width, t.name.size());
  out << "  " << std::left << std::setw(static_cast<int>(name_width)) << "name"
      << "  " << std::setw(5) << "dtype"
      << "  " << std::setw(16) << "shape"
      << "  bytes\n";
  for (std::size_t i = 0; i < in.tensors.size(); ++i) {
    const engine::InspectedTensor& t = in.tensors[i];
    // With several ranks, each state file's tensors (its ranges, flat) under its name.
    if (m.ranks > 1 && (i == 0 || in.tensors[i - 1].file != t.file)) out << " " << t.file << "\n";
    out << "  " << std::left << std::setw(static_cast<int>(name_width)) << t.name << "  " << std::setw(5)
        << t.dtype << "  " << std::setw(16) << shape_text(t.shape) << "  " << t.bytes << "\n";
  }
}

}  // namespace

int inspect_command(const std::string& checkpoint_dir, bool verify, bool json, std::ostream& out,
                    std::ostream& err) {
  auto inspection = engine::inspect_checkpoint(checkpoint_dir, verify);
  if (!inspection.ok()) {
    err << "strata inspect: " << inspection.status().message() << "\n";
    return inspection.status().code() == core::StatusCode::kDataLoss ? kInspectDamaged : kInspectBadInput;
  }
  if (json) {
    out << engine::format_inspection_json(*inspection);
  } else {
    print_table(*inspection, out);
  }
  return kInspectOk;
}

int inspect_command(const std::string& checkpoint_dir, bool verify, bool json) {
  return inspect_command(checkpoint_dir, verify, json, std::cout, std::cerr);
}

const char* inspect_usage() {
  return R"(strata inspect CKPT [--verify] [--json]
  CKPT       a checkpoint root (its `latest` is followed) or a step-<N> folder
  --verify   also read every file and check its CRC64 against the manifest
  --json     print JSON instead of a table
  exit 0 when the checkpoint reads (and verifies), 1 when a file is damaged
  (DATA_LOSS, the file named on stderr), 2 when there is no checkpoint there
)";
}

}  // namespace strata::cli
