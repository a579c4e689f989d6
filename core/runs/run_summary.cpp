// Run summaries and comparisons: see run_summary.h.
#include "core/runs/run_summary.h"

#include <algorithm>
#include <cmath>

#include "core/base/json_parse.h"

namespace lorapipe {
using json = nlohmann::json;

namespace {
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

// A run whose process died without setting a final status shows as "crashed" (one recorded on another
// host stays "running": this host cannot tell).
std::string live_status(const run_record& r) {
  if (r.status == "interrupted") return "stopped";  // how the database stores a run stopped with a checkpoint
  return r.status == "running" && process_liveness(r.process()) == liveness::gone ? "crashed" : r.status;
}



metric_summary summarize_run(run_store& s, int64_t run) {
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

nlohmann::json summary_json(const metric_summary& m) {
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


std::optional<run_details> load_run_details(run_store& s, int64_t run) {
  auto r = s.get_run(run);
  if (!r) return std::nullopt;
  return run_details{*r, summarize_run(s, run), s.metrics(run), s.evaluations(run), s.checkpoints(run), s.events(run)};
}

std::optional<run_comparison> compare_runs(run_store& s, int64_t a, int64_t b) {
  auto ra = s.get_run(a), rb = s.get_run(b);
  if (!ra || !rb) return std::nullopt;
  run_comparison c{*ra, *rb, differences(ra->config_json, rb->config_json, ""), differences(ra->hardware, rb->hardware, "hardware"),
                   0, -1, 0, summarize_run(s, a), summarize_run(s, b)};
  c.environment_diff.merge(differences(ra->versions, rb->versions, "versions"));
  std::map<int64_t, double> loss_b;
  for (const auto& m : s.metrics(b)) loss_b[m.step] = m.loss;
  for (const auto& m : s.metrics(a)) {
    auto it = loss_b.find(m.step);
    if (it == loss_b.end()) continue;
    ++c.common_steps;
    if (it->second != m.loss && c.first_differing_step < 0) c.first_differing_step = m.step;
    c.max_abs_loss_diff = std::max(c.max_abs_loss_diff, std::abs(it->second - m.loss));
  }
  return c;
}

json details_json(const run_details& d) {
  auto j = run_json(d.record);
  j["config"] = parse_json_or_discarded(d.record.config_json);
  j["summary"] = summary_json(d.summary);
  j["metrics"] = json::array();
  for (const auto& x : d.metrics)
    j["metrics"].push_back({{"step", x.step}, {"loss", x.loss}, {"lr", x.lr}, {"grad_norm", x.grad_norm},
                            {"tokens_per_s", x.tokens_per_s}, {"elapsed_s", x.elapsed_s},
                            {"memory", x.memory_json.empty() ? json(nullptr) : parse_json_or_discarded(x.memory_json)},
                            {"bubble_ratio", x.bubble_ratio ? json(*x.bubble_ratio) : json(nullptr)}});
  j["evaluations"] = json::array();
  for (const auto& e : d.evaluations)
    j["evaluations"].push_back({{"step", e.step}, {"split", e.split}, {"dataset", e.dataset}, {"loss", e.loss}, {"tokens", e.tokens}});
  j["checkpoints"] = json::array();
  for (const auto& c : d.checkpoints)
    j["checkpoints"].push_back({{"step", c.step}, {"path", c.path}, {"sha256", c.sha256}, {"bytes", c.bytes}, {"created_at", c.created_at}});
  j["events"] = json::array();
  for (const auto& e : d.events) j["events"].push_back({{"at", e.at}, {"level", e.level}, {"message", e.message}});
  return j;
}

json comparison_json(const run_comparison& c) {
  auto to_json = [](const json_diff& d) {
    json j = json::object();
    for (const auto& [k, v] : d) j[k] = {{"a", v.first}, {"b", v.second}};
    return j;
  };
  const json curves = {{"common_steps", c.common_steps},
                       {"identical", c.common_steps > 0 && c.first_differing_step < 0},
                       {"max_abs_loss_diff", c.max_abs_loss_diff},
                       {"first_differing_step", c.first_differing_step >= 0 ? json(c.first_differing_step) : json(nullptr)}};
  return {{"a", run_json(c.a)}, {"b", run_json(c.b)}, {"config_diff", to_json(c.config_diff)},
          {"environment_diff", to_json(c.environment_diff)}, {"loss_curves", curves},
          {"summary", {{"a", summary_json(c.summary_a)}, {"b", summary_json(c.summary_b)}}}};
}

}  // namespace lorapipe
