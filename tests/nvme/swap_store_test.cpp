// SwapStore conformance over every backend: aligned and unaligned block
// sizes, many blocks in flight, striping over several paths, reopen from a
// saved index, corruption caught by CRC64, and the checks made at creation
// (missing, unwritable, full or locked paths, the lock held against a second
// process).
#include "nvme/swap_store.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "core/logging.h"
#include "core/memory_budget.h"
#include "nvme/fault_injection.h"
#include "nvme/internal/swap_index.h"
#include "tests/nvme/test_util.h"

extern char** environ;

namespace strata::nvme {
namespace {

using core::Status;
using core::StatusCode;
using testing_util::random_buffer;
using testing_util::same_bytes;
using testing_util::TempDir;
using testing_util::zero_buffer;

class SwapStoreTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    const std::string why = testing_util::unavailable_reason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }

  SwapStoreOptions options(std::vector<std::string> paths, std::uint64_t capacity = 32 << 20) const {
    SwapStoreOptions o;
    o.paths = std::move(paths);
    o.capacity_bytes = capacity;
    o.stripe_bytes = 256 << 10;
    o.request_bytes = 64 << 10;
    o.io.kind = GetParam();
    o.io.queue_depth = 16;
    return o;
  }

  std::unique_ptr<SwapStore> make(const SwapStoreOptions& o) {
    auto s = SwapStore::create(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  TempDir dir_;
};

TEST_P(SwapStoreTest, AlignedAndUnalignedSizesRoundTrip) {
  auto store = make(options({dir_.path()}));
  ASSERT_NE(store, nullptr);
  const std::vector<std::uint64_t> sizes = {1, 100, 4095, 4096, 4097, 65536, 65536 + 17, 256 << 10,
                                            (256 << 10) + 1, 1000000, 3 << 20};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::string id = "b" + std::to_string(i);
    ASSERT_TRUE(store->allocate(id, sizes[i]).ok());
    auto src = random_buffer(sizes[i], static_cast<std::uint32_t>(i));
    auto dst = zero_buffer(sizes[i]);
    ASSERT_TRUE(store->write(id, std::span<const std::byte>(src.data(), sizes[i])).ok()) << sizes[i];
    Status s = store->read(id, std::span<std::byte>(dst.data(), sizes[i]));
    ASSERT_TRUE(s.ok()) << sizes[i] << ": " << s;
    EXPECT_TRUE(same_bytes(src, dst, sizes[i])) << "size " << sizes[i];
  }
  EXPECT_TRUE(store->close().ok());
}

TEST_P(SwapStoreTest, ManyBlocksInFlight) {
  auto store = make(options({dir_.path()}));
  ASSERT_NE(store, nullptr);
  constexpr int kBlocks = 48;
  constexpr std::size_t kSize = 100 << 10;
  std::vector<core::AlignedBuffer> src, dst;
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(store->allocate("m" + std::to_string(i), kSize + 8 * i).ok());
    src.push_back(random_buffer(kSize + 8 * i, 100 + i));
    dst.push_back(zero_buffer(kSize + 8 * i));
  }
  std::vector<SwapIo> ios;
  for (int i = 0; i < kBlocks; ++i) {
    auto io = store->start_write("m" + std::to_string(i), std::span<const std::byte>(src[i].data(), kSize + 8 * i));
    ASSERT_TRUE(io.ok()) << io.status();
    ios.push_back(std::move(io).value());
  }
  for (auto& io : ios) EXPECT_TRUE(io.wait().ok());
  ios.clear();
  for (int i = 0; i < kBlocks; ++i) {
    auto io = store->start_read("m" + std::to_string(i), std::span<std::byte>(dst[i].data(), kSize + 8 * i));
    ASSERT_TRUE(io.ok()) << io.status();
    ios.push_back(std::move(io).value());
  }
  for (auto& io : ios) EXPECT_TRUE(io.wait().ok());
  for (int i = 0; i < kBlocks; ++i) EXPECT_TRUE(same_bytes(src[i], dst[i], kSize + 8 * i)) << i;
}

