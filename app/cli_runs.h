// lorapipe-cli commands that use the run database: train, resume, eval (cli_train.cpp) and
// runs list | show | compare (cli_runs.cpp). Each returns the process exit code.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "core/base/cancel.h"
#include "core/base/result.h"

namespace lorapipe {

struct train_args {
  std::string project;
  int64_t steps = -1;
  std::string output, devices, schedule, transport, db;
  int64_t threads = -1;
  bool json = false;
  int64_t processes = -1;  // distributed.processes override
  int rank = -1;           // -1: not given (rank 0, starting the other ranks here)
  std::string rendezvous, resume_from;
};
struct resume_args {
  int64_t run = 0;  // run id in the database (which knows its config and output folder)
  std::string db;
  int64_t checkpoint = -1;  // step of an older checkpoint to continue from (-1 = newest)
  int64_t processes = -1;   // continue over this many processes (-1: as recorded)
  std::string rendezvous;   // serve the rendezvous here and start no local ranks (they are started by hand)
  bool json = false;
};
struct eval_args {
  std::string project, adapter, data, db;
  int64_t run = 0;  // evaluate this run's adapter with its config and record the result
  bool json = false;
};

// `stop` is requested by Ctrl-C: training stops after writing a checkpoint (exit code 130).
int cmd_train(const train_args& a, const cancel_token& stop);
int cmd_resume(const resume_args& a, const cancel_token& stop);
int cmd_eval(const eval_args& a);
int cmd_runs_list(const std::string& db, int64_t limit, bool json);
int cmd_runs_show(const std::string& db, int64_t id, bool json);
int cmd_runs_compare(const std::string& db, int64_t a, int64_t b, bool json);

int cli_fail(const std::string& msg);
// Base model path and adapter folder of a recorded run (for export --run).
result<std::pair<std::string, std::string>> run_export_sources(const std::string& db, int64_t run);  // prints "error: msg" on stderr, returns 1

}  // namespace lorapipe
