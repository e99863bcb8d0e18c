// SwapStore: named blocks of bytes kept in preallocated swap files under one
// or more directories. Blocks larger than a stripe are striped over the
// directories so several drives add up; every extent carries a CRC64 computed
// on write and checked on read; each directory is locked while a store uses it;
// the files go away at close unless kept; the index can be saved and reopened.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/mutex.h"
#include "core/result.h"
#include "core/unique_fd.h"
#include "nvme/buffer_pool.h"
#include "nvme/direct_io.h"
#include "nvme/io_backend.h"

namespace strata::nvme {

class SwapStore;

// Each field maps to a config key (engine/config.h); the engine copies them.
struct SwapStoreOptions {
  // Swap directories (strata.io.paths): at least one, distinct, existing and writable.
  std::vector<std::string> paths;
  // Swap bytes over all paths (strata.budgets.disk_bytes), split evenly; > 0.
  // Checked against free space up front, per file system (paths on one file
  // system count against its free space once, together).
  std::uint64_t capacity_bytes = 0;
  // Blocks larger than this are striped over the paths in units of this size
  // (strata.io.stripe_bytes); a multiple of 4096; default 8 MiB.
  std::uint64_t stripe_bytes = 8ull << 20;
  // Largest single request (strata.io.block_bytes); a multiple of 4096; default 1 MiB.
  std::uint64_t request_bytes = 1ull << 20;
  // CRC64 per extent, on write and on read (strata.crc); default true.
  bool crc = true;
  // Keep the swap files after close (strata.io.keep_files); default false.
  bool keep_files = false;
  DirectIo direct_io = DirectIo::kAuto;  // O_DIRECT on the swap files (nvme/direct_io.h); default auto
  // The I/O backend (strata.io.backend, queue_depth, rings, sqpoll).
  IoBackendOptions io;
};

// Where a block's bytes live: `length` bytes at `file_offset` of `file`.
struct SwapExtent {
  std::string file;
  std::uint64_t file_offset = 0;
  std::uint64_t length = 0;
};

// One block read or write in flight (from SwapStore::start_read/start_write).
// Move-only, owner-thread-only. wait() finishes it; the destructor waits too
// (ignoring the result). Must not outlive its store.
class SwapIo {
 public:
  SwapIo() = default;
  SwapIo(SwapIo&&) noexcept;
  SwapIo& operator=(SwapIo&&) noexcept;
  SwapIo(const SwapIo&) = delete;
  SwapIo& operator=(const SwapIo&) = delete;
  ~SwapIo();

  // Blocks until the I/O is done; for reads, checks every extent's CRC as its
  // requests complete (overlapping the rest of the I/O); for writes, computes
  // the CRCs while the I/O runs. Returns the block's status (see SwapStore);
  // a second call returns OK.
  core::Status wait();
  // True when every request has completed, so wait() will not block on I/O
  // (it still checks the CRCs). False when nothing is pending.
  bool ready() const { return pending_ && batch_->done(); }
  // How the block's bytes split over the store's paths (SwapStore::path_bytes),
  // for the caller's accounting. Empty for a default-constructed SwapIo.
  const std::vector<std::uint64_t>& path_bytes() const { return path_bytes_; }

 private:
  friend class SwapStore;
  struct Part {
    std::size_t extent = 0;        // index into the block's extents
    std::byte* tail_dest = nullptr;  // O_DIRECT tail: copy this many bytes out of the bounce
    std::size_t tail_bytes = 0;
  };
  SwapStore* store_ = nullptr;
  std::string id_;
  IoOp op_ = IoOp::kRead;
  std::span<std::byte> data_;
  std::unique_ptr<IoBatch> batch_;
  std::vector<Part> parts_;  // one per request of batch_
  core::AlignedBuffer bounce_;
  std::vector<std::uint64_t> path_bytes_;
  bool pending_ = false;
};

// Thread-safe: any thread may allocate, read, write and remove blocks; two
// operations on the same block at once are refused (kFailedPrecondition).
class SwapStore {
 public:
  // Creates the swap files. Checks up front, with a clear error naming the
  // path: a missing path (kNotFound), a non-directory or duplicate
  // (kInvalidArgument), an unwritable one (kPermissionDenied), one locked by
  // another store or process (kAlreadyExists), too little free space
  // (kResourceExhausted, with bytes needed and free). Then preallocates
  // (fallocate) capacity_bytes / paths.size() per path. A swap file left in a
  // path by a store that never closed (its process was killed) or kept
  // (keep_files) is reclaimed: its space counts as free, and an info line
  // names it and its size.
  static core::Result<std::unique_ptr<SwapStore>> create(const SwapStoreOptions& options);

