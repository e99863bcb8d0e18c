// Each mode's schedule, one file each (none.cpp, exact.cpp, speculative.cpp,
// delayed.cpp); schedule_for picks one. Private to engine/schedule/.
#pragma once

#include "engine/schedule/schedule.h"

namespace strata::engine {

const Schedule& none_schedule();
const Schedule& exact_schedule();
const Schedule& speculative_schedule();
const Schedule& delayed_schedule();

}  // namespace strata::engine
