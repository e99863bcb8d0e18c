// device_for_local_rank (gpu/device_query.h): which CUDA device a rank drives.
#include "core/str.h"
#include "gpu/device_query.h"

namespace strata::gpu {

core::Result<int> device_for_local_rank(int local_rank, int local_ranks, int visible) {
  if (local_ranks < 1 || local_rank < 0 || local_rank >= local_ranks) {
    return core::Status::invalid_argument(
        core::str_cat("local rank ", local_rank, " of ", local_ranks, ": it must be in [0, local ranks)"));
  }
  if (visible < 1) return core::Status::unavailable("no CUDA device is visible");
  if (visible == 1) return 0;
  if (local_ranks > visible) {
    return core::Status::invalid_argument(
        core::str_cat(local_ranks, " ranks on this machine and ", visible,
                      " CUDA devices visible to each: two ranks would share "
                      "a device (run at most one rank per GPU, or give each rank's process one device with "
                      "CUDA_VISIBLE_DEVICES)"));
  }
  return local_rank;
}

}  // namespace strata::gpu
