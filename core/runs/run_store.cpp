// Run database: see run_store.h.
#include "core/runs/run_store.h"

#include <cstdlib>

#include <fmt/format.h>

#include "core/base/errors.h"

namespace lorapipe {
namespace fs = std::filesystem;

namespace {

constexpr const char* now_sql = "strftime('%Y-%m-%dT%H:%M:%fZ','now')";

// Migration N takes the schema from version N-1 to N. Append only; never edit a released one.
const std::vector<std::string>& migrations() {
  static const std::vector<std::string> m = {
      // 1: the tables.
      R"(CREATE TABLE projects(
           id INTEGER PRIMARY KEY,
           name TEXT NOT NULL,
           path TEXT NOT NULL UNIQUE,
           created_at TEXT NOT NULL);
         CREATE TABLE runs(
           id INTEGER PRIMARY KEY,
           project_id INTEGER NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
           status TEXT NOT NULL CHECK(status IN ('running','completed','failed','interrupted')),
           config_json TEXT NOT NULL,
           config_hash TEXT NOT NULL,
           output_dir TEXT NOT NULL,
           hardware TEXT NOT NULL,
           versions TEXT NOT NULL,
           started_at TEXT NOT NULL,
           ended_at TEXT,
           pid INTEGER NOT NULL DEFAULT 0,
           total_steps INTEGER NOT NULL DEFAULT 0,
           error TEXT NOT NULL DEFAULT '');
         CREATE TABLE metrics(
           run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
           step INTEGER NOT NULL,
           loss REAL NOT NULL, lr REAL NOT NULL, grad_norm REAL NOT NULL,
           tokens_per_s REAL NOT NULL, elapsed_s REAL NOT NULL,
           memory_json TEXT NOT NULL DEFAULT '',
           bubble_ratio REAL,
           PRIMARY KEY(run_id, step)) WITHOUT ROWID;
         CREATE TABLE evaluations(
           run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
           step INTEGER NOT NULL, split TEXT NOT NULL, dataset TEXT NOT NULL,
           loss REAL NOT NULL, tokens INTEGER NOT NULL,
           created_at TEXT NOT NULL,
           PRIMARY KEY(run_id, step, split, dataset)) WITHOUT ROWID;
         CREATE TABLE checkpoints(
           run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
           step INTEGER NOT NULL, path TEXT NOT NULL, sha256 TEXT NOT NULL, bytes INTEGER NOT NULL,
           created_at TEXT NOT NULL,
           PRIMARY KEY(run_id, step)) WITHOUT ROWID;
         CREATE TABLE events(
           id INTEGER PRIMARY KEY,
           run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
           at TEXT NOT NULL, level TEXT NOT NULL, message TEXT NOT NULL);)",
      // 2: resume bookkeeping and an index for per-run event lookups.
      R"(ALTER TABLE runs ADD COLUMN resumed_count INTEGER NOT NULL DEFAULT 0;
         ALTER TABLE runs ADD COLUMN last_step INTEGER NOT NULL DEFAULT 0;
         CREATE INDEX events_by_run ON events(run_id, id);)",
      // 3: the process that runs a run, beyond its pid (process_identity.h).
      R"(ALTER TABLE runs ADD COLUMN host TEXT NOT NULL DEFAULT '';
         ALTER TABLE runs ADD COLUMN process_start TEXT NOT NULL DEFAULT '';)",
  };
  return m;
}

run_record read_run(sqlite_stmt& s) {
  run_record r;
  r.id = s.column_int(0);
  r.project_name = s.column_text(1);
  r.project_path = s.column_text(2);
  r.status = s.column_text(3);
  r.config_json = s.column_text(4);
  r.config_hash = s.column_text(5);
  r.output_dir = s.column_text(6);
  r.hardware = s.column_text(7);
  r.versions = s.column_text(8);
  r.started_at = s.column_text(9);
  r.ended_at = s.column_text(10);
  r.pid = s.column_int(11);
  r.total_steps = s.column_int(12);
  r.error = s.column_text(13);
  r.resumed_count = s.column_int(14);
  r.last_step = s.column_int(15);
  r.host = s.column_text(16);
  r.process_start = s.column_text(17);
  return r;
}

