// lorapipe-cli train, resume and eval: front-end over core/engine's run sessions (printing and exit
// codes only). See cli_runs.h.
#include <unistd.h>

#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/cli_printer.h"
#include "core/base/child_process.h"
#include "core/base/file_io.h"
#include "app/cli_runs.h"
#include "core/engine/model_session.h"
#include "core/engine/run_queries.h"
#include "core/engine/run_session.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

int cli_fail(const std::string& msg) {
  std::fputs(fmt::format("error: {}\n", msg).c_str(), stderr);
  return 1;
}

namespace {

// Names the run right after the run header (so a crashed run can be resumed by id).
class announcing_printer final : public observer {
 public:
  announcing_printer(bool json, int64_t checkpoint_interval) : printer_(json, isatty(STDERR_FILENO) != 0), interval_(checkpoint_interval) {}
  void on_event(const engine_event& e) override {
    printer_.on_event(e);
    if (const auto* s = std::get_if<run_started_event>(&e))
      printer_.on_event(log_event{log_event::level::info, fmt::format("run {} (database {}; checkpoints every {} steps in {})", s->run_id,
                                                                      s->database, interval_, s->checkpoint_dir)});
  }

 private:
  cli_printer printer_;
  int64_t interval_;
};

// The other ranks of a run over several processes, started on this machine once rank 0 listens:
// `lorapipe-cli train <the run's config> --rank R --rendezvous 127.0.0.1:PORT`, each killed by the
// kernel if this process dies, and reaped (or killed) here when the run ends.
class local_ranks {
 public:
  local_ranks(const run_handle& h) : h_(h) {}
  ~local_ranks() {
    for (auto& k : kids_) (void)k->wait(std::chrono::seconds(10));  // then the destructor kills it
  }
  void launch(uint16_t port) {
    const fs::path out = h_.config.resolve(h_.config.run.output_dir);
    std::error_code ec;
    fs::create_directories(out, ec);
    const fs::path config = out / "rank-project.json";
    if (auto st = write_file_atomic(config, project_to_json(h_.config)); !st) {
      std::fputs(fmt::format("error: {}\n", st.message()).c_str(), stderr);
      return;  // the rendezvous then names the ranks that never came
    }
    ::setenv("LORAPIPE_PARENT_PID", std::to_string(::getpid()).c_str(), 1);
    for (int64_t r = 1; r < h_.config.distributed.processes; ++r) {
      std::vector<std::string> args{"/proc/self/exe", "train", config.string(), "--rank", std::to_string(r), "--rendezvous",
                                    fmt::format("127.0.0.1:{}", port)};
      if (!h_.resume_from.empty()) args.insert(args.end(), {"--resume-from", h_.resume_from.string()});
      kids_.push_back(std::make_unique<child_process>(args));
    }
  }
  // A rank that could not start or already exited (polled during the rendezvous).
  std::string failed() {
    for (size_t i = 0; i < kids_.size(); ++i) {
      if (!kids_[i]->started()) return fmt::format("rank {} could not be started", i + 1);
      if (auto st = kids_[i]->wait(std::chrono::milliseconds(0)))
        return fmt::format("rank {} exited with {} {} before joining", i + 1, *st < 0 ? "signal" : "status", *st < 0 ? -*st : *st);
    }
    return "";
  }

 private:
  const run_handle& h_;
  std::vector<std::unique_ptr<child_process>> kids_;
};

// A rank other than 0: its warnings and errors on stderr, named; the progress is rank 0's to show.
class rank_printer final : public observer {
 public:
  explicit rank_printer(int rank) : rank_(rank) {}
  void on_event(const engine_event& e) override {
    if (const auto* l = std::get_if<log_event>(&e); l != nullptr && l->lvl != log_event::level::info)
      std::fputs(fmt::format("rank {}: {}\n", rank_, l->message).c_str(), stderr);
  }

