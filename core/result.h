// Result<T>: a value or a non-OK Status, shaped like std::expected. The only
// control-flow helpers are STRATA_RETURN_IF_ERROR and STRATA_ASSIGN_OR_RETURN.
// Thread-compatible value type.
#pragma once

#include <type_traits>
#include <utility>
#include <variant>

#include "core/check.h"
#include "core/status.h"

namespace strata::core {

template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::remove_cv_t<T>, Status>, "use Status directly");
  static_assert(!std::is_reference_v<T>, "Result<T&> is not supported");

 public:
  // A value.
  Result(const T& value) : v_(std::in_place_index<0>, value) {}  // NOLINT(implicit)
  Result(T&& value) : v_(std::in_place_index<0>, std::move(value)) {}  // NOLINT(implicit)
  template <typename U,
            typename = std::enable_if_t<std::is_constructible_v<T, U&&> &&
                                        !std::is_same_v<std::decay_t<U>, T> &&
                                        !std::is_same_v<std::decay_t<U>, Status> &&
                                        !std::is_same_v<std::decay_t<U>, Result>>>
  Result(U&& value) : v_(std::in_place_index<0>, std::forward<U>(value)) {}  // NOLINT
  // An error. An OK status here is a bug (there would be no value).
  Result(Status status) : v_(std::in_place_index<1>, std::move(status)) {  // NOLINT(implicit)
    STRATA_CHECK(!std::get<1>(v_).ok()) << "Result constructed from an OK Status";
  }

  bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }

  // The error; OK when there is a value.
  Status status() const& { return ok() ? Status() : std::get<1>(v_); }
  Status status() && { return ok() ? Status() : std::move(std::get<1>(v_)); }

  T& value() & { return checked(); }
  const T& value() const& { return const_cast<Result*>(this)->checked(); }
  T&& value() && { return std::move(checked()); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? std::get<0>(v_) : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  T& checked() {
    STRATA_CHECK(ok()) << "value() of a failed Result: " << std::get<1>(v_).to_string();
    return std::get<0>(v_);
  }
  std::variant<T, Status> v_;
};

}  // namespace strata::core

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

// Evaluates a Status expression and returns it from the enclosing function if it failed.
#define STRATA_RETURN_IF_ERROR(expr)                                   \
  do {                                                                 \
    ::strata::core::Status strata_status_tmp_ = (expr);                \
    if (!strata_status_tmp_.ok()) [[unlikely]] return strata_status_tmp_; \
  } while (false)

// `STRATA_ASSIGN_OR_RETURN(auto x, make_x());` or with an existing lvalue.
#define STRATA_ASSIGN_OR_RETURN(lhs, rexpr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_result_, __LINE__), lhs, rexpr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr)         \
  auto tmp = (rexpr);                                          \
  if (!tmp.ok()) [[unlikely]] return std::move(tmp).status(); \
  lhs = std::move(tmp).value()
