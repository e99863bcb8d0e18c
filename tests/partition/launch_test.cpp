#include "partition/launch.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include "tests/partition/temp_dir.h"

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
  EXPECT_EQ(x.run_id, "abc.0");  // the restart count (none yet)
}

TEST(Launch, DeepSpeedsLauncherNamesTheLocalSizeLocalSize) {
  // deepspeed's launch.py: torchrun's names, the machine's rank count as LOCAL_SIZE.
  Env env{{{"RANK", "9"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}, {"LOCAL_SIZE", "8"},
           {"CROSS_RANK", "1"}, {"CROSS_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}}};
  auto l = launch_from_environment(env.get());
  ASSERT_TRUE(l.ok() && l->has_value()) << l.status().to_string();
  EXPECT_EQ((*l)->rank, 9);
  EXPECT_EQ((*l)->local_rank, 1);
  EXPECT_EQ((*l)->local_size, 8);  // two machines of 8: not every rank local
  // LOCAL_WORLD_SIZE, where both are set, is torchrun's and wins.
  env.vars["LOCAL_WORLD_SIZE"] = "4";
  auto both = launch_from_environment(env.get());
  ASSERT_TRUE(both.ok() && both->has_value()) << both.status().to_string();
  EXPECT_EQ((*both)->local_size, 4);
  env.vars.erase("LOCAL_WORLD_SIZE");
  env.vars["LOCAL_SIZE"] = "eight";
  auto bad = launch_from_environment(env.get());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("LOCAL_SIZE=\"eight\""), std::string_view::npos) << bad.status().to_string();
  // Another program's LOCAL_SIZE (no CROSS_RANK, CROSS_SIZE beside it), or one
  // that does not fit the ranks, is not taken.
  for (const char* local : {"8", "1", "17"}) {
    Env other = env;
    other.vars["LOCAL_SIZE"] = local;
    if (std::string(local) == "8") {
      other.vars.erase("CROSS_RANK");
      other.vars.erase("CROSS_SIZE");
    }
    auto o = launch_from_environment(other.get());
    ASSERT_TRUE(o.ok() && o->has_value()) << o.status().to_string();
    EXPECT_EQ((*o)->local_size, 0) << "LOCAL_SIZE " << local;
  }
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

  Env slurm{{{"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
             {"SLURM_JOB_ID", "1234"}, {"SLURM_STEP_ID", "3"}}};
  auto s = launch_from_environment(slurm.get());
  ASSERT_TRUE(s.ok() && s->has_value()) << s.status().to_string();
  EXPECT_EQ((*s)->launcher, "slurm");
  EXPECT_EQ((*s)->rank, 5);
  EXPECT_EQ((*s)->local_rank, 2);
  EXPECT_EQ((*s)->local_size, 0);  // Slurm does not say
  EXPECT_EQ((*s)->size, 6);  // the step's tasks, not the allocation's
  EXPECT_EQ((*s)->run_id, "1234.3");

  // A batch script's or an allocation's shell (no srun step) is one rank, not an error.
  for (Env shell : {Env{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}}, Env{{{"SLURM_NTASKS", "4"}}}}) {
    auto none = launch_from_environment(shell.get());
    ASSERT_TRUE(none.ok()) << none.status().to_string();
    EXPECT_FALSE(none->has_value());
  }
}

TEST(Launch, TorchrunsRunIdNoneIsNoIdAndARestartIsAnotherRun) {
  Env plain{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "none"}}};
  auto p = launch_from_environment(plain.get());
  ASSERT_TRUE(p.ok() && p->has_value());
  EXPECT_EQ((*p)->run_id, "");
  Env restarted{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "job7"},
                 {"TORCHELASTIC_RESTART_COUNT", "2"}}};
  auto r = launch_from_environment(restarted.get());
  ASSERT_TRUE(r.ok() && r->has_value());
  EXPECT_EQ((*r)->run_id, "job7.2");
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

