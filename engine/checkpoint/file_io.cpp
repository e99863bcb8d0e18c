#include "engine/checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <memory>

#include "core/str.h"
#include "core/unique_fd.h"
#include "nvme/io_backend.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

namespace {

// One transfer through a backend of its own (psync, one thread): the nvme
// engine retries, judges and reports it; a test's injector sees it.
Status transfer(nvme::IoOp op, int fd, std::byte* data, std::uint64_t n, std::uint64_t offset,
                const std::string& path, const IoConfig& io) {
  if (n == 0) return Status();
  nvme::IoBackendOptions o;
  o.kind = nvme::BackendKind::kPsync;
  o.queue_depth = 1;
  o.rings = 1;
  o.fault_injector = io.fault_injector;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoBackend> backend, nvme::IoBackend::create(o));
  STRATA_ASSIGN_OR_RETURN(const nvme::FileId file, backend->register_file(fd, path));
  Status s;
  {
    nvme::IoBatch batch({nvme::IoRequest{op, file, offset, std::span<std::byte>(data, n)}});
    s = backend->execute(batch);
  }
  Status u = backend->unregister_file(file);
  if (s.ok()) s = std::move(u);
  return s;
}

}  // namespace

Status pread_all(int fd, void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path,
                 const IoConfig& io) {
  return transfer(nvme::IoOp::kRead, fd, static_cast<std::byte*>(buf), n, offset, path, io);
}

Status pwrite_all(int fd, const void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path,
                  const IoConfig& io) {
  // The backend only reads a write's buffer (an injected bit flip goes into a copy).
  return transfer(nvme::IoOp::kWrite, fd, const_cast<std::byte*>(static_cast<const std::byte*>(buf)), n, offset,
                  path, io);
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

Status write_file_synced(const std::string& path, std::span<const std::byte> data, const IoConfig& io) {
  core::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return Status::from_errno(errno, str_cat("create ", path));
  STRATA_RETURN_IF_ERROR(pwrite_all(fd.get(), data.data(), data.size(), 0, path, io));
  if (::fsync(fd.get()) != 0) return Status::from_errno(errno, str_cat("fsync ", path));
  return fd.close(path);
}

Status replace_file(const std::string& path, std::span<const std::byte> data, const IoConfig& io) {
  const std::string tmp = path + ".tmp";
  Status s = write_file_synced(tmp, data, io);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = Status::from_errno(errno, str_cat("rename ", tmp, " to ", path));
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return fsync_dir_of(path);
}

core::Result<std::vector<std::byte>> read_file(const std::string& path, const IoConfig& io) {
  core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Status::from_errno(errno, str_cat("open ", path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::from_errno(errno, str_cat("stat ", path));
  std::vector<std::byte> out(static_cast<std::size_t>(st.st_size));
  STRATA_RETURN_IF_ERROR(pread_all(fd.get(), out.data(), out.size(), 0, path, io));
  return out;
}

}  // namespace strata::engine
