// Aligned buffers, byte formatting/parsing, UniqueFd, logging.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "engine/core/aligned_buffer.h"
#include "engine/core/clock.h"
#include "engine/core/logging.h"
#include "engine/core/str.h"
#include "engine/core/unique_fd.h"

namespace strata::core {
namespace {

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
