// DirectFileWriter / DirectFileReader over every backend: round trips of odd
// sizes through a small ring and the default one, the CRC64 of the stream,
// ranges read at odd offsets, failed writes and reads naming the file (fault
// injection), a file that shrank, misuse, and O_DIRECT taken where the file
// system allows it (ext4 and tmpfs here) with the page cache as the fallback.
#include "nvme/direct_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/memory_budget.h"
#include "nvme/crc64.h"
#include "nvme/fault_injection.h"
#include "tests/nvme/test_util.h"

namespace strata::nvme {
namespace {

using core::Status;
using core::StatusCode;
using testing_util::TempDir;

constexpr std::size_t kMiB = 1u << 20;

std::vector<std::byte> random_bytes(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(rng() >> 56);
  return v;
}

// A small ring, so that a few MiB wrap it many times and requests split buffers.
DirectFileOptions small_ring() {
  DirectFileOptions o;
  o.buffer_bytes = 64 << 10;
  o.buffer_count = 3;
  o.request_bytes = 16 << 10;
  return o;
}

// True when the file system under `dir` accepts O_DIRECT.
bool accepts_direct(const std::string& dir) {
  const std::string probe = dir + "/probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

class DirectFileTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    const std::string why = testing_util::unavailable_reason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
    IoBackendOptions o;
    o.kind = GetParam();
    o.queue_depth = 8;
    o.max_retries = 16;
    o.fault_injector = &faults_;
    auto b = IoBackend::create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(b).value();
  }

  // Writes `data` in pieces of varied odd sizes; returns the writer's status.
  Status write_file(const std::string& path, const std::vector<std::byte>& data, const DirectFileOptions& o,
                    std::uint64_t* crc = nullptr, bool* direct = nullptr) {
    auto w = DirectFileWriter::create(*backend_, path, o);
    if (!w.ok()) return w.status();
    static constexpr std::size_t kPieces[] = {1, 4095, 7, 70001, 4096, 333, 200000};
    std::size_t at = 0;
    for (std::size_t k = 0; at < data.size(); ++k) {
      const std::size_t n = std::min(kPieces[k % std::size(kPieces)], data.size() - at);
      Status s = (*w)->append(std::span<const std::byte>(data.data() + at, n));
      if (!s.ok()) return s;
      at += n;
    }
    Status s = (*w)->finish();
    if (!s.ok()) return s;
    EXPECT_EQ((*w)->size_bytes(), data.size());
    if (crc != nullptr) *crc = (*w)->crc64();
    if (direct != nullptr) *direct = (*w)->direct();
    return Status();
  }

