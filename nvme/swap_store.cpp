// SwapStore: path checks and locks, preallocated swap files, extent
// allocation with striping, block I/O with CRC64 per extent, the index.
#include "nvme/swap_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>

#include "core/check.h"
#include "core/logging.h"
#include "core/str.h"
#include "nvme/crc64.h"
#include "nvme/internal/swap_index.h"

namespace strata::nvme {

using core::Result;
using core::Status;
using core::str_cat;

namespace {

constexpr std::uint64_t kAlign = core::kDirectIoAlignment;

std::string hex(std::uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string join_path(const std::string& dir, std::string_view name) {
  if (!dir.empty() && dir.back() == '/') return str_cat(dir, name);
  return str_cat(dir, "/", name);
}

Status read_whole_file(const std::string& path, std::string* out) {
  core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    return Status::from_errno(err, str_cat("open swap index '", path, "'"));
  }
  out->clear();
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      return Status::io_error(err, "read", path, out->size(), sizeof buf, -1);
    }
    if (n == 0) break;
    out->append(buf, static_cast<std::size_t>(n));
  }
  return Status();
}

Status write_all(int fd, const std::string& path, std::string_view bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR || err == EAGAIN) continue;
      return Status::io_error(err, "write", path, done, bytes.size() - done, -1);
    }
    done += static_cast<std::size_t>(n);
  }
  return Status();
}

}  // namespace

// --- SwapIo ---------------------------------------------------------------------

