// lorapipe-cli train, resume and eval: a training run recorded in the run database, with checkpoints
// under <output_dir>/checkpoints/run-<id>. See cli_runs.h.
#include <sys/utsname.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sqlite3.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "app/cli_printer.h"
#include "app/cli_runs.h"
#include "core/checkpoint.h"
#include "core/errors.h"
#include "core/project.h"
#include "core/run_recorder.h"
#include "core/safetensors.h"
#include "core/run_store.h"
#include "core/trainer.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

int cli_fail(const std::string& msg) {
  std::fputs(fmt::format("error: {}\n", msg).c_str(), stderr);
  return 1;
}

namespace {

std::string first_line_with(const char* file, const std::string& key) {
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) {
      auto p = line.find(':');
      std::string v = p == std::string::npos ? line : line.substr(p + 1);
      v.erase(0, v.find_first_not_of(" \t"));
      return v;
    }
  return {};
}

std::string hardware_json() {
  utsname u{};
  uname(&u);
  json j = {{"cpu", first_line_with("/proc/cpuinfo", "model name")},
            {"cores", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN))},
            {"memory", first_line_with("/proc/meminfo", "MemTotal")},
            {"os", fmt::format("{} {} {}", u.sysname, u.release, u.machine)},
            {"cuda_devices", torch::cuda::device_count()}};
  return j.dump();
}

std::string versions_json() {
  json j = {{"lorapipe", "0.1.0"}, {"libtorch", TORCH_VERSION}, {"sqlite", sqlite3_libversion()},
            {"compiler", __VERSION__}};
  return j.dump();
}

fs::path database_path(const std::string& flag, const project_config* cfg) {
  if (!flag.empty()) return fs::absolute(flag);
  if (cfg != nullptr && !cfg->run.database.empty()) return cfg->resolve(cfg->run.database);
  return default_database_path();
}

// LORAPIPE_KILL_AT=<site>:<n> (test hook, used by tests/cli/kill_test.py): the process SIGKILLs itself
// the n-th time it reaches <site> (checkpoint:file, checkpoint:manifest, checkpoint:rename, db:commit).
probe_fn kill_probe_from_env() {
  const char* spec = std::getenv("LORAPIPE_KILL_AT");
  if (spec == nullptr || *spec == 0) return {};
  std::string s(spec);
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) return {};
  auto site = s.substr(0, colon);
  auto left = std::make_shared<std::atomic<int64_t>>(std::atoll(s.c_str() + colon + 1));
  return [site, left](const char* at) {
    if (site == at && left->fetch_sub(1) == 1) std::raise(SIGKILL);
  };
}

std::string checkpoint_root_of(const std::string& output_dir, int64_t run) {
  return (fs::path(output_dir) / "checkpoints" / fmt::format("run-{}", run)).string();
}

// Runs training for a run row that exists, records everything, sets its final status.
int execute_run(run_store& store, int64_t run, const project_config& cfg, const fs::path& resume_from, bool as_json,
                const std::atomic<bool>& stop) {
  cli_printer printer(as_json, isatty(STDERR_FILENO) != 0);
  const auto probe = kill_probe_from_env();
  store.set_probe(probe);
  auto recorder = std::make_unique<run_recorder>(store, run, cfg.resolve(cfg.data.train).string());
  // Names the run right after the run header (so a crashed run can be resumed by id).
  struct announce final : observer {
    observer& to;
    std::string line;
    announce(observer& o, std::string l) : to(o), line(std::move(l)) {}
    void on_event(const engine_event& e) override {
      to.on_event(e);
      if (std::holds_alternative<run_started_event>(e)) to.on_event(log_event{log_event::level::info, line});
    }
  } header(printer, fmt::format("run {} (database {}; checkpoints every {} steps in {})", run, store.db().path().string(),
                                cfg.run.checkpoint_interval, checkpoint_root_of(cfg.resolve(cfg.run.output_dir).string(), run)));
  observer_tee tee({&header, recorder.get()});
  train_options opts;
  opts.stop = &stop;
  opts.checkpoint_root = checkpoint_root_of(cfg.resolve(cfg.run.output_dir).string(), run);
  opts.resume_from = resume_from;
  opts.config_hash = config_hash(cfg);
  opts.probe = probe;
  auto r = run_training(cfg, tee, opts);
  if (!r) recorder->on_event(log_event{log_event::level::error, r.message()});
  const std::string db_err = recorder->finish();
  recorder.reset();
  if (!r) {
    store.set_status(run, "failed", r.message());
    return cli_fail(fmt::format("{} (run {} recorded as failed)", r.message(), run));
  }
  if (!db_err.empty()) {
    store.set_status(run, "failed", db_err);
    return cli_fail(fmt::format("run database: {}", db_err));
  }
  if (r->stopped) {
    store.set_status(run, "interrupted", "stopped by the user");
    std::fputs(fmt::format("interrupted at step {}; checkpoint {}\ncontinue with: lorapipe-cli resume {}\n", r->steps,
                           r->last_checkpoint.empty() ? "(none: checkpoints disabled)" : r->last_checkpoint, run)
                   .c_str(),
               stderr);
    return 130;
  }
  store.set_status(run, "completed", "");
  std::fputs(fmt::format("run {} completed (lorapipe-cli runs show {})\n", run, run).c_str(), stderr);
  return 0;
}

}  // namespace

