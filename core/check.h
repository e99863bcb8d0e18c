// STRATA_CHECK: internal invariants, on in every build type. A failure prints
// file:line, the condition and the streamed message, then aborts. Never use it
// for what a user, the kernel or a syscall can cause: return a Status instead.
#pragma once

#include <sstream>

namespace strata::core {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;
  [[noreturn]] ~CheckFailure();
  std::ostream& stream() { return message_; }

 private:
  const char* file_;
  int line_;
  const char* condition_;
  std::ostringstream message_;
};

// Turns `CheckFailure(...).stream() << x` into a void expression for the ternary.
struct CheckVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace strata::core

#define STRATA_CHECK(condition)                \
  (condition) ? (void)0                        \
              : ::strata::core::CheckVoidify() & \
                    ::strata::core::CheckFailure(__FILE__, __LINE__, #condition).stream()
