// The NCCL backend at world size 1 (the lent GPU machines have one GPU):
// each collective on device buffers, queued on a stream; host buffers
// refused. Skips without NCCL in the build or without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string_view>
#include <vector>

#include "partition/communicator.h"

namespace strata::partition {
namespace {

using core::StatusCode;

class NcclTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!has_backend("nccl")) GTEST_SKIP() << "this build has no NCCL";
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    CommunicatorOptions o;
    o.backend = "nccl";
    o.device = 0;
    o.timeout = std::chrono::seconds(60);
    auto c = make_communicator(o);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    comm_ = std::move(c).value();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    for (void* p : buffers_) cudaFree(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  template <typename T>
  T* device(const std::vector<T>& host) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
    buffers_.push_back(p);
    EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return static_cast<T*>(p);
  }
  template <typename T>
  std::vector<T> back(const T* p, std::size_t n) {
    std::vector<T> out(n);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

  std::unique_ptr<Communicator> comm_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> buffers_;
};

TEST_F(NcclTest, OneRanksCollectivesOnDeviceBuffersInStreamOrder) {
  EXPECT_EQ(comm_->backend(), "nccl");
  const std::vector<float> x = {1.5f, -2.0f, 3.25f};
  float* a = device(x);
  ASSERT_TRUE(comm_->all_reduce(a, x.size(), DType::kF32, ReduceOp::kSum, stream_).ok());
  EXPECT_EQ(back(a, x.size()), x);
  float* gathered = device(std::vector<float>(3, 0.0f));
  ASSERT_TRUE(comm_->all_gather(a, gathered, x.size(), DType::kF32, stream_).ok());
  EXPECT_EQ(back(gathered, 3), x);
  float* shard = device(std::vector<float>(3, 0.0f));
  ASSERT_TRUE(comm_->reduce_scatter(a, shard, x.size(), DType::kF32, ReduceOp::kMax, stream_).ok());
  EXPECT_EQ(back(shard, 3), x);
  std::int64_t* k = device(std::vector<std::int64_t>{7, 8});
  ASSERT_TRUE(comm_->broadcast(k, 2, DType::kI64, 0, stream_).ok());
  EXPECT_EQ(back(k, 2), (std::vector<std::int64_t>{7, 8}));
  EXPECT_TRUE(comm_->barrier().ok());
}

TEST_F(NcclTest, HostBuffersAreRefusedNamingTheCall) {
  std::vector<float> host(4, 1.0f);
  const core::Status s = comm_->all_reduce(host.data(), host.size(), DType::kF32, ReduceOp::kSum, stream_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("all_reduce"), std::string_view::npos) << s.to_string();
  EXPECT_NE(s.message().find("device buffers"), std::string_view::npos) << s.to_string();
  // A refused call breaks the communicator as a failed one does (the other ranks' matching call
  // would be left unpaired): the next call says so instead of hanging.
  const core::Status after = comm_->barrier();
  EXPECT_EQ(after.code(), StatusCode::kFailedPrecondition) << after.to_string();
  EXPECT_NE(after.message().find("broke at an earlier call"), std::string_view::npos) << after.to_string();
}

}  // namespace
}  // namespace strata::partition