constexpr const char* run_columns =
    "r.id, p.name, p.path, r.status, r.config_json, r.config_hash, r.output_dir, r.hardware, r.versions, "
    "r.started_at, coalesce(r.ended_at,''), r.pid, r.total_steps, r.error, r.resumed_count, r.last_step, r.host, r.process_start "
    "FROM runs r JOIN projects p ON p.id = r.project_id";

}  // namespace

fs::path default_database_path() {
  if (const char* p = std::getenv("LORAPIPE_DB"); p != nullptr && *p != 0) return p;
  if (const char* x = std::getenv("XDG_DATA_HOME"); x != nullptr && *x == '/') return fs::path(x) / "lorapipe" / "runs.db";
  const char* home = std::getenv("HOME");
  return fs::path(home != nullptr ? home : ".") / ".local" / "share" / "lorapipe" / "runs.db";
}

run_store::run_store(const fs::path& path, int busy_timeout_ms, int64_t target_version) {
  std::error_code ec;
  if (!path.parent_path().empty()) fs::create_directories(path.parent_path(), ec);
  db_ = std::make_unique<sqlite_db>(path, sqlite_db::mode::read_write_create, busy_timeout_ms);
  db_->exec("PRAGMA foreign_keys = ON");
  // WAL: readers never block the writer and a killed writer leaves a consistent database.
  if (db_->query_text("PRAGMA journal_mode = WAL") != "wal")
    throw database_error(fmt::format("{}: cannot switch the database to WAL mode", path.string()), 0);
  // FULL: each commit is fsynced, so the metrics a checkpoint's sync() waited for survive a power loss
  // (NORMAL may roll back the last transactions in WAL mode). The recorder batches, so this costs little.
  db_->exec("PRAGMA synchronous = FULL");
  migrate(target_version);
}

run_store run_store::open_reader(const fs::path& path, int busy_timeout_ms) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw database_error(fmt::format("{}: no run database here (no run recorded yet)", path.string()), 14);
  auto db = std::make_unique<sqlite_db>(path, sqlite_db::mode::read_only, busy_timeout_ms);
  const int64_t have = db->query_int("SELECT count(*) FROM sqlite_master WHERE name = 'schema_version'") == 0
                           ? 0
                           : db->query_int("SELECT coalesce(max(version), 0) FROM schema_version");
  if (have < latest_version) {  // older schema: migrate once, then read without locks
    db.reset();
    run_store(path, busy_timeout_ms);
    db = std::make_unique<sqlite_db>(path, sqlite_db::mode::read_only, busy_timeout_ms);
  }
  run_store reader(std::move(db));
  reader.refuse_newer(reader.version());
  return reader;
}

void run_store::refuse_newer(int64_t have) {
  if (have > latest_version)
    throw database_error(fmt::format("{}: database schema version {} is newer than this build understands ({}); use a newer lorapipe",
                                     db_->path().string(), have, latest_version),
                         0);
}

int64_t run_store::version() {
  return db_->query_int("SELECT coalesce(max(version), 0) FROM schema_version");
}

void run_store::migrate(int64_t target) {
  {
    sqlite_txn t(*db_);
    db_->exec("CREATE TABLE IF NOT EXISTS schema_version(version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)");
    t.commit();
  }
  const int64_t have = version();
  refuse_newer(have);
  const auto& m = migrations();
  for (int64_t v = have + 1; v <= target && v <= static_cast<int64_t>(m.size()); ++v) {
    sqlite_txn t(*db_);
    if (version() >= v) continue;  // another process migrated meanwhile
    db_->exec(m[static_cast<size_t>(v - 1)]);
    sqlite_stmt(*db_, fmt::format("INSERT INTO schema_version(version, applied_at) VALUES(?, {})", now_sql)).bind(1, v).exec();
    t.commit();
  }
}

