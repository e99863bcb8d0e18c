// Durable whole-file and positional I/O for the engine's own files
// (safetensors, checkpoint manifests and pointers): every transfer goes
// through an nvme backend (its psync driver), so the nvme engine's one set of
// rules holds here too (short transfers, EINTR and EAGAIN retried; EIO, ENOSPC
// and an early end of file returned naming the file and offset) and a test's
// fault injector (IoConfig::fault_injector) reaches these files as it reaches
// swap I/O.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "engine/config.h"

namespace strata::engine {

// Reads / writes exactly n bytes at `offset` of `fd`; `path` names it in
// errors. `io`: only its fault_injector is used (default none). Errors:
// kIoError (EIO and the rest), kResourceExhausted (ENOSPC), kDataLoss (the
// file ends before n bytes were read).
core::Status pread_all(int fd, void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path,
                       const IoConfig& io = IoConfig{});
core::Status pwrite_all(int fd, const void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path,
                        const IoConfig& io = IoConfig{});

// fsyncs a directory, or the directory that holds `path`.
core::Status fsync_dir(const std::string& dir);
core::Status fsync_dir_of(const std::string& path);

// Creates (or truncates) `path`, writes `data`, fsyncs and closes it.
core::Status write_file_synced(const std::string& path, std::span<const std::byte> data,
                               const IoConfig& io = IoConfig{});
// Replaces `path` atomically: writes "<path>.tmp" synced, renames it over
// `path`, fsyncs the directory. On failure the temporary file is removed and
// `path` is as it was.
core::Status replace_file(const std::string& path, std::span<const std::byte> data, const IoConfig& io = IoConfig{});
// The whole file.
core::Result<std::vector<std::byte>> read_file(const std::string& path, const IoConfig& io = IoConfig{});

}  // namespace strata::engine
