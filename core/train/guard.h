// The engine's error boundary: runs `f` (which returns result<T>) and turns what it throws into an
// error value: a stop request into "cancelled", LibTorch errors without their backtrace, device,
// database and other failures by their message. Used by core/train and core/engine entry points.
#pragma once

#include <exception>

#include <c10/util/Exception.h>

#include "core/base/cancel.h"
#include "core/base/result.h"

namespace lorapipe {

template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const cancelled_error&) {
    return make_error("cancelled");
  } catch (const c10::Error& e) {
    return make_error("LibTorch: {}", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return make_error("{}", e.what());
  }
}

}  // namespace lorapipe