 private:
  int rank_;
};

int execute(const run_handle& h, bool as_json, const cancel_token& stop, bool start_ranks = true) {
  announcing_printer printer(as_json, h.config.run.checkpoint_interval);
  execute_options eo;
  eo.probe = kill_probe_from_environment();
  std::optional<local_ranks> ranks;
  if (h.config.distributed.processes > 1 && start_ranks) {
    ranks.emplace(h);
    eo.launch_ranks = [&](uint16_t port) { ranks->launch(port); };
    eo.watch_ranks = [&] { return ranks->failed(); };
  }
  auto r = execute_run(h, printer, stop, eo);
  if (!r) return cli_fail(fmt::format("{} (run {} recorded as failed)", r.message(), h.run_id));
  if (r->status == run_status::stopped) {
    std::fputs(fmt::format("interrupted at step {}; checkpoint {}\ncontinue with: lorapipe-cli resume {}\n", r->summary.steps,
                           r->summary.last_checkpoint.empty() ? "(none: checkpoints disabled)" : r->summary.last_checkpoint, h.run_id)
                   .c_str(),
               stderr);
    return 130;
  }
  std::fputs(fmt::format("run {} completed (lorapipe-cli runs show {})\n", h.run_id, h.run_id).c_str(), stderr);
  return 0;
}

}  // namespace

int cmd_train(const train_args& a, const cancel_token& stop) {
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
  if (a.processes >= 0) cfg.distributed.processes = a.processes;
  if (!a.rendezvous.empty()) cfg.distributed.rendezvous = a.rendezvous;
  if (a.rank > 0) {  // joins rank 0, computes its share, records nothing
    if (const char* parent = std::getenv("LORAPIPE_PARENT_PID")) die_with_parent(static_cast<pid_t>(std::atoi(parent)));
    rank_printer printer(static_cast<int>(a.rank));
    auto r = run_rank(cfg, a.rank, a.resume_from, printer, stop, kill_probe_from_environment());
    if (!r) return cli_fail(fmt::format("rank {}: {}", a.rank, r.message()));
    return 0;
  }
  if (a.rank == 0)
    if (auto st = check_hand_started_rank0(cfg); !st) return cli_fail(st.message());
  auto h = begin_run(cfg, a.project, resolve_database(a.db, &cfg));
  if (!h) return cli_fail(h.message());
  return execute(*h, a.json, stop, /*start_ranks=*/a.rank < 0);
}

int cmd_resume(const resume_args& a, const cancel_token& stop) {
  const fs::path db = resolve_database(a.db);
  auto h = prepare_resume(db, a.run, a.checkpoint >= 0 ? std::optional<int64_t>(a.checkpoint) : std::nullopt,
                          a.processes >= 0 ? std::optional<int64_t>(a.processes) : std::nullopt);
  if (!h) return cli_fail(h.message());
  if (h->already_completed) {
    std::fputs(fmt::format("run {} already completed ({} steps)\n", a.run, h->total_steps).c_str(), stderr);
    return 0;
  }
  std::fputs(fmt::format("resuming run {} at step {} of {} (database {})\n", a.run, h->start_step, h->total_steps, db.string()).c_str(),
             stderr);
  if (!a.rendezvous.empty()) {  // the other ranks are started by hand, on their machines
    h->config.distributed.rendezvous = a.rendezvous;
    if (auto st = validate_project(h->config); !st) return cli_fail(st.message());
    if (auto st = check_hand_started_rank0(h->config); !st) return cli_fail(st.message());
    return execute(*h, a.json, stop, /*start_ranks=*/false);
  }
  return execute(*h, a.json, stop);
}

result<std::pair<std::string, std::string>> run_export_sources(const std::string& db, int64_t run) {
  LP_TRY_ASSIGN(s, stored_run_of(resolve_database(db), run));
  return std::make_pair(s.config.resolve(s.config.model.path).string(), s.adapter_dir.string());
}

int cmd_eval(const eval_args& a) {
  project_config cfg;
  fs::path adapter = a.adapter.empty() ? fs::path() : fs::absolute(a.adapter);
  int64_t step = 0;
  const fs::path db = resolve_database(a.db);
  if (a.run > 0) {
    auto s = stored_run_of(db, a.run);
    if (!s) return cli_fail(s.message());
    cfg = s->config;
    if (adapter.empty()) adapter = s->adapter_dir;
    step = s->last_step;
  } else {
    if (a.project.empty()) return cli_fail("eval needs a project file or --run ID");
    auto p = load_project(a.project);
    if (!p) return cli_fail(p.message());
    cfg = *p;
  }
  null_observer quiet;
  auto r = evaluate_model(cfg, adapter, a.data, quiet);
  if (!r) return cli_fail(r.message());
  if (a.run > 0)
    if (auto st = record_evaluation(db, a.run, step, r->dataset, r->loss, r->tokens); !st) return cli_fail(st.message());
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