SwapIo::SwapIo(SwapIo&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      id_(std::move(other.id_)),
      op_(other.op_),
      data_(other.data_),
      batch_(std::move(other.batch_)),
      parts_(std::move(other.parts_)),
      bounce_(std::move(other.bounce_)),
      path_bytes_(std::move(other.path_bytes_)),
      pending_(std::exchange(other.pending_, false)) {}

SwapIo& SwapIo::operator=(SwapIo&& other) noexcept {
  if (this != &other) {
    if (pending_) wait().ignore_error();  // the replaced operation's result was not wanted
    store_ = std::exchange(other.store_, nullptr);
    id_ = std::move(other.id_);
    op_ = other.op_;
    data_ = other.data_;
    batch_ = std::move(other.batch_);
    parts_ = std::move(other.parts_);
    bounce_ = std::move(other.bounce_);
    path_bytes_ = std::move(other.path_bytes_);
    pending_ = std::exchange(other.pending_, false);
  }
  return *this;
}

SwapIo::~SwapIo() {
  if (pending_) wait().ignore_error();  // dropped without wait(): finish, nobody asked for the result
}

Status SwapIo::wait() {
  if (!pending_) return Status();
  pending_ = false;
  return store_->finish(*this);
}

// --- SwapStore: creation --------------------------------------------------------

SwapStore::SwapStore(const SwapStoreOptions& options) : options_(options) {}

SwapStore::~SwapStore() {
  Status s = close();
  if (!s.ok()) {
    STRATA_LOG(kError) << "nvme: closing the swap store: " << s;
  }
}

Result<std::unique_ptr<SwapStore>> SwapStore::create(const SwapStoreOptions& options) {
  return build(options, nullptr);
}

Result<std::unique_ptr<SwapStore>> SwapStore::open(const SwapStoreOptions& options, const std::string& index_path) {
  return build(options, &index_path);
}

Result<std::unique_ptr<SwapStore>> SwapStore::build(const SwapStoreOptions& options, const std::string* index_path) {
  auto store = std::unique_ptr<SwapStore>(new SwapStore(options));
  std::vector<std::uint64_t> sizes;
  if (index_path != nullptr) {
    STRATA_RETURN_IF_ERROR(store->load_index(*index_path, &sizes));
  } else {
    if (options.paths.empty()) return Status::invalid_argument("swap store: no swap path given (strata.io.paths)");
    if (options.capacity_bytes == 0) {
      return Status::invalid_argument("swap store: capacity_bytes must be > 0 (strata.budgets.disk_bytes)");
    }
    if (options.stripe_bytes == 0 || options.stripe_bytes % kAlign != 0) {
      return Status::invalid_argument(str_cat("swap store: stripe_bytes ", options.stripe_bytes,
                                              " is not a positive multiple of ", kAlign, " (strata.io.stripe_bytes)"));
    }
    store->paths_ = options.paths;
    store->stripe_bytes_ = options.stripe_bytes;
    const std::uint64_t share = core::align_up((options.capacity_bytes + options.paths.size() - 1) /
                                                   options.paths.size(), kAlign);
    sizes.assign(options.paths.size(), share);
  }
  if (options.request_bytes == 0 || options.request_bytes % kAlign != 0) {
    return Status::invalid_argument(str_cat("swap store: request_bytes ", options.request_bytes,
                                            " is not a positive multiple of ", kAlign, " (strata.io.block_bytes)"));
  }
  // Every path: exists, is a directory, is writable, is not a duplicate.
  std::set<std::pair<dev_t, ino_t>> seen;
  std::vector<dev_t> devices;
  for (const std::string& p : store->paths_) {
    struct stat st;
    if (::stat(p.c_str(), &st) != 0) {
      const int err = errno;
      if (err == ENOENT) return Status::not_found(str_cat("swap path '", p, "' does not exist"));
      return Status::from_errno(err, str_cat("swap path '", p, "'"));
    }
    if (!S_ISDIR(st.st_mode)) return Status::invalid_argument(str_cat("swap path '", p, "' is not a directory"));
    if (!seen.insert({st.st_dev, st.st_ino}).second) {
      return Status::invalid_argument(str_cat("swap path '", p, "' is given twice (strata.io.paths)"));
    }
    if (::access(p.c_str(), W_OK | X_OK) != 0) {
      const int err = errno;
      return Status::permission_denied(str_cat("swap path '", p, "' is not writable (",
                                               Status::from_errno(err, "access").message(), ")"));
    }
    devices.push_back(st.st_dev);
  }
  STRATA_RETURN_IF_ERROR(store->lock_paths());
  if (index_path == nullptr) {
    // Swap files left by an earlier store (its process killed, or kept with
    // keep_files): ours now that we hold the lock; open_files truncates them.
    for (const File& f : store->files_) {
      struct stat old;
      if (::stat(f.path.c_str(), &old) == 0 && S_ISREG(old.st_mode)) {
        STRATA_LOG(kInfo) << "nvme: reclaiming stale swap file '" << f.path << "' ("
                          << core::format_bytes(static_cast<std::uint64_t>(old.st_size))
                          << ") left by an earlier run (killed, or kept by strata.io.keep_files)";
      }
    }
    // Free space, once per file system: paths on the same one share it.
    std::vector<bool> counted(store->paths_.size(), false);
    for (std::size_t i = 0; i < store->paths_.size(); ++i) {
      if (counted[i]) continue;
      std::uint64_t need = 0;
      std::string names;
      for (std::size_t j = i; j < store->paths_.size(); ++j) {
        if (devices[j] != devices[i]) continue;
        counted[j] = true;
        need += sizes[j];
        // A stale swap file of ours is replaced: its space counts as free.
        struct stat old;
        if (::stat(join_path(store->paths_[j], kSwapFileName).c_str(), &old) == 0) {
          need -= std::min<std::uint64_t>(need, static_cast<std::uint64_t>(old.st_blocks) * 512);
        }
        names += str_cat(names.empty() ? "" : ", ", "'", store->paths_[j], "'");
      }
      struct statvfs vfs;
      if (::statvfs(store->paths_[i].c_str(), &vfs) != 0) {
        const int err = errno;
        return Status::from_errno(err, str_cat("statvfs '", store->paths_[i], "'"));
      }
      const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      if (avail < need) {
        return Status::resource_exhausted(str_cat(
            "swap path(s) ", names, " (one file system) need ", core::format_bytes(need), " for swap files but only ",
            core::format_bytes(avail), " is free (strata.budgets.disk_bytes)"));
      }
    }
  }
  STRATA_RETURN_IF_ERROR(store->open_files(index_path != nullptr, sizes));
  if (index_path != nullptr) STRATA_RETURN_IF_ERROR(store->reserve_indexed_extents(*index_path));
  auto backend = IoBackend::create(options.io);
  if (!backend.ok()) return std::move(backend).status().annotate("swap store");
  store->backend_ = std::move(backend).value();
  for (File& f : store->files_) {
    STRATA_ASSIGN_OR_RETURN(f.id, store->backend_->register_file(f.fd.get(), f.path));
    f.registered = true;
  }
  // A reopened store owns its files from here on (close removes them unless kept);
  // before, a failure leaves them as they were.
  for (File& f : store->files_) f.created = true;
  return store;
}

Status SwapStore::lock_paths() {
  files_.resize(paths_.size());
  for (std::size_t i = 0; i < paths_.size(); ++i) {
    const std::string lock_path = join_path(paths_[i], kLockFileName);
    STRATA_ASSIGN_OR_RETURN(files_[i].lock_fd, lock_path_file(paths_[i], lock_path));
    files_[i].lock_path = lock_path;
    files_[i].path = join_path(paths_[i], kSwapFileName);
  }
  return Status();
}

// The lock file is removed at close while its flock is held, so a locker that
// opened it before must check, once it holds the lock, that the path still
// names the file it locked; if not, it tries again with the new file.
Result<core::UniqueFd> SwapStore::lock_path_file(const std::string& dir, const std::string& lock_path) {
  for (int attempt = 0;; ++attempt) {
    core::UniqueFd fd(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!fd.valid()) {
      const int err = errno;
      if (err == EACCES || err == EPERM || err == EROFS) {
        return Status::permission_denied(str_cat("swap path '", dir, "' is not writable (cannot create '",
                                                 lock_path, "': ", Status::from_errno(err, "open").message(), ")"));
      }
      return Status::from_errno(err, str_cat("open lock file '", lock_path, "'"));
    }
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK) {
        char pid[32] = {0};
        const ssize_t n = ::pread(fd.get(), pid, sizeof pid - 1, 0);
        const std::string holder = n > 0 ? str_cat(" (held by pid ", std::string(pid, static_cast<std::size_t>(n)), ")") : "";
        return Status::already_exists(str_cat("swap path '", dir, "' is in use by another swap store: '",
                                              lock_path, "' is locked", holder));
      }
      return Status::from_errno(err, str_cat("flock '", lock_path, "'"));
    }
    struct stat locked {}, named {};
    if (::fstat(fd.get(), &locked) != 0) {
      const int err = errno;
      return Status::from_errno(err, str_cat("fstat '", lock_path, "'"));
    }
    if (::stat(lock_path.c_str(), &named) != 0 || named.st_ino != locked.st_ino || named.st_dev != locked.st_dev) {
      // Its holder removed it as we locked it (a clean close): lock the new one.
      if (attempt >= 100) {
        return Status::unavailable(str_cat("swap path '", dir, "': '", lock_path,
                                           "' was replaced 100 times while being locked"));
      }
      continue;
    }
    const std::string me = std::to_string(::getpid());
    if (::ftruncate(fd.get(), 0) == 0) {
      Status s = write_all(fd.get(), lock_path, me);
      s.ignore_error();  // the pid is a courtesy for the next process's message
    }
    return fd;
  }
}