  TempDir dir_;
  FaultInjector faults_;  // outlives backend_ (declared first)
  std::unique_ptr<IoBackend> backend_;
};

TEST_P(DirectFileTest, OddSizesRoundTripWithTheCrcOfTheBytes) {
  const std::size_t sizes[] = {0, 1, 4095, 4096, 4097, 65536, 65537, 3 * 65536 - 1, 5 * kMiB + 12345};
  for (const DirectFileOptions& o : {small_ring(), DirectFileOptions{}}) {
    for (std::size_t n : sizes) {
      SCOPED_TRACE(testing::Message() << n << " bytes, buffers of " << o.buffer_bytes);
      const std::string path = dir_.path() + "/f" + std::to_string(n);
      const auto data = random_bytes(n, static_cast<std::uint32_t>(n));
      std::uint64_t crc = 0;
      ASSERT_TRUE(write_file(path, data, o, &crc).ok());
      EXPECT_EQ(std::filesystem::file_size(path), n);
      EXPECT_EQ(crc, crc64(0, data));

      auto r = DirectFileReader::open(*backend_, path, o);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ((*r)->size_bytes(), n);
      auto file_crc = (*r)->crc64();
      ASSERT_TRUE(file_crc.ok()) << file_crc.status();
      EXPECT_EQ(*file_crc, crc);
      std::vector<std::byte> back(n);
      ASSERT_TRUE((*r)->read(0, back).ok());
      EXPECT_TRUE(back == data);
      // Ranges at odd offsets, crossing buffers and ending in the partial last block.
      if (n > 10) {
        for (auto [off, len] : {std::pair<std::size_t, std::size_t>{3, n - 3}, {n / 3 + 1, n / 3}, {n - 5, 5}, {1, 1}}) {
          std::vector<std::byte> part(len);
          Status s = (*r)->read(off, part);
          ASSERT_TRUE(s.ok()) << s;
          EXPECT_TRUE(std::equal(part.begin(), part.end(), data.begin() + static_cast<std::ptrdiff_t>(off)))
              << "offset " << off << ", " << len << " bytes";
        }
      }
      // scan hands out pieces in order, none larger than a buffer.
      std::size_t seen = 0;
      ASSERT_TRUE((*r)->scan(0, n, [&](std::span<const std::byte> piece) {
                       EXPECT_LE(piece.size(), o.buffer_bytes);
                       EXPECT_TRUE(std::equal(piece.begin(), piece.end(), data.begin() + static_cast<std::ptrdiff_t>(seen)));
                       seen += piece.size();
                       return Status();
                     }).ok());
      EXPECT_EQ(seen, n);
    }
  }
}

// take_crc64_as_read: reads about front to back (consecutive ranges, gaps
// within a block, a range read twice, one far ahead) take the CRC64 in
// passing, and crc64_as_read reads only what they left; any order of reads,
// none at all, or a damaged byte still gives the whole file's CRC64.
TEST_P(DirectFileTest, Crc64TakenAsReadIsTheWholeFilesWhateverWasRead) {
  const std::size_t n = 3 * 65536 + 5000;  // a partial last block
  const auto data = random_bytes(n, 7);
  const std::string path = dir_.path() + "/f";
  std::uint64_t crc = 0;
  ASSERT_TRUE(write_file(path, data, small_ring(), &crc).ok());
  using Range = std::pair<std::size_t, std::size_t>;  // offset, length
  const std::vector<std::vector<Range>> orders = {
      {},                                                          // nothing read: all at the end
      {{0, 8}, {8, 1000}, {1100, 60000}, {61100, n - 61100}},      // front to back, a gap inside a block
      {{0, 100}, {50000, 100}, {100, 49900}, {40, 10}},            // ahead first, then the gap, then behind
      {{n - 10, 10}, {0, 4096}},                                   // the end first: not taken until the rest is
      {{70000, 5000}},                                             // a range past the first byte not taken
  };
  for (std::size_t k = 0; k < orders.size(); ++k) {
    const auto& order = orders[k];
    SCOPED_TRACE(testing::Message() << "order " << k);
    auto r = DirectFileReader::open(*backend_, path, small_ring());
    ASSERT_TRUE(r.ok()) << r.status();
    (*r)->take_crc64_as_read();
    for (const auto& [off, len] : order) {
      std::vector<std::byte> part(len);
      ASSERT_TRUE((*r)->read(off, part).ok());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), data.begin() + static_cast<std::ptrdiff_t>(off)));
    }
    const std::uint64_t ops = faults_.ops_seen();
    auto got = (*r)->crc64_as_read();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, crc);
    // Read front to back: nothing is left to read; nothing read: all of it.
    if (k == 1) {
      EXPECT_EQ(faults_.ops_seen(), ops);
    }
    if (k == 0) {
      EXPECT_GT(faults_.ops_seen(), ops);
    }
  }
  // A flipped byte in a range read, or in one never read: another CRC64.
  for (const std::size_t at : {std::size_t{100}, n - 1}) {
    auto damaged = data;
    damaged[at] ^= std::byte{0x10};
    const std::string other = dir_.path() + "/g" + std::to_string(at);
    ASSERT_TRUE(write_file(other, damaged, small_ring()).ok());
    auto r = DirectFileReader::open(*backend_, other, small_ring());
    ASSERT_TRUE(r.ok()) << r.status();
    (*r)->take_crc64_as_read();
    std::vector<std::byte> part(65536);
    ASSERT_TRUE((*r)->read(0, part).ok());
    auto got = (*r)->crc64_as_read();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_NE(*got, crc) << "byte " << at;
  }
  // Without take_crc64_as_read: a misuse, said so.
  auto r = DirectFileReader::open(*backend_, path, small_ring());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->crc64_as_read().status().code(), StatusCode::kFailedPrecondition);
}

TEST_P(DirectFileTest, ReadPastTheEndIsOutOfRangeNamingTheFile) {
  const std::string path = dir_.path() + "/short";
  ASSERT_TRUE(write_file(path, random_bytes(5000, 1), small_ring()).ok());
  auto r = DirectFileReader::open(*backend_, path, small_ring());
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<std::byte> out(10);
  Status s = (*r)->read(4995, out);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find(path), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("4995"), std::string_view::npos) << s;
  EXPECT_TRUE((*r)->read(5000, std::span<std::byte>()).ok());
}

