// Probing the machine for the planner: CUDA device memory, MemTotal, and
// statvfs under each swap path.
#include "engine/plan/machine.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "core/str.h"
#include "gpu/device_query.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

// The path itself when it exists, else its nearest existing ancestor.
core::Result<fs::path> nearest_existing(const std::string& path, struct stat* st) {
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(path), ec);
  if (ec) {
    return core::Status::from_errno(ec.value(), core::str_cat("swap path ", path, ": absolute"));
  }
  p = p.lexically_normal();
  if (p.filename().empty() && p != p.root_path()) p = p.parent_path();  // "/a/b/" -> "/a/b"
  while (true) {
    if (::stat(p.c_str(), st) == 0) return p;
    const int err = errno;
    const bool missing = err == ENOENT || err == ENOTDIR;
    if (!missing || p == p.root_path() || !p.has_parent_path()) {
      return core::Status::from_errno(err,
                                      core::str_cat("swap path ", path, ": stat ", p.string()));
    }
    p = p.parent_path();
  }
}

}  // namespace

core::Result<std::uint64_t> parse_mem_total_bytes(std::string_view meminfo_text) {
  std::istringstream in{std::string(meminfo_text)};
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemTotal:", 0) != 0) continue;
    std::istringstream fields(line.substr(9));
    std::uint64_t value = 0;
    std::string unit;
    if (!(fields >> value) || !(fields >> unit) || unit != "kB") {
      return core::Status::invalid_argument(
          core::str_cat("malformed MemTotal line in meminfo: '", line, "'"));
    }
    return value * 1024;
  }
  return core::Status::invalid_argument("no MemTotal line in meminfo");
}

core::Result<std::uint64_t> read_mem_total_bytes(const std::string& meminfo_path) {
  std::ifstream in(meminfo_path);
  if (!in) {
    const int err = errno;
    return core::Status::from_errno(err != 0 ? err : ENOENT, core::str_cat("open ", meminfo_path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  core::Result<std::uint64_t> total = parse_mem_total_bytes(text.str());
  if (!total.ok()) return std::move(total).status().annotate(meminfo_path);
  return total;
}

core::Result<std::vector<DiskSpace>> probe_disk_space(const std::vector<std::string>& paths) {
  std::vector<DiskSpace> disks;
  for (const std::string& path : paths) {
    struct stat st {};
    STRATA_ASSIGN_OR_RETURN(fs::path at, nearest_existing(path, &st));
    struct statvfs vfs {};
    if (::statvfs(at.c_str(), &vfs) != 0) {
      const int err = errno;
      return core::Status::from_errno(err,
                                      core::str_cat("swap path ", path, ": statvfs ", at.string()));
    }
    DiskSpace disk;
    disk.path = path;
    disk.measured_at = at.string();
    disk.free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    disk.device_id = static_cast<std::uint64_t>(st.st_dev);
    for (const DiskSpace& earlier : disks) {
      if (earlier.counted && earlier.device_id == disk.device_id) disk.counted = false;
    }
    disks.push_back(std::move(disk));
  }
  return disks;
}

std::uint64_t counted_free_bytes(const std::vector<DiskSpace>& disks) {
  std::uint64_t total = 0;
  for (const DiskSpace& d : disks) {
    if (d.counted) total += d.free_bytes;
  }
  return total;
}

core::Result<MachineSpec> probe_machine(const std::vector<std::string>& swap_paths,
                                        const MachineOverrides& overrides) {
  MachineSpec machine;

  std::optional<std::uint64_t> gpu_probed;
  core::Result<std::vector<gpu::GpuInfo>> gpus = gpu::query_cuda_devices();
  if (gpus.ok() && !gpus->empty()) {
    const gpu::GpuInfo& g = gpus->front();
    gpu_probed = g.total_bytes;
    machine.gpu_probe = core::str_cat(g.name, ", device 0 of ", gpus->size(), ", ",
                                      core::format_bytes(g.total_bytes), ", ",
                                      core::format_bytes(g.free_bytes), " free");
  } else if (gpus.ok()) {
    machine.gpu_probe = "no GPU: no CUDA device is visible";
  } else {
    machine.gpu_probe = core::str_cat("no GPU: ", gpus.status().message());
  }
  if (overrides.gpu_bytes) {
    machine.gpu_bytes = overrides.gpu_bytes;
    machine.gpu_source = "given (--gpu-memory)";
  } else {
    machine.gpu_bytes = gpu_probed;
    machine.gpu_source = gpu_probed ? "probed (CUDA device 0)" : "unknown";
  }

  if (overrides.ram_bytes) {
    machine.ram_bytes = *overrides.ram_bytes;
    machine.ram_source = "given (--ram)";
  } else {
    core::Result<std::uint64_t> ram = read_mem_total_bytes();
    if (!ram.ok()) {
      return std::move(ram).status().annotate("cannot probe CPU RAM (give it with --ram SIZE)");
    }
    machine.ram_bytes = *ram;
    machine.ram_source = "probed (MemTotal in /proc/meminfo)";
  }

  if (overrides.disk_bytes) {
    machine.disk_bytes = *overrides.disk_bytes;
    machine.disk_source = "given (--disk)";
  } else {
    core::Result<std::vector<DiskSpace>> disks = probe_disk_space(swap_paths);
    if (!disks.ok()) {
      return std::move(disks).status().annotate(
          "cannot probe free disk space (give it with --disk SIZE)");
    }
    machine.disks = std::move(disks).value();
    machine.disk_bytes = counted_free_bytes(machine.disks);
    machine.disk_source = "probed (free space under the swap paths, each file system once)";
  }
  return machine;
}

}  // namespace strata::engine
