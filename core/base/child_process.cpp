// child_process: see child_process.h.
#include "core/base/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

extern char** environ;

namespace lorapipe {

child_process::child_process(std::vector<std::string> args, std::filesystem::path stderr_file) : err_(std::move(stderr_file)) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (!err_.empty()) posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (argv[0] == nullptr || posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&fa);
}

child_process::~child_process() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (!err_.empty()) {
    std::error_code ec;
    std::filesystem::remove(err_, ec);
  }
}

void child_process::kill() const {
  if (pid_ > 0) ::kill(pid_, SIGKILL);
}

std::optional<int> child_process::wait(std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (pid_ > 0) {
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_ || r < 0) {
      pid_ = -1;
      status_known_ = true;
      status_ = r < 0 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
      break;
    }
    if (std::chrono::steady_clock::now() >= end) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!status_known_) return std::nullopt;
  return status_;
}

std::string child_process::stderr_text() const {
  if (err_.empty()) return {};
  std::ifstream f(err_);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

bool die_with_parent(pid_t parent) {
#ifdef __linux__
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return false;
  if (::getppid() != parent) ::raise(SIGKILL);  // it died before the line above
  return true;
#else
  (void)parent;
  return false;
#endif
}

}  // namespace lorapipe
