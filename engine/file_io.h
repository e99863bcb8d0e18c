// Durable whole-file and positional I/O for the engine's own files
// (safetensors, checkpoint manifests and pointers): every transfer completes or
// returns an error naming the file and offset; EINTR is retried. Swap I/O has
// its own engine (nvme/).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"

namespace strata::engine {

// Reads / writes exactly n bytes at `offset` of `fd`; `path` names it in errors.
core::Status pread_all(int fd, void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path);
core::Status pwrite_all(int fd, const void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path);

// fsyncs a directory, or the directory that holds `path`.
core::Status fsync_dir(const std::string& dir);
core::Status fsync_dir_of(const std::string& path);

// Creates (or truncates) `path`, writes `data`, fsyncs and closes it.
core::Status write_file_synced(const std::string& path, std::span<const std::byte> data);
// Replaces `path` atomically: writes "<path>.tmp" synced, renames it over
// `path`, fsyncs the directory. On failure the temporary file is removed and
// `path` is as it was.
core::Status replace_file(const std::string& path, std::span<const std::byte> data);
// The whole file.
core::Result<std::vector<std::byte>> read_file(const std::string& path);

}  // namespace strata::engine
