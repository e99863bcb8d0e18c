// CpuTurns: turns never overlap, and a waiting urgent turn goes before every
// waiting background turn, whichever came first.
#include <gtest/gtest.h>

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/internal/cpu_turns.h"

namespace strata::engine {
namespace {

// The names of the turns taken, in the order they were taken.
class TurnLog {
 public:
  void add(const std::string& name) {
    const std::lock_guard<std::mutex> lock(mu_);
    names_.push_back(name);
  }
  std::vector<std::string> names() {
    const std::lock_guard<std::mutex> lock(mu_);
    return names_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> names_;
};

// A thread that asks for one turn and logs its name once it has it.
class Waiter {
 public:
  Waiter(CpuTurns& turns, CpuTurns::Priority priority, std::string name, TurnLog& log) {
    std::promise<pid_t> tid;
    tid_ = tid.get_future().share();
    thread_ = std::thread([&turns, priority, name, &log, tid = std::move(tid)]() mutable {
      tid.set_value(::gettid());
      const CpuTurns::Turn turn(turns, priority);
      log.add(name);
    });
  }
  ~Waiter() {
    if (thread_.joinable()) thread_.join();
  }
  pid_t tid() const { return tid_.get(); }
  void join() { thread_.join(); }

 private:
  std::shared_future<pid_t> tid_;
  std::thread thread_;
};

// The scheduler state of thread `tid` of this process ('R', 'S', ...) from
// /proc, or '\0' when it cannot be read.
char ThreadState(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return '\0';
  const std::size_t paren = line.rfind(')');  // the name, in parentheses, may hold spaces
  if (paren == std::string::npos || paren + 2 >= line.size()) return '\0';
  return line[paren + 2];
}

// Returns once thread `tid` is asleep on two looks 1 ms apart: blocked in
// its turn's wait, the only place the waiters here sleep (the turns' mutex is
// free while the test holds a turn and every earlier waiter sleeps). False
// at once when the thread is gone (it got a turn instead of waiting), and
// after 10 s.
bool WaitUntilAsleep(pid_t tid) {
  int asleep = 0;
  for (int i = 0; i < 10000 && asleep < 2; ++i) {
    const char state = ThreadState(tid);
    if (state == '\0') return false;
    asleep = state == 'S' ? asleep + 1 : 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return asleep >= 2;
}

bool CanSeeThreadStates() { return ThreadState(::gettid()) != '\0'; }

const char* Name(CpuTurns::Priority p) { return p == CpuTurns::kUrgent ? "urgent" : "background"; }

// Holds a turn of priority `holder`, starts one waiter per entry of
// `arrivals`, in that order, each asleep in its wait before the next starts,
// then releases the turn. Returns the order in which the waiters got their
// turns, by priority name.
std::vector<std::string> TurnOrder(CpuTurns::Priority holder, const std::vector<CpuTurns::Priority>& arrivals) {
  CpuTurns turns;
  TurnLog log;
  std::vector<std::unique_ptr<Waiter>> waiters;
  std::optional<CpuTurns::Turn> held;  // after the waiters: released before they are joined
  held.emplace(turns, holder);
  for (std::size_t i = 0; i < arrivals.size(); ++i) {
    waiters.push_back(std::make_unique<Waiter>(turns, arrivals[i], Name(arrivals[i]), log));
    if (!WaitUntilAsleep(waiters.back()->tid())) {
      ADD_FAILURE() << "waiter " << i << " (" << Name(arrivals[i]) << ") did not wait for the held turn";
      break;
    }
  }
  EXPECT_TRUE(log.names().empty()) << "a turn was given while another was held";
  held.reset();
  // A waiter never woken would hang the joins below: fail loudly instead.
  for (int i = 0; i < 30000 && log.names().size() < waiters.size(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (log.names().size() < waiters.size()) {
    std::fprintf(stderr, "FAILED: %zu of %zu waiters still wait 30 s after the turn was released\n",
                 waiters.size() - log.names().size(), waiters.size());
    std::abort();
  }
  for (std::unique_ptr<Waiter>& w : waiters) w->join();
  return log.names();
}

TEST(CpuTurns, TurnsTakenOneAfterAnotherOnOneThreadDoNotBlock) {
  CpuTurns turns;
  for (int i = 0; i < 3; ++i) {
    { const CpuTurns::Turn t(turns, CpuTurns::kUrgent); }
    { const CpuTurns::Turn t(turns, CpuTurns::kBackground); }
  }
  SUCCEED();
}

TEST(CpuTurns, TurnsNeverOverlap) {
  CpuTurns turns;
  constexpr int kThreads = 6;
  constexpr int kTurns = 300;
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::atomic<int> taken{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    const CpuTurns::Priority p = t % 2 == 0 ? CpuTurns::kUrgent : CpuTurns::kBackground;
    threads.emplace_back([&, p] {
      for (int i = 0; i < kTurns; ++i) {
        const CpuTurns::Turn turn(turns, p);
        if (inside.fetch_add(1) != 0) ++overlaps;
        std::this_thread::yield();  // gives another thread the chance to barge in
        ++taken;
        inside.fetch_sub(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(taken.load(), kThreads * kTurns);
}

constexpr auto kU = CpuTurns::kUrgent;
constexpr auto kB = CpuTurns::kBackground;
using Names = std::vector<std::string>;

// Which waiter a broken priority would let through first is up to the
// scheduler, so each case runs a few rounds.
TEST(CpuTurns, WaitingUrgentTurnGoesBeforeEarlierBackgroundOnes) {
  if (!CanSeeThreadStates()) GTEST_SKIP() << "no /proc/self/task/<tid>/stat to see when a waiter waits";
  for (int round = 0; round < 5; ++round) {
    EXPECT_EQ(TurnOrder(kB, {kB, kB, kB, kU}), (Names{"urgent", "background", "background", "background"}))
        << "round " << round;
  }
}

TEST(CpuTurns, EveryWaitingUrgentTurnGoesBeforeAnyBackgroundOne) {
  if (!CanSeeThreadStates()) GTEST_SKIP() << "no /proc/self/task/<tid>/stat to see when a waiter waits";
  for (int round = 0; round < 5; ++round) {
    EXPECT_EQ(TurnOrder(kU, {kB, kU, kB, kU}), (Names{"urgent", "urgent", "background", "background"}))
        << "round " << round;
  }
}

TEST(CpuTurns, BackgroundWaitersGetTheTurnWhenNoUrgentOneWaits) {
  if (!CanSeeThreadStates()) GTEST_SKIP() << "no /proc/self/task/<tid>/stat to see when a waiter waits";
  EXPECT_EQ(TurnOrder(kU, {kB, kB}), (Names{"background", "background"}));
  EXPECT_EQ(TurnOrder(kB, {kB}), (Names{"background"}));
}

}  // namespace
}  // namespace strata::engine
