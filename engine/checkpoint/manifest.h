// A checkpoint's small files (docs/checkpoints.md): <root>/latest and
// <step dir>/manifest.json, each carrying a CRC64 of its own exact bytes, so
// that any flipped bit in them is kDataLoss naming the file; their writers
// and pure parsers (for the engine, `strata inspect` and fuzzers), and the
// lookup of a checkpoint's directory from a root or a step folder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/result.h"
#include "engine/config.h"

namespace strata::engine {

// The newest format this build reads and writes: version 3 is a checkpoint
// saved by several data-parallel ranks (one state file per rank, each
// holding ranges of the parameters); one rank writes version 2 (one
// state.safetensors holding every parameter whole). Version 4 is either
// with "frozen_base": groups whose frozen parameters' compute copies the
// state files leave out (read from their safetensors files: a LoRA run's
// base), and "shards" present when several ranks saved it. Version 1 (no
// checksum on manifest.json and latest) is still read, with a warning;
// newer versions are refused.
inline constexpr int kCheckpointFormatVersion = 4;
// The version a save writes: 4 with a frozen base left out, else 3 with
// several ranks, else 2.
inline constexpr int kCheckpointFormatOneRank = 2;
inline constexpr int kCheckpointFormatRanks = 3;
// A version-3 manifest naming more ranks than this is refused as damaged.
inline constexpr std::int64_t kMaxCheckpointRanks = 1 << 16;
// manifest.json and latest files larger than this are refused before they are read whole.
inline constexpr std::uint64_t kMaxCheckpointManifestBytes = 64ull << 20;

// One parameter as the checkpoint records it.
struct CheckpointParam {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string group;  // fetch group
  bool trainable = true;
  std::int64_t optimizer_group = 0;
  // Applied steps that left it as it was (no gradient, strata.no_grad
  // "skip"): its own step count is `step` less these. "missed_steps",
  // absent when 0.
  std::int64_t missed_steps = 0;

  friend bool operator==(const CheckpointParam&, const CheckpointParam&) = default;
};

// The fp16 loss scaler's state (engine/loss_scaler.h: LossScaler::State).
struct CheckpointScaler {
  double scale = 1.0;
  std::int64_t iteration = 0;
  std::int64_t last_overflow_iteration = -1;
  std::int64_t hysteresis_left = 1;

  friend bool operator==(const CheckpointScaler&, const CheckpointScaler&) = default;
};

// Elements [lo, hi) of parameter `param` (an index into the manifest's
// params), as one state file holds them: its "<name>.compute" and optimizer
// tensors hold just those elements, flat.
struct CheckpointRange {
  std::int64_t param = 0;
  std::int64_t lo = 0, hi = 0;

  friend bool operator==(const CheckpointRange&, const CheckpointRange&) = default;
};

// One state file of a checkpoint and what it holds.
struct CheckpointStateFile {
  std::string file;  // in the step folder
  std::uint64_t crc64 = 0;
  // Version 3: the ranges it holds (none when the rank's shards are all
  // padding), each tensor flat.
  std::vector<CheckpointRange> ranges;
  // Version <= 2's state.safetensors: every parameter whole, each tensor
  // shaped as the parameter (`ranges` empty).
  bool whole = false;

  friend bool operator==(const CheckpointStateFile&, const CheckpointStateFile&) = default;
};

// "state-rank-<rank>-of-<ranks>.safetensors": rank `rank`'s state file in a
// checkpoint saved by `ranks` ranks.
std::string checkpoint_shard_file(int rank, int ranks);

// "framework-rank-<rank>-of-<ranks>.bin": rank `rank`'s (>= 1) framework blob
// in a checkpoint saved by `ranks` ranks (rank 0's is framework.bin).
std::string checkpoint_framework_file(int rank, int ranks);

// A fetch group whose frozen parameters' compute copies a checkpoint leaves
// out (strata.frozen_base "files": they are read from the safetensors files
// they were imported from, and never change): a load takes them from the
// same files, whose values in the compute dtype (the group's frozen range,
// Layout::frozen_home_range) have CRC64 `crc64`.
struct CheckpointFrozenBase {
  std::string group;
  std::uint64_t crc64 = 0;
  std::vector<std::string> files;  // the files the run read them from (absolute paths)

  friend bool operator==(const CheckpointFrozenBase&, const CheckpointFrozenBase&) = default;
};

// manifest.json's content.
struct CheckpointManifest {
  int version = kCheckpointFormatOneRank;  // of the file parsed (format_... writes 4 with frozen_base, else 3 with shards, else 2)
  std::int64_t step = 0;                   // applied optimizer steps
  std::int64_t skipped_steps = 0;
  double lr_override = -1.0;  // set_lr's rate; < 0: none
  CheckpointScaler loss_scaler;
  std::string compute_dtype;  // "F32", "BF16", "F16"
  std::vector<CheckpointParam> params;
  std::uint64_t state_crc64 = 0;      // CRC64 (nvme/crc64.h) of state.safetensors (one rank)
  // Version 3 (or 4 with "shards"): the ranks that saved it (>= 2) and their
  // state files, in rank order (rank r's is checkpoint_shard_file(r, ranks)),
  // whose ranges cover every element of every parameter exactly once (the
  // parser checks it), but for those compute_in_base names (no range); each
  // rank's trainable ranges are its shards, and a frozen parameter is whole
  // in one file. One rank: ranks 1, shards empty.
  int ranks = 1;
  std::vector<CheckpointStateFile> shards;
  std::uint64_t framework_crc64 = 0;  // of framework.bin
  // Version 3: each rank's framework blob's CRC64, in rank order (rank 0's is
  // framework_crc64, of framework.bin; rank r's file is
  // checkpoint_framework_file(r, ranks)). Empty in a checkpoint saved before
  // each rank's blob was kept: every rank then loads rank 0's.
  std::vector<std::uint64_t> rank_framework_crc64;
  // The resolved config (engine/config.h: to_json), compact JSON; "{}" when unknown.
  std::string config_json = "{}";
  // Version 4: the groups whose frozen parameters' compute copies no state
  // file holds (the shards' ranges leave those parameters out).
  std::vector<CheckpointFrozenBase> frozen_base;

