// Run database (schema, migrations, WAL readers, batched recorder, locking), crash-safe checkpoint
// folders, and project-file schema migration.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/base/hash.h"
#include "core/runs/checkpoint.h"
#include "core/base/errors.h"
#include "core/project/project.h"
#include "core/runs/run_recorder.h"
#include "core/runs/run_store.h"
#include "core/runs/run_summary.h"
#include "core/base/safetensors.h"

using namespace lorapipe;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / fmt::format("lorapipe-store-{}-{}", name, ::getpid());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

new_run sample_run(const std::string& project = "/p/project.json") {
  return {"demo", project, R"({"run":{"steps":3}})", "abc123", "/out", R"({"cores":2})", R"({"sqlite":"3"})", 3, {"", 42, ""}};
}

// A run row as the first schemas stored it (begin_run writes the current columns).
int64_t insert_old_run(run_store& old) {
  old.db().exec("INSERT INTO projects(name, path, created_at) VALUES('demo', '/p/project.json', 'then');"
                "INSERT INTO runs(project_id, status, config_json, config_hash, output_dir, hardware, versions, started_at, pid) "
                "VALUES(1, 'running', '{}', 'abc123', '/out', '{}', '{}', 'then', 42)");
  return old.db().last_insert_rowid();
}

}  // namespace

TEST(RunStore, SchemaWalForeignKeysAndRoundTrip) {
  auto d = fresh_dir("basic");
  run_store s(d / "runs.db");
  EXPECT_EQ(s.version(), run_store::latest_version);
  EXPECT_EQ(s.db().query_text("PRAGMA journal_mode"), "wal");
  EXPECT_EQ(s.db().query_int("PRAGMA foreign_keys"), 1);
  EXPECT_EQ(s.db().query_int("PRAGMA synchronous"), 2);  // FULL: every commit fsynced
  const int64_t id = s.begin_run(sample_run());
  run_batch b;
  b.metrics.push_back({1, 2.5, 1e-3, 0.7, 1000, 0.1, R"({"process_rss":123})", std::nullopt});
  b.metrics.push_back({2, 2.25, 2e-3, 0.6, 1100, 0.2, "", 0.25});
  b.evals.push_back({2, "val", "data.txt", 2.4, 512});
  b.checkpoints.push_back({2, "/out/ck/step-00000002", "ffee", 999, {}});
  b.events.push_back({0, "2026-01-01T00:00:00.000Z", "warning", "hello"});
  s.write(id, b);
  auto r = s.get_run(id);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, "running");
  EXPECT_EQ(r->last_step, 2);
  EXPECT_EQ(r->config_hash, "abc123");
  auto m = s.metrics(id);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[1].loss, 2.25);  // REAL round-trips doubles exactly
  EXPECT_FALSE(m[0].bubble_ratio.has_value());
  EXPECT_EQ(*m[1].bubble_ratio, 0.25);
  EXPECT_EQ(s.evaluations(id).size(), 1u);
  EXPECT_EQ(s.checkpoints(id).at(0).sha256, "ffee");
  EXPECT_EQ(s.events(id).at(0).message, "hello");
  // Re-logged steps replace (resume), truncate_after drops the lost tail.
  run_batch again;
  again.metrics.push_back({2, 9.0, 0, 0, 0, 0, "", std::nullopt});
  s.write(id, again);
  EXPECT_EQ(s.metrics(id).at(1).loss, 9.0);
  s.truncate_after(id, 1);
  EXPECT_EQ(s.metrics(id).size(), 1u);
  EXPECT_TRUE(s.evaluations(id).empty());
  s.set_status(id, "completed", "");
  EXPECT_EQ(s.get_run(id)->status, "completed");
  EXPECT_FALSE(s.get_run(id)->ended_at.empty());
  // Same project path -> same project row; a bad status is refused by the CHECK constraint.
  const int64_t id2 = s.begin_run(sample_run());
  EXPECT_EQ(s.list_runs(10).size(), 2u);
  EXPECT_EQ(s.db().query_int("SELECT count(*) FROM projects"), 1);
  EXPECT_THROW(s.set_status(id2, "exploded", ""), database_error);
  EXPECT_EQ(s.integrity_check(), "ok");
}

