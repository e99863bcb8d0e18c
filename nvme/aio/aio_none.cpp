// Built when libaio was not found: libaio requests say so.
#include "nvme/internal/io_driver.h"

namespace strata::nvme::internal {

core::Result<std::unique_ptr<IoDriver>> make_aio_driver(const IoBackendOptions& /*options*/) {
  return core::Status::unimplemented(
      "libaio support was not built (libaio not found at configure time; install libaio-dev)");
}

}  // namespace strata::nvme::internal