int64_t run_store::begin_run(const new_run& r) {
  sqlite_txn t(*db_);
  sqlite_stmt(*db_, fmt::format("INSERT INTO projects(name, path, created_at) VALUES(?, ?, {}) "
                                "ON CONFLICT(path) DO UPDATE SET name = excluded.name", now_sql))
      .bind(1, r.project_name)
      .bind(2, r.project_path)
      .exec();
  const int64_t project = [&] {
    sqlite_stmt s(*db_, "SELECT id FROM projects WHERE path = ?");
    s.bind(1, r.project_path);
    s.step();
    return s.column_int(0);
  }();
  sqlite_stmt(*db_, fmt::format("INSERT INTO runs(project_id, status, config_json, config_hash, output_dir, hardware, versions, "
                                "started_at, pid, total_steps, host, process_start) VALUES(?, 'running', ?, ?, ?, ?, ?, {}, ?, ?, ?, ?)",
                                now_sql))
      .bind(1, project)
      .bind(2, r.config_json)
      .bind(3, r.config_hash)
      .bind(4, r.output_dir)
      .bind(5, r.hardware)
      .bind(6, r.versions)
      .bind(7, r.process.pid)
      .bind(8, r.total_steps)
      .bind(9, r.process.host)
      .bind(10, r.process.start)
      .exec();
  const int64_t id = db_->last_insert_rowid();
  t.commit();
  return id;
}

void run_store::set_status(int64_t run, const std::string& status, const std::string& error) {
  sqlite_txn t(*db_);
  const bool ended = status != "running";
  sqlite_stmt(*db_, fmt::format("UPDATE runs SET status = ?, error = ?, ended_at = {} WHERE id = ?",
                                ended ? now_sql : "NULL"))
      .bind(1, status)
      .bind(2, error)
      .bind(3, run)
      .exec();
  t.commit();
}

void run_store::mark_resumed(int64_t run, const process_identity& by) {
  sqlite_txn t(*db_);
  sqlite_stmt(*db_, "UPDATE runs SET status = 'running', error = '', ended_at = NULL, pid = ?, host = ?, process_start = ?, "
                    "resumed_count = resumed_count + 1 WHERE id = ?")
      .bind(1, by.pid)
      .bind(2, by.host)
      .bind(3, by.start)
      .bind(4, run)
      .exec();
  t.commit();
}

void run_store::truncate_after(int64_t run, int64_t step) {
  sqlite_txn t(*db_);
  sqlite_stmt(*db_, "DELETE FROM metrics WHERE run_id = ? AND step > ?").bind(1, run).bind(2, step).exec();
  sqlite_stmt(*db_, "DELETE FROM evaluations WHERE run_id = ? AND step > ? AND split = 'val'").bind(1, run).bind(2, step).exec();
  sqlite_stmt(*db_, "DELETE FROM checkpoints WHERE run_id = ? AND step > ?").bind(1, run).bind(2, step).exec();
  sqlite_stmt(*db_, "UPDATE runs SET last_step = ? WHERE id = ?").bind(1, step).bind(2, run).exec();
  t.commit();
}

bool run_store::delete_run(int64_t run) {
  sqlite_txn t(*db_);
  if (!get_run(run)) return false;
  for (const char* table : {"metrics", "evaluations", "checkpoints", "events"})
    sqlite_stmt(*db_, fmt::format("DELETE FROM {} WHERE run_id = ?", table)).bind(1, run).exec();
  sqlite_stmt(*db_, "DELETE FROM runs WHERE id = ?").bind(1, run).exec();
  t.commit();
  return true;
}

