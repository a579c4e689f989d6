// lorapipe-cli runs list | show | compare: printing what core/engine/run_queries.h returns.
#include <cmath>
#include <iostream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/cli_runs.h"
#include "core/base/json_parse.h"
#include "core/engine/run_queries.h"
#include "core/engine/run_session.h"

namespace lorapipe {
using json = nlohmann::json;

namespace {
std::string num(const std::optional<double>& v, const char* f = "{:.4f}") {
  return v ? fmt::format(fmt::runtime(f), *v) : std::string("-");
}
}  // namespace

int cmd_runs_list(const std::string& db, int64_t limit, bool as_json) {
  const auto path = resolve_database(db);
  auto runs = list_runs(path, limit);
  if (!runs) return cli_fail(runs.message());
  if (as_json) {
    json arr = json::array();
    for (const auto& r : *runs) {
      auto j = run_json(r.record);
      j["summary"] = summary_json(r.summary);
      arr.push_back(j);
    }
    std::cout << arr.dump(2) << "\n";
    return 0;
  }
  if (runs->empty()) {
    std::cout << "no runs recorded in " << path.string() << "\n";
    return 0;
  }
  std::cout << fmt::format("{:>4}  {:<11}  {:<24}  {:<20}  {:>11}  {:>8}  {:>8}  {}\n", "id", "status", "project", "started",
                           "steps", "loss", "val", "config");
  for (const auto& [r, m] : *runs) {
    std::cout << fmt::format("{:>4}  {:<11}  {:<24}  {:<20}  {:>11}  {:>8}  {:>8}  {}\n", r.id, live_status(r),
                             r.project_name.substr(0, 24), r.started_at.substr(0, 19), fmt::format("{}/{}", m.steps, r.total_steps),
                             num(m.last10_loss), num(m.final_val), r.config_hash.substr(0, 12));
  }
  return 0;
}

int cmd_runs_show(const std::string& db, int64_t id, bool as_json) {
  auto d = show_run(resolve_database(db), id);
  if (!d) return cli_fail(d.message());
  const run_record* r = &d->record;
  const auto& m = d->summary;
  const auto& ckpts = d->checkpoints;
  const auto& evals = d->evaluations;
  const auto& events = d->events;
  if (as_json) {
    std::cout << details_json(*d).dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("run {} — {} ({})\n", r->id, r->project_name, live_status(*r));
  std::cout << fmt::format("  project      {}\n  output       {}\n  config hash  {}\n  started      {}\n  ended        {}\n",
                           r->project_path, r->output_dir, r->config_hash.substr(0, 12), r->started_at,
                           r->ended_at.empty() ? "-" : r->ended_at);
  if (r->resumed_count > 0) std::cout << fmt::format("  resumed      {} time(s)\n", r->resumed_count);
  if (!r->error.empty()) std::cout << fmt::format("  error        {}\n", r->error);
  auto hw = parse_json_or_discarded(r->hardware);
  if (hw.is_object())
    std::cout << fmt::format("  hardware     {} ({} cores, {}), {}\n", hw.value("cpu", ""), hw.value("cores", 0), hw.value("memory", ""),
                             hw.value("os", ""));
  std::cout << fmt::format("  versions     {}\n", r->versions);
  std::cout << fmt::format("  steps        {}/{}\n  loss         {} -> {} (last 10 mean {}, min {})\n", m.steps, r->total_steps,
                           num(m.first_loss), num(m.last_loss), num(m.last10_loss), num(m.min_loss));
  std::cout << fmt::format("  validation   {} -> {} (best {})\n  throughput   {:.0f} tokens/s over {:.1f} s of training\n",
                           num(m.first_val), num(m.final_val), num(m.best_val), m.mean_tokens_per_s, m.train_seconds);
  if (m.peak_rss > 0) std::cout << fmt::format("  peak memory  {:.1f} MiB resident (process)\n", static_cast<double>(m.peak_rss) / 1048576.0);
  for (size_t d = 0; d < m.peak_devices.size(); ++d)
    std::cout << fmt::format("  device {}     {:.2f} MiB arena peak\n", d, static_cast<double>(m.peak_devices[d]) / 1048576.0);
  if (m.bubble_ratio) std::cout << fmt::format("  bubble ratio {:.3f} (simulated)\n", *m.bubble_ratio);
  for (const auto& e : evals)
    if (e.split != "val") std::cout << fmt::format("  eval         step {}: loss {:.4f}, perplexity {:.3f} on {}\n", e.step, e.loss, std::exp(e.loss), e.dataset);
  for (const auto& c : ckpts) std::cout << fmt::format("  checkpoint   step {}: {} (sha256 {})\n", c.step, c.path, c.sha256.substr(0, 12));
  for (const auto& e : events)
    if (e.level != "info") std::cout << fmt::format("  {:<12} {} {}\n", e.level, e.at, e.message);
  return 0;
}

int cmd_runs_compare(const std::string& db, int64_t a, int64_t b, bool as_json) {
  auto c = compare_runs(resolve_database(db), a, b);
  if (!c) return cli_fail(c.message());
  const run_record* ra = &c->a;
  const run_record* rb = &c->b;
  const auto& diff = c->config_diff;
  const auto& env = c->environment_diff;
  const int64_t common = c->common_steps, first_diff = c->first_differing_step;
  const double max_diff = c->max_abs_loss_diff;
  const auto sa = summary_json(c->summary_a), sb = summary_json(c->summary_b);
  if (as_json) {
    std::cout << comparison_json(*c).dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("run {} ({}, {}) vs run {} ({}, {})\n", a, ra->project_name, live_status(*ra), b, rb->project_name,
                           live_status(*rb));
  if (ra->config_hash == rb->config_hash)
    std::cout << fmt::format("config: the same computation (hash {}){}\n", ra->config_hash.substr(0, 12),
                             diff.empty() ? "" : fmt::format("; {} location field(s) differ", diff.size()));
  else std::cout << fmt::format("config: {} field(s) differ\n", diff.size());
  for (const auto& [k, v] : diff) std::cout << fmt::format("  {:<32} {:>20}  ->  {}\n", k, v.first.dump(), v.second.dump());
  std::cout << (env.empty() ? std::string("environment: same hardware and library versions\n")
                            : fmt::format("environment: {} difference(s)\n", env.size()));
  for (const auto& [k, v] : env) std::cout << fmt::format("  {:<32} {:>20}  ->  {}\n", k, v.first.dump(), v.second.dump());
  if (common == 0) std::cout << "loss curves: no common steps\n";
  else if (first_diff < 0) std::cout << fmt::format("loss curves: identical over {} common steps\n", common);
  else
    std::cout << fmt::format("loss curves: {} common steps, max |loss difference| {:.4g}, first difference at step {}\n", common,
                             max_diff, first_diff);
  std::cout << fmt::format("{:<26} {:>14} {:>14} {:>10}\n", "metric", fmt::format("run {}", a), fmt::format("run {}", b), "b/a");
  for (auto it = sa.begin(); it != sa.end(); ++it) {
    const json& x = it.value();
    const json& y = sb[it.key()];
    auto show = [](const json& v) {
      if (v.is_null()) return std::string("-");
      if (v.is_number_integer()) return fmt::format("{}", v.get<int64_t>());
      return fmt::format("{:.4g}", v.get<double>());
    };
    std::string ratio = "-";
    if (x.is_number() && y.is_number() && x.get<double>() != 0) ratio = fmt::format("{:.3f}", y.get<double>() / x.get<double>());
    std::cout << fmt::format("{:<26} {:>14} {:>14} {:>10}\n", it.key(), show(x), show(y), ratio);
  }
  return 0;
}

}  // namespace lorapipe