  // True when parameter i's compute copies are left out: frozen, in a group
  // of frozen_base.
  bool compute_in_base(std::size_t i) const;

  friend bool operator==(const CheckpointManifest&, const CheckpointManifest&) = default;
};

// The state files of `m`: its shards, or one state.safetensors (one rank).
std::vector<CheckpointStateFile> checkpoint_state_files(const CheckpointManifest& m);
// The framework blobs of `m` (file, CRC64): framework.bin, then each other
// rank's when the ranks' blobs were kept.
std::vector<std::pair<std::string, std::uint64_t>> checkpoint_framework_files(const CheckpointManifest& m);
// The framework blob rank `rank` of `ranks` loads from `m` (file, CRC64): its
// own when `m` was saved by as many ranks and kept each rank's, else rank 0's
// (framework.bin; a checkpoint resharded to another rank count).
std::pair<std::string, std::uint64_t> checkpoint_framework_file_for(const CheckpointManifest& m, int rank, int ranks);

// manifest.json's bytes (version 4 when `m.frozen_base` is not empty, else 3
// when `m.shards` is not empty, else 2): indented JSON whose
// last member is "manifest_crc64": the CRC64 of every byte of the file before
// the comma that precedes it, as 16 lowercase hex digits. The file ends with
// exactly ",\n  \"manifest_crc64\": \"<16 hex>\"\n}\n". `m.config_json` must be
// a JSON object (else it is written as {}).
std::string format_checkpoint_manifest(const CheckpointManifest& m);

// Parses manifest.json's bytes; `path` names the file in messages. The
// checksum is checked on the exact bytes before anything is parsed, nesting is
// bounded (engine/config/json_bounds.h) and names in messages are cut to a
// preview. Errors, each naming `path`: kDataLoss for a checksum mismatch, a
// damaged or missing checksum line (in a version-2 file), invalid JSON, or
// content of the wrong shape, or a value no save writes (step or
// skipped_steps below 0, lr_override neither -1 nor finite and >= 0, a loss
// scale not finite and > 0, loss_scaler.iteration below 0, in version 3
// (or 4 with shards) ranks below 2 or shards that are not one file per rank
// with ranges covering every parameter's elements exactly once (but for
// those frozen_base leaves out, which no range may hold), in version 4 a
// frozen_base missing or empty, naming a group twice or a group without a
// frozen parameter,
// last_overflow_iteration outside [-1, iteration), hysteresis_left below 1,
// an optimizer_group below 0, a compute_dtype other than F32, BF16, F16: the
// message names the field and its value); kFailedPrecondition for a version newer than
// this build reads (both versions named). A version-1 manifest (no checksum)
// parses with version == 1. Pure; thread-safe; no input crashes, hangs or
// costs more than a small multiple of its size.
core::Result<CheckpointManifest> parse_checkpoint_manifest(std::span<const std::byte> bytes,
                                                           const std::string& path);

// <root>/latest's bytes: "step-<N> <16 hex>\n", the hex digits the CRC64 of "step-<N>".
std::string format_latest_pointer(std::string_view step_dir_name);

// What <root>/latest names.
struct LatestPointer {
  std::string step_dir_name;  // "step-<N>"
  bool checksummed = true;    // false: a version-1 pointer ("step-<N>\n")
};
// Parses <root>/latest's bytes (`path` names it in messages): exactly
// "step-<N> <16 hex>\n" with a matching CRC64, or a version-1 "step-<N>\n".
// Anything else is kDataLoss naming `path`. Pure; thread-safe.
core::Result<LatestPointer> parse_latest_pointer(std::span<const std::byte> bytes, const std::string& path);

// A checkpoint found on disk.
struct CheckpointLocation {
  std::string dir;          // the step folder
  std::string latest_path;  // "<root>/latest" when found through it, else ""
  CheckpointManifest manifest;
};
// `root_or_dir` is a checkpoint root (holding `latest`, which is followed) or
// a step folder (holding manifest.json). Reads and checks `latest` and the
// manifest; a version-1 checkpoint is logged at warn level (its manifest and
// pointer carry no checksum). A newer step-<N> folder beside the one `latest`
// names is not taken (latest is a save's commit point) but named at warn
// level. A root without `latest` (a save ended before writing it): its newest
// complete step-<N> folder (manifest parses, the CRC64s of state.safetensors
// and framework.bin, read whole, match), logged at warn level with the
// folders passed over and why; `latest_path` is then "". Errors: kNotFound
// when `root_or_dir` holds neither file and no complete step-<N> folder (the
// root named, and each folder's fault); kDataLoss naming `latest` when it is damaged, names
// a folder without a manifest, or is a version-1 pointer to a version-2
// checkpoint; the manifest's errors (parse_checkpoint_manifest); I/O errors
// naming the file.
core::Result<CheckpointLocation> locate_checkpoint(const std::string& root_or_dir, const IoConfig& io = IoConfig{});

// True when `name` is "step-<N>" with N a decimal int64 (stored in *step unless null).
bool parse_step_dir_name(std::string_view name, std::int64_t* step);

// "0123456789abcdef": a CRC64 as 16 lowercase hex digits.
std::string crc64_hex(std::uint64_t crc);

}  // namespace strata::engine
