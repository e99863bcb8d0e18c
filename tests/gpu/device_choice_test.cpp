// device_for_local_rank (gpu/device_query.h): which CUDA device each rank of a
// machine drives.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>

#include "gpu/device_query.h"

namespace strata::gpu {
namespace {

TEST(DeviceForLocalRank, EachLocalRankDrivesItsOwnDevice) {
  // 8 ranks on a machine of 8 GPUs (torchrun --nproc_per_node 8), or fewer.
  std::set<int> taken;
  for (int l = 0; l < 8; ++l) {
    auto d = device_for_local_rank(l, 8, 8);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(*d, l);
    taken.insert(*d);
  }
  EXPECT_EQ(taken.size(), 8u);
  auto two = device_for_local_rank(1, 2, 8);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(*two, 1);
}

TEST(DeviceForLocalRank, OneVisibleDeviceIsTheRanksOwn) {
  // Each process given its GPU through CUDA_VISIBLE_DEVICES (srun --gpus-per-task 1).
  for (int l = 0; l < 4; ++l) {
    auto d = device_for_local_rank(l, 4, 1);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(*d, 0);
  }
}

TEST(DeviceForLocalRank, RanksThatWouldShareADeviceAreRefusedOnEveryRank) {
  // 4 ranks, 2 devices: rank 0 and 1 would fit, but the machine's ranks
  // outnumber its devices, so every rank fails alike.
  for (int l = 0; l < 4; ++l) {
    auto d = device_for_local_rank(l, 4, 2);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), core::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("4 ranks on this machine and 2 CUDA devices"), std::string::npos)
        << d.status();
  }
}

TEST(DeviceForLocalRank, NoDeviceAndBadRanksAreNamed) {
  auto none = device_for_local_rank(0, 1, 0);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), core::StatusCode::kUnavailable);
  for (auto [l, n] : {std::pair{2, 2}, std::pair{-1, 2}, std::pair{0, 0}}) {
    auto bad = device_for_local_rank(l, n, 8);
    ASSERT_FALSE(bad.ok()) << l << " of " << n;
    EXPECT_EQ(bad.status().code(), core::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("local rank " + std::to_string(l)), std::string::npos)
        << bad.status();
  }
}

}  // namespace
}  // namespace strata::gpu