TEST_P(SwapStoreTest, LargeBlocksAreStripedOverEveryPath) {
  const std::vector<std::string> paths = {dir_.sub("a"), dir_.sub("b"), dir_.sub("c")};
  auto store = make(options(paths));
  ASSERT_NE(store, nullptr);
  constexpr std::uint64_t kSize = (256 << 10) * 5 + 1234;  // 6 stripe units, the last one short
  ASSERT_TRUE(store->allocate("big", kSize).ok());
  auto ext = store->extents("big");
  ASSERT_TRUE(ext.ok());
  EXPECT_EQ(ext->size(), 6u);
  std::set<std::string> files;
  std::uint64_t total = 0;
  for (const auto& e : *ext) {
    files.insert(e.file);
    total += e.length;
  }
  EXPECT_EQ(files.size(), 3u);
  EXPECT_EQ(total, kSize);
  auto src = random_buffer(kSize, 7);
  auto dst = zero_buffer(kSize);
  ASSERT_TRUE(store->write("big", std::span<const std::byte>(src.data(), kSize)).ok());
  ASSERT_TRUE(store->read("big", std::span<std::byte>(dst.data(), kSize)).ok());
  EXPECT_TRUE(same_bytes(src, dst, kSize));
  // Small blocks go round robin.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(store->allocate("s" + std::to_string(i), 1000).ok());
  std::set<std::string> small_files;
  for (int i = 0; i < 3; ++i) small_files.insert((*store->extents("s" + std::to_string(i)))[0].file);
  EXPECT_EQ(small_files.size(), 3u);
}

// traffic() counts each path's bytes as the backend completes them; the
// blocks' path_bytes (from their extents) say where each block's bytes go.
// Short transfers and EINTR retries (a fault injector under the backend) move
// each byte once, and count it once.
TEST_P(SwapStoreTest, TrafficCountsEachPathsBytesOnceAcrossRetries) {
  FaultInjector faults;
  faults.add({.kind = FaultKind::kShortTransfer, .ops = FaultOps::kAny, .skip = 1, .times = 6});
  faults.add({.kind = FaultKind::kEintr, .ops = FaultOps::kAny, .skip = 2, .times = 4});
  SwapStoreOptions o = options({dir_.sub("a"), dir_.sub("b")});
  o.io.fault_injector = &faults;
  auto store = make(o);
  ASSERT_NE(store, nullptr);
  for (const FileTraffic& t : store->traffic()) EXPECT_EQ(t, FileTraffic{});
  // 4096-aligned blocks: one striped over both paths (3 stripe units and a
  // sector), two small ones round robin.
  const std::vector<std::uint64_t> sizes = {(256 << 10) * 3 + 4096, 8192, 12288};
  std::vector<std::uint64_t> expect(2, 0);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::string id = "t" + std::to_string(i);
    ASSERT_TRUE(store->allocate(id, sizes[i]).ok());
    auto split = store->path_bytes(id);
    ASSERT_TRUE(split.ok()) << split.status();
    ASSERT_EQ(split->size(), 2u);
    EXPECT_EQ((*split)[0] + (*split)[1], sizes[i]);
    // The split agrees with the extents' files.
    auto ext = store->extents(id);
    ASSERT_TRUE(ext.ok());
    std::vector<std::uint64_t> by_file(2, 0);
    for (const SwapExtent& e : *ext) by_file[e.file == store->file_path(0) ? 0 : 1] += e.length;
    EXPECT_EQ(by_file, *split) << id;
    auto src = random_buffer(sizes[i], static_cast<std::uint32_t>(40 + i));
    auto io = store->start_write(id, std::span<const std::byte>(src.data(), sizes[i]));
    ASSERT_TRUE(io.ok()) << io.status();
    EXPECT_EQ(io->path_bytes(), *split) << id;
    ASSERT_TRUE(io->wait().ok());
    expect[0] += (*split)[0];
    expect[1] += (*split)[1];
    total += sizes[i];
  }
  EXPECT_GT(expect[0], 0u);
  EXPECT_GT(expect[1], 0u);
  std::vector<FileTraffic> t = store->traffic();
  ASSERT_EQ(t.size(), 2u);
  for (std::size_t p = 0; p < 2; ++p) {
    EXPECT_EQ(t[p].bytes_written, expect[p]) << "path " << p;
    EXPECT_EQ(t[p].bytes_read, 0u) << "path " << p;
  }
  // Read the striped block twice: reads count separately from writes.
  auto dst = zero_buffer(sizes[0]);
  for (int k = 0; k < 2; ++k) ASSERT_TRUE(store->read("t0", std::span<std::byte>(dst.data(), sizes[0])).ok());
  const std::vector<std::uint64_t> split0 = *store->path_bytes("t0");
  t = store->traffic();
  for (std::size_t p = 0; p < 2; ++p) {
    EXPECT_EQ(t[p].bytes_written, expect[p]) << "path " << p;
    EXPECT_EQ(t[p].bytes_read, 2 * split0[p]) << "path " << p;
  }
  EXPECT_EQ(t[0].bytes_written + t[1].bytes_written, total);
  EXPECT_GT(faults.total_hits(), 0u);
  // The totals survive close.
  ASSERT_TRUE(store->close().ok());
  EXPECT_EQ(store->traffic(), t);
  EXPECT_EQ(store->path_bytes("nope").status().code(), StatusCode::kNotFound);
}