Status SwapStore::open_files(bool reopen, const std::vector<std::uint64_t>& sizes) {
  bool use_direct = options_.direct_io != DirectIo::kOff;
  for (std::size_t i = 0; i < files_.size(); ++i) {
    File& f = files_[i];
    const int flags = O_RDWR | (reopen ? 0 : O_CREAT | O_TRUNC);
    // After one file fell back to the page cache (logged), the rest follow without trying.
    auto opened = open_file(f.path, flags, 0600, use_direct ? options_.direct_io : DirectIo::kOff, "swap file");
    if (!opened.ok()) {
      if (reopen && opened.status().code() == core::StatusCode::kNotFound) {
        return Status::data_loss(str_cat("swap file '", f.path, "' named by the index does not exist"));
      }
      return std::move(opened).status();
    }
    use_direct = use_direct && opened->direct;
    const int fd = opened->fd.get();
    f.fd = std::move(opened->fd);
    f.created = !reopen;
    if (reopen) {
      struct stat st;
      if (::fstat(fd, &st) != 0) {
        const int e = errno;
        return Status::from_errno(e, str_cat("fstat '", f.path, "'"));
      }
      if (static_cast<std::uint64_t>(st.st_size) != sizes[i]) {
        return Status::data_loss(str_cat("swap file '", f.path, "' is ", st.st_size, " bytes; the index says ",
                                          sizes[i]));
      }
    } else {
      const int rc = ::fallocate(fd, 0, 0, static_cast<off_t>(sizes[i]));
      if (rc != 0) {
        const int e = errno;
        if (e == EOPNOTSUPP) {
          STRATA_LOG(kWarn) << "nvme: the file system of '" << paths_[i]
                            << "' cannot preallocate; swap space there is not reserved";
          if (::ftruncate(fd, static_cast<off_t>(sizes[i])) != 0) {
            const int e2 = errno;
            return Status::from_errno(e2, str_cat("ftruncate '", f.path, "'"));
          }
        } else {
          return Status::from_errno(e, str_cat("fallocate ", core::format_bytes(sizes[i]), " for swap file '", f.path,
                                               "'"));
        }
      }
    }
    f.size_bytes = sizes[i];
    f.free.clear();
    if (sizes[i] > 0) f.free[0] = sizes[i];
  }
  // One mode for all files, so every request follows the same alignment rule.
  if (!use_direct && options_.direct_io != DirectIo::kOff) {
    for (File& f : files_) {
      const int flags = ::fcntl(f.fd.get(), F_GETFL);
      if (flags >= 0 && (flags & O_DIRECT) != 0) {
        if (::fcntl(f.fd.get(), F_SETFL, flags & ~O_DIRECT) != 0) {
          const int err = errno;
          return Status::from_errno(err, str_cat("fcntl '", f.path, "' (clear O_DIRECT)"));
        }
      }
    }
  }
  direct_ = use_direct;
  return Status();
}