TEST(Launch, AGivenRendezvousDirectoryNeedsARunId) {
  const testing_util::TempDir tmp;
  const std::string dir = tmp.path() + "/meet";
  Launch two{.launcher = "torchrun", .rank = 1, .size = 2, .local_size = 1, .master = "127.0.0.1:1"};
  // (Two machines: the transport's address is given, the point here is the run id.)
  Env no_id{{{"STRATA_RENDEZVOUS_DIR", dir}, {"STRATA_HOST_ADDRESS", "10.0.0.1"}}};
  auto refused = communicator_options(two, no_id.get(), std::chrono::seconds(7));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("set STRATA_RUN_ID"), std::string_view::npos)
      << refused.status().to_string();

  Env with_id{{{"STRATA_RENDEZVOUS_DIR", dir}, {"STRATA_RUN_ID", "r/1"}, {"STRATA_HOST_ADDRESS", "10.0.0.1"}}};
  auto o = communicator_options(two, with_id.get(), std::chrono::seconds(7));
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->backend, "gloo");
  EXPECT_EQ(o->rank, 1);
  EXPECT_EQ(o->size, 2);
  EXPECT_EQ(o->store_dir, dir);
  EXPECT_TRUE(std::filesystem::is_directory(dir));  // created
  EXPECT_EQ(o->prefix, "strata-r_1");
  EXPECT_EQ(o->timeout, std::chrono::seconds(7));
  EXPECT_FALSE(o->store_is_the_runs);  // a given directory is the caller's
  two.run_id = "job.0";  // the launcher's own id serves as well
  auto launcher_id = communicator_options(two, no_id.get(), std::chrono::seconds(7));
  ASSERT_TRUE(launcher_id.ok()) << launcher_id.status().to_string();
  EXPECT_EQ(launcher_id->prefix, "strata-job.0");
}

