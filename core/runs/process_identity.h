// Who recorded a "running" run, and whether that process still exists. A pid alone misleads: pids
// are reused, kill(pid, 0) fails with EPERM for another user's live process, and a database on a
// shared folder can be written from another machine. A process is named by its host, its pid and
// its start ("<boot id>/<start time in clock ticks>" from /proc), which no other process shares.
#pragma once

#include <cstdint>
#include <string>

namespace lorapipe {

struct process_identity {
  std::string host;   // gethostname()
  int64_t pid = 0;
  std::string start;  // "<boot id>/<start ticks>"; empty where /proc is not available
};

process_identity this_process();

enum class liveness { alive, gone, unknown };  // unknown: recorded on another machine
// Another host name with this machine's boot id (a container renamed) counts as this machine; a
// record of another boot of this machine (rebooted since) is gone. A record without host and start
// (written before they were stored) falls back to the pid alone, reading EPERM as alive.
liveness process_liveness(const process_identity& p);

}  // namespace lorapipe
