// The engine's fault-injection test hook (IoConfig::fault_injector): the
// nvme fault injector's types under the engine's name, for tests that drive
// a whole engine (tests/e2e/fault_test.cpp). Not for production use.
#pragma once

#include "nvme/fault_injection.h"

namespace strata::engine {

using nvme::FaultInjector;
using nvme::FaultKind;
using nvme::FaultOps;
using nvme::FaultRule;

}  // namespace strata::engine
