// Run sessions: the run lifecycle every front-end uses. begin_run (validation, output-folder check,
// hardware/version fingerprint, the run row), prepare_resume (liveness, checkpoint choice and
// verification, the abandoned metrics dropped), execute_run (training with the run recorder, a
// cancel token and the caller's observer; the run's final status is always written). Nothing here
// throws or prints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "core/base/cancel.h"
#include "core/base/events.h"
#include "core/base/result.h"
#include "core/engine/model_session.h"
#include "core/project/project.h"
#include "core/train/trainer.h"

namespace lorapipe {

// The run database: `flag` (e.g. --db), else the project's run.database, else $LORAPIPE_DB, else
// $XDG_DATA_HOME/lorapipe/runs.db (~/.local/share/lorapipe/runs.db).
std::filesystem::path resolve_database(const std::string& flag, const project_config* cfg = nullptr);

struct run_handle {
  int64_t run_id = 0;
  std::filesystem::path database;
  project_config config;                // absolute paths
  std::filesystem::path resume_from;    // empty: from the start
  std::filesystem::path checkpoint_root;
  int64_t start_step = 0, total_steps = 0;
  bool already_completed = false;       // prepare_resume of a completed run: nothing to do
};

result<run_handle> begin_run(const project_config& cfg, const std::string& project_path, const std::filesystem::path& database);
// checkpoint_step: an older checkpoint to continue from (nullopt = the newest).
// `processes`: continue over another number of processes (distributed.processes; the checkpoint
// holds every stage's state, so any count the project's devices and schedule allow will do).
result<run_handle> prepare_resume(const std::filesystem::path& database, int64_t run, std::optional<int64_t> checkpoint_step,
                                  std::optional<int64_t> processes = std::nullopt);

enum class run_status { completed, stopped, failed };
const char* run_status_name(run_status s);

struct run_outcome {
  run_status status = run_status::completed;
  train_summary summary;
};

struct execute_options {
  probe_fn probe;  // test hook (kill tests): checkpoint writes, database commits, pipeline instructions
  // A loaded model to share with the run when it is the project's (see model_session::weights_for).
  const model_session* model = nullptr;
  // distributed.processes > 1: called by rank 0 (this process) once the rendezvous serves, with its
  // port, to start the other ranks (the CLI starts them on this machine with run_rank); empty when
  // they are started by hand (lorapipe-cli train --rank R on each host).
  std::function<void(uint16_t port)> launch_ranks;
  // Polled by rank 0 while it waits for the others at the rendezvous: non-empty ("rank 1 exited with
  // status 1 before joining") fails the run at once instead of after distributed.timeout_s.
  std::function<std::string()> watch_ranks;
};

// Trains the run; a failure comes back as an error value after the run is recorded as failed.
result<run_outcome> execute_run(const run_handle& h, observer& obs, const cancel_token& cancel, const execute_options& opts = {});

// A rank other than 0 of a run over several processes (distributed.processes > 1): joins rank 0's
// rendezvous (distributed.rendezvous, which must name the port) with the project's hash, computes its
// share of every step, and writes nothing (rank 0 records the run and writes the checkpoints and the
// adapter). resume_from: the checkpoint rank 0 continues from (empty: from the start).
// A failing rank leaves its error in the rendezvous store before it returns, so the others' errors
// quote it ("rank 1 last reported: failed: …"). probe: test hook, reached at "rank:start".
result<train_summary> run_rank(const project_config& cfg, int rank, const std::filesystem::path& resume_from, observer& obs,
                               const cancel_token& cancel, const probe_fn& probe = {});

// Rank 0 of a run whose other ranks are started by hand (train --rank 0, resume --rendezvous): its
// rendezvous must name a fixed port to give them (port 0 picks one nobody is told). Checked before a
// run is recorded.
status check_hand_started_rank0(const project_config& cfg);

// LORAPIPE_KILL_AT=<site>:<n> (kill tests): the process SIGKILLs itself the n-th time it reaches
// <site> (checkpoint:file, checkpoint:manifest, checkpoint:rename, db:commit, pipeline:instruction,
// rank:start).
probe_fn kill_probe_from_environment();

}  // namespace lorapipe
