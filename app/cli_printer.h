// Prints engine events for a terminal (progress bar with ETA), for logs (plain lines when stderr
// is not a TTY), or as JSON lines (--json). Everything goes to stderr; stdout stays for results.
#pragma once

#include <cstdio>

#include "core/base/events.h"

namespace lorapipe {

class cli_printer final : public observer {
 public:
  cli_printer(bool json, bool tty) : json_(json), tty_(tty) {}
  void on_event(const engine_event& e) override;

 private:
  void end_bar();
  bool json_, tty_;
  bool bar_open_ = false;
  double last_print_s_ = -1;
  double loss_ema_ = -1;
};

}  // namespace lorapipe
