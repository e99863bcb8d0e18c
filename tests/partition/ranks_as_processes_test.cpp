// Ranks as separate processes (fork), meeting through the environment a
// launcher sets: each child reads RANK/WORLD_SIZE/MASTER_* through
// launch_from_environment, as a process under torchrun would, and exits with
// what it saw. A rank killed before a collective ends the others with a
// named error, not a hang.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "partition/communicator.h"
#include "partition/launch.h"
#include "tests/partition/temp_dir.h"

namespace strata::partition {
namespace {

namespace nx = core::numerics;

using testing_util::TempDir;

// What one child wrote before it exited: its exit code and one line.
struct Child {
  int status = 0;
  std::string said;
};

// Runs body(rank) in `size` forked children with torchrun's variables (and,
// with `shared`, STRATA_RENDEZVOUS_DIR and STRATA_RUN_ID, as across machines;
// else the one machine's default directory); each writes one line to its
// file and exits with body's result.
std::vector<Child> run_ranks(int size, const TempDir& dir, bool shared,
                             const std::function<int(int, std::string*)>& body) {
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", "1", 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(size).c_str(), 1);
      if (shared) {
        ::setenv("STRATA_RENDEZVOUS_DIR", (dir.path() + "/store").c_str(), 1);
        ::setenv("STRATA_RUN_ID", "test", 1);
      }
      std::string said;
      const int code = body(r, &said);
      std::ofstream(dir.path() + "/said" + std::to_string(r)) << said;
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<Child> out(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    ::waitpid(pids[static_cast<std::size_t>(r)], &out[static_cast<std::size_t>(r)].status, 0);
    std::ifstream in(dir.path() + "/said" + std::to_string(r));
    std::stringstream ss;
    ss << in.rdbuf();
    out[static_cast<std::size_t>(r)].said = ss.str();
  }
  return out;
}

core::Result<std::unique_ptr<Communicator>> communicator_from_environment(std::chrono::milliseconds timeout) {
  GetEnv env = [](const char* name) -> const char* { return ::getenv(name); };
  STRATA_ASSIGN_OR_RETURN(std::optional<Launch> launch, launch_from_environment(env));
  if (!launch) return core::Status::internal("no launcher variables");
  STRATA_ASSIGN_OR_RETURN(CommunicatorOptions o, communicator_options(*launch, env, timeout));
  return make_communicator(o);
}

TEST(RanksAsProcesses, ThreeProcessesFromTheLaunchersVariablesReduceInRankOrder) {
  if (!has_backend("gloo")) GTEST_SKIP() << "this build has no gloo backend";
  TempDir dir;
  const int size = 3;
  // One machine's default rendezvous directory: this user's, named after this process (the children's parent).
  const std::string meet = std::filesystem::temp_directory_path().string() + "/strata-rendezvous-" +
                           std::to_string(::getuid()) + "-127.0.0.1_1-" + std::to_string(::getpid());
  std::filesystem::remove_all(meet);
  const std::vector<Child> children = run_ranks(size, dir, /*shared=*/false, [&](int r, std::string* said) {
    auto c = communicator_from_environment(std::chrono::seconds(60));
    if (!c.ok()) {
      *said = c.status().to_string();
      return 2;
    }
    std::vector<float> x(1000);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = r == 0 ? 1.0e8f : 1.0f + static_cast<float>(i % 5);
    const core::Status s = (*c)->all_reduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum);
    if (!s.ok()) {
      *said = s.to_string();
      return 3;
    }
    for (std::size_t i = 0; i < x.size(); ++i) {
      float want = 1.0e8f;
      for (int q = 1; q < size; ++q) want = nx::add_f32(want, 1.0f + static_cast<float>(i % 5));
      if (std::bit_cast<std::uint32_t>(x[i]) != std::bit_cast<std::uint32_t>(want)) {
        *said = "element " + std::to_string(i) + " differs";
        return 4;
      }
    }
    *said = "rank " + std::to_string((*c)->rank()) + " of " + std::to_string((*c)->size());
    return 0;
  });
  for (int r = 0; r < size; ++r) {
    const Child& ch = children[static_cast<std::size_t>(r)];
    ASSERT_TRUE(WIFEXITED(ch.status)) << "rank " << r;
    EXPECT_EQ(WEXITSTATUS(ch.status), 0) << "rank " << r << ": " << ch.said;
    EXPECT_EQ(ch.said, "rank " + std::to_string(r) + " of 3");
  }
  EXPECT_TRUE(std::filesystem::is_directory(meet));
  std::filesystem::remove_all(meet);
}

TEST(RanksAsProcesses, AKilledRankEndsTheOthersWithANamedError) {
  if (!has_backend("gloo")) GTEST_SKIP() << "this build has no gloo backend";
  TempDir dir;
  const int size = 3;
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<Child> children = run_ranks(size, dir, /*shared=*/true, [&](int r, std::string* said) {
    auto c = communicator_from_environment(std::chrono::seconds(20));
    if (!c.ok()) {
      *said = c.status().to_string();
      return 2;
    }
    if (r == 2) ::raise(SIGKILL);  // dies after meeting the others, before the collective
    std::vector<float> x(100000, 1.0f);
    const core::Status s = (*c)->all_reduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum);
    *said = s.to_string();
    return s.ok() ? 0 : 5;
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const Child& killed = children[2];
  ASSERT_TRUE(WIFSIGNALED(killed.status));
  EXPECT_EQ(WTERMSIG(killed.status), SIGKILL);
  // Gloo names the peer by its address; the error names its rank: the killed
  // one, or a survivor that gave up on it first (each survivor sees whichever
  // of its peers' connections breaks first; the first to notice sees rank 2's).
  int named_killed = 0;
  for (int r = 0; r < 2; ++r) {
    const Child& ch = children[static_cast<std::size_t>(r)];
    ASSERT_TRUE(WIFEXITED(ch.status)) << "rank " << r;
    EXPECT_EQ(WEXITSTATUS(ch.status), 5) << "rank " << r << ": " << ch.said;
    EXPECT_NE(ch.said.find("UNAVAILABLE"), std::string::npos) << ch.said;
    EXPECT_NE(ch.said.find("all_reduce on rank " + std::to_string(r) + " of 3 (gloo)"), std::string::npos)
        << ch.said;
    const bool killed_named = ch.said.find("rank 2 failed or left") != std::string::npos;
    const bool survivor_named =
        ch.said.find("rank " + std::to_string(1 - r) + " failed or left") != std::string::npos;
    EXPECT_TRUE(killed_named || survivor_named) << ch.said;
    named_killed += killed_named ? 1 : 0;
  }
  EXPECT_GE(named_killed, 1) << children[0].said << " / " << children[1].said;
  EXPECT_LT(seconds, 120.0);  // it ended (within the 20 s timeout and the meeting)
}

}  // namespace
}  // namespace strata::partition

// Its own main: the children are forked before this process starts any thread.
int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