TEST(RunStore, MigratesAnOlderDatabaseKeepingItsRows) {
  auto d = fresh_dir("migrate");
  int64_t id = 0;
  {
    run_store v1(d / "runs.db", 5000, 1);  // a database written by the first schema
    EXPECT_EQ(v1.version(), 1);
    id = insert_old_run(v1);
    EXPECT_THROW(v1.db().query_int("SELECT resumed_count FROM runs"), database_error);
  }
  run_store now(d / "runs.db");
  EXPECT_EQ(now.version(), run_store::latest_version);
  auto r = now.get_run(id);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->project_name, "demo");
  EXPECT_EQ(r->resumed_count, 0);
  now.mark_resumed(id, this_process());
  EXPECT_EQ(now.get_run(id)->resumed_count, 1);
  EXPECT_EQ(now.db().query_int("SELECT count(*) FROM schema_version"), run_store::latest_version);
  // A database from a newer build is refused, not damaged.
  now.db().exec("INSERT INTO schema_version VALUES(99, 'future')");
  try {
    run_store newer(d / "runs.db");
    FAIL() << "expected a refusal";
  } catch (const database_error& e) {
    EXPECT_NE(std::string(e.what()).find("newer than this build"), std::string::npos) << e.what();
  }
}

TEST(RunStore, ReaderReadsWhileAWriterHoldsATransaction) {
  auto d = fresh_dir("wal");
  run_store writer(d / "runs.db");
  const int64_t id = writer.begin_run(sample_run());
  run_batch b;
  b.metrics.push_back({1, 1.0, 0, 0, 0, 0, "", std::nullopt});
  writer.write(id, b);
  run_store reader(d / "runs.db", 100);
  writer.db().exec("BEGIN IMMEDIATE");
  writer.db().exec("INSERT INTO metrics(run_id, step, loss, lr, grad_norm, tokens_per_s, elapsed_s) VALUES(1, 2, 2, 0, 0, 0, 0)");
  EXPECT_EQ(reader.metrics(id).size(), 1u);  // sees the committed state, not blocked
  // A second writer gives up with a clear "locked" error after its busy timeout.
  try {
    reader.set_status(id, "failed", "x");
    FAIL() << "expected a lock error";
  } catch (const database_error& e) {
    EXPECT_TRUE(e.locked());
    EXPECT_NE(std::string(e.what()).find("locked by another process"), std::string::npos) << e.what();
  }
  writer.db().exec("COMMIT");
  EXPECT_EQ(reader.metrics(id).size(), 2u);
}

// Front-ends read through a read-only connection: it opens while a run holds the write lock (a
// writing connection would wait in its migration check and fail after its busy timeout), cannot write,
// migrates an older database once, and refuses a missing one.
TEST(RunStore, ReadOnlyReaderTakesNoLock) {
  auto d = fresh_dir("reader");
  EXPECT_THROW(run_store::open_reader(d / "runs.db"), database_error);
  EXPECT_FALSE(fs::exists(d / "runs.db"));  // a reader creates nothing
  int64_t id = 0;
  {
    run_store v2(d / "runs.db", 5000, 2);
    id = insert_old_run(v2);
  }
  auto migrated = run_store::open_reader(d / "runs.db");
  EXPECT_EQ(migrated.version(), run_store::latest_version);
  EXPECT_EQ(migrated.get_run(id)->host, "");  // rows from before the column keep working

  run_store writer(d / "runs.db");
  writer.db().exec("BEGIN IMMEDIATE");
  writer.db().exec("UPDATE runs SET last_step = 5");
  auto reader = run_store::open_reader(d / "runs.db", 100);
  EXPECT_EQ(reader.get_run(id)->last_step, 0);  // the committed state
  try {
    reader.set_status(id, "failed", "x");
    FAIL() << "a reader wrote";
  } catch (const database_error& e) {
    EXPECT_NE(std::string(e.what()).find("read-only"), std::string::npos) << e.what();
  }
  writer.db().exec("COMMIT");
  EXPECT_EQ(reader.get_run(id)->last_step, 5);
}