  // Reopens swap files kept by an earlier store from its saved index
  // (save_index). The paths come from the index (options.paths must be empty
  // or the same list); stripe and capacity too. Errors: as create, plus
  // kDataLoss for a corrupt index or a swap file of the wrong size, and
  // kFailedPrecondition for an index version this build cannot read.
  static core::Result<std::unique_ptr<SwapStore>> open(const SwapStoreOptions& options,
                                                       const std::string& index_path);

  // Closes if still open (logging a close error).
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Reserves space for block `id` of `size_bytes` (> 0). Errors:
  // kAlreadyExists, kInvalidArgument, kResourceExhausted when no path has room.
  core::Status allocate(std::string_view id, std::uint64_t size_bytes) STRATA_EXCLUDES(mu_);
  // Frees the block's space. kNotFound; kFailedPrecondition while it has I/O in flight.
  core::Status remove(std::string_view id) STRATA_EXCLUDES(mu_);
  bool contains(std::string_view id) const STRATA_EXCLUDES(mu_);
  // The block's size, or kNotFound.
  core::Result<std::uint64_t> block_size(std::string_view id) const STRATA_EXCLUDES(mu_);
  // Where the block lives, in block order.
  core::Result<std::vector<SwapExtent>> extents(std::string_view id) const STRATA_EXCLUDES(mu_);
  // How the block's bytes split over the paths: element i is the length of its
  // extents under paths()[i]; the elements add up to the block's size. Fixed
  // from allocate to remove. kNotFound.
  core::Result<std::vector<std::uint64_t>> path_bytes(std::string_view id) const STRATA_EXCLUDES(mu_);

  // Starts writing `data` (exactly the block's size) to block `id`. `data` is
  // borrowed until wait() and must not change meanwhile. With O_DIRECT its
  // address must be 4096-aligned (BufferPool buffers are); any size works.
  // Until the write completes the block holds no valid data.
  core::Result<SwapIo> start_write(std::string_view id, std::span<const std::byte> data) STRATA_EXCLUDES(mu_);
  // Starts reading block `id` into `out` (exactly the block's size, same
  // alignment rule). wait() then returns kDataLoss naming the file and offset of
  // an extent whose CRC does not match, kFailedPrecondition when the block was
  // never written (or its last write failed), or the I/O error (path, offset,
  // length) of a failed request.
  core::Result<SwapIo> start_read(std::string_view id, std::span<std::byte> out) STRATA_EXCLUDES(mu_);
  // start + wait.
  core::Status write(std::string_view id, std::span<const std::byte> data) STRATA_EXCLUDES(mu_);
  core::Status read(std::string_view id, std::span<std::byte> out) STRATA_EXCLUDES(mu_);

  // Registers the pool's buffers with the backend (io_uring fixed buffers).
  // Call with no I/O in flight; the pool must outlive the store or the next call.
  core::Status register_buffers(const BufferPool& pool);

  // fdatasync on every swap file.
  core::Status sync();
  // Syncs the swap files, then writes the index to `path` atomically (write
  // aside, fsync, rename). Fails with kFailedPrecondition while I/O is in flight.
  core::Status save_index(const std::string& path) STRATA_EXCLUDES(mu_);

  // Waits for nothing: fails with kFailedPrecondition while I/O is in flight.
  // Stops the backend, closes the files (reporting close errors), removes them
  // unless keep_files, and removes the lock files (also with keep_files),
  // releasing the path locks. Idempotent.
  core::Status close() STRATA_EXCLUDES(mu_);

