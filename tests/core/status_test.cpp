// Status, Result and the control-flow macros.
#include "core/result.h"
#include "core/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>
#include <string>

namespace strata::core {
namespace {

TEST(Status, DefaultIsOkAndCarriesNothing) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.to_string(), "OK");
  EXPECT_EQ(sizeof(Status), sizeof(void*));  // OK is one null pointer
}

TEST(Status, FactoriesSetCodeAndMessage) {
  const Status s = Status::invalid_argument("bad key");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.to_string(), "INVALID_ARGUMENT: bad key");
  EXPECT_TRUE(Status::data_loss("crc").is_data_loss());
  EXPECT_FALSE(Status::io_error("x").is_data_loss());
}

TEST(Status, ErrnoMapsToCodesAndRetryability) {
  EXPECT_EQ(Status::from_errno(ENOENT, "open").code(), StatusCode::kNotFound);
  EXPECT_EQ(Status::from_errno(ENOSPC, "write").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::from_errno(EACCES, "open").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(Status::from_errno(EIO, "read").code(), StatusCode::kIoError);
  const Status again = Status::from_errno(EAGAIN, "submit");
  EXPECT_TRUE(again.retryable());
  EXPECT_EQ(again.error_number(), EAGAIN);
  EXPECT_FALSE(Status::from_errno(EIO, "read").retryable());
  EXPECT_NE(Status::from_errno(EIO, "read").to_string().find("errno 5"), std::string::npos);
}

TEST(Status, IoErrorNamesOperationPathOffsetAndSizes) {
  const Status s = Status::io_error(EIO, "pread", "/swap/a.bin", 4096, 1048576, 512);
  const std::string text = s.to_string();
  EXPECT_NE(text.find("pread '/swap/a.bin' at offset 4096"), std::string::npos) << text;
  EXPECT_NE(text.find("wanted 1048576 bytes, got 512"), std::string::npos) << text;
  EXPECT_EQ(s.error_number(), EIO);
}

TEST(Status, AnnotatePrefixesContextAndCopiesAreDeep) {
  Status s = Status::not_found("block 7").annotate("reading chunk 3");
  EXPECT_EQ(s.message(), "reading chunk 3: block 7");
  Status copy = s;
  s = Status();
  EXPECT_EQ(copy.message(), "reading chunk 3: block 7");
  EXPECT_TRUE(Status().annotate("nothing").ok());
}

Result<int> parse_positive(int x) {
  if (x <= 0) return Status::invalid_argument("not positive");
  return x * 2;
}

Status use_macros(int x, int* out) {
  STRATA_ASSIGN_OR_RETURN(const int doubled, parse_positive(x));
  STRATA_RETURN_IF_ERROR(doubled > 100 ? Status::out_of_range("too big") : Status());
  *out = doubled;
  return Status();
}

TEST(Result, HoldsValueOrError) {
  Result<int> good = parse_positive(3);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 6);
  EXPECT_TRUE(good.status().ok());
  Result<int> bad = parse_positive(0);
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.value_or(-1), -1);
}

TEST(Result, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> owned = std::move(r).value();
  EXPECT_EQ(*owned, 5);
}

TEST(Result, MacrosPropagateErrors) {
  int out = 0;
  EXPECT_TRUE(use_macros(5, &out).ok());
  EXPECT_EQ(out, 10);
  EXPECT_EQ(use_macros(-1, &out).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(use_macros(60, &out).code(), StatusCode::kOutOfRange);
}

TEST(ResultDeathTest, ValueOfAnErrorAbortsWithTheMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Result<int> bad = parse_positive(0);
  EXPECT_DEATH((void)bad.value(), "not positive");
}

}  // namespace
}  // namespace strata::core