// A process is named by host, pid and start: a reused pid, an exited process and another host's
// process are told apart (kill(pid, 0) alone took a reused pid for the run's process).
TEST(RunStore, ProcessLivenessBeyondThePid) {
  const auto me = this_process();
  EXPECT_EQ(me.pid, ::getpid());
  ASSERT_FALSE(me.host.empty());
  ASSERT_FALSE(me.start.empty());
  EXPECT_EQ(process_liveness(me), liveness::alive);
  auto reused = me;
  reused.start = me.start + "1";  // same pid, another start: the pid was reused
  EXPECT_EQ(process_liveness(reused), liveness::gone);
  auto renamed = me;  // this machine under another host name (a new container): still checked here
  renamed.host = me.host + "-other";
  EXPECT_EQ(process_liveness(renamed), liveness::alive);
  renamed.start = me.start + "1";
  EXPECT_EQ(process_liveness(renamed), liveness::gone);
  auto elsewhere = renamed;  // another machine: another boot id
  elsewhere.start = "00000000-0000-0000-0000-000000000000/" + me.start.substr(me.start.find('/') + 1);
  EXPECT_EQ(process_liveness(elsewhere), liveness::unknown);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  int st = 0;
  ::waitpid(child, &st, 0);
  EXPECT_EQ(process_liveness({me.host, child, me.start}), liveness::gone);
  EXPECT_EQ(process_liveness({"", child, ""}), liveness::gone);  // legacy rows: the pid alone
  if (::geteuid() != 0) {
    EXPECT_EQ(process_liveness({"", 1, ""}), liveness::alive);  // EPERM is alive
  }

  auto d = fresh_dir("live");
  run_store s(d / "runs.db");
  auto r = sample_run();
  r.process = reused;
  const int64_t id = s.begin_run(r);
  EXPECT_EQ(live_status(*s.get_run(id)), "crashed");
  s.mark_resumed(id, me);
  EXPECT_EQ(s.get_run(id)->process_start, me.start);
  EXPECT_EQ(live_status(*s.get_run(id)), "running");
}

TEST(RunStore, NotADatabase) {
  auto d = fresh_dir("garbage");
  std::ofstream(d / "runs.db") << "this is not sqlite, just text that is long enough to be a header............";
  try {
    run_store s(d / "runs.db");
    FAIL() << "expected an error";
  } catch (const database_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a valid SQLite database"), std::string::npos) << e.what();
  }
}

TEST(RunRecorder, BatchesWritesOffTheCallingThreadAndSyncs) {
  auto d = fresh_dir("recorder");
  run_store s(d / "runs.db");
  const int64_t id = s.begin_run(sample_run());
  int64_t transactions = 0;
  {
    run_recorder rec(s, id, "data.txt", std::chrono::milliseconds(10000));  // only sync/size/finish flush
    for (int64_t i = 1; i <= 300; ++i) rec.on_event(step_event{i, 300, 1.0 / static_cast<double>(i), 1e-3, 0.5, 100, 0.01 * i, 0, {}, 1 << 20, -1});
    rec.on_event(eval_event{300, 0.5, 64});
    rec.on_event(log_event{log_event::level::warning, "careful"});
    EXPECT_EQ(rec.sync(), "");
    run_store reader(d / "runs.db");
    EXPECT_EQ(reader.metrics(id).size(), 300u);  // durable once sync returns
    EXPECT_EQ(reader.evaluations(id).at(0).dataset, "data.txt");
    rec.on_event(checkpoint_event{300, "/ck", "aa", 10, {100, 200}});
    EXPECT_EQ(rec.finish(), "");
    transactions = rec.transactions();
  }
  EXPECT_LE(transactions, 3);  // 302 records in a handful of transactions, not one each
  EXPECT_EQ(s.checkpoints(id).size(), 1u);
  EXPECT_EQ(s.events(id).at(0).level, "warning");
}

// Another process holding the write lock past the busy timeout delays the recorder's commit; it no
// longer fails the run.
TEST(RunRecorder, RetriesWhileAnotherProcessHoldsTheLock) {
  auto d = fresh_dir("busy");
  run_store s(d / "runs.db", 20);
  const int64_t id = s.begin_run(sample_run());
  run_store holder(d / "runs.db");
  holder.db().exec("BEGIN IMMEDIATE");
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    holder.db().exec("COMMIT");
  });
  int64_t retries = 0;
  {
    run_recorder rec(s, id, "data.txt", std::chrono::milliseconds(10));
    rec.on_event(step_event{1, 3, 2.0, 1e-3, 0.5, 100, 0.1, 0, {}, 1 << 20, -1});
    EXPECT_EQ(rec.sync(), "");
    EXPECT_EQ(rec.finish(), "");
    retries = rec.busy_retries();
  }
  release.join();
  EXPECT_GT(retries, 0);
  EXPECT_EQ(s.metrics(id).size(), 1u);
  // Past its patience the failure is reported.
  holder.db().exec("BEGIN IMMEDIATE");
  run_recorder impatient(s, id, "data.txt", std::chrono::milliseconds(10), std::chrono::milliseconds(100));
  impatient.on_event(step_event{2, 3, 2.0, 1e-3, 0.5, 100, 0.1, 0, {}, 1 << 20, -1});
  EXPECT_NE(impatient.sync().find("locked"), std::string::npos);
  holder.db().exec("COMMIT");
}