// With O_DIRECT a block's last partial sector is written whole: the backend's
// count is the bytes the drive took, at most one sector more per extent.
TEST_P(SwapStoreTest, TrafficCountsWholeSectorsOfAnUnalignedBlock) {
  auto store = make(options({dir_.path()}));
  ASSERT_NE(store, nullptr);
  constexpr std::uint64_t kSize = 10000;
  ASSERT_TRUE(store->allocate("u", kSize).ok());
  auto src = random_buffer(kSize, 9);
  ASSERT_TRUE(store->write("u", std::span<const std::byte>(src.data(), kSize)).ok());
  const std::uint64_t written = store->traffic()[0].bytes_written;
  EXPECT_EQ(written, store->direct_io() ? 12288u : kSize);
}

TEST_P(SwapStoreTest, ReopenFromSavedIndexAndReadBack) {
  const std::vector<std::string> paths = {dir_.sub("p0"), dir_.sub("p1")};
  const std::string index = dir_.path() + "/swap.index";
  const std::vector<std::uint64_t> sizes = {4096, 77777, (256 << 10) * 3 + 5, 1};
  std::vector<core::AlignedBuffer> src;
  {
    auto o = options(paths);
    o.keep_files = true;
    auto store = make(o);
    ASSERT_NE(store, nullptr);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::string id = "r" + std::to_string(i);
      ASSERT_TRUE(store->allocate(id, sizes[i]).ok());
      src.push_back(random_buffer(sizes[i], 40 + static_cast<std::uint32_t>(i)));
      ASSERT_TRUE(store->write(id, std::span<const std::byte>(src[i].data(), sizes[i])).ok());
    }
    ASSERT_TRUE(store->allocate("never-written", 5000).ok());
    ASSERT_TRUE(store->save_index(index).ok());
    ASSERT_TRUE(store->close().ok());
  }
  for (const auto& p : paths) EXPECT_TRUE(std::filesystem::exists(p + "/" + std::string(SwapStore::kSwapFileName)));
  auto o = options({});
  auto reopened = SwapStore::open(o, index);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto& store = *reopened;
  EXPECT_EQ(store->paths(), paths);
  EXPECT_EQ(store->block_count(), sizes.size() + 1);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    auto dst = zero_buffer(sizes[i]);
    Status s = store->read("r" + std::to_string(i), std::span<std::byte>(dst.data(), sizes[i]));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(same_bytes(src[i], dst, sizes[i]));
  }
  auto dst = zero_buffer(5000);
  EXPECT_EQ(store->read("never-written", std::span<std::byte>(dst.data(), 5000)).code(),
            StatusCode::kFailedPrecondition);
  // New blocks do not overlap the old ones.
  ASSERT_TRUE(store->allocate("new", 300000).ok());
  auto fresh = random_buffer(300000, 9);
  ASSERT_TRUE(store->write("new", std::span<const std::byte>(fresh.data(), 300000)).ok());
  auto again = zero_buffer(sizes[2]);
  ASSERT_TRUE(store->read("r2", std::span<std::byte>(again.data(), sizes[2])).ok());
  EXPECT_TRUE(same_bytes(src[2], again, sizes[2]));
  ASSERT_TRUE(store->close().ok());
  // Not kept this time: the files are gone.
  for (const auto& p : paths) EXPECT_FALSE(std::filesystem::exists(p + "/" + std::string(SwapStore::kSwapFileName)));
}