  const std::vector<std::string>& paths() const { return paths_; }
  // The swap file under paths()[i].
  const std::string& file_path(std::size_t i) const { return files_[i].path; }
  // Bytes moved to and from each path's swap file since this store opened it
  // (element i: paths()[i]), as the I/O backend counted its completions
  // (IoBackend::traffic: with O_DIRECT a block's last partial sector moves
  // whole). A snapshot, exact once no I/O is in flight; after close, the
  // totals at close.
  std::vector<FileTraffic> traffic() const STRATA_EXCLUDES(mu_);
  std::uint64_t capacity_bytes() const;
  std::uint64_t free_bytes() const STRATA_EXCLUDES(mu_);
  std::size_t block_count() const STRATA_EXCLUDES(mu_);
  bool direct_io() const { return direct_; }
  IoBackend& backend() { return *backend_; }
  const SwapStoreOptions& options() const { return options_; }

  static constexpr std::string_view kLockFileName = "strata-swap.lock";
  static constexpr std::string_view kSwapFileName = "strata-swap.dat";

 private:
  friend class SwapIo;
  struct Extent {
    std::uint32_t path = 0;
    std::uint64_t file_offset = 0;
    std::uint64_t length = 0;  // data bytes; the space taken is align_up(length, 4096)
    std::uint64_t crc = 0;
  };
  struct Block {
    std::uint64_t size = 0;
    std::vector<Extent> extents;
    bool written = false;   // holds data from a completed write
    bool crc_valid = false; // extents' crc fields are set
    bool busy = false;      // an I/O is in flight
    std::string last_error; // why the last write failed
  };
  struct File {
    std::string path;         // the swap file
    core::UniqueFd fd;
    core::UniqueFd lock_fd;   // holds the flock on the directory's lock file
    std::string lock_path;    // that file (removed at close)
    FileId id;
    bool registered = false;
    bool created = false;     // we made this file (remove it on failure/close)
    std::uint64_t size_bytes = 0;
    std::map<std::uint64_t, std::uint64_t> free;  // offset -> length, coalesced
  };

  explicit SwapStore(const SwapStoreOptions& options);
  static core::Result<std::unique_ptr<SwapStore>> build(const SwapStoreOptions& options,
                                                        const std::string* index_path);
  core::Status lock_paths();
  static core::Result<core::UniqueFd> lock_path_file(const std::string& dir, const std::string& lock_path);
  core::Status open_files(bool reopen, const std::vector<std::uint64_t>& sizes);
  core::Status load_index(const std::string& index_path, std::vector<std::uint64_t>* sizes) STRATA_EXCLUDES(mu_);
  core::Status reserve_indexed_extents(const std::string& index_path) STRATA_EXCLUDES(mu_);
  core::Result<std::uint64_t> take(std::uint32_t path, std::uint64_t bytes) STRATA_REQUIRES(mu_);
  void give(std::uint32_t path, std::uint64_t offset, std::uint64_t bytes) STRATA_REQUIRES(mu_);
  core::Result<SwapIo> start(IoOp op, std::string_view id, std::span<std::byte> data) STRATA_EXCLUDES(mu_);
  core::Status finish(SwapIo& io) STRATA_EXCLUDES(mu_);
  std::string describe_extent(const Extent& e) const;

  SwapStoreOptions options_;
  std::vector<std::string> paths_;
  std::uint64_t stripe_bytes_ = 0;
  bool direct_ = false;
  bool closed_ = false;
  // Destruction order: backend_ (drains I/O, joins its threads) before files_
  // (closes the descriptors the rings reference). close() does it explicitly.
  std::vector<File> files_;
  std::unique_ptr<IoBackend> backend_;
  mutable core::Mutex mu_;  // guards the index below; never held across I/O
  std::unordered_map<std::string, Block> blocks_ STRATA_GUARDED_BY(mu_);
  std::uint32_t next_path_ STRATA_GUARDED_BY(mu_) = 0;
  std::size_t busy_count_ STRATA_GUARDED_BY(mu_) = 0;
  std::vector<FileTraffic> closed_traffic_ STRATA_GUARDED_BY(mu_);  // traffic() at close
};

}  // namespace strata::nvme