TEST_P(DirectFileTest, FailedWriteIsAnErrorNamingTheFileFromThenOn) {
  const std::string path = dir_.path() + "/eio";
  faults_.add({.kind = FaultKind::kEio, .ops = FaultOps::kWrites, .skip = 3});
  auto w = DirectFileWriter::create(*backend_, path, small_ring());
  ASSERT_TRUE(w.ok()) << w.status();
  const auto data = random_bytes(kMiB, 7);
  Status s;
  for (std::size_t at = 0; at < data.size() && s.ok(); at += 10000) {
    s = (*w)->append(std::span<const std::byte>(data.data() + at, std::min<std::size_t>(10000, data.size() - at)));
  }
  if (s.ok()) s = (*w)->finish();
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_EQ(s.error_number(), EIO);
  EXPECT_NE(s.message().find(path), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("at offset "), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("wanted 16384 bytes"), std::string_view::npos) << s;
  EXPECT_EQ(faults_.total_hits(), 1u);
  // Sticky: nothing after it succeeds.
  EXPECT_FALSE((*w)->append(std::span<const std::byte>(data.data(), 1)).ok());
}

TEST_P(DirectFileTest, EnospcIsResourceExhaustedNamingTheFile) {
  // 100 KiB through 64 KiB buffers of 16 KiB requests: the fifth write is part of the padded tail.
  faults_.add({.kind = FaultKind::kEnospc, .ops = FaultOps::kWrites, .skip = 4});
  DirectFileOptions o = small_ring();
  Status s = write_file(dir_.path() + "/full", random_bytes(100 << 10, 3), o);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find(dir_.path() + "/full"), std::string_view::npos) << s;
}

TEST_P(DirectFileTest, ShortAndRetriedTransfersLoseNothing) {
  faults_.add({.kind = FaultKind::kShortTransfer, .ops = FaultOps::kAny, .times = 5});
  faults_.add({.kind = FaultKind::kEintr, .ops = FaultOps::kAny, .skip = 2, .times = 3});
  const std::string path = dir_.path() + "/short";
  const auto data = random_bytes(kMiB + 777, 9);
  std::uint64_t crc = 0;
  ASSERT_TRUE(write_file(path, data, small_ring(), &crc).ok());
  auto r = DirectFileReader::open(*backend_, path, small_ring());
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE((*r)->read(0, back).ok());
  EXPECT_TRUE(back == data);
  EXPECT_EQ(crc, crc64(0, data));
  EXPECT_GT(faults_.total_hits(), 0u);
}

TEST_P(DirectFileTest, FailedReadIsAnErrorNamingTheFileAndTheReaderStaysUsable) {
  const std::string path = dir_.path() + "/rd";
  const auto data = random_bytes(kMiB, 4);
  ASSERT_TRUE(write_file(path, data, small_ring()).ok());
  auto r = DirectFileReader::open(*backend_, path, small_ring());
  ASSERT_TRUE(r.ok()) << r.status();
  faults_.add({.kind = FaultKind::kEio, .ops = FaultOps::kReads, .skip = 20});
  auto crc = (*r)->crc64();
  ASSERT_FALSE(crc.ok());
  EXPECT_EQ(crc.status().code(), StatusCode::kIoError) << crc.status();
  EXPECT_NE(crc.status().message().find(path), std::string_view::npos) << crc.status();
  auto again = (*r)->crc64();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, crc64(0, data));
}

// The file's partial last block goes through the backend like the rest (so
// its retries and a test's faults reach it).
TEST_P(DirectFileTest, PartialLastBlockIsReadThroughTheBackend) {
  const std::string path = dir_.path() + "/tail";
  const auto data = random_bytes(300000, 6);  // 73 blocks and 976 bytes
  ASSERT_TRUE(write_file(path, data, small_ring()).ok());
  auto r = DirectFileReader::open(*backend_, path, small_ring());
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<std::byte> out(500);
  const std::size_t eio = faults_.add({.kind = FaultKind::kEio, .ops = FaultOps::kReads});
  const Status s = (*r)->read(299500, out);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_NE(s.message().find(path), std::string_view::npos) << s;
  EXPECT_EQ(faults_.hits(eio), 1u);
  faults_.clear();
  faults_.add({.kind = FaultKind::kEintr, .ops = FaultOps::kReads, .times = 3});
  ASSERT_TRUE((*r)->read(299500, out).ok());
  EXPECT_EQ(std::memcmp(out.data(), data.data() + 299500, out.size()), 0);
  EXPECT_EQ(faults_.total_hits(), 3u);
}

