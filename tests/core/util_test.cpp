// Aligned buffers, byte formatting/parsing, UniqueFd, logging.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/clock.h"
#include "core/host_allocator.h"
#include "core/logging.h"
#include "core/str.h"
#include "core/unique_fd.h"

namespace strata::core {
namespace {

// Counts what passes through, to prove HostBlock returns memory to the allocator it came from.
class CountingAllocator final : public HostAllocator {
 public:
  std::string_view name() const override { return "counting"; }
  Result<void*> allocate(std::size_t size, std::size_t alignment, int numa_node) override {
    last_node = numa_node;
    STRATA_ASSIGN_OR_RETURN(void* p, default_host_allocator().allocate(size, alignment, numa_node));
    live += size;
    return p;
  }
  void deallocate(void* p, std::size_t size) noexcept override {
    live -= size;
    default_host_allocator().deallocate(p, size);
  }
  std::size_t live = 0;
  int last_node = -2;
};

TEST(HostAllocator, BlockReturnsMemoryToItsAllocator) {
  CountingAllocator counting;
  {
    Result<HostBlock> a = HostBlock::allocate(counting, 8192, 4096, 0);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(is_aligned(a->data(), 4096));
    EXPECT_EQ(a->allocator(), &counting);
    EXPECT_EQ(counting.live, 8192u);
    EXPECT_EQ(counting.last_node, 0);
    HostBlock moved = std::move(a).value();
    EXPECT_EQ(counting.live, 8192u);
    moved.data()[8191] = std::byte{1};  // writable to the end
    moved.reset();
    EXPECT_EQ(moved.data(), nullptr);
    EXPECT_EQ(counting.live, 0u);
    moved.reset();  // idempotent
    Result<HostBlock> b = HostBlock::allocate(counting, 100, 64);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(counting.live, 100u);
  }
  EXPECT_EQ(counting.live, 0u);
}

TEST(HostAllocator, RejectsBadRequestsByName) {
  HostAllocator& a = default_host_allocator();
  EXPECT_EQ(a.allocate(0, 64, -1).status().code(), StatusCode::kInvalidArgument);
  const Status bad_align = a.allocate(64, 48, -1).status();
  EXPECT_EQ(bad_align.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_align.message().find("48"), std::string::npos) << bad_align;
  const Status huge = a.allocate(std::size_t{1} << 62, 4096, -1).status();
  EXPECT_EQ(huge.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(huge.message().find("pageable host memory"), std::string::npos) << huge;
}

TEST(AlignedBuffer, AlignsAndOwns) {
  for (std::size_t align : {64u, 4096u}) {
    Result<AlignedBuffer> b = AlignedBuffer::allocate(1000, align);
    ASSERT_TRUE(b.ok());
    EXPECT_TRUE(is_aligned(b->data(), align));
    EXPECT_EQ(b->size_bytes(), 1000u);
    EXPECT_EQ(b->as<float>().size(), 250u);
    AlignedBuffer moved = std::move(b).value();
    EXPECT_EQ(moved.size_bytes(), 1000u);
  }
  EXPECT_TRUE(AlignedBuffer::allocate(0).ok());
  EXPECT_EQ(AlignedBuffer::allocate(64, 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AlignedBuffer::allocate(~std::size_t{0} - 10, 4096).status().code(),
            StatusCode::kOutOfMemory);
  EXPECT_EQ(align_up(4097, 4096), 8192u);
}

TEST(Bytes, FormatAndParse) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(80ull << 30), "80.00 GiB");
  std::uint64_t v = 0;
  ASSERT_TRUE(parse_bytes("80GiB", &v));
  EXPECT_EQ(v, 80ull << 30);
  ASSERT_TRUE(parse_bytes("2TB", &v));
  EXPECT_EQ(v, 2'000'000'000'000ull);
  ASSERT_TRUE(parse_bytes("1e9", &v));
  EXPECT_EQ(v, 1'000'000'000ull);
  ASSERT_TRUE(parse_bytes(" 1.5 KiB ", &v));
  EXPECT_EQ(v, 1536u);
  ASSERT_TRUE(parse_bytes("128 gib", &v));
  EXPECT_EQ(v, 128ull << 30);
  EXPECT_FALSE(parse_bytes("-1", &v));
  EXPECT_FALSE(parse_bytes("ten", &v));
  EXPECT_FALSE(parse_bytes("5 XB", &v));
  EXPECT_FALSE(parse_bytes("1.5", &v));
  EXPECT_FALSE(parse_bytes("", &v));
}

TEST(UniqueFd, ClosesAndReportsErrors) {
  char path[] = "/tmp/strata_fd_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  UniqueFd owned(fd);
  EXPECT_TRUE(owned.valid());
  EXPECT_TRUE(owned.close(path).ok());
  EXPECT_FALSE(owned.valid());
  EXPECT_TRUE(owned.close(path).ok());  // closing twice is a no-op
  ::unlink(path);
  UniqueFd bogus(987654);  // never opened: close reports EBADF with the name
  const Status s = bogus.close("bogus file");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.to_string().find("bogus file"), std::string::npos);
}

TEST(Logging, SinkReceivesMessagesAtOrAboveTheLevel) {
  std::vector<std::string> seen;
  set_log_sink([&](LogLevel level, std::string_view msg) {
    seen.push_back(std::string(log_level_name(level)) + ":" + std::string(msg));
  });
  const LogLevel before = log_level();
  set_log_level(LogLevel::kWarn);
  STRATA_LOG(kInfo) << "hidden";
  STRATA_LOG(kWarn) << "shown " << 42;
  set_log_level(before);
  set_log_sink({});
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], "warn:shown 42");
  LogLevel parsed;
  EXPECT_TRUE(parse_log_level("DEBUG", &parsed));
  EXPECT_EQ(parsed, LogLevel::kDebug);
  EXPECT_FALSE(parse_log_level("loud", &parsed));
}

TEST(Clock, IsMonotonic) {
  const std::int64_t a = monotonic_ns();
  const std::int64_t b = monotonic_ns();
  EXPECT_LE(a, b);
  Stopwatch sw;
  EXPECT_GE(sw.elapsed_ns(), 0);
}

}  // namespace
}  // namespace strata::core
