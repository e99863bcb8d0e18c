// IoBackend conformance: every backend through the same raw-file cases
// (aligned requests, many in flight, per-request statuses, fixed buffers,
// misuse), backend selection and its log line, CRC64 values, the buffer pool.
#include "nvme/io_backend.h"

#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/logging.h"
#include "core/memory_budget.h"
#include "core/unique_fd.h"
#include "nvme/buffer_pool.h"
#include "nvme/crc64.h"
#include "tests/nvme/test_util.h"

namespace strata::nvme {
namespace {

using core::Status;
using core::StatusCode;
using testing_util::random_buffer;
using testing_util::TempDir;
using testing_util::zero_buffer;

class IoBackendTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    const std::string why = testing_util::unavailable_reason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
    IoBackendOptions o;
    o.kind = GetParam();
    o.queue_depth = 8;
    auto b = IoBackend::create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(b).value();
    path_ = dir_.path() + "/data.bin";
    fd_.reset(::open(path_.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600));
    ASSERT_TRUE(fd_.valid()) << "open " << path_ << ": " << std::strerror(errno);
    ASSERT_EQ(::ftruncate(fd_.get(), kFileBytes), 0);
    auto id = backend_->register_file(fd_.get(), path_);
    ASSERT_TRUE(id.ok()) << id.status();
    file_ = *id;
  }
  void TearDown() override {
    if (backend_) {
      EXPECT_TRUE(backend_->unregister_file(file_).ok());
    }
    backend_.reset();
  }

  static constexpr std::size_t kFileBytes = 8 << 20;
  TempDir dir_;
  std::string path_;
  core::UniqueFd fd_;
  std::unique_ptr<IoBackend> backend_;
  FileId file_;
};

TEST_P(IoBackendTest, WritesThenReadsBackManyRequestsInFlight) {
  constexpr std::size_t kChunk = 64 << 10;
  constexpr std::size_t kCount = kFileBytes / kChunk;  // 128 requests, queue depth 8
  auto src = random_buffer(kFileBytes, 1);
  auto dst = zero_buffer(kFileBytes);
  IoBatch writes;
  for (std::size_t i = 0; i < kCount; ++i) {
    writes.add({IoOp::kWrite, file_, i * kChunk, src.bytes().subspan(i * kChunk, kChunk)});
  }
  ASSERT_TRUE(backend_->execute(writes).ok());
  for (std::size_t i = 0; i < kCount; ++i) EXPECT_TRUE(writes.request_status(i).ok());
  IoBatch reads;
  // Reverse order, so completion order differs from file order.
  for (std::size_t i = kCount; i > 0; --i) {
    reads.add({IoOp::kRead, file_, (i - 1) * kChunk, dst.bytes().subspan((i - 1) * kChunk, kChunk)});
  }
  ASSERT_TRUE(backend_->submit(reads).ok());
  for (std::size_t i = 0; i < kCount; ++i) EXPECT_TRUE(reads.wait_request(i).ok()) << i;
  ASSERT_TRUE(reads.wait().ok());
  EXPECT_TRUE(testing_util::same_bytes(src, dst, kFileBytes));
}

