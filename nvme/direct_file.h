// DirectFileWriter and DirectFileReader: one file written or read
// sequentially through an IoBackend with O_DIRECT (past the page cache),
// staged through a small ring of aligned buffers with several requests in
// flight, the CRC64 of the bytes computed as they pass. Checkpoint state and
// weight exports go through them (docs/checkpoints.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/host_allocator.h"
#include "core/memory_budget.h"
#include "core/result.h"
#include "core/unique_fd.h"
#include "nvme/buffer_pool.h"
#include "nvme/direct_io.h"
#include "nvme/io_backend.h"

namespace strata::nvme {

struct DirectFileOptions {
  // Bytes per staging buffer; a positive multiple of 4096; default 4 MiB.
  std::size_t buffer_bytes = 4u << 20;
  // Staging buffers in the ring, >= 2; default 4. The writer fills one while
  // the others are being written; the reader keeps all of them reading ahead
  // except the one being handed out.
  std::size_t buffer_count = 4;
  // Largest single request; a positive multiple of 4096; default 1 MiB (the
  // engine passes strata.io.block_bytes). A buffer goes out as one batch of
  // requests of at most this size.
  std::size_t request_bytes = 1u << 20;
  // O_DIRECT (nvme/direct_io.h); default auto: the page cache, with a log
  // line, where the file system refuses O_DIRECT.
  DirectIo direct_io = DirectIo::kAuto;
  // Charged buffer_count x buffer_bytes for the ring (borrowed; must outlive
  // the writer or reader). Default nullptr: an unlimited budget of its own.
  core::MemoryBudget* budget = nullptr;
  // Where the ring's memory comes from (borrowed; must outlive the writer or
  // reader). Default nullptr: core::default_host_allocator() (pageable).
  core::HostAllocator* allocator = nullptr;
};

// The ring of staging buffers, each with the batch in flight on it (if any).
// Shared by the writer and the reader; private to direct_file.cpp.
struct DirectFileRing;

// Writes one file from front to back. Bytes of any size are appended and
// copied into the ring's 4096-aligned buffers; each full buffer is written
// asynchronously (up to buffer_count - 1 buffers in flight while the next
// one fills, so copying overlaps writing); finish() writes the partial last
// buffer (padded to 4096 bytes under O_DIRECT), truncates the file to the
// bytes appended, fsyncs and closes it. The CRC64 (nvme/crc64.h) of the
// appended bytes is computed as they are copied.
//
// Owner-thread-only. Errors name the file, the offset and the length (the
// backend's request status); after a failed write every later call returns
// that error. A writer destroyed before finish() waits for its writes, closes
// the file and leaves it as it is (the caller removes it).
class DirectFileWriter {
 public:
  // Creates (or truncates) `path` (mode 0644) and registers it with `backend`,
  // which is borrowed and must outlive the writer. Errors: kInvalidArgument
  // for bad options; the open error naming the file (kUnavailable when
  // direct_io is kOn and the file system refuses O_DIRECT); the budget's
  // kResourceExhausted; the backend's registration error.
  static core::Result<std::unique_ptr<DirectFileWriter>> create(IoBackend& backend, std::string path,
                                                                const DirectFileOptions& options = {});
  ~DirectFileWriter();
  DirectFileWriter(const DirectFileWriter&) = delete;
  DirectFileWriter& operator=(const DirectFileWriter&) = delete;

  // Appends `bytes` (copied; the span may be reused when this returns).
  // Blocks only when every buffer is in flight. Errors: an earlier or a
  // completed write's failure; kFailedPrecondition after finish().
  core::Status append(std::span<const std::byte> bytes);
  // Writes what is left, waits for every write, truncates the file to
  // size_bytes(), fsyncs and closes it (reporting a close error). Errors as
  // append; kFailedPrecondition when called twice.
  core::Status finish();

  const std::string& path() const { return path_; }
  // Bytes appended so far (after finish(): the file's size).
  std::uint64_t size_bytes() const { return size_bytes_; }
  // CRC64 of the bytes appended so far.
  std::uint64_t crc64() const { return crc_; }
  // True when the file was opened with O_DIRECT.
  bool direct() const { return direct_; }

 private:
  DirectFileWriter(IoBackend& backend, std::string path);
  // Sends the current buffer's first `length` bytes at file_offset_ and moves
  // to the next buffer, waiting until it is free.
  core::Status flush_current(std::size_t length);
  // Waits for every write in flight; the first error, if any.
  core::Status drain();
  core::Status fail(core::Status s);
  core::Status close_file();