Status SwapStore::load_index(const std::string& index_path, std::vector<std::uint64_t>* sizes) {
  std::string bytes;
  STRATA_RETURN_IF_ERROR(read_whole_file(index_path, &bytes));
  STRATA_ASSIGN_OR_RETURN(internal::SwapIndex index, internal::decode_index(bytes, index_path));
  if (!options_.paths.empty() && options_.paths != index.paths) {
    std::string given, saved;
    for (const auto& p : options_.paths) given += str_cat(given.empty() ? "" : ", ", p);
    for (const auto& p : index.paths) saved += str_cat(saved.empty() ? "" : ", ", p);
    return Status::invalid_argument(str_cat("swap index '", index_path, "' was saved for paths [", saved,
                                            "], but the options give [", given, "]"));
  }
  paths_ = index.paths;
  stripe_bytes_ = index.stripe_bytes;
  *sizes = index.file_bytes;
  core::MutexLock lock(mu_);
  for (auto& b : index.blocks) {
    Block blk;
    blk.size = b.size;
    blk.written = b.written;
    blk.crc_valid = b.crc_valid;
    for (const auto& e : b.extents) blk.extents.push_back({e.path, e.file_offset, e.length, e.crc});
    blocks_.emplace(b.id, std::move(blk));
  }
  return Status();
}

// --- SwapStore: space -------------------------------------------------------------

Status SwapStore::reserve_indexed_extents(const std::string& index_path) {
  core::MutexLock lock(mu_);
  for (const auto& [id, b] : blocks_) {
    for (const Extent& e : b.extents) {
      const std::uint64_t bytes = core::align_up(e.length, kAlign);
      auto& free = files_[e.path].free;
      // The free extent that contains [offset, offset + bytes), split around it.
      auto it = free.upper_bound(e.file_offset);
      if (it == free.begin() || std::prev(it)->first + std::prev(it)->second < e.file_offset + bytes) {
        return Status::data_loss(str_cat("swap index '", index_path, "': block '", id, "' extent ",
                                         describe_extent(e), " overlaps another block or lies past the file end"));
      }
      --it;
      const std::uint64_t start = it->first, len = it->second;
      free.erase(it);
      if (e.file_offset > start) free[start] = e.file_offset - start;
      const std::uint64_t end = e.file_offset + bytes;
      if (start + len > end) free[end] = start + len - end;
    }
  }
  return Status();
}

Result<std::uint64_t> SwapStore::take(std::uint32_t path, std::uint64_t bytes) {
  auto& free = files_[path].free;
  for (auto it = free.begin(); it != free.end(); ++it) {
    if (it->second < bytes) continue;
    const std::uint64_t offset = it->first;
    const std::uint64_t rest = it->second - bytes;
    free.erase(it);
    if (rest > 0) free[offset + bytes] = rest;
    return offset;
  }
  return Status::resource_exhausted("no free extent");
}

