// A child process started with posix_spawn (the local ranks of a multi-process run, the peers of the
// multi-process tests). Its stderr goes to a file when one is named (read back with stderr_text),
// else it shares ours. The destructor kills (SIGKILL) and reaps a child still running, so no child
// outlives its owner; a child can also ask the kernel to kill it when its parent dies
// (die_with_parent).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace lorapipe {

class child_process {
 public:
  // args[0]: the executable's path. Check started().
  explicit child_process(std::vector<std::string> args, std::filesystem::path stderr_file = {});
  ~child_process();
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  bool started() const { return pid_ > 0 || status_known_; }
  pid_t pid() const { return pid_; }
  void kill() const;
  // The exit code, or -signal; nullopt while it still runs after `limit` (0: just look).
  std::optional<int> wait(std::chrono::milliseconds limit);
  std::string stderr_text() const;

 private:
  std::filesystem::path err_;
  pid_t pid_ = -1;
  bool status_known_ = false;
  int status_ = 0;
};

// In a child: SIGKILL this process when the process `parent` is gone (prctl PR_SET_PDEATHSIG), and
// now if it already is. False where the platform cannot.
bool die_with_parent(pid_t parent);

}  // namespace lorapipe