int cmd_train(const train_args& a, const std::atomic<bool>& stop) {
  int64_t migrated_from = 0;
  auto p = load_project(a.project, &migrated_from);
  if (!p) return cli_fail(p.message());
  auto& cfg = *p;
  if (migrated_from > 0)
    std::fputs(fmt::format("note: {} uses schema_version {}; read as version {} (lorapipe-cli init writes the current format)\n",
                           a.project, migrated_from, project_schema_version).c_str(), stderr);
  if (a.steps >= 0) cfg.run.steps = a.steps;
  if (!a.output.empty()) cfg.run.output_dir = fs::absolute(a.output).string();
  if (!a.devices.empty()) cfg.parallel.devices = a.devices;
  if (!a.schedule.empty()) cfg.parallel.schedule = a.schedule;
  if (!a.transport.empty()) cfg.parallel.transport = a.transport;
  if (a.threads >= 0) cfg.run.threads = a.threads;
  if (auto st = validate_project(cfg); !st) return cli_fail(fmt::format("{} is not valid:\n{}", a.project, st.message()));
  // Refuse an output folder we cannot write before a run is recorded.
  const fs::path out = cfg.resolve(cfg.run.output_dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return cli_fail(fmt::format("run.output_dir: cannot create {}: {}", out.string(), ec.message()));
  if (auto st = write_file_atomic(out / ".lorapipe-write-test", ""); !st)
    return cli_fail(fmt::format("run.output_dir: {} is not writable ({})", out.string(), st.message()));
  fs::remove(out / ".lorapipe-write-test", ec);
  const project_config snapshot = with_absolute_paths(cfg);
  const fs::path db = database_path(a.db, &cfg);
  run_store store(db);
  new_run nr{cfg.name, fs::absolute(a.project).lexically_normal().string(), project_to_json(snapshot), config_hash(snapshot),
             snapshot.run.output_dir, hardware_json(), versions_json(), cfg.run.steps, static_cast<int64_t>(::getpid())};
  const int64_t run = store.begin_run(nr);
  return execute_run(store, run, snapshot, {}, a.json, stop);
}

int cmd_resume(const resume_args& a, const std::atomic<bool>& stop) {
  const fs::path db = database_path(a.db, nullptr);
  run_store store(db);
  auto rec = store.get_run(a.run);
  if (!rec) return cli_fail(fmt::format("no run {} in {}", a.run, db.string()));
  if (rec->status == "completed") {
    std::fputs(fmt::format("run {} already completed ({} steps)\n", a.run, rec->total_steps).c_str(), stderr);
    return 0;
  }
  if (rec->status == "running" && rec->pid != ::getpid() && process_alive(rec->pid))
    return cli_fail(fmt::format("run {} is still running (pid {})", a.run, rec->pid));
  auto cfg = parse_project(rec->config_json, fs::path(rec->output_dir) / "project.json");
  if (!cfg) return cli_fail(fmt::format("run {}: stored configuration: {}", a.run, cfg.message()));
  if (auto st = validate_project(*cfg); !st) return cli_fail(fmt::format("run {} can no longer run:\n{}", a.run, st.message()));
  const fs::path root = checkpoint_root_of(rec->output_dir, a.run);
  auto all = list_checkpoints(root);
  fs::path from;
  if (a.checkpoint >= 0) {
    auto it = std::find_if(all.begin(), all.end(), [&](const auto& c) { return c.step == a.checkpoint; });
    if (it == all.end()) return cli_fail(fmt::format("run {} has no checkpoint at step {} in {}", a.run, a.checkpoint, root.string()));
    from = it->dir;
  } else if (!all.empty()) {
    from = all.back().dir;
  }
  int64_t step = 0;
  if (!from.empty()) {
    auto v = verify_checkpoint(from);
    if (!v) {
      std::string older;
      for (const auto& c : all)
        if (c.dir != from) older += fmt::format(" {}", c.step);
      return cli_fail(fmt::format("{}\nnothing was changed; {}", v.message(),
                                  older.empty() ? "no older checkpoint exists (start a new run with lorapipe-cli train)"
                                                : "older checkpoints (resume with --checkpoint STEP):" + older));
    }
    step = v->step;
  }
  store.truncate_after(a.run, step);
  store.mark_resumed(a.run, ::getpid());
  std::fputs(fmt::format("resuming run {} at step {} of {} (database {})\n", a.run, step, rec->total_steps, db.string()).c_str(),
             stderr);
  return execute_run(store, a.run, *cfg, from, a.json, stop);
}

result<std::pair<std::string, std::string>> run_export_sources(const std::string& db, int64_t run) {
  run_store store(database_path(db, nullptr));
  auto rec = store.get_run(run);
  if (!rec) return make_error("no run {} in {}", run, store.db().path().string());
  auto cfg = parse_project(rec->config_json, fs::path(rec->output_dir) / "project.json");
  if (!cfg) return cfg.err();
  return std::make_pair(cfg->resolve(cfg->model.path).string(), (fs::path(rec->output_dir) / "adapter").string());
}

int cmd_eval(const eval_args& a) {
  project_config cfg;
  fs::path adapter = a.adapter.empty() ? fs::path() : fs::absolute(a.adapter);
  std::unique_ptr<run_store> store;
  int64_t step = 0;
  if (a.run > 0) {
    const fs::path db = database_path(a.db, nullptr);
    store = std::make_unique<run_store>(db);
    auto rec = store->get_run(a.run);
    if (!rec) return cli_fail(fmt::format("no run {} in {}", a.run, db.string()));
    auto p = parse_project(rec->config_json, fs::path(rec->output_dir) / "project.json");
    if (!p) return cli_fail(p.message());
    cfg = *p;
    if (adapter.empty()) adapter = fs::path(rec->output_dir) / "adapter";
    step = rec->last_step;
  } else {
    if (a.project.empty()) return cli_fail("eval needs a project file or --run ID");
    auto p = load_project(a.project);
    if (!p) return cli_fail(p.message());
    cfg = *p;
  }
  auto r = evaluate_project(cfg, adapter, a.data);
  if (!r) return cli_fail(r.message());
  if (store) {
    run_batch b;
    b.evals.push_back({step, "eval", r->dataset, r->loss, r->tokens});
    store->write(a.run, b);
  }
  if (a.json) {
    std::cout << json{{"loss", r->loss}, {"perplexity", r->perplexity}, {"tokens", r->tokens}, {"sequences", r->sequences},
                      {"dataset", r->dataset}, {"adapter", adapter.string()}}.dump(2)
              << "\n";
  } else {
    std::cout << fmt::format("{}: loss {:.4f}, perplexity {:.3f} over {} tokens ({} sequences){}\n", r->dataset, r->loss,
                             r->perplexity, r->tokens, r->sequences, adapter.empty() ? " (base model)" : ", adapter " + adapter.string());
  }
  return 0;
}

}  // namespace lorapipe
