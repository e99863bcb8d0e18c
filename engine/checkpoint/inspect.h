// What a checkpoint holds, read without an engine (`strata inspect`): the
// counters, the placement and config it was saved under, its tensors, and,
// on request, a full CRC64 verification of every file.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/result.h"
#include "engine/checkpoint/manifest.h"

namespace strata::engine {

// One tensor of a state file.
struct InspectedTensor {
  std::string file;   // "state.safetensors", or with several ranks "state-rank-<r>-of-<N>.safetensors"
  std::string name;   // "<param>.compute", "<param>.master", ".exp_avg", ".exp_avg_sq"
  std::string dtype;  // "F32", "BF16", "F16"
  std::vector<std::int64_t> shape;
  std::uint64_t bytes = 0;
};

// One file of the step folder.
struct InspectedFile {
  std::string name;         // "manifest.json", the state files, "framework.bin"
  std::uint64_t bytes = 0;  // its size on disk
  std::uint64_t crc64 = 0;  // the CRC64 the manifest records (manifest.json: its own)
};

struct CheckpointInspection {
  std::string dir;          // the step folder
  std::string latest_path;  // "<root>/latest" when found through it, else ""
  CheckpointManifest manifest;
  // The placement keys of the saved config, as "key.path" and the value's JSON:
  // zero_optimization.stage, offload_optimizer.device, offload_param.device,
  // strata.optimizer_cpu_fraction (when written), strata.device, strata.overlap.
  std::vector<std::pair<std::string, std::string>> placement;
  std::vector<InspectedTensor> tensors;  // state file by state file, each in file order
  std::vector<InspectedFile> files;      // manifest.json, the state files (one per rank), the ranks' blobs
  bool verified = false;                 // every file's CRC64 was computed and matched
};

// Reads the checkpoint at `dir` (a root holding `latest`, which is followed,
// or a step folder). Always checks `latest` and the manifest (their own
// CRC64s) and the state files' headers; with `verify`, also reads
// the state files and framework.bin whole (a few MiB of memory at a time)
// and checks their CRC64s against the manifest. Errors: those of
// locate_checkpoint (kNotFound, kDataLoss naming latest or manifest.json);
// kDataLoss naming the file whose CRC64 or header does not match; I/O errors
// naming the file. Thread-safe (reads only).
core::Result<CheckpointInspection> inspect_checkpoint(const std::string& dir, bool verify);

// The inspection as JSON (`strata inspect --json`): {"dir", "latest" (or
// null), "format_version", "step", "skipped_steps", "lr_override" (null when
// none), "loss_scaler": {...}, "compute_dtype", "placement": {key: value},
// "ranks", "params": [...], "frozen_base": [{"group", "crc64" (hex), "files"}] (empty
// unless the frozen base was read from its files), "files": [{"name", "bytes", "crc64" (hex; absent for
// manifest.json)}], "tensors": [{"file", "name", "dtype", "shape", "bytes"}],
// "verified", "config": {...}}, indented, with a final newline.
std::string format_inspection_json(const CheckpointInspection& inspection);

// CRC64 (nvme/crc64.h) of a whole file, read in pieces of a few MiB; also
// returns its size. Errors name the file.
core::Result<std::pair<std::uint64_t, std::uint64_t>> file_crc64(const std::string& path);

}  // namespace strata::engine
