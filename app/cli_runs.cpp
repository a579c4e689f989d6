// lorapipe-cli runs list | show | compare: reading the run database. See cli_runs.h.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/cli_runs.h"
#include "core/json_parse.h"
#include "core/run_store.h"

namespace lorapipe {
using json = nlohmann::json;

namespace {

// A run whose process died without setting a final status shows as "crashed".
std::string live_status(const run_record& r) {
  return r.status == "running" && r.pid > 0 && !process_alive(r.pid) ? "crashed" : r.status;
}

struct metric_summary {
  int64_t steps = 0;
  std::optional<double> first_loss, last_loss, min_loss, last10_loss, first_val, final_val, best_val;
  double mean_tokens_per_s = 0, train_seconds = 0, max_grad_norm = 0;
  int64_t peak_rss = 0;                 // process
  std::vector<int64_t> peak_devices;    // pipeline devices (arena)
  std::optional<double> bubble_ratio;
};

metric_summary summarize(run_store& s, int64_t run) {
  metric_summary m;
  auto rows = s.metrics(run);
  double tps = 0, l10 = 0;
  int n10 = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    if (!m.first_loss) m.first_loss = r.loss;
    m.last_loss = r.loss;
    m.min_loss = std::min(m.min_loss.value_or(r.loss), r.loss);
    tps += r.tokens_per_s;
    m.max_grad_norm = std::max(m.max_grad_norm, r.grad_norm);
    if (rows.size() - i <= 10) {
      l10 += r.loss;
      ++n10;
    }
    if (!r.memory_json.empty()) {
      auto j = parse_json_or_discarded(r.memory_json);
      if (j.is_object() && j.contains("process_rss") && j["process_rss"].is_number_integer())
        m.peak_rss = std::max(m.peak_rss, j["process_rss"].get<int64_t>());
      if (j.is_object() && j.contains("devices") && j["devices"].is_array()) {
        m.peak_devices.resize(std::max(m.peak_devices.size(), j["devices"].size()));
        for (size_t d = 0; d < j["devices"].size(); ++d)
          if (j["devices"][d].is_number_integer()) m.peak_devices[d] = std::max(m.peak_devices[d], j["devices"][d].get<int64_t>());
      }
    }
    if (r.bubble_ratio) m.bubble_ratio = r.bubble_ratio;
    if (i + 1 == rows.size() || rows[i + 1].elapsed_s < r.elapsed_s) m.train_seconds += r.elapsed_s;  // per process segment
  }
  m.steps = rows.empty() ? 0 : rows.back().step;
  if (!rows.empty()) m.mean_tokens_per_s = tps / static_cast<double>(rows.size());
  if (n10 > 0) m.last10_loss = l10 / n10;
  for (const auto& e : s.evaluations(run)) {
    if (e.split != "val") continue;
    if (!m.first_val) m.first_val = e.loss;
    m.final_val = e.loss;
    m.best_val = std::min(m.best_val.value_or(e.loss), e.loss);
  }
  return m;
}

json summary_json(const metric_summary& m) {
  auto opt = [](const std::optional<double>& v) { return v ? json(*v) : json(nullptr); };
  return {{"steps", m.steps},
          {"first_loss", opt(m.first_loss)},
          {"final_loss", opt(m.last_loss)},
          {"final_loss_mean_last_10", opt(m.last10_loss)},
          {"min_loss", opt(m.min_loss)},
          {"first_val_loss", opt(m.first_val)},
          {"final_val_loss", opt(m.final_val)},
          {"best_val_loss", opt(m.best_val)},
          {"mean_tokens_per_s", m.mean_tokens_per_s},
          {"train_seconds", m.train_seconds},
          {"max_grad_norm", m.max_grad_norm},
          {"peak_rss_bytes", m.peak_rss},
          {"peak_device_bytes", m.peak_devices.empty() ? json(nullptr) : json(*std::max_element(m.peak_devices.begin(), m.peak_devices.end()))},
          {"bubble_ratio", opt(m.bubble_ratio)}};
}

json run_json(const run_record& r) {
  return {{"id", r.id},
          {"project", r.project_name},
          {"project_path", r.project_path},
          {"status", live_status(r)},
          {"config_hash", r.config_hash},
          {"output_dir", r.output_dir},
          {"started_at", r.started_at},
          {"ended_at", r.ended_at},
          {"total_steps", r.total_steps},
          {"last_step", r.last_step},
          {"resumed", r.resumed_count},
          {"error", r.error},
          {"hardware", parse_json_or_discarded(r.hardware)},
          {"versions", parse_json_or_discarded(r.versions)}};
}

std::string num(const std::optional<double>& v, const char* f = "{:.4f}") {
  return v ? fmt::format(fmt::runtime(f), *v) : std::string("-");
}

void flatten(const json& j, const std::string& prefix, std::map<std::string, json>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
  } else {
    out[prefix] = j;
  }
}

// Leaf fields that differ between two JSON documents (null where one side lacks the field).
std::map<std::string, std::pair<json, json>> differences(const std::string& a, const std::string& b, const std::string& prefix) {
  std::map<std::string, json> fa, fb;
  flatten(parse_json_or_discarded(a), prefix, fa);
  flatten(parse_json_or_discarded(b), prefix, fb);
  std::map<std::string, std::pair<json, json>> diff;
  for (const auto& [k, v] : fa)
    if (!fb.count(k) || fb[k] != v) diff[k] = {v, fb.count(k) ? fb[k] : json(nullptr)};
  for (const auto& [k, v] : fb)
    if (!fa.count(k)) diff[k] = {json(nullptr), v};
  return diff;
}

}  // namespace

