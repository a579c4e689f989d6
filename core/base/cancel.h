// Cooperative cancellation: a front-end (Ctrl-C handler, a GUI Stop button, a test) requests, the
// engine checks at its loop heads (model loading, tokenisation, evaluation, sampling, generation,
// every instruction of a pipeline step) and unwinds. Loops that return errors as values use
// check(); deep loops throw cancelled_error, which the engine's boundary turns into a stop.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "core/base/errors.h"
#include "core/base/result.h"

namespace lorapipe {

struct cancelled_error : lorapipe_error {
  cancelled_error() : lorapipe_error("cancelled") {}
};

class cancel_token {
 public:
  void request() noexcept { flag_.store(true, std::memory_order_relaxed); }
  void reset() noexcept { flag_.store(false, std::memory_order_relaxed); }
  bool requested() const noexcept { return flag_.load(std::memory_order_relaxed); }
  void throw_if_requested() const {
    if (requested()) throw cancelled_error();
  }

 private:
  std::atomic<bool> flag_{false};
};

// Progress of a countable loop (total 0 = not known yet); returning false stops it ("cancelled").
using progress_fn = std::function<bool(int64_t done, int64_t total)>;

inline bool cancel_requested(const cancel_token* c) { return c != nullptr && c->requested(); }
inline void throw_if_cancelled(const cancel_token* c) {
  if (c != nullptr) c->throw_if_requested();
}
// The error value a loop returns when it stops for a cancel request.
inline bool is_cancelled(const error& e) { return e.message == "cancelled"; }

}  // namespace lorapipe