TEST_P(SwapStoreTest, CorruptExtentIsDataLossNamingFileAndOffset) {
  auto store = make(options({dir_.sub("x"), dir_.sub("y")}));
  ASSERT_NE(store, nullptr);
  constexpr std::uint64_t kSize = (256 << 10) * 2 + 999;
  ASSERT_TRUE(store->allocate("c", kSize).ok());
  auto src = random_buffer(kSize, 11);
  ASSERT_TRUE(store->write("c", std::span<const std::byte>(src.data(), kSize)).ok());
  auto ext = store->extents("c");
  ASSERT_TRUE(ext.ok());
  const SwapExtent& victim = (*ext)[1];
  // Flip one bit on disk behind the store's back.
  {
    const int fd = ::open(victim.file.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    unsigned char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(victim.file_offset + 10)), 1);
    byte ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(victim.file_offset + 10)), 1);
    ::close(fd);
  }
  auto dst = zero_buffer(kSize);
  Status s = store->read("c", std::span<std::byte>(dst.data(), kSize));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_TRUE(s.is_data_loss());
  EXPECT_NE(s.message().find(victim.file), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("at offset " + std::to_string(victim.file_offset)), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("CRC64"), std::string_view::npos) << s;
}

TEST_P(SwapStoreTest, MisuseIsRejected) {
  auto store = make(options({dir_.path()}));
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->allocate("a", 8192).ok());
  EXPECT_EQ(store->allocate("a", 8192).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(store->allocate("zero", 0).code(), StatusCode::kInvalidArgument);
  auto buf = zero_buffer(16384);
  EXPECT_EQ(store->write("a", std::span<const std::byte>(buf.data(), 4096)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->write("nope", std::span<const std::byte>(buf.data(), 8192)).code(), StatusCode::kNotFound);
  EXPECT_EQ(store->read("a", std::span<std::byte>(buf.data(), 8192)).code(), StatusCode::kFailedPrecondition);
  if (store->direct_io()) {
    EXPECT_EQ(store->write("a", std::span<const std::byte>(buf.data() + 8, 8192)).code(),
              StatusCode::kInvalidArgument);
  }
  auto io = store->start_write("a", std::span<const std::byte>(buf.data(), 8192));
  ASSERT_TRUE(io.ok());
  EXPECT_EQ(store->start_read("a", std::span<std::byte>(buf.data() + 8192, 8192)).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->remove("a").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->close().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(io->wait().ok());
  EXPECT_TRUE(store->remove("a").ok());
  EXPECT_EQ(store->remove("a").code(), StatusCode::kNotFound);
  // Space comes back: the whole capacity is free again.
  EXPECT_EQ(store->free_bytes(), store->capacity_bytes());
}

TEST_P(SwapStoreTest, FullStoreIsResourceExhaustedNamingTheKey) {
  auto store = make(options({dir_.path()}, 1 << 20));
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->allocate("most", 900 << 10).ok());
  Status s = store->allocate("more", 200 << 10);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("strata.budgets.disk_bytes"), std::string_view::npos) << s;
}

TEST_P(SwapStoreTest, RegisteredPoolBuffersWork) {
  core::MemoryBudget budget("pinned host memory", 4 << 20, "strata.budgets.staging");
  auto pool = BufferPool::create({.buffer_bytes = 1 << 20, .buffer_count = 2}, budget);
  ASSERT_TRUE(pool.ok());
  auto store = make(options({dir_.path()}));
  ASSERT_NE(store, nullptr);
  Status reg = store->register_buffers(**pool);
  if (!reg.ok()) GTEST_SKIP() << "buffer registration refused here: " << reg;
  auto a = (*pool)->acquire();
  auto b = (*pool)->acquire();
  auto src = random_buffer(1 << 20, 12);
  std::memcpy(a.data(), src.data(), 1 << 20);
  ASSERT_TRUE(store->allocate("p", 1 << 20).ok());
  ASSERT_TRUE(store->write("p", a.bytes()).ok());
  ASSERT_TRUE(store->read("p", b.bytes()).ok());
  EXPECT_EQ(std::memcmp(b.data(), src.data(), 1 << 20), 0);
  ASSERT_TRUE(store->close().ok());
}

