// The run database (SQLite): projects, runs (config snapshot, status, config hash, hardware
// fingerprint, library versions), metrics per step, evaluations, checkpoints and events. WAL mode
// (a reader such as the GUI reads while a run writes), synchronous=FULL (a committed row survives a
// power loss, like the fsynced checkpoint it describes), foreign keys on, schema migrations recorded
// in a version table. One database per user by default (XDG data dir). Failures throw
// database_error (errors.h); the CLI catches it at its boundary.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/runs/process_identity.h"
#include "core/runs/sqlite_db.h"

namespace lorapipe {

struct run_record {
  int64_t id = 0;
  std::string project_name, project_path;
  std::string status;  // running, completed, failed, interrupted
  std::string config_json, config_hash, output_dir, hardware, versions, error;
  std::string started_at, ended_at;
  int64_t pid = 0, resumed_count = 0, total_steps = 0, last_step = 0;
  std::string host, process_start;  // with pid: the process that runs (or ran) it (process_identity.h)
  process_identity process() const { return {host, pid, process_start}; }
};

struct metric_row {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, elapsed_s = 0;
  std::string memory_json;  // {"process_rss": peak bytes, "devices": [arena peak per device (pipelines)]}
  std::optional<double> bubble_ratio;   // pipelines: simulated idle fraction
};
struct eval_row {
  int64_t step = 0;
  std::string split;    // val (during training) or eval (lorapipe-cli eval)
  std::string dataset;  // data file
  double loss = 0;
  int64_t tokens = 0;
};
struct checkpoint_row {
  int64_t step = 0;
  std::string path, sha256;  // sha256 of the checkpoint's manifest
  int64_t bytes = 0;
  std::string created_at;
};
struct event_row {
  int64_t id = 0;
  std::string at, level, message;
};

// Everything one transaction writes for a run.
struct run_batch {
  std::vector<metric_row> metrics;
  std::vector<eval_row> evals;
  std::vector<checkpoint_row> checkpoints;
  std::vector<int64_t> removed_checkpoints;  // steps pruned by the keep-last-N policy
  std::vector<event_row> events;
  std::optional<int64_t> total_steps;  // known once the data is loaded (run.epochs)
  bool empty() const {
    return metrics.empty() && evals.empty() && checkpoints.empty() && removed_checkpoints.empty() && events.empty() &&
           !total_steps;
  }
};

struct new_run {
  std::string project_name, project_path, config_json, config_hash, output_dir, hardware, versions;
  int64_t total_steps = 0;
  process_identity process;
};

class run_store {
 public:
  static constexpr int64_t latest_version = 3;
  // Opens or creates the database and migrates it to target_version (tests pass older versions).
  // A database written by a newer build is refused.
  explicit run_store(const std::filesystem::path& path, int busy_timeout_ms = 5000, int64_t target_version = latest_version);
  // A read-only connection for front-ends (runs list/show/compare, the GUI): takes no lock and runs no
  // migration, so it opens while a run writes. A missing database is an error; one of an older schema is
  // migrated once through a writing connection first; a newer one is refused.
  static run_store open_reader(const std::filesystem::path& path, int busy_timeout_ms = 5000);

  int64_t version();
  int64_t begin_run(const new_run& r);
  // status: running | completed | failed | interrupted; ended sets ended_at.
  void set_status(int64_t run, const std::string& status, const std::string& error);
  void mark_resumed(int64_t run, const process_identity& by);
  // Resume: metrics, evaluations and checkpoints after `step` belong to the lost tail (or to the timeline
  // a resume from an older checkpoint abandons) and are recomputed.
  void truncate_after(int64_t run, int64_t step);
  // Removes a run and everything recorded for it (one transaction); false when there is no such run.
  bool delete_run(int64_t run);
  void write(int64_t run, const run_batch& b);  // one transaction

  std::vector<run_record> list_runs(int64_t limit);
  std::optional<run_record> get_run(int64_t id);
  std::vector<metric_row> metrics(int64_t run);
  std::vector<eval_row> evaluations(int64_t run);
  std::vector<checkpoint_row> checkpoints(int64_t run);
  std::vector<event_row> events(int64_t run);
  std::string integrity_check();  // "ok" when sound
  sqlite_db& db() { return *db_; }
  // Called inside write()'s transaction just before COMMIT (the kill test stops the process there).
  void set_probe(std::function<void(const char*)> p) { probe_ = std::move(p); }

 private:
  explicit run_store(std::unique_ptr<sqlite_db> db) : db_(std::move(db)) {}
  void migrate(int64_t target);
  void refuse_newer(int64_t have);
  std::unique_ptr<sqlite_db> db_;
  std::function<void(const char*)> probe_;
};

// $LORAPIPE_DB, else $XDG_DATA_HOME/lorapipe/runs.db, else ~/.local/share/lorapipe/runs.db.
std::filesystem::path default_database_path();

}  // namespace lorapipe
