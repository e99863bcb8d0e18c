// What the planner knows about the machine: GPU memory, CPU RAM and free disk
// space under the swap paths, each probed or given by the user.
// Free functions; thread-safe (they only read the system).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace strata::engine {

// Free space under one swap path.
struct DiskSpace {
  std::string path;              // as configured (may not exist yet)
  std::string measured_at;       // the nearest existing ancestor, absolute
  std::uint64_t free_bytes = 0;  // available to an unprivileged user (statvfs f_bavail)
  std::uint64_t device_id = 0;   // st_dev of measured_at
  // False when an earlier path lies on the same file system (same st_dev):
  // its space is counted once, under that earlier path.
  bool counted = true;
};

// The machine as the planner sees it. Each *_source says where the number
// came from: "given (--ram)" or "probed (...)".
struct MachineSpec {
  std::optional<std::uint64_t> gpu_bytes;  // device memory; nullopt: unknown (no GPU, none given)
  std::string gpu_source;
  // What the GPU query found, given or not: "NVIDIA H100 80GB HBM3, device 0
  // of 1, ..." or "no GPU: <why>". Empty when not queried.
  std::string gpu_probe;
  std::uint64_t ram_bytes = 0;  // CPU RAM (MemTotal)
  std::string ram_source;
  std::uint64_t disk_bytes = 0;  // free swap space, each file system once
  std::string disk_source;
  std::vector<DiskSpace> disks;  // empty when disk_bytes was given
};

// Values given by the user (strata plan --gpu-memory, --ram, --disk); each
// one replaces the probe of its tier.
struct MachineOverrides {
  std::optional<std::uint64_t> gpu_bytes;
  std::optional<std::uint64_t> ram_bytes;
  std::optional<std::uint64_t> disk_bytes;
};

// MemTotal of a /proc/meminfo text, in bytes. kInvalidArgument when the line
// is missing or malformed.
core::Result<std::uint64_t> parse_mem_total_bytes(std::string_view meminfo_text);

// MemTotal read from `meminfo_path`. kNotFound/kIoError name the file.
core::Result<std::uint64_t> read_mem_total_bytes(const std::string& meminfo_path = "/proc/meminfo");

// Free space under each path. A path that does not exist yet is measured at
// its nearest existing ancestor (a relative path is taken from the current
// directory). Paths on one file system are counted once: the first keeps
// counted = true, the others get false. Errors (stat/statvfs refused) name
// the path.
core::Result<std::vector<DiskSpace>> probe_disk_space(const std::vector<std::string>& paths);

// Sum of free_bytes over the counted entries.
std::uint64_t counted_free_bytes(const std::vector<DiskSpace>& disks);

// Probes what `overrides` does not give: GPU memory of CUDA device 0 (through
// gpu::query_cuda_devices; the GPU is queried even when given, so gpu_probe
// can say "no GPU: ..."), RAM from /proc/meminfo, and free space under
// `swap_paths`. An unknown GPU is not an error here (a budget may supply
// it; make_plan says what to set). A failed RAM or disk probe is an error
// that names the flag that would replace it.
core::Result<MachineSpec> probe_machine(const std::vector<std::string>& swap_paths,
                                        const MachineOverrides& overrides);

}  // namespace strata::engine
