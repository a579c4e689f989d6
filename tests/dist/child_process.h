// A child process for the multi-process tests: started with posix_spawn, stderr into a file; the
// destructor kills (SIGKILL) and reaps it if it still runs, so no test leaves a process behind.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace lorapipe {

using clk = std::chrono::steady_clock;

// One peer process; stderr goes to a file. The destructor kills and reaps it if still running.
class child_process {
 public:
  explicit child_process(std::vector<std::string> args)
      : err_(std::filesystem::temp_directory_path() / ("lp_child_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++))) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~child_process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove(err_);
  }
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  void kill() const { ::kill(pid_, SIGKILL); }
  // The exit code, or -signal; -1000 if it had not ended within `limit` (the destructor kills it).
  int wait(std::chrono::seconds limit) {
    const auto end = clk::now() + limit;
    int st = 0;
    while (::waitpid(pid_, &st, WNOHANG) == 0) {
      if (clk::now() > end) return -1000;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
  }
  std::string stderr_text() const {
    std::ifstream f(err_);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  bool started() const { return pid_ > 0; }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path err_;
  pid_t pid_ = -1;
};

}  // namespace lorapipe
