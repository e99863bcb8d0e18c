// Built when liburing was not found: io_uring requests say so.
#include "nvme/internal/io_driver.h"

namespace strata::nvme::internal {

core::Result<std::unique_ptr<IoDriver>> make_uring_driver(const IoBackendOptions& /*options*/) {
  return core::Status::unimplemented(
      "io_uring support was not built (liburing not found at configure time; install liburing-dev)");
}

}  // namespace strata::nvme::internal
