// A rank killed in the middle of a step (SIGKILL: no destructor runs, the
// kernel closes its sockets), or one that stops answering (SIGSTOP: its
// sockets stay open), ends the other rank's step within the collectives'
// timeout, with an error naming what it waited for, instead of a hang. The ranks are separate processes, forked before this process has
// any other thread (the only test of its executable: oneTBB's workers, which
// an engine starts, do not survive a fork).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "tests/e2e/ranks_harness.h"

namespace strata::engine::e2e {
namespace {

// What rank 0's process reports through its exit status.
enum Outcome : int {
  kFailedInTime = 0,
  kNoEngine = 10,
  kFirstStepFailed,
  kSecondStepOk,
  kWrongError,
  kTooSlow,
  kHung = -2,  // rank 0's process did not end within kHangLimit: killed
};

constexpr auto kTimeout = std::chrono::seconds(3);
// How long the parent waits for rank 0's process (two steps and the
// timeout, on a loaded machine under the sanitizers) before it calls it hung.
constexpr auto kHangLimit = std::chrono::seconds(120);

// waitpid with a deadline: the pid, or 0 when it passed (the child lives on).
pid_t wait_until(pid_t pid, int* status, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const pid_t got = ::waitpid(pid, status, WNOHANG);
    if (got != 0 || std::chrono::steady_clock::now() >= deadline) return got;
    ::usleep(20'000);
  }
}

class RanksKilled : public RanksTest {
 public:
  // One rank's life in its own process: a whole step with the other, then
  // rank 1 kills itself after its next forward and rank 0 goes on with its
  // gradients. Returns rank 0's outcome (rank 1 never returns).
  int run_rank(int r, int sig) {
    const Config c = config("cpu", OverlapMode::kExact);
    partition::CommunicatorOptions o = ranks(r, 2, sig == SIGKILL ? "killed" : "stopped");
    o.timeout = kTimeout;
    std::unique_ptr<Engine> e = make_mlp_engine(c, o);
    if (e == nullptr) return kNoEngine;
    Framework f;
    if (!micro_batch(*e, f, r, true, nullptr).ok()) return kFirstStepFailed;
    f.bind(*e);
    f.batch(99 + r);
    f.load(*e, "l1");
    f.load(*e, "l2");
    f.forward();
    if (r == 1) {
      ::raise(sig);
      std::_Exit(0);  // (SIGSTOP: the parent kills it once rank 0 is done)
    }
    const auto& g = f.backward(1.0f);
    const auto start = std::chrono::steady_clock::now();
    f.load(*e, "l2");
    f.give_grads(*e, "l2", g);  // its pass waits for rank 1, which is gone
    const core::Status second = [&]() -> core::Status {
      STRATA_RETURN_IF_ERROR(e->grad_buffer("l1").status());
      STRATA_RETURN_IF_ERROR(e->grads_ready("l1"));
      return e->step_end().status();
    }();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "rank 0: after %.2f s: %s\n", waited, second.to_string().c_str());
    if (second.ok()) return kSecondStepOk;
    if (second.message().find("group") == std::string_view::npos) return kWrongError;
    // A killed rank's connection closes: the error names it; a stopped one
    // is only late, and with two ranks the timeout names the other.
    const char* named = sig == SIGKILL ? "rank 1 failed or left" : "rank 1 did not take part";
    if (second.message().find(named) == std::string_view::npos) return kWrongError;
    // Within the timeout, and some margin for a loaded machine.
    if (waited > 3.0 * std::chrono::duration<double>(kTimeout).count()) return kTooSlow;
    return kFailedInTime;
  }
};

// Rank 1 raises `sig` after its second forward; returns rank 0's outcome
// (and checks how rank 1 ended).
int two_ranks(RanksKilled& test, int sig) {
  pid_t pids[2] = {-1, -1};
  for (int r = 0; r < 2; ++r) {
    std::fflush(nullptr);
    pids[r] = ::fork();
    if (pids[r] < 0) return -1;
    if (pids[r] == 0) std::_Exit(test.run_rank(r, sig));
  }
  int status0 = 0, status1 = 0;
  if (wait_until(pids[0], &status0, std::chrono::steady_clock::now() + kHangLimit) == 0) {
    // The hang this test is about: end it, and say so, instead of waiting for the test's timeout.
    ::kill(pids[0], SIGKILL);
    ::kill(pids[1], SIGKILL);
    ::waitpid(pids[0], &status0, 0);
    ::waitpid(pids[1], &status1, 0);
    return kHung;
  }
  ::kill(pids[1], SIGKILL);  // a stopped rank 1 still waits (a killed one is gone already)
  EXPECT_EQ(::waitpid(pids[1], &status1, 0), pids[1]);
  EXPECT_TRUE(WIFSIGNALED(status1) && WTERMSIG(status1) == SIGKILL) << "rank 1's status " << status1;
  EXPECT_TRUE(WIFEXITED(status0)) << "rank 0 ended by signal " << WTERMSIG(status0);
  return WIFEXITED(status0) ? WEXITSTATUS(status0) : -1;
}

std::string outcome_text(int outcome) {
  return outcome == kFailedInTime   ? "failed in time, naming the group"
         : outcome == kSecondStepOk ? "its step succeeded without rank 1"
         : outcome == kWrongError   ? "the error does not name the group it waited for (or the killed rank)"
         : outcome == kTooSlow      ? "the error came long after the timeout"
         : outcome == kNoEngine     ? "no engine"
         : outcome == kHung         ? "it hung: its process had not ended after 120 s"
                                    : "the first step failed, or no process";
}

TEST_F(RanksKilled, AKilledOrStoppedRankEndsTheOthersStepWithANamedError) {
  const int killed = two_ranks(*this, SIGKILL);
  EXPECT_EQ(killed, kFailedInTime) << "killed rank: rank 0: " << outcome_text(killed);
  const int stopped = two_ranks(*this, SIGSTOP);
  EXPECT_EQ(stopped, kFailedInTime) << "stopped rank: rank 0: " << outcome_text(stopped);
}

}  // namespace
}  // namespace strata::engine::e2e
