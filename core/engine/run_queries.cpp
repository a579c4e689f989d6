// Run database queries for front-ends: see run_queries.h.
#include "core/engine/run_queries.h"

#include "core/train/guard.h"

namespace lorapipe {
namespace fs = std::filesystem;

result<std::vector<run_overview>> list_runs(const fs::path& database, int64_t limit) {
  return guarded([&]() -> result<std::vector<run_overview>> {
    std::vector<run_overview> out;
    std::error_code ec;
    if (!fs::exists(database, ec)) return out;  // nothing recorded yet
    auto s = run_store::open_reader(database);
    for (auto& r : s.list_runs(limit)) {
      auto m = summarize_run(s, r.id);
      out.push_back({std::move(r), std::move(m)});
    }
    return out;
  });
}

result<run_details> show_run(const fs::path& database, int64_t run) {
  return guarded([&]() -> result<run_details> {
    auto s = run_store::open_reader(database);
    auto d = load_run_details(s, run);
    if (!d) return make_error("no run {} in {}", run, s.db().path().string());
    return *d;
  });
}

result<run_comparison> compare_runs(const fs::path& database, int64_t a, int64_t b) {
  return guarded([&]() -> result<run_comparison> {
    auto s = run_store::open_reader(database);
    for (int64_t id : {a, b})
      if (!s.get_run(id)) return make_error("no run {} in {}", id, s.db().path().string());
    return *compare_runs(s, a, b);
  });
}

result<stored_run> stored_run_of(const fs::path& database, int64_t run) {
  return guarded([&]() -> result<stored_run> {
    auto s = run_store::open_reader(database);
    auto rec = s.get_run(run);
    if (!rec) return make_error("no run {} in {}", run, s.db().path().string());
    LP_TRY_ASSIGN(cfg, parse_recorded_project(rec->config_json, fs::path(rec->output_dir) / "project.json"));
    return stored_run{cfg, rec->output_dir, fs::path(rec->output_dir) / "adapter", rec->last_step};
  });
}

status delete_run(const fs::path& database, int64_t run, bool with_files) {
  return guarded([&]() -> status {
    run_store s(database);
    auto rec = s.get_run(run);
    if (!rec) return make_error("no run {} in {}", run, database.string());
    if (live_status(*rec) == "running") return make_error("run {} is still running (pid {}); stop it first", run, rec->pid);
    if (with_files) {
      std::error_code ec;
      const auto dir = fs::path(rec->output_dir) / "checkpoints" / fmt::format("run-{}", run);
      fs::remove_all(dir, ec);
      if (ec) return make_error("cannot remove {}: {}", dir.string(), ec.message());
    }
    s.delete_run(run);
    return ok_status();
  });
}

status record_evaluation(const fs::path& database, int64_t run, int64_t step, const std::string& dataset, double loss, int64_t tokens) {
  return guarded([&]() -> status {
    run_store s(database);
    run_batch b;
    b.evals.push_back({step, "eval", dataset, loss, tokens});
    s.write(run, b);
    return ok_status();
  });
}

}  // namespace lorapipe
