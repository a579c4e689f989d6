// Run sessions: see run_session.h.
#include "core/engine/run_session.h"
#include "core/engine/device_inventory.h"

#include <sys/utsname.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "core/base/file_io.h"
#include "core/engine/build_info.h"
#include "core/engine/plan_report.h"
#include "core/runs/checkpoint.h"
#include "core/runs/run_recorder.h"
#include "core/runs/run_store.h"
#include "core/runs/run_summary.h"
#include "core/train/guard.h"
#include "offload/process_group.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

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

std::string versions_json() { return build_info_json(describe_build()); }

fs::path checkpoint_root_of(const std::string& output_dir, int64_t run) {
  return fs::path(output_dir) / "checkpoints" / fmt::format("run-{}", run);
}

status check_output_dir(const project_config& cfg) {
  const fs::path out = cfg.resolve(cfg.run.output_dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return make_error("run.output_dir: cannot create {}: {}", out.string(), ec.message());
  if (auto st = write_file_atomic(out / ".lorapipe-write-test", ""); !st)
    return make_error("run.output_dir: {} is not writable ({})", out.string(), st.message());
  fs::remove(out / ".lorapipe-write-test", ec);
  return ok_status();
}

// The checkpoint a resume continues from, verified (nullopt: none yet, start over).
result<std::optional<checkpoint_info>> choose_checkpoint(int64_t run, const fs::path& root, std::optional<int64_t> step) {
  recover_replaced_checkpoints(root);
  auto all = list_checkpoints(root);
  fs::path from;
  if (step) {
    auto it = std::find_if(all.begin(), all.end(), [&](const auto& c) { return c.step == *step; });
    if (it == all.end()) return make_error("run {} has no checkpoint at step {} in {}", run, *step, root.string());
    from = it->dir;
  } else if (!all.empty()) {
    from = all.back().dir;
  }
  if (from.empty()) return std::optional<checkpoint_info>();
  auto v = verify_checkpoint(from);
  if (!v) {
    std::string older;
    for (const auto& c : all)
      if (c.dir != from) older += fmt::format(" {}", c.step);
    return make_error("{}\nnothing was changed; {}", v.message(),
                      older.empty() ? "no older checkpoint exists (start a new run with lorapipe-cli train)"
                                    : "older checkpoints (resume with --checkpoint STEP):" + older);
  }
  return std::optional<checkpoint_info>(*v);
}

}  // namespace

const char* run_status_name(run_status s) {
  switch (s) {
    case run_status::completed: return "completed";
    case run_status::stopped: return "stopped";
    case run_status::failed: return "failed";
  }
  return "?";
}

fs::path resolve_database(const std::string& flag, const project_config* cfg) {
  std::error_code ec;
  if (!flag.empty()) return fs::absolute(flag, ec);
  if (cfg != nullptr && !cfg->run.database.empty()) return cfg->resolve(cfg->run.database);
  return default_database_path();
}

result<run_handle> begin_run(const project_config& cfg, const std::string& project_path, const fs::path& database) {
  return guarded([&]() -> result<run_handle> {
    if (auto st = validate_project(cfg); !st) return make_error("{} is not valid:\n{}", project_path, st.message());
    LP_TRY(check_output_dir(cfg));  // refused before a run is recorded
    // The run records (and a resume repeats) the pipeline the planner chose, not "auto".
    // The GPUs' free memory and copy rates read once: what the choices fit is what the check holds
    // them to (the rate they were costed at is recorded, so the executor's memory plan is theirs).
    const auto gpus = gpu_planning_inventory(cfg);
    LP_TRY_ASSIGN(resolved, resolve_project_schedule(cfg, gpus ? &*gpus : nullptr));
    LP_TRY(check_project_memory(resolved, gpus ? &*gpus : nullptr));  // a plan over the memory bound: refused before it is recorded
    run_handle h;
    h.config = with_absolute_paths(resolved);
    h.database = database;
    run_store store(database);
    new_run nr{cfg.name, fs::absolute(project_path).lexically_normal().string(), project_to_json(h.config), config_hash(h.config),
               h.config.run.output_dir, hardware_json(), versions_json(), cfg.run.steps, this_process()};
    h.run_id = store.begin_run(nr);
    h.total_steps = cfg.run.steps;
    h.checkpoint_root = checkpoint_root_of(h.config.run.output_dir, h.run_id);
    return h;
  });
}

