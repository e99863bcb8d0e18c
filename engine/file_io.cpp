#include "engine/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "core/str.h"
#include "core/unique_fd.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

Status pread_all(int fd, void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path) {
  auto* p = static_cast<std::byte*>(buf);
  std::uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return Status::io_error(r < 0 ? errno : 0, "pread", path, offset + done, n - done, r);
    done += static_cast<std::uint64_t>(r);
  }
  return Status();
}

Status pwrite_all(int fd, const void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path) {
  const auto* p = static_cast<const std::byte*>(buf);
  std::uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pwrite(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return Status::io_error(r < 0 ? errno : 0, "pwrite", path, offset + done, n - done, r);
    done += static_cast<std::uint64_t>(r);
  }
  return Status();
}

Status fsync_dir(const std::string& dir) {
  core::UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!d.valid()) return Status::from_errno(errno, str_cat("open directory ", dir));
  if (::fsync(d.get()) != 0) return Status::from_errno(errno, str_cat("fsync directory ", dir));
  return Status();
}

Status fsync_dir_of(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return fsync_dir(slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash)));
}

Status write_file_synced(const std::string& path, std::span<const std::byte> data) {
  core::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return Status::from_errno(errno, str_cat("create ", path));
  STRATA_RETURN_IF_ERROR(pwrite_all(fd.get(), data.data(), data.size(), 0, path));
  if (::fsync(fd.get()) != 0) return Status::from_errno(errno, str_cat("fsync ", path));
  return fd.close(path);
}

Status replace_file(const std::string& path, std::span<const std::byte> data) {
  const std::string tmp = path + ".tmp";
  Status s = write_file_synced(tmp, data);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = Status::from_errno(errno, str_cat("rename ", tmp, " to ", path));
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return fsync_dir_of(path);
}

core::Result<std::vector<std::byte>> read_file(const std::string& path) {
  core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Status::from_errno(errno, str_cat("open ", path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::from_errno(errno, str_cat("stat ", path));
  std::vector<std::byte> out(static_cast<std::size_t>(st.st_size));
  STRATA_RETURN_IF_ERROR(pread_all(fd.get(), out.data(), out.size(), 0, path));
  return out;
}

}  // namespace strata::engine
