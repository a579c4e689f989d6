// Process identity and liveness from /proc: see process_identity.h.
#include "core/runs/process_identity.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>

namespace lorapipe {

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); "" when the process is gone,
// or dead and not yet reaped (a zombie: state 'Z', field 3; a container's init may never reap it).
// The command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'.
std::string start_ticks(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return "";
  const auto close = line.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return "";
    if (i == 22) return field;
  }
  return "";
}

bool have_proc() {
  std::ifstream f("/proc/self/stat");
  return f.good();
}

liveness by_signal(int64_t pid) {
  if (pid <= 0) return liveness::gone;
  if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) return liveness::alive;
  return liveness::gone;
}

}  // namespace

process_identity this_process() {
  const int64_t pid = ::getpid();
  const std::string ticks = start_ticks(pid);
  return {host_name(), pid, ticks.empty() ? std::string() : boot_id() + "/" + ticks};
}

liveness process_liveness(const process_identity& p) {
  if (p.host.empty()) return by_signal(p.pid);  // recorded before identities were stored
  // Another host name on this very boot (a container gets a new name each time) is this machine.
  const bool same_boot = !p.start.empty() && p.start.rfind(boot_id() + "/", 0) == 0;
  if (p.host != host_name() && !same_boot) return liveness::unknown;
  if (p.pid <= 0) return liveness::gone;
  if (p.start.empty() || !have_proc()) return by_signal(p.pid);
  const std::string ticks = start_ticks(p.pid);
  if (ticks.empty()) return liveness::gone;
  return p.start == boot_id() + "/" + ticks ? liveness::alive : liveness::gone;  // else: pid reused
}

}  // namespace lorapipe