void run_store::write(int64_t run, const run_batch& b) {
  if (b.empty()) return;
  sqlite_txn t(*db_);
  if (!b.metrics.empty()) {
    sqlite_stmt s(*db_, "INSERT OR REPLACE INTO metrics(run_id, step, loss, lr, grad_norm, tokens_per_s, elapsed_s, "
                        "memory_json, bubble_ratio) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)");
    for (const auto& m : b.metrics)
      s.bind(1, run).bind(2, m.step).bind(3, m.loss).bind(4, m.lr).bind(5, m.grad_norm).bind(6, m.tokens_per_s)
          .bind(7, m.elapsed_s).bind(8, m.memory_json).bind(9, m.bubble_ratio).exec();
    sqlite_stmt(*db_, "UPDATE runs SET last_step = max(last_step, ?) WHERE id = ?").bind(1, b.metrics.back().step).bind(2, run).exec();
  }
  if (!b.evals.empty()) {
    sqlite_stmt s(*db_, fmt::format("INSERT OR REPLACE INTO evaluations(run_id, step, split, dataset, loss, tokens, created_at) "
                                    "VALUES(?, ?, ?, ?, ?, ?, {})", now_sql));
    for (const auto& e : b.evals)
      s.bind(1, run).bind(2, e.step).bind(3, e.split).bind(4, e.dataset).bind(5, e.loss).bind(6, e.tokens).exec();
  }
  if (!b.checkpoints.empty()) {
    sqlite_stmt s(*db_, fmt::format("INSERT OR REPLACE INTO checkpoints(run_id, step, path, sha256, bytes, created_at) "
                                    "VALUES(?, ?, ?, ?, ?, {})", now_sql));
    for (const auto& c : b.checkpoints) s.bind(1, run).bind(2, c.step).bind(3, c.path).bind(4, c.sha256).bind(5, c.bytes).exec();
  }
  if (!b.removed_checkpoints.empty()) {
    sqlite_stmt s(*db_, "DELETE FROM checkpoints WHERE run_id = ? AND step = ?");
    for (int64_t step : b.removed_checkpoints) s.bind(1, run).bind(2, step).exec();
  }
  if (!b.events.empty()) {
    sqlite_stmt s(*db_, "INSERT INTO events(run_id, at, level, message) VALUES(?, ?, ?, ?)");
    for (const auto& e : b.events) s.bind(1, run).bind(2, e.at).bind(3, e.level).bind(4, e.message).exec();
  }
  if (b.total_steps)
    sqlite_stmt(*db_, "UPDATE runs SET total_steps = ? WHERE id = ?").bind(1, *b.total_steps).bind(2, run).exec();
  if (probe_) probe_("db:commit");
  t.commit();
}

std::vector<run_record> run_store::list_runs(int64_t limit) {
  sqlite_stmt s(*db_, fmt::format("SELECT {} ORDER BY r.id DESC LIMIT ?", run_columns));
  s.bind(1, limit);
  std::vector<run_record> out;
  while (s.step()) out.push_back(read_run(s));
  return out;
}

std::optional<run_record> run_store::get_run(int64_t id) {
  sqlite_stmt s(*db_, fmt::format("SELECT {} WHERE r.id = ?", run_columns));
  s.bind(1, id);
  if (!s.step()) return std::nullopt;
  return read_run(s);
}

std::vector<metric_row> run_store::metrics(int64_t run) {
  sqlite_stmt s(*db_, "SELECT step, loss, lr, grad_norm, tokens_per_s, elapsed_s, memory_json, bubble_ratio "
                      "FROM metrics WHERE run_id = ? ORDER BY step");
  s.bind(1, run);
  std::vector<metric_row> out;
  while (s.step()) {
    metric_row m{s.column_int(0), s.column_double(1), s.column_double(2), s.column_double(3), s.column_double(4),
                 s.column_double(5), s.column_text(6), std::nullopt};
    if (!s.column_is_null(7)) m.bubble_ratio = s.column_double(7);
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<eval_row> run_store::evaluations(int64_t run) {
  sqlite_stmt s(*db_, "SELECT step, split, dataset, loss, tokens FROM evaluations WHERE run_id = ? ORDER BY step, split");
  s.bind(1, run);
  std::vector<eval_row> out;
  while (s.step()) out.push_back({s.column_int(0), s.column_text(1), s.column_text(2), s.column_double(3), s.column_int(4)});
  return out;
}

std::vector<checkpoint_row> run_store::checkpoints(int64_t run) {
  sqlite_stmt s(*db_, "SELECT step, path, sha256, bytes, created_at FROM checkpoints WHERE run_id = ? ORDER BY step");
  s.bind(1, run);
  std::vector<checkpoint_row> out;
  while (s.step()) out.push_back({s.column_int(0), s.column_text(1), s.column_text(2), s.column_int(3), s.column_text(4)});
  return out;
}

std::vector<event_row> run_store::events(int64_t run) {
  sqlite_stmt s(*db_, "SELECT id, at, level, message FROM events WHERE run_id = ? ORDER BY id");
  s.bind(1, run);
  std::vector<event_row> out;
  while (s.step()) out.push_back({s.column_int(0), s.column_text(1), s.column_text(2), s.column_text(3)});
  return out;
}

std::string run_store::integrity_check() { return db_->query_text("PRAGMA integrity_check"); }

}  // namespace lorapipe
