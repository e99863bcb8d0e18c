// partition/launch.h: which rank this process is, from the environment the
// launchers set (DESIGN.md section 10), and the communicator options that
// follow. Checked in this order, the first found wins:
//   torchrun and DeepSpeed's launcher  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//                                      MASTER_ADDR, MASTER_PORT (TORCHELASTIC_RUN_ID)
//   Open MPI (mpirun)                  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//                                      OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE
//   Slurm (an srun step)               SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID
//                                      (SLURM_JOB_ID, SLURM_STEP_ID); an allocation's or batch
//                                      script's shell, which has only some of these, is no launcher
// No launcher: one rank. A launcher's variables half set (torchrun's, Open
// MPI's), not whole numbers, or a rank outside the size are an error naming
// the variable.
//
// The ranks meet through a file store, whose keys are written once, so each
// run needs keys of its own. On one machine (the default): a directory of
// this user's alone (0700) under the temporary directory, named after the
// master address and port (or job) and the launcher's process, every rank's
// parent. Across machines: STRATA_RENDEZVOUS_DIR, a directory every rank
// reaches (a shared file system), with STRATA_RUN_ID or the launcher's run or
// job id (torchrun's --rdzv-id and restart count, Open MPI's job id, Slurm's
// job and step) naming the run's keys; without either that is an error.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "core/result.h"
#include "partition/communicator.h"

namespace strata::partition {

struct Launch {
  std::string launcher = {};  // "torchrun", "mpirun", "slurm"
  int rank = 0;
  int size = 1;
  int local_rank = 0;   // the rank among this machine's (picks the GPU)
  int local_size = 1;   // 0 when the launcher does not say
  std::string run_id = {};  // the run or job id, when the launcher gives one
  // "addr:port" (torchrun's MASTER_ADDR and MASTER_PORT; an srun step's
  // launching node, SLURM_LAUNCH_NODE_IPADDR): names the default rendezvous
  // directory, and across machines the route this rank's address is taken from.
  std::string master = {};
  int nodes = 0;  // machines, where the launcher says (SLURM_STEP_NUM_NODES); 0: not said
  // More than one machine: more ranks than this machine's, or more nodes.
  bool spans_machines() const { return nodes > 1 || (local_size > 0 && local_size < size); }
};

using GetEnv = std::function<const char*(const char*)>;

// The launch this process belongs to, or nullopt without a launcher.
core::Result<std::optional<Launch>> launch_from_environment(const GetEnv& getenv);

// Gloo options for the launch (self for one rank): the rendezvous directory
// (created when missing), the run's key prefix, and this rank's address for
// the transport: the loopback address on one machine; across machines
// STRATA_HOST_ADDRESS when set, else this machine's address on the route to
// the master (no packet is sent: the kernel's route lookup), else the first
// address the host name resolves to that is not a loopback one; `timeout`
// for every collective. UNAVAILABLE when the master's address does not
// resolve or no address is found, saying to set STRATA_HOST_ADDRESS.
core::Result<CommunicatorOptions> communicator_options(const Launch& launch, const GetEnv& getenv,
                                                       std::chrono::milliseconds timeout);

// This rank's address for the transport, as communicator_options chooses it.
core::Result<std::string> transport_address(const Launch& launch, const GetEnv& getenv);

}  // namespace strata::partition