TEST_P(SwapStoreTest, SecondProcessIsRefusedALockedPath) {
  const char* probe = std::getenv("STRATA_NVME_LOCK_PROBE");
  if (probe == nullptr || ::access(probe, X_OK) != 0) {
    GTEST_SKIP() << "STRATA_NVME_LOCK_PROBE (the nvme_lock_probe helper) is not set; run through meson test";
  }
  auto store = make(options({dir_.path()}));
  ASSERT_NE(store, nullptr);
  // A second store in this process is refused too.
  auto second = SwapStore::create(options({dir_.path()}));
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists) << second.status();
  pid_t pid = 0;
  std::string path = dir_.path();
  char* argv[] = {const_cast<char*>(probe), path.data(), nullptr};
  ASSERT_EQ(posix_spawn(&pid, probe, nullptr, nullptr, argv, environ), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the second process was not refused (1) or failed otherwise (2)";
  // Once closed, the path is free again.
  ASSERT_TRUE(store->close().ok());
  auto third = SwapStore::create(options({dir_.path()}));
  EXPECT_TRUE(third.ok()) << third.status();
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapStoreTest, ::testing::ValuesIn(testing_util::all_backends()),
                         testing_util::backend_name);

// --- creation checks (no backend dependence) -----------------------------------

SwapStoreOptions psync_options(std::vector<std::string> paths, std::uint64_t capacity = 1 << 20) {
  SwapStoreOptions o;
  o.paths = std::move(paths);
  o.capacity_bytes = capacity;
  o.io.kind = BackendKind::kPsync;
  o.io.queue_depth = 2;
  return o;
}

TEST(SwapStoreCreate, MissingPathIsNotFound) {
  TempDir dir;
  auto s = SwapStore::create(psync_options({dir.path() + "/nope"}));
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find(dir.path() + "/nope"), std::string_view::npos) << s.status();
}