TEST(Checkpoint, CommitsAtomicallyAndVerifies) {
  auto root = fresh_dir("ckpt");
  std::vector<std::string> sites;
  auto info = write_checkpoint(
      root, 7,
      [](const fs::path& d) -> status {
        LP_TRY(write_file_atomic(d / "a.bin", std::string(1000, 'x')));
        return write_file_atomic(d / "state.json", "{}");
      },
      [&](const char* s) { sites.emplace_back(s); });
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(info->dir.filename(), "step-00000007");
  EXPECT_EQ(sites, (std::vector<std::string>{"checkpoint:file", "checkpoint:file", "checkpoint:manifest", "checkpoint:rename"}));
  auto v = verify_checkpoint(info->dir);
  ASSERT_TRUE(v.ok()) << v.message();
  EXPECT_EQ(v->manifest_sha256, info->manifest_sha256);
  EXPECT_EQ(v->bytes, info->bytes);
  EXPECT_EQ(sha256_hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");

  // Corruption of any kind is reported naming the file.
  std::ofstream(info->dir / "a.bin", std::ios::binary | std::ios::in | std::ios::out).put('y');
  auto bad = verify_checkpoint(info->dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("a.bin does not match its sha256"), std::string::npos) << bad.message();
  std::ofstream(info->dir / "a.bin", std::ios::binary | std::ios::in | std::ios::out).put('x');
  ASSERT_TRUE(verify_checkpoint(info->dir).ok());
  std::ofstream(info->dir / "extra") << "?";
  EXPECT_NE(verify_checkpoint(info->dir).message().find("unexpected file extra"), std::string::npos);
  fs::remove(info->dir / "extra");
  fs::remove(info->dir / "state.json");
  EXPECT_NE(verify_checkpoint(info->dir).message().find("state.json is missing"), std::string::npos);
  fs::remove(info->dir / "manifest.json");
  EXPECT_NE(verify_checkpoint(info->dir).message().find("corrupted checkpoint"), std::string::npos);

  // A failing fill leaves nothing; leftovers of a killed write are not checkpoints and get swept.
  auto failed = write_checkpoint(root, 8, [](const fs::path&) -> status { return make_error("disk full"); });
  EXPECT_FALSE(failed.ok());
  fs::create_directories(root / ".tmp-step-00000009-1");
  fs::create_directories(root / ".trash-step-00000001-1");
  auto listed = list_checkpoints(root);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].step, 7);
  sweep_checkpoint_leftovers(root);
  EXPECT_FALSE(fs::exists(root / ".tmp-step-00000009-1"));
  EXPECT_FALSE(fs::exists(root / ".trash-step-00000001-1"));
}

