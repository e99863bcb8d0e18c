// A second process for the lock test: tries to open a swap store on the path
// given and exits 0 when it is refused because another store holds the path,
// 1 when it was let in, 2 on any other error (printed).
#include <cstdio>
#include <string>

#include "nvme/swap_store.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: nvme_lock_probe SWAP_PATH\n");
    return 2;
  }
  strata::nvme::SwapStoreOptions o;
  o.paths = {argv[1]};
  o.capacity_bytes = 1 << 20;
  o.io.kind = strata::nvme::BackendKind::kPsync;
  o.io.queue_depth = 1;
  auto store = strata::nvme::SwapStore::create(o);
  if (store.ok()) return 1;
  const auto& s = store.status();
  if (s.code() == strata::core::StatusCode::kAlreadyExists &&
      s.message().find("in use") != std::string_view::npos) {
    std::printf("%s\n", s.to_string().c_str());
    return 0;
  }
  std::fprintf(stderr, "%s\n", s.to_string().c_str());
  return 2;
}
