// An observer that keeps every engine event (tests): all<T>() picks one kind in order, first_index<T>()
// where it first arrived; `hook` sees each event as it comes (to request a stop, count steps, ...).
#pragma once

#include <functional>
#include <variant>
#include <vector>

#include "core/base/events.h"

struct event_log : lorapipe::observer {
  std::vector<lorapipe::engine_event> events;
  std::function<void(const lorapipe::engine_event&)> hook;
  void on_event(const lorapipe::engine_event& e) override {
    events.push_back(e);
    if (hook) hook(e);
  }
  template <class T>
  std::vector<T> all() const {
    std::vector<T> out;
    for (const auto& e : events)
      if (auto* p = std::get_if<T>(&e)) out.push_back(*p);
    return out;
  }
  template <class T>
  size_t first_index() const {
    for (size_t i = 0; i < events.size(); ++i)
      if (std::holds_alternative<T>(events[i])) return i;
    return events.size();
  }
};