TEST(SwapStoreCreate, FileInsteadOfDirectoryIsInvalid) {
  TempDir dir;
  const std::string f = dir.path() + "/plain";
  ::close(::open(f.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  EXPECT_EQ(SwapStore::create(psync_options({f})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SwapStore::create(psync_options({dir.path(), dir.path() + "/"})).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SwapStore::create(psync_options({})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SwapStore::create(psync_options({dir.path()}, 0)).status().code(), StatusCode::kInvalidArgument);
}

TEST(SwapStoreCreate, UnwritablePathIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: directory permissions do not stop root";
  TempDir dir;
  const std::string ro = dir.sub("ro");
  ASSERT_EQ(::chmod(ro.c_str(), 0555), 0);
  auto s = SwapStore::create(psync_options({ro}));
  EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status();
  EXPECT_NE(s.status().message().find(ro), std::string_view::npos) << s.status();
  ::chmod(ro.c_str(), 0755);
}

TEST(SwapStoreCreate, NotEnoughFreeSpaceIsResourceExhaustedUpFront) {
  TempDir dir;
  // Two paths on one file system: their needs add up against its free space.
  auto s = SwapStore::create(psync_options({dir.sub("a"), dir.sub("b")}, 1ull << 62));
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find("one file system"), std::string_view::npos) << s.status();
  EXPECT_NE(s.status().message().find("is free"), std::string_view::npos) << s.status();
  // Nothing was left behind.
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/a/" + std::string(SwapStore::kSwapFileName)));
}

TEST(SwapStoreCreate, FilesAreRemovedAtCloseUnlessKept) {
  TempDir dir;
  const std::string file = dir.path() + "/" + std::string(SwapStore::kSwapFileName);
  {
    auto s = SwapStore::create(psync_options({dir.path()}));
    ASSERT_TRUE(s.ok());
    EXPECT_TRUE(std::filesystem::exists(file));
    EXPECT_GE(std::filesystem::file_size(file), 1u << 20);
  }
  EXPECT_FALSE(std::filesystem::exists(file));
  auto o = psync_options({dir.path()});
  o.keep_files = true;
  {
    auto s = SwapStore::create(o);
    ASSERT_TRUE(s.ok());
  }
  EXPECT_TRUE(std::filesystem::exists(file));
}

TEST(SwapStoreCreate, CloseRemovesTheLockFileKeptOrNot) {
  TempDir dir;
  const std::string lock = dir.path() + "/" + std::string(SwapStore::kLockFileName);
  for (const bool keep : {false, true}) {
    auto o = psync_options({dir.path()});
    o.keep_files = keep;
    auto s = SwapStore::create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(std::filesystem::exists(lock));
    ASSERT_TRUE((*s)->close().ok());
    EXPECT_FALSE(std::filesystem::exists(lock)) << "keep_files " << keep;
  }
  // A store whose creation failed after locking removes its lock file too.
  auto full = SwapStore::create(psync_options({dir.path()}, 1ull << 62));
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted) << full.status();
  EXPECT_FALSE(std::filesystem::exists(lock));
}

// A process that opened the lock file before its holder removed it (at close)
// must not lock the removed inode: it locks the file the path names now.
TEST(SwapStoreCreate, LockFileRemovedUnderAWaitingLockerIsNotShared) {
  TempDir dir;
  const std::string lock = dir.path() + "/" + std::string(SwapStore::kLockFileName);
  auto first = SwapStore::create(psync_options({dir.path()}));
  ASSERT_TRUE(first.ok()) << first.status();
  const int stale = ::open(lock.c_str(), O_RDWR | O_CLOEXEC);  // a locker that opened it already
  ASSERT_GE(stale, 0);
  ASSERT_TRUE((*first)->close().ok());
  auto second = SwapStore::create(psync_options({dir.path()}));
  ASSERT_TRUE(second.ok()) << second.status();
  struct stat old_inode {}, now {};
  ASSERT_EQ(::fstat(stale, &old_inode), 0);
  ASSERT_EQ(::stat(lock.c_str(), &now), 0);
  EXPECT_NE(old_inode.st_ino, now.st_ino) << "the second store locked the removed lock file";
  // The path is locked: a third store is refused.
  EXPECT_EQ(SwapStore::create(psync_options({dir.path()})).status().code(), StatusCode::kAlreadyExists);
  ::close(stale);
}

// A run killed while its store was open (no close: the child _exits) leaves
// its swap file; the next store in that path reclaims it with an info line
// naming it and its size.
TEST(SwapStoreCreate, StaleSwapFileOfAKilledRunIsReclaimedWithAnInfoLine) {
  TempDir dir;
  const std::string file = dir.path() + "/" + std::string(SwapStore::kSwapFileName);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto s = SwapStore::create(psync_options({dir.path()}, 3 << 20));
    if (!s.ok()) ::_exit(2);
    std::move(s).value().release();  // never closed, as under kill -9
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(std::filesystem::exists(file));
  std::vector<std::string> infos;
  core::set_log_sink([&](core::LogLevel level, std::string_view m) {
    if (level == core::LogLevel::kInfo) infos.emplace_back(m);
  });
  const core::LogLevel was = core::log_level();
  core::set_log_level(core::LogLevel::kInfo);
  auto s = SwapStore::create(psync_options({dir.path()}));
  core::set_log_level(was);
  core::set_log_sink({});
  ASSERT_TRUE(s.ok()) << s.status();
  bool named = false;
  for (const std::string& m : infos) {
    if (m.find(file) != std::string::npos && m.find("3.00 MiB") != std::string::npos) named = true;
  }
  EXPECT_TRUE(named) << "no info line names " << file << " and its 3.00 MiB (" << infos.size() << " info lines)";
  ASSERT_TRUE((*s)->close().ok());
  EXPECT_FALSE(std::filesystem::exists(file));
  // A clean close leaves nothing to reclaim.
  infos.clear();
  core::set_log_sink([&](core::LogLevel level, std::string_view m) {
    if (level == core::LogLevel::kInfo) infos.emplace_back(m);
  });
  core::set_log_level(core::LogLevel::kInfo);
  auto again = SwapStore::create(psync_options({dir.path()}));
  core::set_log_level(was);
  core::set_log_sink({});
  ASSERT_TRUE(again.ok()) << again.status();
  for (const std::string& m : infos) EXPECT_EQ(m.find("stale"), std::string::npos) << m;
}

TEST(SwapStoreIndex, CorruptOrForeignIndexIsRefused) {
  TempDir dir;
  const std::string index = dir.path() + "/i";
  {
    auto o = psync_options({dir.sub("d")});
    o.keep_files = true;
    auto s = SwapStore::create(o);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->allocate("x", 10).ok());
    ASSERT_TRUE((*s)->save_index(index).ok());
  }
  // Flip a byte in the middle: the index checksum catches it.
  std::string bytes;
  {
    FILE* f = std::fopen(index.c_str(), "rb");
    ASSERT_NE(f, nullptr);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.append(buf, n);
    std::fclose(f);
  }
  auto write_file = [](const std::string& p, const std::string& b) {
    FILE* f = std::fopen(p.c_str(), "wb");
    std::fwrite(b.data(), 1, b.size(), f);
    std::fclose(f);
  };
  std::string bad = bytes;
  bad[bad.size() / 2] ^= 1;
  write_file(index + ".bad", bad);
  auto r = SwapStore::open(psync_options({}), index + ".bad");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  write_file(index + ".short", bytes.substr(0, 20));
  EXPECT_FALSE(SwapStore::open(psync_options({}), index + ".short").ok());
  write_file(index + ".foreign", "hello world, not an index");
  EXPECT_EQ(SwapStore::open(psync_options({}), index + ".foreign").status().code(), StatusCode::kInvalidArgument);
  std::string v2 = bytes;
  v2[8] = 2;  // version field
  write_file(index + ".v2", v2);
  auto rv = SwapStore::open(psync_options({}), index + ".v2");
  EXPECT_EQ(rv.status().code(), StatusCode::kFailedPrecondition) << rv.status();
  EXPECT_NE(rv.status().message().find("version 2"), std::string_view::npos) << rv.status();
  // Paths that differ from the saved ones are refused.
  EXPECT_EQ(SwapStore::open(psync_options({dir.path()}), index).status().code(), StatusCode::kInvalidArgument);
  // The good one opens.
  auto ok = SwapStore::open(psync_options({}), index);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

// Saves the index of a kept store holding block "x" (10 bytes) and "y" (3 stripes of 8 KiB),
// changes it with `edit` (re-encoded with a right checksum, as a bug or a tool could write it),
// and reopens the store from it.
Status reopen_edited_index(const std::function<void(internal::SwapIndex&)>& edit) {
  TempDir dir;
  const std::string index = dir.path() + "/i";
  {
    auto o = psync_options({dir.sub("d")});
    o.keep_files = true;
    o.stripe_bytes = 8192;
    auto s = SwapStore::create(o);
    if (!s.ok()) return s.status();
    if (Status st = (*s)->allocate("x", 10); !st.ok()) return st;
    if (Status st = (*s)->allocate("y", 3 * 8192); !st.ok()) return st;
    if (Status st = (*s)->save_index(index); !st.ok()) return st;
  }
  std::string bytes;
  {
    std::ifstream in(index, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto decoded = internal::decode_index(bytes, index);
  if (!decoded.ok()) return decoded.status();
  edit(*decoded);
  {
    std::ofstream out(index, std::ios::binary | std::ios::trunc);
    out << internal::encode_index(*decoded);
  }
  auto reopened = SwapStore::open(psync_options({}), index);
  return reopened.ok() ? Status() : reopened.status();
}

TEST(SwapStoreIndex, UneditedIndexReopens) {
  Status s = reopen_edited_index([](internal::SwapIndex&) {});
  EXPECT_TRUE(s.ok()) << s;
}

TEST(SwapStoreIndex, ZeroOrUnalignedStripeIsDataLoss) {
  // A stripe of 0 divided by zero in the next allocate.
  for (std::uint64_t stripe : {std::uint64_t{0}, std::uint64_t{5000}}) {
    Status s = reopen_edited_index([&](internal::SwapIndex& i) { i.stripe_bytes = stripe; });
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("stripe size " + std::to_string(stripe)), std::string_view::npos) << s;
  }
}

TEST(SwapStoreIndex, ExtentsThatDoNotHoldTheBlockAreDataLoss) {
  auto block = [](internal::SwapIndex& i, const std::string& id) -> internal::IndexBlock& {
    for (auto& b : i.blocks) {
      if (b.id == id) return b;
    }
    ADD_FAILURE() << "no block " << id;
    return i.blocks.front();
  };
  // An extent longer than its block made a read write past the caller's buffer.
  Status s = reopen_edited_index([&](internal::SwapIndex& i) { block(i, "x").extents[0].length = 11264; });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("block 'x'"), std::string_view::npos) << s;
  s = reopen_edited_index([&](internal::SwapIndex& i) { block(i, "y").extents.back().length -= 8192; });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("hold 16384 bytes, not its 24576 bytes"), std::string_view::npos) << s;
  s = reopen_edited_index([&](internal::SwapIndex& i) { block(i, "y").size = 3 * 8192 + 1; });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  // Past the end of its swap file, or not aligned.
  s = reopen_edited_index(
      [&](internal::SwapIndex& i) { block(i, "x").extents[0].file_offset = i.file_bytes[0]; });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("does not fit in its swap file"), std::string_view::npos) << s;
  s = reopen_edited_index([&](internal::SwapIndex& i) { block(i, "x").extents[0].file_offset += 512; });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
}

}  // namespace
}  // namespace strata::nvme