  IoBackend& backend_;
  const std::string path_;
  core::UniqueFd fd_;
  FileId file_;
  bool registered_ = false;
  bool direct_ = false;
  std::size_t request_bytes_ = 0;
  // Destruction order: the destructor drains the ring and closes the file;
  // then the ring's buffers go back to the pool, the pool to the budget.
  std::unique_ptr<core::MemoryBudget> own_budget_;
  std::unique_ptr<BufferPool> pool_;
  std::unique_ptr<DirectFileRing> ring_;
  std::size_t current_ = 0;           // the buffer being filled
  std::size_t fill_bytes_ = 0;        // bytes in it
  std::uint64_t file_offset_ = 0;     // where it goes in the file
  std::uint64_t size_bytes_ = 0;
  std::uint64_t crc_ = 0;
  core::Status error_;                // the first failed write, returned from then on
  bool finished_ = false;
};

// Reads a file through the ring: ranges are read as the aligned blocks that
// enclose them (all requests 4096-aligned, the file's partial last block with
// one positional read) and copied out or handed to a callback, with up to
// buffer_count buffers read ahead.
//
// Owner-thread-only. Errors name the file, the offset and the length.
class DirectFileReader {
 public:
  // Opens `path` read-only and registers it with `backend` (borrowed; must
  // outlive the reader); the size is taken now. Errors: kInvalidArgument for
  // bad options; the open error naming the file (kNotFound when missing); the
  // budget's; the backend's registration error.
  static core::Result<std::unique_ptr<DirectFileReader>> open(IoBackend& backend, std::string path,
                                                              const DirectFileOptions& options = {});
  ~DirectFileReader();
  DirectFileReader(const DirectFileReader&) = delete;
  DirectFileReader& operator=(const DirectFileReader&) = delete;

  // Hands [offset, offset + length) to `fn` in order, in pieces of at most
  // buffer_bytes; the following reads are in flight while `fn` runs. A piece
  // is valid only during its call. An error from `fn` stops the scan and is
  // returned as it is. Errors: kOutOfRange for a range past the end (naming
  // the file, the range and the size); an I/O error naming the file, offset
  // and length; kDataLoss when the file ends before the size it had at open.
  core::Status scan(std::uint64_t offset, std::uint64_t length,
                    const std::function<core::Status(std::span<const std::byte>)>& fn);
  // Reads [offset, offset + out.size()) into `out` (any address). Errors as scan.
  core::Status read(std::uint64_t offset, std::span<std::byte> out);
  // CRC64 of the whole file (a scan from front to back).
  core::Result<std::uint64_t> crc64();
  // The file's CRC64 taken as it is read, for a reader that reads it about
  // front to back anyway (a checkpoint's load into state that holds nothing
  // yet): from here on, each block a scan or read brings in that starts at
  // or before the first byte not yet taken extends the CRC64 (the whole
  // aligned blocks read, not only the range asked for); blocks further on
  // are not taken. crc64_as_read() reads what is left, from the first byte
  // not taken to the end, and returns the whole file's CRC64 (as crc64()).
  void take_crc64_as_read();
  core::Result<std::uint64_t> crc64_as_read();

  const std::string& path() const { return path_; }
  // The file's size when it was opened.
  std::uint64_t size_bytes() const { return size_bytes_; }
  bool direct() const { return direct_; }

 private:
  DirectFileReader(IoBackend& backend, std::string path);
  // Reads the file's partial last block [tail_offset, size) into `dest`.
  core::Status read_tail(std::uint64_t tail_offset, std::byte* dest);
  // A failed read of a file that has since shrunk is kDataLoss saying so; others stay as they are.
  core::Status explain_shrink(core::Status s) const;

  IoBackend& backend_;
  const std::string path_;
  core::UniqueFd fd_;
  FileId file_;
  bool registered_ = false;
  bool direct_ = false;
  std::size_t request_bytes_ = 0;
  std::uint64_t size_bytes_ = 0;
  // take_crc64_as_read: the CRC64 of bytes [0, crc_upto_).
  bool taking_crc_ = false;
  std::uint64_t crc_taken_ = 0, crc_upto_ = 0;
  // Destruction order as in the writer.
  std::unique_ptr<core::MemoryBudget> own_budget_;
  std::unique_ptr<BufferPool> pool_;
  std::unique_ptr<DirectFileRing> ring_;
};

}  // namespace strata::nvme
