// The NCCL backend of a build without NCCL (it comes with the CUDA toolkit).
#include "partition/communicator.h"

namespace strata::partition {

bool nccl_built() { return false; }

core::Result<std::unique_ptr<Communicator>> make_nccl_communicator(const CommunicatorOptions&) {
  return core::Status::unimplemented(
      "communicator \"nccl\": this build has no NCCL (it comes with the CUDA toolkit: put nvcc on PATH, "
      "e.g. export PATH=/usr/local/cuda/bin:$PATH, and reconfigure)");
}

}  // namespace strata::partition