void SwapStore::give(std::uint32_t path, std::uint64_t offset, std::uint64_t bytes) {
  auto& free = files_[path].free;
  auto next = free.lower_bound(offset);
  if (next != free.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = free.erase(next);
  }
  if (next != free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  free[offset] = bytes;
}

Status SwapStore::allocate(std::string_view id, std::uint64_t size_bytes) {
  if (size_bytes == 0) return Status::invalid_argument(str_cat("swap block '", id, "': size must be > 0"));
  core::MutexLock lock(mu_);
  if (closed_) return Status::failed_precondition("swap store is closed");
  if (blocks_.count(std::string(id)) != 0) {
    return Status::already_exists(str_cat("swap block '", id, "' already exists"));
  }
  const auto paths = static_cast<std::uint32_t>(files_.size());
  const std::uint64_t units = (size_bytes + stripe_bytes_ - 1) / stripe_bytes_;
  const std::uint32_t first = next_path_;
  next_path_ = (next_path_ + 1) % paths;
  auto no_room = [&](std::uint32_t p, std::uint64_t bytes) {
    std::uint64_t free_total = 0;
    for (const File& f : files_) {
      for (const auto& [o, l] : f.free) free_total += l;
    }
    return Status::resource_exhausted(str_cat(
        "swap block '", id, "' (", core::format_bytes(size_bytes), "): no room in swap file '", files_[p].path,
        "' for ", core::format_bytes(bytes), " (", core::format_bytes(free_total), " free of ",
        core::format_bytes(capacity_bytes()), " over all paths; strata.budgets.disk_bytes)"));
  };
  Block blk;
  blk.size = size_bytes;
  if (units == 1) {
    // One unit: the first path, round robin, that has room.
    const std::uint64_t bytes = core::align_up(size_bytes, kAlign);
    for (std::uint32_t t = 0; t < paths; ++t) {
      const std::uint32_t p = (first + t) % paths;
      auto off = take(p, bytes);
      if (off.ok()) {
        blk.extents.push_back({p, *off, size_bytes, 0});
        break;
      }
    }
    if (blk.extents.empty()) return no_room(first, bytes);
  } else {
    // Unit k goes to path (first + k) % paths; each path gets one contiguous
    // region holding its units in order.
    std::vector<std::uint64_t> region_bytes(paths, 0);
    for (std::uint64_t k = 0; k < units; ++k) {
      const std::uint64_t len = std::min(stripe_bytes_, size_bytes - k * stripe_bytes_);
      region_bytes[(first + k) % paths] += core::align_up(len, kAlign);
    }
    std::vector<std::uint64_t> cursor(paths, 0);
    for (std::uint32_t p = 0; p < paths; ++p) {
      if (region_bytes[p] == 0) continue;
      auto off = take(p, region_bytes[p]);
      if (!off.ok()) {
        for (std::uint32_t u = 0; u < p; ++u) {
          if (region_bytes[u] != 0) give(u, cursor[u], region_bytes[u]);
        }
        return no_room(p, region_bytes[p]);
      }
      cursor[p] = *off;
    }
    for (std::uint64_t k = 0; k < units; ++k) {
      const std::uint64_t len = std::min(stripe_bytes_, size_bytes - k * stripe_bytes_);
      const std::uint32_t p = (first + k) % paths;
      const Extent e{p, cursor[p], len, 0};
      cursor[p] += core::align_up(len, kAlign);
      // With one path the units are contiguous: keep them as one extent.
      if (!blk.extents.empty()) {
        Extent& last = blk.extents.back();
        if (last.path == e.path && last.file_offset + last.length == e.file_offset && last.length % kAlign == 0) {
          last.length += e.length;
          continue;
        }
      }
      blk.extents.push_back(e);
    }
  }
  blocks_.emplace(std::string(id), std::move(blk));
  return Status();
}

Status SwapStore::remove(std::string_view id) {
  core::MutexLock lock(mu_);
  auto it = blocks_.find(std::string(id));
  if (it == blocks_.end()) return Status::not_found(str_cat("swap block '", id, "' does not exist"));
  if (it->second.busy) return Status::failed_precondition(str_cat("swap block '", id, "' has I/O in flight"));
  for (const Extent& e : it->second.extents) give(e.path, e.file_offset, core::align_up(e.length, kAlign));
  blocks_.erase(it);
  return Status();
}

bool SwapStore::contains(std::string_view id) const {
  core::MutexLock lock(mu_);
  return blocks_.count(std::string(id)) != 0;
}

Result<std::uint64_t> SwapStore::block_size(std::string_view id) const {
  core::MutexLock lock(mu_);
  auto it = blocks_.find(std::string(id));
  if (it == blocks_.end()) return Status::not_found(str_cat("swap block '", id, "' does not exist"));
  return it->second.size;
}

Result<std::vector<SwapExtent>> SwapStore::extents(std::string_view id) const {
  core::MutexLock lock(mu_);
  auto it = blocks_.find(std::string(id));
  if (it == blocks_.end()) return Status::not_found(str_cat("swap block '", id, "' does not exist"));
  std::vector<SwapExtent> out;
  for (const Extent& e : it->second.extents) out.push_back({files_[e.path].path, e.file_offset, e.length});
  return out;
}

Result<std::vector<std::uint64_t>> SwapStore::path_bytes(std::string_view id) const {
  core::MutexLock lock(mu_);
  auto it = blocks_.find(std::string(id));
  if (it == blocks_.end()) return Status::not_found(str_cat("swap block '", id, "' does not exist"));
  std::vector<std::uint64_t> out(paths_.size(), 0);
  for (const Extent& e : it->second.extents) out[e.path] += e.length;
  return out;
}

std::vector<FileTraffic> SwapStore::traffic() const {
  core::MutexLock lock(mu_);
  if (closed_) return closed_traffic_;
  // Open: the backend lives at least until close() has set closed_ (under mu_).
  std::vector<FileTraffic> out(files_.size());
  for (std::size_t i = 0; i < files_.size(); ++i) {
    if (files_[i].registered) out[i] = backend_->traffic(files_[i].id);
  }
  return out;
}

std::uint64_t SwapStore::capacity_bytes() const {
  std::uint64_t n = 0;
  for (const File& f : files_) n += f.size_bytes;
  return n;
}

std::uint64_t SwapStore::free_bytes() const {
  core::MutexLock lock(mu_);
  std::uint64_t n = 0;
  for (const File& f : files_) {
    for (const auto& [o, l] : f.free) n += l;
  }
  return n;
}

std::size_t SwapStore::block_count() const {
  core::MutexLock lock(mu_);
  return blocks_.size();
}

std::string SwapStore::describe_extent(const Extent& e) const {
  return str_cat("'", files_[e.path].path, "' at offset ", e.file_offset, " (", e.length, " bytes)");
}

// --- SwapStore: I/O ---------------------------------------------------------------

Result<SwapIo> SwapStore::start(IoOp op, std::string_view id, std::span<std::byte> data) {
  const char* what = op == IoOp::kRead ? "read" : "write";
  SwapIo io;
  io.store_ = this;
  io.id_ = std::string(id);
  io.op_ = op;
  io.data_ = data;
  io.batch_ = std::make_unique<IoBatch>();
  std::vector<Extent> extents;
  {
    core::MutexLock lock(mu_);
    if (closed_) return Status::failed_precondition("swap store is closed");
    auto it = blocks_.find(io.id_);
    if (it == blocks_.end()) return Status::not_found(str_cat("swap block '", id, "' does not exist"));
    Block& b = it->second;
    if (data.size() != b.size) {
      return Status::invalid_argument(str_cat(what, " swap block '", id, "': buffer is ", data.size(),
                                              " bytes, the block is ", b.size));
    }
    if (direct_ && !core::is_aligned(data.data(), kAlign)) {
      return Status::invalid_argument(str_cat(what, " swap block '", id, "': buffer address is not ", kAlign,
                                              "-byte aligned, as O_DIRECT needs (use an nvme::BufferPool buffer)"));
    }
    if (b.busy) return Status::failed_precondition(str_cat("swap block '", id, "' already has I/O in flight"));
    if (op == IoOp::kRead && !b.written) {
      return Status::failed_precondition(str_cat(
          "swap block '", id, "' holds no data: ",
          b.last_error.empty() ? std::string("it was never written") : str_cat("its last write failed (", b.last_error, ")")));
    }
    b.busy = true;
    ++busy_count_;
    if (op == IoOp::kWrite) {
      b.written = false;
      b.crc_valid = false;
      b.last_error.clear();
    }
    extents = b.extents;
  }
  io.path_bytes_.assign(paths_.size(), 0);
  for (const Extent& e : extents) io.path_bytes_[e.path] += e.length;
  std::uint64_t block_offset = 0;
  for (std::size_t x = 0; x < extents.size(); ++x) {
    const Extent& e = extents[x];
    const FileId file = files_[e.path].id;
    const std::uint64_t body = direct_ ? e.length & ~(kAlign - 1) : e.length;
    for (std::uint64_t off = 0; off < body; off += options_.request_bytes) {
      const std::uint64_t len = std::min(options_.request_bytes, body - off);
      io.batch_->add({op, file, e.file_offset + off, data.subspan(block_offset + off, len)});
      io.parts_.push_back({x, nullptr, 0});
    }
    if (body < e.length) {
      // O_DIRECT tail: a whole aligned sector through a bounce buffer.
      auto bounce = core::AlignedBuffer::allocate(kAlign, kAlign);
      if (!bounce.ok()) {
        core::MutexLock lock(mu_);
        blocks_[io.id_].busy = false;
        --busy_count_;
        return std::move(bounce).status();
      }
      io.bounce_ = std::move(bounce).value();
      const std::size_t tail = e.length - body;
      std::memset(io.bounce_.data(), 0, kAlign);
      if (op == IoOp::kWrite) std::memcpy(io.bounce_.data(), data.data() + block_offset + body, tail);
      io.batch_->add({op, file, e.file_offset + body, io.bounce_.bytes()});
      io.parts_.push_back({x, data.data() + block_offset + body, tail});
    }
    block_offset += e.length;
  }
  Status s = backend_->submit(*io.batch_);
  if (!s.ok()) {
    core::MutexLock lock(mu_);
    blocks_[io.id_].busy = false;
    --busy_count_;
    return std::move(s).annotate(str_cat(what, " swap block '", id, "'"));
  }
  io.pending_ = true;
  return io;
}

Status SwapStore::finish(SwapIo& io) {
  const bool check_crc = options_.crc;
  std::vector<Extent> extents;
  bool crc_valid = false;
  {
    core::MutexLock lock(mu_);
    const Block& b = blocks_.at(io.id_);
    extents = b.extents;
    crc_valid = b.crc_valid;
  }
  Status result;
  std::vector<std::uint64_t> crcs(extents.size(), 0);
  if (io.op_ == IoOp::kWrite) {
    // The CRC pass runs here while the requests are in flight.
    if (check_crc) {
      std::uint64_t off = 0;
      for (std::size_t x = 0; x < extents.size(); ++x) {
        crcs[x] = crc64(0, io.data_.subspan(off, extents[x].length));
        off += extents[x].length;
      }
    }
    result = io.batch_->wait();
  } else {
    // Check each request as it lands, in block order, overlapping the rest.
    for (std::size_t i = 0; i < io.parts_.size(); ++i) {
      Status s = io.batch_->wait_request(i);
      if (!s.ok()) {
        if (result.ok()) result = std::move(s);
        continue;
      }
      const SwapIo::Part& part = io.parts_[i];
      std::span<const std::byte> bytes = io.batch_->request(i).buffer;
      if (part.tail_dest != nullptr) {
        std::memcpy(part.tail_dest, io.bounce_.data(), part.tail_bytes);
        bytes = std::span<const std::byte>(part.tail_dest, part.tail_bytes);
      }
      if (check_crc && crc_valid) crcs[part.extent] = crc64(crcs[part.extent], bytes);
    }
    if (result.ok() && check_crc && crc_valid) {
      for (std::size_t x = 0; x < extents.size(); ++x) {
        if (crcs[x] != extents[x].crc) {
          result = Status::data_loss(str_cat("swap block '", io.id_, "': CRC64 mismatch in ",
                                             describe_extent(extents[x]), ": stored ", hex(extents[x].crc),
                                             ", read ", hex(crcs[x])));
          break;
        }
      }
    }
  }
  core::MutexLock lock(mu_);
  Block& b = blocks_.at(io.id_);
  b.busy = false;
  --busy_count_;
  if (io.op_ == IoOp::kWrite) {
    if (result.ok()) {
      b.written = true;
      b.crc_valid = check_crc;
      for (std::size_t x = 0; x < b.extents.size(); ++x) b.extents[x].crc = crcs[x];
    } else {
      b.last_error = std::string(result.message());
    }
  }
  if (!result.ok()) {
    return std::move(result).annotate(str_cat(io.op_ == IoOp::kRead ? "read" : "write", " swap block '", io.id_, "'"));
  }
  return Status();
}

Result<SwapIo> SwapStore::start_write(std::string_view id, std::span<const std::byte> data) {
  // Writes only read from the buffer; the request type is shared with reads.
  return start(IoOp::kWrite, id, std::span<std::byte>(const_cast<std::byte*>(data.data()), data.size()));
}

Result<SwapIo> SwapStore::start_read(std::string_view id, std::span<std::byte> out) {
  return start(IoOp::kRead, id, out);
}

Status SwapStore::write(std::string_view id, std::span<const std::byte> data) {
  STRATA_ASSIGN_OR_RETURN(SwapIo io, start_write(id, data));
  return io.wait();
}

Status SwapStore::read(std::string_view id, std::span<std::byte> out) {
  STRATA_ASSIGN_OR_RETURN(SwapIo io, start_read(id, out));
  return io.wait();
}

Status SwapStore::register_buffers(const BufferPool& pool) {
  const auto buffers = pool.buffers();
  return backend_->register_buffers(buffers);
}

// --- SwapStore: durability, index, close ------------------------------------------

Status SwapStore::sync() {
  for (const File& f : files_) {
    if (::fdatasync(f.fd.get()) != 0) {
      const int err = errno;
      return Status::from_errno(err, str_cat("fdatasync swap file '", f.path, "'"));
    }
  }
  return Status();
}

Status SwapStore::save_index(const std::string& path) {
  internal::SwapIndex index;
  {
    core::MutexLock lock(mu_);
    if (closed_) return Status::failed_precondition("swap store is closed");
    if (busy_count_ != 0) {
      return Status::failed_precondition(str_cat("save_index '", path, "': ", busy_count_,
                                                 " block(s) have I/O in flight"));
    }
    index.stripe_bytes = stripe_bytes_;
    index.paths = paths_;
    for (const File& f : files_) index.file_bytes.push_back(f.size_bytes);
    for (const auto& [id, b] : blocks_) {
      internal::IndexBlock ib{id, b.size, b.written, b.crc_valid, {}};
      for (const Extent& e : b.extents) ib.extents.push_back({e.path, e.file_offset, e.length, e.crc});
      index.blocks.push_back(std::move(ib));
    }
  }
  STRATA_RETURN_IF_ERROR(sync());
  const std::string bytes = internal::encode_index(index);
  const std::string tmp = str_cat(path, ".tmp");
  core::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) {
    const int err = errno;
    return Status::from_errno(err, str_cat("create swap index '", tmp, "'"));
  }
  STRATA_RETURN_IF_ERROR(write_all(fd.get(), tmp, bytes));
  if (::fsync(fd.get()) != 0) {
    const int err = errno;
    return Status::from_errno(err, str_cat("fsync swap index '", tmp, "'"));
  }
  STRATA_RETURN_IF_ERROR(fd.close(tmp));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    return Status::from_errno(err, str_cat("rename '", tmp, "' to '", path, "'"));
  }
  // Make the rename itself durable.
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  core::UniqueFd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.valid() && ::fsync(dfd.get()) != 0) {
    const int err = errno;
    return Status::from_errno(err, str_cat("fsync directory '", dir, "'"));
  }
  return Status();
}

