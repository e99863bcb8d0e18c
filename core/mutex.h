// core::Mutex, MutexLock and CondVar: std::mutex with thread-safety annotations.
// Mutex is thread-safe; MutexLock is owner-thread-only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "core/thread_annotations.h"

namespace strata::core {

class STRATA_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() STRATA_ACQUIRE() { mu_.lock(); }
  void unlock() STRATA_RELEASE() { mu_.unlock(); }
  bool try_lock() STRATA_TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

class STRATA_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) STRATA_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() STRATA_RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// Condition variable over core::Mutex. wait() must be called with `mu` held.
class CondVar {
 public:
  template <typename Predicate>
  void wait(Mutex& mu, Predicate pred) STRATA_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock, pred);
    lock.release();
  }
  // Returns pred() at the end (false on timeout with pred still false).
  template <typename Predicate>
  bool wait_for(Mutex& mu, std::chrono::nanoseconds timeout, Predicate pred) STRATA_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool result = cv_.wait_for(lock, timeout, pred);
    lock.release();
    return result;
  }
  void notify_one() { cv_.notify_one(); }
  void notify_all() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace strata::core
