// The trainer's SIGINT / SIGTERM handlers (see stop_signal.h).
#include "examples/train/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace strata::examples::train {
namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the handler needs a lock-free atomic");

extern "C" void on_stop_signal(int sig) {
  int expected = 0;
  if (g_stop_signal.compare_exchange_strong(expected, sig)) {
    static const char kInt[] =
        "\nstrata-train: SIGINT: stopping after the step in flight (again to exit at once)\n";
    static const char kTerm[] =
        "\nstrata-train: SIGTERM: stopping after the step in flight (again to exit at once)\n";
    const ssize_t written = sig == SIGINT ? ::write(STDERR_FILENO, kInt, sizeof kInt - 1)
                                          : ::write(STDERR_FILENO, kTerm, sizeof kTerm - 1);
    (void)written;
  } else {
    // The second signal: no clean-up, exit now (only async-signal-safe calls here).
    static const char kMessage[] =
        "\nstrata-train: second signal, exiting at once (the swap files stay until "
        "the next run in that directory reclaims them)\n";
    const ssize_t written = ::write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
    (void)written;
    ::_exit(128 + sig);
  }
}

}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  // Each handler runs with both signals blocked in its thread, so a second
  // signal to that thread is handled after the first has been recorded. Any
  // thread may run it (OpenBLAS starts its threads before main).
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);
  sigaddset(&sa.sa_mask, SIGTERM);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_stop_signal.load(); }

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    default:
      return "a signal";
  }
}

}  // namespace strata::examples::train