bool process_alive(int64_t pid) { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) == 0; }

int cmd_runs_list(const std::string& db, int64_t limit, bool as_json) {
  run_store s(db.empty() ? default_database_path() : std::filesystem::path(db));
  auto runs = s.list_runs(limit);
  if (as_json) {
    json arr = json::array();
    for (const auto& r : runs) {
      auto j = run_json(r);
      j["summary"] = summary_json(summarize(s, r.id));
      arr.push_back(j);
    }
    std::cout << arr.dump(2) << "\n";
    return 0;
  }
  if (runs.empty()) {
    std::cout << "no runs recorded in " << s.db().path().string() << "\n";
    return 0;
  }
  std::cout << fmt::format("{:>4}  {:<11}  {:<24}  {:<20}  {:>11}  {:>8}  {:>8}  {}\n", "id", "status", "project", "started",
                           "steps", "loss", "val", "config");
  for (const auto& r : runs) {
    auto m = summarize(s, r.id);
    std::cout << fmt::format("{:>4}  {:<11}  {:<24}  {:<20}  {:>11}  {:>8}  {:>8}  {}\n", r.id, live_status(r),
                             r.project_name.substr(0, 24), r.started_at.substr(0, 19), fmt::format("{}/{}", m.steps, r.total_steps),
                             num(m.last10_loss), num(m.final_val), r.config_hash.substr(0, 12));
  }
  return 0;
}

int cmd_runs_show(const std::string& db, int64_t id, bool as_json) {
  run_store s(db.empty() ? default_database_path() : std::filesystem::path(db));
  auto r = s.get_run(id);
  if (!r) return cli_fail(fmt::format("no run {} in {}", id, s.db().path().string()));
  auto m = summarize(s, id);
  auto ckpts = s.checkpoints(id);
  auto evals = s.evaluations(id);
  auto events = s.events(id);
  if (as_json) {
    auto j = run_json(*r);
    j["config"] = parse_json_or_discarded(r->config_json);
    j["summary"] = summary_json(m);
    j["metrics"] = json::array();
    for (const auto& x : s.metrics(id))
      j["metrics"].push_back({{"step", x.step}, {"loss", x.loss}, {"lr", x.lr}, {"grad_norm", x.grad_norm},
                              {"tokens_per_s", x.tokens_per_s}, {"elapsed_s", x.elapsed_s},
                              {"memory", x.memory_json.empty() ? json(nullptr) : parse_json_or_discarded(x.memory_json)},
                              {"bubble_ratio", x.bubble_ratio ? json(*x.bubble_ratio) : json(nullptr)}});
    j["evaluations"] = json::array();
    for (const auto& e : evals)
      j["evaluations"].push_back({{"step", e.step}, {"split", e.split}, {"dataset", e.dataset}, {"loss", e.loss}, {"tokens", e.tokens}});
    j["checkpoints"] = json::array();
    for (const auto& c : ckpts)
      j["checkpoints"].push_back({{"step", c.step}, {"path", c.path}, {"sha256", c.sha256}, {"bytes", c.bytes}, {"created_at", c.created_at}});
    j["events"] = json::array();
    for (const auto& e : events) j["events"].push_back({{"at", e.at}, {"level", e.level}, {"message", e.message}});
    std::cout << j.dump(2) << "\n";
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
  run_store s(db.empty() ? default_database_path() : std::filesystem::path(db));
  auto ra = s.get_run(a), rb = s.get_run(b);
  if (!ra) return cli_fail(fmt::format("no run {} in {}", a, s.db().path().string()));
  if (!rb) return cli_fail(fmt::format("no run {} in {}", b, s.db().path().string()));
  const auto diff = differences(ra->config_json, rb->config_json, "");
  auto env = differences(ra->hardware, rb->hardware, "hardware");
  env.merge(differences(ra->versions, rb->versions, "versions"));
  const auto ma = summarize(s, a), mb = summarize(s, b);
  const auto sa = summary_json(ma), sb = summary_json(mb);
  // Loss curves at the steps both runs logged: identical, or how far apart and from where.
  const auto la = s.metrics(a), lb = s.metrics(b);
  std::map<int64_t, double> loss_b;
  for (const auto& m : lb) loss_b[m.step] = m.loss;
  int64_t common = 0, first_diff = -1;
  double max_diff = 0;
  for (const auto& m : la) {
    auto it = loss_b.find(m.step);
    if (it == loss_b.end()) continue;
    ++common;
    if (it->second != m.loss && first_diff < 0) first_diff = m.step;
    max_diff = std::max(max_diff, std::abs(it->second - m.loss));
  }
  const json curves = {{"common_steps", common}, {"identical", common > 0 && first_diff < 0}, {"max_abs_loss_diff", max_diff},
                       {"first_differing_step", first_diff >= 0 ? json(first_diff) : json(nullptr)}};
  auto to_json = [](const std::map<std::string, std::pair<json, json>>& d) {
    json j = json::object();
    for (const auto& [k, v] : d) j[k] = {{"a", v.first}, {"b", v.second}};
    return j;
  };
  if (as_json) {
    std::cout << json{{"a", run_json(*ra)}, {"b", run_json(*rb)}, {"config_diff", to_json(diff)}, {"environment_diff", to_json(env)},
                      {"loss_curves", curves}, {"summary", {{"a", sa}, {"b", sb}}}}
                     .dump(2)
              << "\n";
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
