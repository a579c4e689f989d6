// Errors as values: result<T> carries either a value or a one-line error message.
// Used for all I/O and parsing in core/ and offload/; exceptions are reserved for
// programming errors and device/library failures (see errors.h), caught at one boundary.
#pragma once

#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace lorapipe {

struct error {
  std::string message;
};

template <class... Args>
error make_error(fmt::format_string<Args...> f, Args&&... args) {
  return error{fmt::format(f, std::forward<Args>(args)...)};
}

template <class T>
class [[nodiscard]] result {
 public:
  result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  result(error e) : v_(std::move(e)) {}      // NOLINT
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const error& err() const { return std::get<1>(v_); }
  const std::string& message() const { return err().message; }

 private:
  std::variant<T, error> v_;
};

// result<void>: success or an error.
using status = result<std::monostate>;
inline status ok_status() { return std::monostate{}; }

}  // namespace lorapipe

// Propagates an error from an expression yielding result<T>; binds the value to `var`.
#define LP_TRY_ASSIGN(var, expr)                         \
  auto var##_res_ = (expr);                              \
  if (!var##_res_.ok()) return var##_res_.err();         \
  auto var = std::move(var##_res_).value()

#define LP_TRY(expr)                                     \
  do {                                                   \
    auto lp_try_res_ = (expr);                           \
    if (!lp_try_res_.ok()) return lp_try_res_.err();     \
  } while (0)