TEST_P(IoBackendTest, SeveralBatchesFromSeveralThreads) {
  constexpr std::size_t kChunk = 256 << 10;
  auto src = random_buffer(kFileBytes, 2);
  auto dst = zero_buffer(kFileBytes);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const std::size_t base = static_cast<std::size_t>(t) * (kFileBytes / 4);
      IoBatch w;
      for (std::size_t off = 0; off < kFileBytes / 4; off += kChunk) {
        w.add({IoOp::kWrite, file_, base + off, src.bytes().subspan(base + off, kChunk)});
      }
      EXPECT_TRUE(backend_->execute(w).ok());
      IoBatch r;
      for (std::size_t off = 0; off < kFileBytes / 4; off += kChunk) {
        r.add({IoOp::kRead, file_, base + off, dst.bytes().subspan(base + off, kChunk)});
      }
      EXPECT_TRUE(backend_->execute(r).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(testing_util::same_bytes(src, dst, kFileBytes));
}

TEST_P(IoBackendTest, RegisteredBuffersGiveTheSameBytes) {
  core::MemoryBudget budget("pinned host memory", 4 << 20, "strata.budgets.pinned");
  auto pool = BufferPool::create({.buffer_bytes = 1 << 20, .buffer_count = 2}, budget);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto bufs = (*pool)->buffers();
  Status s = backend_->register_buffers(bufs);
  if (!s.ok()) GTEST_SKIP() << "buffer registration refused here: " << s;
  auto a = (*pool)->acquire();
  auto b = (*pool)->acquire();
  auto src = random_buffer(1 << 20, 3);
  std::memcpy(a.data(), src.data(), 1 << 20);
  IoBatch w({{IoOp::kWrite, file_, 1 << 20, a.bytes()}});
  ASSERT_TRUE(backend_->execute(w).ok());
  IoBatch r({{IoOp::kRead, file_, 1 << 20, b.bytes()}});
  ASSERT_TRUE(backend_->execute(r).ok());
  EXPECT_EQ(std::memcmp(b.data(), src.data(), 1 << 20), 0);
  EXPECT_TRUE(backend_->unregister_buffers().ok());
}

TEST_P(IoBackendTest, ReadPastEndOfFileIsDataLossNamingThePath) {
  auto dst = zero_buffer(8192);
  IoBatch r({{IoOp::kRead, file_, kFileBytes - 4096, dst.bytes()}});
  Status s = backend_->execute(r);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(path_), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("end of file"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("request 0 of 1"), std::string_view::npos) << s;
}

TEST_P(IoBackendTest, OneBadRequestFailsAloneWithItsOffset) {
  auto src = random_buffer(3 * 4096, 4);
  // Unaligned offset under O_DIRECT: EINVAL for that request only.
  IoBatch w({{IoOp::kWrite, file_, 0, src.bytes().subspan(0, 4096)},
             {IoOp::kWrite, file_, 4096 + 100, src.bytes().subspan(4096, 4096)},
             {IoOp::kWrite, file_, 8192, src.bytes().subspan(8192, 4096)}});
  Status s = backend_->execute(w);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(w.request_status(0).ok());
  EXPECT_FALSE(w.request_status(1).ok());
  EXPECT_TRUE(w.request_status(2).ok());
  EXPECT_NE(s.message().find("request 1 of 3"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("at offset 4196"), std::string_view::npos) << s;
  EXPECT_EQ(w.request_status(1).error_number(), EINVAL);
}

TEST_P(IoBackendTest, MisuseIsRejectedBeforeAnythingStarts) {
  auto buf = zero_buffer(4096);
  IoBatch unknown({{IoOp::kRead, FileId{17}, 0, buf.bytes()}});
  EXPECT_EQ(backend_->submit(unknown).code(), StatusCode::kInvalidArgument);
  IoBatch empty({{IoOp::kRead, file_, 0, {}}});
  EXPECT_EQ(backend_->submit(empty).code(), StatusCode::kInvalidArgument);
  IoBatch twice({{IoOp::kRead, file_, 0, buf.bytes()}});
  ASSERT_TRUE(backend_->submit(twice).ok());
  EXPECT_EQ(backend_->submit(twice).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(twice.wait().ok());
  IoBatch none;
  EXPECT_TRUE(backend_->execute(none).ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, IoBackendTest, ::testing::ValuesIn(testing_util::all_backends()),
                         testing_util::backend_name);

// --- selection ---------------------------------------------------------------

std::vector<std::string> capture_logs(const std::function<void()>& fn) {
  std::vector<std::string> lines;
  std::mutex mu;
  core::set_log_sink([&](core::LogLevel, std::string_view m) {
    std::lock_guard<std::mutex> l(mu);
    lines.emplace_back(m);
  });
  fn();
  core::set_log_sink({});
  return lines;
}

TEST(IoBackendSelection, AutoPicksABackendAndLogsWhy) {
  std::unique_ptr<IoBackend> b;
  auto lines = capture_logs([&] {
    auto r = IoBackend::create({});
    ASSERT_TRUE(r.ok()) << r.status();
    b = std::move(r).value();
  });
  ASSERT_NE(b, nullptr);
  EXPECT_NE(b->kind(), BackendKind::kAuto);
  int picked = 0;
  for (const auto& l : lines) {
    if (l.find("auto picked") != std::string::npos) ++picked;
  }
  EXPECT_EQ(picked, 1);
  if (testing_util::unavailable_reason(BackendKind::kIoUring).empty()) {
    EXPECT_EQ(b->kind(), BackendKind::kIoUring);
  }
}

TEST(IoBackendSelection, BadOptionsAreInvalidArguments) {
  IoBackendOptions o;
  o.queue_depth = 0;
  EXPECT_EQ(IoBackend::create(o).status().code(), StatusCode::kInvalidArgument);
  o.queue_depth = 8;
  o.rings = 65;
  EXPECT_EQ(IoBackend::create(o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_backend_kind("uring").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*parse_backend_kind("io_uring"), BackendKind::kIoUring);
}

TEST(IoBackendSelection, SeveralRingsWork) {
  const std::string why = testing_util::unavailable_reason(BackendKind::kIoUring);
  if (!why.empty()) GTEST_SKIP() << why;
  IoBackendOptions o;
  o.kind = BackendKind::kIoUring;
  o.rings = 3;
  o.queue_depth = 4;
  auto b = IoBackend::create(o);
  ASSERT_TRUE(b.ok()) << b.status();
  TempDir dir;
  const std::string path = dir.path() + "/f";
  core::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  ASSERT_TRUE(fd.valid());
  auto id = (*b)->register_file(fd.get(), path);
  ASSERT_TRUE(id.ok());
  auto src = random_buffer(1 << 20, 5);
  auto dst = zero_buffer(1 << 20);
  IoBatch w, r;
  for (std::size_t off = 0; off < (1 << 20); off += 16384) {
    w.add({IoOp::kWrite, *id, off, src.bytes().subspan(off, 16384)});
    r.add({IoOp::kRead, *id, off, dst.bytes().subspan(off, 16384)});
  }
  ASSERT_TRUE((*b)->execute(w).ok());
  ASSERT_TRUE((*b)->execute(r).ok());
  EXPECT_TRUE(testing_util::same_bytes(src, dst, 1 << 20));
  EXPECT_TRUE((*b)->unregister_file(*id).ok());
}

TEST(IoBackendSelection, SqpollWhenTheKernelAllowsIt) {
  const std::string why = testing_util::unavailable_reason(BackendKind::kIoUring);
  if (!why.empty()) GTEST_SKIP() << why;
  IoBackendOptions o;
  o.kind = BackendKind::kIoUring;
  o.sqpoll = true;
  o.sqpoll_idle_ms = 10;
  o.queue_depth = 8;
  auto b = IoBackend::create(o);
  if (!b.ok()) {
    EXPECT_EQ(b.status().code(), StatusCode::kUnavailable) << b.status();
    GTEST_SKIP() << "SQPOLL refused here: " << b.status();
  }
  TempDir dir;
  const std::string path = dir.path() + "/f";
  core::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  auto id = (*b)->register_file(fd.get(), path);
  ASSERT_TRUE(id.ok());
  auto src = random_buffer(256 << 10, 6);
  auto dst = zero_buffer(256 << 10);
  IoBatch w, r;
  for (std::size_t off = 0; off < (256 << 10); off += 8192) {
    w.add({IoOp::kWrite, *id, off, src.bytes().subspan(off, 8192)});
    r.add({IoOp::kRead, *id, off, dst.bytes().subspan(off, 8192)});
  }
  ASSERT_TRUE((*b)->execute(w).ok());
  ASSERT_TRUE((*b)->execute(r).ok());
  EXPECT_TRUE(testing_util::same_bytes(src, dst, 256 << 10));
  EXPECT_TRUE((*b)->unregister_file(*id).ok());
}

// A seccomp filter on one thread makes io_uring_setup fail with EPERM, as a
// container sandbox does. Returns false when seccomp is not available.
bool block_io_uring_on_this_thread() {
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) == 0;
}

TEST(IoBackendSelection, BlockedIoUringIsAnErrorWhenAskedForAndAFallbackUnderAuto) {
  if (!backend_compiled(BackendKind::kIoUring)) GTEST_SKIP() << "io_uring was not built into this binary";
  bool filtered = false;
  Status explicit_status;
  BackendKind auto_kind = BackendKind::kAuto;
  std::vector<std::string> lines;
  // The filter lives and dies with this thread (and threads it starts).
  std::thread t([&] {
    if (!block_io_uring_on_this_thread()) return;
    filtered = true;
    IoBackendOptions o;
    o.kind = BackendKind::kIoUring;
    explicit_status = IoBackend::create(o).status();
    lines = capture_logs([&] {
      auto b = IoBackend::create({});
      if (b.ok()) auto_kind = (*b)->kind();
    });
  });
  t.join();
  if (!filtered) GTEST_SKIP() << "seccomp filters are not available here";
  EXPECT_EQ(explicit_status.code(), StatusCode::kUnavailable) << explicit_status;
  EXPECT_EQ(explicit_status.error_number(), EPERM);
  EXPECT_NE(explicit_status.message().find("io_uring"), std::string_view::npos) << explicit_status;
  EXPECT_NE(explicit_status.message().find("strata.io.backend"), std::string_view::npos) << explicit_status;
  EXPECT_NE(auto_kind, BackendKind::kIoUring);
  EXPECT_NE(auto_kind, BackendKind::kAuto);
  bool logged = false;
  for (const auto& l : lines) {
    if (l.find("auto picked") != std::string::npos && l.find("io_uring unavailable") != std::string::npos) logged = true;
  }
  EXPECT_TRUE(logged);
}

// --- CRC64 -------------------------------------------------------------------

TEST(Crc64, MatchesTheCrc64XzCheckValueAndChains) {
  const std::string check = "123456789";
  const auto bytes = std::as_bytes(std::span<const char>(check.data(), check.size()));
  EXPECT_EQ(crc64(0, bytes), 0x995dc9bbdf1939faull);
  EXPECT_EQ(crc64(crc64(0, bytes.subspan(0, 4)), bytes.subspan(4)), crc64(0, bytes));
  EXPECT_EQ(crc64(0, {}), 0u);
}

// --- BufferPool --------------------------------------------------------------

TEST(BufferPool, BuffersAreAlignedAndChargedToTheBudget) {
  core::MemoryBudget budget("pinned host memory", 1 << 20, "strata.budgets.pinned");
  auto pool = BufferPool::create({.buffer_bytes = 100000, .buffer_count = 3}, budget);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->buffer_bytes(), core::align_up(100000, 4096));
  EXPECT_EQ(budget.used_bytes(), 3 * core::align_up(100000, 4096));
  auto a = (*pool)->try_acquire();
  auto b = (*pool)->try_acquire();
  auto c = (*pool)->try_acquire();
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_TRUE(core::is_aligned(a->data(), 4096));
  EXPECT_EQ((*pool)->try_acquire().status().code(), StatusCode::kResourceExhausted);
  a->reset();
  EXPECT_EQ((*pool)->free_count(), 1u);
  auto d = (*pool)->acquire();
  EXPECT_TRUE(d.valid());
}

TEST(BufferPool, AskingBeyondTheBudgetNamesIt) {
  core::MemoryBudget budget("pinned host memory", 1 << 20, "strata.budgets.staging");
  auto pool = BufferPool::create({.buffer_bytes = 512 << 10, .buffer_count = 3}, budget);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(pool.status().message().find("pinned host memory"), std::string_view::npos) << pool.status();
  EXPECT_NE(pool.status().message().find("strata.budgets.staging"), std::string_view::npos) << pool.status();
  EXPECT_EQ(budget.used_bytes(), 0u);
}

// Counts what passes through it, as the engine's pinned allocator would be handed in.
class CountingAllocator final : public core::HostAllocator {
 public:
  std::string_view name() const override { return "counting allocator"; }
  core::Result<void*> allocate(std::size_t size, std::size_t alignment, int numa_node) override {
    ++allocations;
    last_node = numa_node;
    return core::default_host_allocator().allocate(size, alignment, numa_node);
  }
  void deallocate(void* p, std::size_t size) noexcept override {
    ++frees;
    core::default_host_allocator().deallocate(p, size);
  }
  int allocations = 0, frees = 0, last_node = -2;
};

TEST(BufferPool, UsesTheInjectedAllocatorAndNumaNode) {
  core::MemoryBudget budget("pinned host memory", 1 << 20);
  CountingAllocator alloc;
  {
    auto pool = BufferPool::create({.buffer_bytes = 4096, .buffer_count = 4, .numa_node = 0}, budget, alloc);
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ(alloc.allocations, 1);  // one slab
    EXPECT_EQ(alloc.last_node, 0);
  }
  EXPECT_EQ(alloc.frees, 1);
  EXPECT_EQ(budget.used_bytes(), 0u);
  auto bad = BufferPool::create({.buffer_bytes = 4096, .buffer_count = 1, .numa_node = 4096}, budget, alloc);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status();
  auto misaligned = BufferPool::create({.buffer_bytes = 4096, .buffer_count = 1, .alignment = 3000}, budget);
  EXPECT_EQ(misaligned.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::nvme
