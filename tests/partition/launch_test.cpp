#include "partition/launch.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

namespace strata::partition {
namespace {

using core::StatusCode;

struct Env {
  std::map<std::string, std::string> vars;
  GetEnv get() const {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

TEST(Launch, NoLauncherIsOneRank) {
  Env env;
  auto l = launch_from_environment(env.get());
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_FALSE(l->has_value());
}

TEST(Launch, TorchrunsVariables) {
  Env env{{{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
           {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RUN_ID", "abc"},
           // Another launcher's variables are not read when torchrun's are there.
           {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}}};
  auto l = launch_from_environment(env.get());
  ASSERT_TRUE(l.ok() && l->has_value()) << l.status().to_string();
  const Launch& x = **l;
  EXPECT_EQ(x.launcher, "torchrun");
  EXPECT_EQ(x.rank, 3);
  EXPECT_EQ(x.size, 8);
  EXPECT_EQ(x.local_rank, 1);
  EXPECT_EQ(x.local_size, 2);
  EXPECT_EQ(x.master, "10.0.0.1:29500");
  EXPECT_EQ(x.run_id, "abc");
}

TEST(Launch, OpenMpisAndSlurmsVariables) {
  Env mpi{{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
           {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}, {"OMPI_MCA_ess_base_jobid", "77"}}};
  auto m = launch_from_environment(mpi.get());
  ASSERT_TRUE(m.ok() && m->has_value()) << m.status().to_string();
  EXPECT_EQ((*m)->launcher, "mpirun");
  EXPECT_EQ((*m)->rank, 1);
  EXPECT_EQ((*m)->size, 4);
  EXPECT_EQ((*m)->local_size, 4);
  EXPECT_EQ((*m)->run_id, "77");

  Env slurm{{{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "2"}, {"SLURM_JOB_ID", "1234"},
             {"SLURM_STEP_ID", "3"}}};
  auto s = launch_from_environment(slurm.get());
  ASSERT_TRUE(s.ok() && s->has_value()) << s.status().to_string();
  EXPECT_EQ((*s)->launcher, "slurm");
  EXPECT_EQ((*s)->rank, 5);
  EXPECT_EQ((*s)->local_rank, 2);
  EXPECT_EQ((*s)->local_size, 0);  // Slurm does not say
  EXPECT_EQ((*s)->run_id, "1234.3");
}

TEST(Launch, HalfSetOrWrongVariablesNameTheVariable) {
  auto bad = [](Env env, std::string_view fragment) {
    auto l = launch_from_environment(env.get());
    ASSERT_FALSE(l.ok());
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find(fragment), std::string_view::npos) << l.status().to_string();
  };
  bad(Env{{{"RANK", "0"}}}, "set RANK but not WORLD_SIZE");
  bad(Env{{{"WORLD_SIZE", "2"}}}, "set WORLD_SIZE but not RANK");
  bad(Env{{{"RANK", "2"}, {"WORLD_SIZE", "2"}}}, "RANK=2 and WORLD_SIZE=2: need 0 <= rank < size");
  bad(Env{{{"RANK", "one"}, {"WORLD_SIZE", "2"}}}, "RANK=\"one\" is not a whole number");
  bad(Env{{{"SLURM_PROCID", "-1"}, {"SLURM_NTASKS", "2"}}}, "SLURM_PROCID=\"-1\"");
  bad(Env{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "x"}}}, "LOCAL_RANK=\"x\"");
}

TEST(Launch, CommunicatorOptionsMeetInTheRendezvousDirectoryUnderTheRunsPrefix) {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/strata-launch-test";
  std::filesystem::remove_all(dir);
  Env env{{{"STRATA_RENDEZVOUS_DIR", dir}}};
  Launch two{.launcher = "torchrun", .rank = 1, .size = 2, .run_id = "r/1", .master = "h:1"};
  auto o = communicator_options(two, env.get(), std::chrono::seconds(7));
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->backend, "gloo");
  EXPECT_EQ(o->rank, 1);
  EXPECT_EQ(o->size, 2);
  EXPECT_EQ(o->store_dir, dir);
  EXPECT_TRUE(std::filesystem::is_directory(dir));  // created
  EXPECT_EQ(o->prefix, "strata-r_1");
  EXPECT_EQ(o->timeout, std::chrono::seconds(7));
  std::filesystem::remove_all(dir);

  // Without STRATA_RENDEZVOUS_DIR: a directory named after the master under the temporary directory.
  Env none;
  auto d = communicator_options(two, none.get(), std::chrono::seconds(1));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_NE(d->store_dir.find("strata-rendezvous-h_1"), std::string::npos) << d->store_dir;
  std::filesystem::remove_all(d->store_dir);
  Launch anonymous{.launcher = "mpirun", .rank = 0, .size = 2};
  auto a = communicator_options(anonymous, none.get(), std::chrono::seconds(1));
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("set STRATA_RENDEZVOUS_DIR"), std::string_view::npos) << a.status().to_string();

  Launch one{.launcher = "torchrun", .rank = 0, .size = 1};
  auto s = communicator_options(one, none.get(), std::chrono::seconds(1));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->backend, "self");
}

}  // namespace
}  // namespace strata::partition
