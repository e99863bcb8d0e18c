// The Gloo backend of a build without Gloo (Debian's libgloo-dev).
#include "core/str.h"
#include "partition/communicator.h"

namespace strata::partition {

bool gloo_built() { return false; }

core::Result<std::unique_ptr<Communicator>> make_gloo_communicator(const CommunicatorOptions&) {
  return core::Status::unimplemented(
      "communicator \"gloo\": this build has no Gloo (install libgloo-dev, e.g. scripts/install-deps.sh, and "
      "reconfigure)");
}

}  // namespace strata::partition