result<run_handle> prepare_resume(const fs::path& database, int64_t run, std::optional<int64_t> checkpoint_step,
                                  std::optional<int64_t> processes) {
  return guarded([&]() -> result<run_handle> {
    run_store store(database);
    auto rec = store.get_run(run);
    if (!rec) return make_error("no run {} in {}", run, database.string());
    run_handle h;
    h.run_id = run;
    h.database = database;
    h.total_steps = rec->total_steps;
    if (rec->status == "completed") {
      h.already_completed = true;
      return h;
    }
    const auto me = this_process();
    if (rec->status == "running" && !(rec->pid == me.pid && rec->host == me.host && rec->process_start == me.start)) {
      const auto who = rec->process();
      switch (process_liveness(who)) {
        case liveness::alive: return make_error("run {} is still running (pid {})", run, rec->pid);
        case liveness::unknown:
          return make_error("run {} is recorded as running on host {} (pid {}); this host cannot tell whether it still "
                            "runs there: resume it on {}", run, who.host, who.pid, who.host);
        case liveness::gone: break;
      }
    }
    auto cfg = parse_recorded_project(rec->config_json, fs::path(rec->output_dir) / "project.json");
    if (!cfg) return make_error("run {}: stored configuration: {}", run, cfg.message());
    if (processes) cfg->distributed.processes = *processes;  // outside the config hash: the checkpoint fits any count
    if (auto st = validate_project(*cfg); !st) return make_error("run {} can no longer run:\n{}", run, st.message());
    h.config = *cfg;
    h.checkpoint_root = checkpoint_root_of(rec->output_dir, run);
    LP_TRY_ASSIGN(from, choose_checkpoint(run, h.checkpoint_root, checkpoint_step));
    if (from) {
      h.resume_from = from->dir;
      h.start_step = from->step;
    }
    // Newer checkpoints belong to the timeline this resume abandons: a later plain resume must not pick them.
    LP_TRY(remove_checkpoints_after(h.checkpoint_root, h.start_step));
    store.truncate_after(run, h.start_step);
    store.mark_resumed(run, me);
    return h;
  });
}

namespace {

// Membership in the project's process group: rank 0 serves the rendezvous (launching the others
// once it listens), every rank brings the project's hash.
result<std::unique_ptr<process_group>> join_processes(const project_config& cfg, int rank, std::function<void(uint16_t)> launch,
                                                      std::function<std::string()> watch = {}) {
  const auto& d = cfg.distributed;
  const auto colon = d.rendezvous.rfind(':');
  rendezvous_options o;
  o.host = d.rendezvous.substr(0, colon);
  o.port = static_cast<uint16_t>(std::stoi(d.rendezvous.substr(colon + 1)));
  if (rank > 0 && o.port == 0) return make_error("distributed.rendezvous: rank {} needs rank 0's port (host:port)", rank);
  if (rank == 0 && !launch) LP_TRY(check_hand_started_rank0(cfg));
  o.rank = rank;
  o.world = static_cast<int>(d.processes);
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(d.timeout_s * 1000));
  o.config_hash = config_hash(cfg);
  o.on_listening = std::move(launch);
  o.watch = std::move(watch);
  return process_group::join(o);
}

}  // namespace

status check_hand_started_rank0(const project_config& cfg) {
  const auto& r = cfg.distributed.rendezvous;
  if (cfg.distributed.processes > 1 && r.substr(r.rfind(':') + 1) == "0")
    return make_error("distributed.rendezvous: rank 0 started by hand (--rank 0) needs a fixed port (host:port) to give the other "
                      "ranks; port 0 would pick one nobody is told");
  return ok_status();
}