TEST(Checkpoint, KeepLastN) {
  auto root = fresh_dir("prune");
  for (int64_t step : {2, 4, 6, 8, 10})
    ASSERT_TRUE(write_checkpoint(root, step, [](const fs::path& d) { return write_file_atomic(d / "x", "1"); }).ok());
  auto removed = prune_checkpoints(root, 2);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, (std::vector<int64_t>{2, 4, 6}));
  auto left = list_checkpoints(root);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].step, 8);
  EXPECT_EQ(left[1].step, 10);
  EXPECT_TRUE(prune_checkpoints(root, 0)->empty());  // 0 = keep all
  // Rewriting a step (a resumed run) replaces it whole: the old one is moved aside before the new one is
  // renamed in and deleted only after, so a kill in between leaves it under .trash- and step 8 to resume.
  auto write_y = [](const fs::path& d) { return write_file_atomic(d / "y", "2"); };
  auto killed = [&] {
    try {
      (void)write_checkpoint(root, 10, write_y, [&](const char* site) {
        if (std::string(site) == "checkpoint:replace") throw std::runtime_error("killed");
      });
    } catch (const std::runtime_error&) {
      return true;
    }
    return false;
  }();
  ASSERT_TRUE(killed);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  ASSERT_EQ(names.size(), 2u) << testing::PrintToString(names);  // step-8 and the old step-10 aside (no .tmp-)
  EXPECT_EQ(names[0].rfind(".trash-step-00000010-", 0), 0u) << names[0];
  EXPECT_TRUE(fs::exists(root / names[0] / "x"));
  EXPECT_EQ(list_checkpoints(root).back().step, 8);
  recover_replaced_checkpoints(root);  // what resume does first: the old step 10 is back, whole
  EXPECT_EQ(list_checkpoints(root).back().step, 10);
  EXPECT_TRUE(verify_checkpoint(root / "step-00000010").ok());
  EXPECT_TRUE(fs::exists(root / "step-00000010" / "x"));
  std::vector<std::string> sites;
  ASSERT_TRUE(write_checkpoint(root, 10, write_y, [&](const char* site) { sites.emplace_back(site); }).ok());
  EXPECT_EQ(sites.back(), "checkpoint:replace");
  EXPECT_TRUE(fs::exists(root / "step-00000010" / "y"));
  EXPECT_FALSE(fs::exists(root / "step-00000010" / "x"));
  EXPECT_EQ(std::distance(fs::directory_iterator(root), fs::directory_iterator()), 2);  // nothing left aside
  // Abandoning a timeline moves the newer checkpoints aside, newest first; the next write sweeps them.
  EXPECT_EQ(remove_checkpoints_after(root, 8).value(), (std::vector<int64_t>{10}));
  EXPECT_EQ(list_checkpoints(root).back().step, 8);
  EXPECT_TRUE(remove_checkpoints_after(root, 8)->empty());
  sweep_checkpoint_leftovers(root);  // a run starting keeps them (it may fail before its first checkpoint)
  EXPECT_EQ(std::distance(fs::directory_iterator(root), fs::directory_iterator()), 2);
  ASSERT_TRUE(write_checkpoint(root, 9, write_y).ok());
  discard_abandoned_checkpoints(root);  // after the resumed run's first checkpoint
  EXPECT_EQ(std::distance(fs::directory_iterator(root), fs::directory_iterator()), 2);  // step 8 and 9
  EXPECT_EQ(list_checkpoints(root).back().step, 9);
}

TEST(ProjectSchema, Version1IsMigrated) {
  int64_t from = 0;
  auto p = parse_project(R"({"schema_version": 1, "parallel": {"schedule": "1f1b", "async_optimizer": true}})", "p.json", &from);
  ASSERT_TRUE(p.ok()) << p.message();
  EXPECT_EQ(from, 1);
  EXPECT_EQ(p->schema_version, project_schema_version);
  EXPECT_TRUE(p->optimizer.asynchronous);
  EXPECT_EQ(p->parallel.schedule, "1f1b");
  // In a version 2 file the old name is an unknown field, with a hint.
  auto q = parse_project(R"({"schema_version": 2, "parallel": {"async_optimizer": true}})", "p.json");
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.message().find("parallel.async_optimizer: unknown field (schema_version 2 calls it optimizer.asynchronous)"),
            std::string::npos)
      << q.message();
  // A round trip writes the current version with every field.
  project_config c;
  c.run.checkpoint_interval = 7;
  auto back = parse_project(project_to_json(c), "p.json");
  ASSERT_TRUE(back.ok()) << back.message();
  EXPECT_EQ(back->run.checkpoint_interval, 7);
  EXPECT_EQ(back->schema_version, project_schema_version);
}

TEST(ProjectSchema, ChecksAgainstTheModel) {
  project_config c;
  c.model.path = std::string(LORAPIPE_TEST_DATA_DEFAULT) + "/models/stories260K/hf";
  c.data.train = std::string(LORAPIPE_TEST_DATA_DEFAULT) + "/text/tinyshakespeare.txt";
  c.lora.r = 65;
  c.data.seq_len = 100000;
  c.run.checkpoint_interval = -1;
  auto st = validate_project(c);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("lora.r: must be <= hidden_size (64)"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("data.seq_len: must be <= the model's context length"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("run.checkpoint_interval: must be non-negative"), std::string::npos) << st.message();
}