TEST_P(DirectFileTest, FileThatShrankAfterOpenIsDataLoss) {
  const std::string path = dir_.path() + "/shrink";
  ASSERT_TRUE(write_file(path, random_bytes(300000, 5), small_ring()).ok());
  for (off_t cut : {off_t{299000}, off_t{100000}}) {
    SCOPED_TRACE(cut);
    auto r = DirectFileReader::open(*backend_, path, small_ring());
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(::truncate(path.c_str(), cut), 0);
    auto crc = (*r)->crc64();
    ASSERT_FALSE(crc.ok());
    EXPECT_EQ(crc.status().code(), StatusCode::kDataLoss) << crc.status();
    EXPECT_NE(crc.status().message().find(path), std::string_view::npos) << crc.status();
  }
}

TEST_P(DirectFileTest, MisuseIsRejected) {
  DirectFileOptions bad = small_ring();
  bad.buffer_bytes = 5000;
  EXPECT_EQ(DirectFileWriter::create(*backend_, dir_.path() + "/x", bad).status().code(),
            StatusCode::kInvalidArgument);
  bad = small_ring();
  bad.buffer_count = 1;
  EXPECT_EQ(DirectFileReader::open(*backend_, dir_.path() + "/x", bad).status().code(),
            StatusCode::kInvalidArgument);
  bad = small_ring();
  bad.request_bytes = 0;
  EXPECT_EQ(DirectFileWriter::create(*backend_, dir_.path() + "/x", bad).status().code(),
            StatusCode::kInvalidArgument);
  auto missing = DirectFileReader::open(*backend_, dir_.path() + "/missing", small_ring());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(dir_.path() + "/missing"), std::string_view::npos) << missing.status();
  // The ring is charged to the budget given, before anything is allocated.
  core::MemoryBudget budget("test staging", 100 << 10, "test.key");
  DirectFileOptions o = small_ring();
  o.budget = &budget;
  auto over = DirectFileWriter::create(*backend_, dir_.path() + "/y", o);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  auto w = DirectFileWriter::create(*backend_, dir_.path() + "/z", small_ring());
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->finish().ok());
  EXPECT_EQ((*w)->finish().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*w)->append(std::span<const std::byte>()).code(), StatusCode::kFailedPrecondition);
}

// O_DIRECT is used wherever the file system takes it (ext4 for the temporary
// directory and tmpfs for /dev/shm on this project's machines); elsewhere
// auto falls back to the page cache and on is an error. kOff never uses it.
TEST_P(DirectFileTest, DirectIoWhereTheFileSystemAllowsIt) {
  std::vector<std::string> dirs = {dir_.path()};
  std::string shm;
  if (std::filesystem::is_directory("/dev/shm")) {
    char tmpl[] = "/dev/shm/strata_direct_XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) shm = tmpl;
  }
  if (!shm.empty()) dirs.push_back(shm);
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    const bool can = accepts_direct(dir);
    const auto data = random_bytes(3 * 65536 + 5, 11);
    for (DirectIo mode : {DirectIo::kAuto, DirectIo::kOn, DirectIo::kOff}) {
      DirectFileOptions o = small_ring();
      o.direct_io = mode;
      const std::string path = dir + "/d";
      bool direct = false;
      std::uint64_t crc = 0;
      Status s = write_file(path, data, o, &crc, &direct);
      if (mode == DirectIo::kOn && !can) {
        EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
        continue;
      }
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(direct, can && mode != DirectIo::kOff);
      auto r = DirectFileReader::open(*backend_, path, o);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ((*r)->direct(), can && mode != DirectIo::kOff);
      auto back = (*r)->crc64();
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(*back, crc64(0, data));
    }
    if (!can) std::printf("note: %s refuses O_DIRECT: checked the page-cache fallback there\n", dir.c_str());
  }
  if (!shm.empty()) std::filesystem::remove_all(shm);
}

INSTANTIATE_TEST_SUITE_P(Backends, DirectFileTest, ::testing::ValuesIn(testing_util::all_backends()),
                         testing_util::backend_name);

}  // namespace
}  // namespace strata::nvme