result<train_summary> run_rank(const project_config& cfg, int rank, const fs::path& resume_from, observer& obs, const cancel_token& cancel,
                               const probe_fn& probe) {
  if (probe) probe("rank:start");
  LP_TRY(validate_project(cfg));
  if (rank < 1 || rank >= cfg.distributed.processes)
    return make_error("--rank {}: must be in 1..{} (distributed.processes {})", rank, cfg.distributed.processes - 1, cfg.distributed.processes);
  // As begin_run does for rank 0 (the hashes compare the resolved projects; a planner that chose
  // differently here, from another machine's profile, is refused at the rendezvous).
  LP_TRY_ASSIGN(resolved_cfg, resolve_project_schedule(cfg));
  const project_config resolved = with_absolute_paths(resolved_cfg);
  LP_TRY_ASSIGN(group, join_processes(resolved, rank, {}));
  train_options to;
  to.cancel = &cancel;
  to.resume_from = resume_from;
  to.config_hash = config_hash(resolved);
  to.group = group.get();
  to.probe = probe;
  auto r = run_training(resolved, obs, to);
  if (!r) group->report_failure(r.message());
  return r;
}

result<run_outcome> execute_run(const run_handle& h, observer& obs, const cancel_token& cancel, const execute_options& opts) {
  if (h.already_completed) return run_outcome{run_status::completed, {}};  // nothing to do, nothing to change
  std::string failure;
  try {
    run_store store(h.database);
    store.set_probe(opts.probe);
    auto recorder = std::make_unique<run_recorder>(store, h.run_id, h.config.resolve(h.config.data.train).string());
    observer_tee tee({&obs, recorder.get()});
    train_options to;
    to.cancel = &cancel;
    to.checkpoint_root = h.checkpoint_root;
    to.resume_from = h.resume_from;
    to.config_hash = config_hash(h.config);
    to.probe = opts.probe;
    to.preloaded = opts.model != nullptr ? opts.model->weights_for(h.config) : nullptr;
    to.run.run_id = h.run_id;
    to.run.start_step = h.start_step;
    to.run.output_dir = h.config.resolve(h.config.run.output_dir).string();
    to.run.checkpoint_dir = h.checkpoint_root.string();
    to.run.database = store.db().path().string();
    std::unique_ptr<process_group> group;
    result<train_summary> r = make_error("not run");
    if (h.config.distributed.processes > 1) {
      auto joined = join_processes(h.config, 0, opts.launch_ranks, opts.watch_ranks);
      if (joined) group = std::move(*joined);
      else r = joined.err();
      to.group = group.get();
    }
    if (h.config.distributed.processes <= 1 || group) r = run_training(h.config, tee, to);
    if (!r && group) group->report_failure(r.message());
    if (!r) recorder->on_event(log_event{log_event::level::error, r.message()});
    const std::string db_err = recorder->finish();
    recorder.reset();
    if (!r) failure = r.message();
    else if (!db_err.empty()) failure = "run database: " + db_err;
    if (failure.empty()) {
      const bool stopped = r->stopped;
      store.set_status(h.run_id, stopped ? "interrupted" : "completed", stopped ? "stopped by the user" : "");
      return run_outcome{stopped ? run_status::stopped : run_status::completed, *r};
    }
    store.set_status(h.run_id, "failed", failure);
  } catch (const std::exception& e) {
    if (failure.empty()) failure = e.what();
    try {  // a fresh connection: the status is written whatever happened above
      run_store(h.database).set_status(h.run_id, "failed", failure);
    } catch (const std::exception&) {
    }
  }
  try {
    obs.on_event(run_finished_event{0, 0, 0, 0, {}, false, "failed", failure});
  } catch (const std::exception&) {  // an observer that throws does not change the outcome
  }
  return make_error("{}", failure);
}

probe_fn kill_probe_from_environment() {
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

}  // namespace lorapipe