TEST(Launch, OneMachinesDefaultDirectoryIsThisUsersAndThisLaunchersAlone) {
  Env none;
  Launch two{.launcher = "torchrun", .rank = 0, .size = 2, .local_size = 2, .master = "h:1"};
  auto d = communicator_options(two, none.get(), std::chrono::seconds(1));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const std::string want = "strata-rendezvous-" + std::to_string(::getuid()) + "-h_1-" + std::to_string(::getppid());
  EXPECT_EQ(std::filesystem::path(d->store_dir).filename().string(), want) << d->store_dir;
  struct stat st {};
  ASSERT_EQ(::stat(d->store_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(d->prefix, "strata-run");
  EXPECT_TRUE(d->store_is_the_runs);  // the engine removes it once the ranks met
  EXPECT_EQ(d->local_rank, 0);
  EXPECT_EQ(d->local_size, 2);
  // Someone else's (or an open) directory of that name is refused, not used.
  ASSERT_EQ(::chmod(d->store_dir.c_str(), 0777), 0);
  auto open = communicator_options(two, none.get(), std::chrono::seconds(1));
  ASSERT_FALSE(open.ok());
  EXPECT_EQ(open.status().code(), StatusCode::kPermissionDenied) << open.status().to_string();
  std::filesystem::remove_all(d->store_dir);

  // Several machines need a shared directory.
  Launch spread{.launcher = "torchrun", .rank = 0, .size = 4, .local_size = 2, .master = "h:1"};
  auto far = communicator_options(spread, none.get(), std::chrono::seconds(1));
  ASSERT_FALSE(far.ok());
  EXPECT_NE(far.status().message().find("2 on this machine: set STRATA_RENDEZVOUS_DIR"), std::string_view::npos)
      << far.status().to_string();

  Launch one{.launcher = "torchrun", .rank = 0, .size = 1};
  auto s = communicator_options(one, none.get(), std::chrono::seconds(1));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->backend, "self");
}

TEST(Launch, TheTransportsAddressIsLoopbackOnOneMachineAndTowardTheMasterAcrossMachines) {
  const testing_util::TempDir tmp;
  const std::string dir = tmp.path() + "/meet";
  const Env shared{{{"STRATA_RENDEZVOUS_DIR", dir}, {"STRATA_RUN_ID", "r"}}};
  // One machine: loopback.
  Launch two{.launcher = "torchrun", .rank = 0, .size = 2, .local_size = 2, .master = "10.9.8.7:1"};
  auto local = communicator_options(two, shared.get(), std::chrono::seconds(1));
  ASSERT_TRUE(local.ok()) << local.status().to_string();
  EXPECT_EQ(local->hostname, "127.0.0.1");
  // Two machines: this machine's address on the route to the master, never
  // a loopback one (the others could not reach it): here the master is this
  // machine, named by a loopback address (an IPv6 one in brackets too), so
  // the host name's first other address, or an error saying what to set.
  Launch spread{.launcher = "torchrun", .rank = 0, .size = 4, .local_size = 2, .master = "127.0.0.1:29500"};
  for (const char* master : {"127.0.0.1:29500", "[::1]:29500"}) {
    spread.master = master;
    auto far = communicator_options(spread, shared.get(), std::chrono::seconds(1));
    if (far.ok()) {
      EXPECT_FALSE(far->hostname.starts_with("127.") || far->hostname == "::1") << far->hostname;
      EXPECT_FALSE(far->hostname.empty());
    } else {
      EXPECT_EQ(far.status().code(), StatusCode::kUnavailable) << far.status().to_string();
      EXPECT_NE(far.status().message().find("set STRATA_HOST_ADDRESS"), std::string_view::npos)
          << far.status().to_string();
      EXPECT_EQ(far.status().message().find("does not resolve"), std::string_view::npos) << far.status().to_string();
    }
  }
  // STRATA_HOST_ADDRESS chooses.
  Env chosen = shared;
  chosen.vars["STRATA_HOST_ADDRESS"] = "10.1.2.3";
  auto given = communicator_options(spread, chosen.get(), std::chrono::seconds(1));
  ASSERT_TRUE(given.ok()) << given.status().to_string();
  EXPECT_EQ(given->hostname, "10.1.2.3");
  // A master that does not resolve is named, with what to set.
  spread.master = "no-such-host.invalid:29500";
  auto lost = communicator_options(spread, shared.get(), std::chrono::seconds(1));
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(lost.status().message().find("'no-such-host.invalid'"), std::string_view::npos) << lost.status().to_string();
  EXPECT_NE(lost.status().message().find("STRATA_HOST_ADDRESS"), std::string_view::npos) << lost.status().to_string();
}

TEST(Launch, AnSrunStepOnSeveralNodesSpansMachines) {
  // 5 tasks on 2 nodes, 3 on the first ("3,2"); this is the second node's.
  Env slurm{{{"SLURM_PROCID", "4"}, {"SLURM_STEP_NUM_TASKS", "5"}, {"SLURM_LOCALID", "1"}, {"SLURM_JOB_ID", "9"},
             {"SLURM_STEP_NUM_NODES", "2"}, {"SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"}, {"SLURM_NODEID", "1"},
             {"SLURM_STEP_TASKS_PER_NODE", "3,2"}, {"STRATA_HOST_ADDRESS", "10.0.0.2"}}};
  auto l = launch_from_environment(slurm.get());
  ASSERT_TRUE(l.ok() && l->has_value()) << l.status().to_string();
  EXPECT_EQ((*l)->nodes, 2);
  EXPECT_EQ((*l)->local_rank, 1);
  EXPECT_EQ((*l)->local_size, 2);
  // The compressed form: 2 tasks on each of 3 nodes, then 1.
  for (auto [node, want] : {std::pair{0, 2}, std::pair{2, 2}, std::pair{3, 1}, std::pair{4, 0}}) {
    Env packed = slurm;
    packed.vars["SLURM_STEP_TASKS_PER_NODE"] = "2(x3),1";
    packed.vars["SLURM_NODEID"] = std::to_string(node);
    auto p = launch_from_environment(packed.get());
    ASSERT_TRUE(p.ok() && p->has_value()) << p.status().to_string();
    EXPECT_EQ((*p)->local_size, want) << "node " << node;
  }
  EXPECT_EQ((*l)->master, "127.0.0.1:0");
  EXPECT_TRUE((*l)->spans_machines());
  // Without a shared directory it is refused (each machine would meet alone).
  auto alone = communicator_options(**l, slurm.get(), std::chrono::seconds(1));
  ASSERT_FALSE(alone.ok());
  EXPECT_NE(alone.status().message().find("on 2 machines: set STRATA_RENDEZVOUS_DIR"), std::string_view::npos)
      << alone.status().to_string();
  const testing_util::TempDir tmp;
  slurm.vars["STRATA_RENDEZVOUS_DIR"] = tmp.path() + "/meet";
  auto met = communicator_options(**l, slurm.get(), std::chrono::seconds(1));
  ASSERT_TRUE(met.ok()) << met.status().to_string();
  EXPECT_EQ(met->hostname, "10.0.0.2");
  EXPECT_EQ(met->local_size, 2);
  EXPECT_EQ(met->prefix, "strata-9.0");
}

}  // namespace
}  // namespace strata::partition
