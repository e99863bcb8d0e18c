// DirectFileWriter / DirectFileReader: sequential O_DIRECT file I/O through
// an IoBackend and a ring of aligned staging buffers, CRC64 on the way.
#include "nvme/direct_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/check.h"
#include "core/str.h"
#include "nvme/crc64.h"

namespace strata::nvme {

using core::Result;
using core::Status;
using core::str_cat;

struct DirectFileRing {
  struct Slot {
    PoolBuffer buffer;
    // Declared after `buffer`: destroyed (which waits for it) before the buffer goes back.
    std::unique_ptr<IoBatch> batch;
    std::uint64_t begin = 0;  // reader: the file range the buffer holds, [begin, end)
    std::uint64_t end = 0;
  };
  std::vector<Slot> slots;
};

namespace {

constexpr std::uint64_t kAlign = core::kDirectIoAlignment;

constexpr std::uint64_t align_down(std::uint64_t n) { return n & ~(kAlign - 1); }

Status check_options(const DirectFileOptions& o, const std::string& path) {
  if (o.buffer_bytes == 0 || o.buffer_bytes % kAlign != 0) {
    return Status::invalid_argument(
        str_cat("'", path, "': buffer_bytes ", o.buffer_bytes, " is not a positive multiple of ", kAlign));
  }
  if (o.buffer_count < 2) {
    return Status::invalid_argument(str_cat("'", path, "': buffer_count ", o.buffer_count, " is below 2"));
  }
  if (o.request_bytes == 0 || o.request_bytes % kAlign != 0) {
    return Status::invalid_argument(
        str_cat("'", path, "': request_bytes ", o.request_bytes, " is not a positive multiple of ", kAlign));
  }
  return Status();
}

// The ring of `o.buffer_count` buffers from a pool charged to `o.budget` (or
// to `own_budget`, made here when none is given).
Status make_ring(const DirectFileOptions& o, const std::string& path, std::unique_ptr<core::MemoryBudget>& own_budget,
                 std::unique_ptr<BufferPool>& pool, std::unique_ptr<DirectFileRing>& ring) {
  core::MemoryBudget* budget = o.budget;
  if (budget == nullptr) {
    own_budget = std::make_unique<core::MemoryBudget>("direct file staging", core::MemoryBudget::kUnlimited);
    budget = own_budget.get();
  }
  BufferPoolOptions po;
  po.buffer_bytes = o.buffer_bytes;
  po.buffer_count = o.buffer_count;
  po.alignment = kAlign;
  po.name = str_cat("staging buffers for '", path, "'");
  auto p = BufferPool::create(po, *budget, o.allocator != nullptr ? *o.allocator : core::default_host_allocator());
  if (!p.ok()) return std::move(p).status();
  pool = std::move(p).value();
  ring = std::make_unique<DirectFileRing>();
  ring->slots.resize(o.buffer_count);
  for (auto& s : ring->slots) {
    STRATA_ASSIGN_OR_RETURN(s.buffer, pool->try_acquire());
  }
  return Status();
}

// A batch of `op` requests of at most `request_bytes` over `buffer`, at `offset`.
std::unique_ptr<IoBatch> make_batch(IoOp op, FileId file, std::uint64_t offset, std::span<std::byte> buffer,
                                    std::size_t request_bytes) {
  auto batch = std::make_unique<IoBatch>();
  for (std::size_t off = 0; off < buffer.size(); off += request_bytes) {
    batch->add({op, file, offset + off, buffer.subspan(off, std::min(request_bytes, buffer.size() - off))});
  }
  return batch;
}

}  // namespace

// --- DirectFileWriter -----------------------------------------------------------

DirectFileWriter::DirectFileWriter(IoBackend& backend, std::string path) : backend_(backend), path_(std::move(path)) {}

Result<std::unique_ptr<DirectFileWriter>> DirectFileWriter::create(IoBackend& backend, std::string path,
                                                                   const DirectFileOptions& options) {
  STRATA_RETURN_IF_ERROR(check_options(options, path));
  auto w = std::unique_ptr<DirectFileWriter>(new DirectFileWriter(backend, std::move(path)));
  STRATA_ASSIGN_OR_RETURN(OpenedFile f,
                          open_file(w->path_, O_WRONLY | O_CREAT | O_TRUNC, 0644, options.direct_io, "file"));
  w->fd_ = std::move(f.fd);
  w->direct_ = f.direct;
  w->request_bytes_ = options.request_bytes;
  STRATA_RETURN_IF_ERROR(make_ring(options, w->path_, w->own_budget_, w->pool_, w->ring_));
  STRATA_ASSIGN_OR_RETURN(w->file_, backend.register_file(w->fd_.get(), w->path_));
  w->registered_ = true;
  return w;
}

DirectFileWriter::~DirectFileWriter() {
  if (ring_) drain().ignore_error();  // abandoned (or failed): whoever cared has seen the error
  if (registered_) {
    backend_.unregister_file(file_).ignore_error();  // the descriptor closes next; nothing is in flight
  }
}

Status DirectFileWriter::fail(Status s) {
  if (error_.ok()) error_ = s;
  return s;
}

Status DirectFileWriter::append(std::span<const std::byte> bytes) {
  if (finished_) return Status::failed_precondition(str_cat("append to '", path_, "' after finish()"));
  if (!error_.ok()) return error_;
  const std::size_t capacity = pool_->buffer_bytes();
  while (!bytes.empty()) {
    std::byte* dst = ring_->slots[current_].buffer.data() + fill_bytes_;
    const std::size_t n = std::min(bytes.size(), capacity - fill_bytes_);
    std::memcpy(dst, bytes.data(), n);
    crc_ = nvme::crc64(crc_, std::span<const std::byte>(dst, n));  // still in cache after the copy
    fill_bytes_ += n;
    size_bytes_ += n;
    bytes = bytes.subspan(n);
    if (fill_bytes_ == capacity) STRATA_RETURN_IF_ERROR(flush_current(fill_bytes_));
  }
  return Status();
}

Status DirectFileWriter::flush_current(std::size_t length) {
  auto& slots = ring_->slots;
  DirectFileRing::Slot& s = slots[current_];
  auto batch = make_batch(IoOp::kWrite, file_, file_offset_, s.buffer.bytes().first(length), request_bytes_);
  Status st = backend_.submit(*batch);
  if (!st.ok()) {
    return fail(std::move(st).annotate(str_cat("write '", path_, "' at offset ", file_offset_, " (", length, " bytes)")));
  }
  s.batch = std::move(batch);
  file_offset_ += length;
  fill_bytes_ = 0;
  current_ = (current_ + 1) % slots.size();
  DirectFileRing::Slot& next = slots[current_];
  if (next.batch) {
    Status ws = next.batch->wait();
    next.batch.reset();
    if (!ws.ok()) return fail(std::move(ws));
  }
  return Status();
}

Status DirectFileWriter::drain() {
  Status first;
  auto& slots = ring_->slots;
  // Oldest first: the buffer after the current one was sent longest ago.
  for (std::size_t k = 1; k <= slots.size(); ++k) {
    DirectFileRing::Slot& s = slots[(current_ + k) % slots.size()];
    if (!s.batch) continue;
    Status ws = s.batch->wait();
    s.batch.reset();
    if (first.ok() && !ws.ok()) first = std::move(ws);
  }
  if (!first.ok()) return fail(std::move(first));
  return Status();
}

Status DirectFileWriter::finish() {
  if (finished_) return Status::failed_precondition(str_cat("'", path_, "': finish() called twice"));
  finished_ = true;
  if (!error_.ok()) return error_;
  if (fill_bytes_ > 0) {
    // Under O_DIRECT the last buffer goes out as whole 4096-byte blocks; the
    // padding is cut off by the truncate below.
    const std::size_t length = direct_ ? core::align_up(fill_bytes_, kAlign) : fill_bytes_;
    std::memset(ring_->slots[current_].buffer.data() + fill_bytes_, 0, length - fill_bytes_);
    STRATA_RETURN_IF_ERROR(flush_current(length));
  }
  STRATA_RETURN_IF_ERROR(drain());
  if (file_offset_ != size_bytes_ && ::ftruncate(fd_.get(), static_cast<off_t>(size_bytes_)) != 0) {
    const int err = errno;
    return fail(Status::from_errno(err, str_cat("truncate '", path_, "' to ", size_bytes_, " bytes")));
  }
  if (::fsync(fd_.get()) != 0) {
    const int err = errno;
    return fail(Status::from_errno(err, str_cat("fsync '", path_, "'")));
  }
  registered_ = false;
  Status us = backend_.unregister_file(file_);
  Status cs = fd_.close(path_);
  if (!us.ok()) return fail(std::move(us));
  if (!cs.ok()) return fail(std::move(cs));
  return Status();
}

// --- DirectFileReader -----------------------------------------------------------

DirectFileReader::DirectFileReader(IoBackend& backend, std::string path) : backend_(backend), path_(std::move(path)) {}

Result<std::unique_ptr<DirectFileReader>> DirectFileReader::open(IoBackend& backend, std::string path,
                                                                 const DirectFileOptions& options) {
  STRATA_RETURN_IF_ERROR(check_options(options, path));
  auto r = std::unique_ptr<DirectFileReader>(new DirectFileReader(backend, std::move(path)));
  STRATA_ASSIGN_OR_RETURN(OpenedFile f, open_file(r->path_, O_RDONLY, 0, options.direct_io, "file"));
  r->fd_ = std::move(f.fd);
  r->direct_ = f.direct;
  r->request_bytes_ = options.request_bytes;
  struct stat st {};
  if (::fstat(r->fd_.get(), &st) != 0) {
    const int err = errno;
    return Status::from_errno(err, str_cat("stat '", r->path_, "'"));
  }
  r->size_bytes_ = static_cast<std::uint64_t>(st.st_size);
  STRATA_RETURN_IF_ERROR(make_ring(options, r->path_, r->own_budget_, r->pool_, r->ring_));
  STRATA_ASSIGN_OR_RETURN(r->file_, backend.register_file(r->fd_.get(), r->path_));
  r->registered_ = true;
  return r;
}

DirectFileReader::~DirectFileReader() {
  // scan() leaves nothing in flight; the ring's batches would wait anyway.
  if (registered_) backend_.unregister_file(file_).ignore_error();  // read-only: nothing to lose
}

Status DirectFileReader::read_tail(std::uint64_t tail_offset, std::byte* dest) {
  const std::uint64_t want = size_bytes_ - tail_offset;  // 1 to 4095 bytes
  // Exactly the bytes left, through the backend like every other read (its
  // retries; a test's faults). O_DIRECT cannot read a partial block, so a
  // direct file's tail is read through a page-cache descriptor of its own.
  core::UniqueFd buffered;
  FileId file = file_;
  if (direct_) {
    buffered.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    if (!buffered.valid()) {
      const int err = errno;
      return Status::from_errno(err, str_cat("open '", path_, "' (its last partial block)"));
    }
    STRATA_ASSIGN_OR_RETURN(file, backend_.register_file(buffered.get(), path_));
  }
  Status s;
  {
    IoBatch batch({IoRequest{IoOp::kRead, file, tail_offset, std::span<std::byte>(dest, want)}});
    s = backend_.execute(batch);
  }
  if (direct_) backend_.unregister_file(file).ignore_error();  // read-only: nothing to lose
  if (s.code() == core::StatusCode::kDataLoss) s = std::move(s).annotate("the file is shorter than when it was opened");
  return s;
}

Status DirectFileReader::explain_shrink(Status s) const {
  struct stat st {};
  if (::fstat(fd_.get(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) < size_bytes_) {
    // Under O_DIRECT the rest of a read cut short by the end of the file is
    // misaligned (EINVAL); what happened is that the file lost bytes.
    return Status::data_loss(str_cat("'", path_, "' is ", st.st_size, " bytes, ", size_bytes_,
                                     " when it was opened: ", s.message()));
  }
  return s;
}

Status DirectFileReader::scan(std::uint64_t offset, std::uint64_t length,
                              const std::function<Status(std::span<const std::byte>)>& fn) {
  if (offset > size_bytes_ || length > size_bytes_ - offset) {
    return Status::out_of_range(str_cat("read '", path_, "' at offset ", offset, " (", length,
                                        " bytes): past the end of the file (", size_bytes_, " bytes)"));
  }
  if (length == 0) return Status();
  const std::uint64_t end = offset + length;
  const std::uint64_t last = core::align_up(end, kAlign);  // the aligned range [align_down(offset), last)
  const std::uint64_t body_limit = align_down(size_bytes_);  // whole blocks go through the backend
  const std::uint64_t buffer_bytes = pool_->buffer_bytes();
  auto& slots = ring_->slots;
  std::uint64_t next = align_down(offset);

  auto start = [&](DirectFileRing::Slot& s) -> Status {
    s.begin = next;
    s.end = std::min(next + buffer_bytes, last);
    next = s.end;
    const std::uint64_t body_end = std::min(s.end, body_limit);
    if (body_end <= s.begin) return Status();  // only the partial last block: read_tail
    auto batch = make_batch(IoOp::kRead, file_, s.begin,
                            s.buffer.bytes().first(static_cast<std::size_t>(body_end - s.begin)), request_bytes_);
    Status st = backend_.submit(*batch);
    if (!st.ok()) {
      return std::move(st).annotate(str_cat("read '", path_, "' at offset ", s.begin, " (", body_end - s.begin,
                                            " bytes)"));
    }
    s.batch = std::move(batch);
    return Status();
  };

  Status result;
  std::size_t started = 0, consumed = 0;
  for (std::size_t i = 0; i < slots.size() && next < last && result.ok(); ++i) {
    result = start(slots[i]);
    if (result.ok()) ++started;
  }
  while (result.ok() && consumed < started) {
    DirectFileRing::Slot& s = slots[consumed % slots.size()];
    if (s.batch) {
      result = s.batch->wait();
      s.batch.reset();
      if (!result.ok()) {
        result = explain_shrink(std::move(result));
        break;
      }
    }
    if (s.end > body_limit) {
      // The file's partial last block, which lies in this buffer.
      STRATA_CHECK(s.begin <= body_limit && body_limit + kAlign <= s.begin + buffer_bytes);
      result = read_tail(body_limit, s.buffer.data() + (body_limit - s.begin));
      if (!result.ok()) break;
    }
    if (taking_crc_) {
      const std::uint64_t valid = std::min(s.end, size_bytes_);
      if (s.begin <= crc_upto_ && crc_upto_ < valid) {
        crc_taken_ = nvme::crc64(crc_taken_, std::span<const std::byte>(s.buffer.data() + (crc_upto_ - s.begin),
                                                                        static_cast<std::size_t>(valid - crc_upto_)));
        crc_upto_ = valid;
      }
    }
    const std::uint64_t lo = std::max(offset, s.begin), hi = std::min(end, s.end);
    result = fn(std::span<const std::byte>(s.buffer.data() + (lo - s.begin), static_cast<std::size_t>(hi - lo)));
    if (!result.ok()) break;
    ++consumed;
    if (next < last) {
      result = start(s);
      if (result.ok()) ++started;
    }
  }
  // Whatever is still in flight lands before its buffer is used again.
  for (auto& s : slots) {
    if (!s.batch) continue;
    s.batch->wait().ignore_error();  // the scan already failed; its first error is returned
    s.batch.reset();
  }
  return result;
}

Status DirectFileReader::read(std::uint64_t offset, std::span<std::byte> out) {
  std::byte* cursor = out.data();
  return scan(offset, out.size(), [&](std::span<const std::byte> piece) {
    std::memcpy(cursor, piece.data(), piece.size());
    cursor += piece.size();
    return Status();
  });
}

void DirectFileReader::take_crc64_as_read() {
  taking_crc_ = true;
  crc_taken_ = 0;
  crc_upto_ = 0;
}

Result<std::uint64_t> DirectFileReader::crc64_as_read() {
  if (!taking_crc_) return Status::failed_precondition(str_cat("crc64_as_read of '", path_, "' without take_crc64_as_read"));
  if (crc_upto_ < size_bytes_) {
    STRATA_RETURN_IF_ERROR(scan(crc_upto_, size_bytes_ - crc_upto_, [](std::span<const std::byte>) { return Status(); }));
  }
  STRATA_CHECK(crc_upto_ == size_bytes_);
  return crc_taken_;
}

Result<std::uint64_t> DirectFileReader::crc64() {
  std::uint64_t crc = 0;
  STRATA_RETURN_IF_ERROR(scan(0, size_bytes_, [&](std::span<const std::byte> piece) {
    crc = nvme::crc64(crc, piece);
    return Status();
  }));
  return crc;
}

}  // namespace strata::nvme