Status SwapStore::close() {
  {
    core::MutexLock lock(mu_);
    if (closed_) return Status();
    if (busy_count_ != 0) {
      return Status::failed_precondition(str_cat("swap store close: ", busy_count_, " block(s) have I/O in flight"));
    }
    closed_traffic_.assign(files_.size(), FileTraffic{});
    for (std::size_t i = 0; i < files_.size(); ++i) {
      if (files_[i].registered && backend_) closed_traffic_[i] = backend_->traffic(files_[i].id);
    }
    closed_ = true;
  }
  Status first;
  auto keep_first = [&first](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  if (backend_) {
    for (File& f : files_) {
      if (f.registered) keep_first(backend_->unregister_file(f.id));
      f.registered = false;
    }
    backend_.reset();  // joins the I/O threads
  }
  for (File& f : files_) {
    if (f.fd.valid()) keep_first(f.fd.close(f.path));
    if (f.created && !options_.keep_files) {
      if (::unlink(f.path.c_str()) != 0) {
        const int err = errno;
        if (err != ENOENT) keep_first(Status::from_errno(err, str_cat("remove swap file '", f.path, "'")));
      }
    }
    // Removed while still locked (a locker that opened it meanwhile sees the
    // path gone once it holds the lock and tries again: lock_path_file), then
    // the flock goes with the descriptor.
    if (f.lock_fd.valid() && ::unlink(f.lock_path.c_str()) != 0) {
      const int err = errno;
      if (err != ENOENT) keep_first(Status::from_errno(err, str_cat("remove lock file '", f.lock_path, "'")));
    }
    f.lock_fd.reset();
  }
  return first;
}

}  // namespace strata::nvme
