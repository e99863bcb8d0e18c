// SIGINT / SIGTERM for a trainer: the first signal asks the training loop to
// stop (it finishes the step in flight, starts no checkpoint, closes the
// engine and exits 128 + signal); a second one exits at once with
// _exit(128 + signal), leaving the swap files for the next run in that
// directory to reclaim. The library installs no handler: this is the
// program's job (bindings/c/README.md). Thread-safe; the handler only stores
// the signal number (async-signal-safe).
#pragma once

namespace strata::examples::train {

// Installs the handlers (sigaction with SA_RESTART, so that the engine's
// blocking calls are not cut short by EINTR). Call once, from main.
void install_stop_handlers();

// The first signal received (SIGINT or SIGTERM), or 0 while none came.
int stop_signal();

// "SIGINT", "SIGTERM".
const char* signal_name(int sig);

}  // namespace strata::examples::train
