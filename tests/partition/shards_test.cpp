#include "partition/shards.h"

#include <gtest/gtest.h>

#include <cstdint>

#include "core/numerics.h"

namespace strata::partition {
namespace {

TEST(Shards, EveryElementHasOneOwnerAndShardsStartOnTheAlignment) {
  for (std::uint64_t elems : std::initializer_list<std::uint64_t>{0, 1, 7, 255, 256, 257, 65536 * 3 + 5, 1000003}) {
    for (int ranks : {1, 2, 3, 4, 7, 8}) {
      for (std::uint64_t align : std::initializer_list<std::uint64_t>{
               1, 256, static_cast<std::uint64_t>(core::numerics::kNormBlockElems)}) {
        SCOPED_TRACE(testing::Message() << elems << " elements, " << ranks << " ranks, align " << align);
        auto p = plan_shards(elems, ranks, align);
        ASSERT_TRUE(p.ok()) << p.status().to_string();
        ASSERT_EQ(p->shards.size(), static_cast<std::size_t>(ranks));
        EXPECT_EQ(p->padded_elems, p->shard_elems * static_cast<std::uint64_t>(ranks));
        EXPECT_GE(p->padded_elems, elems);
        EXPECT_LT(p->padded_elems - elems, static_cast<std::uint64_t>(ranks) * align);  // the least padding
        EXPECT_EQ(p->shard_elems % align, 0u);
        std::uint64_t real = 0;
        for (int r = 0; r < ranks; ++r) {
          const Shard& s = p->shards[static_cast<std::size_t>(r)];
          EXPECT_EQ(s.offset, static_cast<std::uint64_t>(r) * p->shard_elems);
          EXPECT_EQ(s.offset % align, 0u);
          EXPECT_LE(s.size, p->shard_elems);
          if (s.size > 0) {
            EXPECT_EQ(p->owner(s.offset), r);
            EXPECT_EQ(p->owner(s.offset + s.size - 1), r);
          }
          // Real elements are a prefix: only the last real shard is short.
          if (s.size < p->shard_elems) {
            for (int q = r + 1; q < ranks; ++q) EXPECT_EQ(p->shards[static_cast<std::size_t>(q)].size, 0u);
          }
          real += s.size;
        }
        EXPECT_EQ(real, elems);
      }
    }
  }
}

TEST(Shards, ThreeRanksOverTenElementsOfAlignmentTwo) {
  auto p = plan_shards(10, 3, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->padded_elems, 12u);
  EXPECT_EQ(p->shard_elems, 4u);
  EXPECT_EQ(p->shards, (std::vector<Shard>{{0, 4}, {4, 4}, {8, 2}}));
}

TEST(Shards, BadArgumentsAreRefusedWithTheirValue) {
  auto none = plan_shards(10, 0, 1);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), core::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("ranks = 0"), std::string_view::npos) << none.status().to_string();
  EXPECT_EQ(plan_shards(10, 2, 0).status().code(), core::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_shards(~0ull, 3, 1ull << 40).status().code(), core::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace strata::partition
