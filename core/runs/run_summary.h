// Reading the run database for people: a run's live status (a "running" run whose process is gone
// is "crashed"), metric summaries, the full record of one run, and the comparison of two runs
// (config and environment differences, loss-curve equality at common steps, summaries side by side).
// Values for front-ends; *_json give the --json forms.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/runs/run_store.h"

namespace lorapipe {

std::string live_status(const run_record& r);

struct metric_summary {
  int64_t steps = 0;
  std::optional<double> first_loss, last_loss, min_loss, last10_loss, first_val, final_val, best_val;
  double mean_tokens_per_s = 0, train_seconds = 0, max_grad_norm = 0;
  int64_t peak_rss = 0;               // process
  std::vector<int64_t> peak_devices;  // pipeline devices (arena)
  std::optional<double> bubble_ratio;
};
metric_summary summarize_run(run_store& s, int64_t run);

struct run_details {
  run_record record;
  metric_summary summary;
  std::vector<metric_row> metrics;
  std::vector<eval_row> evaluations;
  std::vector<checkpoint_row> checkpoints;
  std::vector<event_row> events;
};
std::optional<run_details> load_run_details(run_store& s, int64_t run);

using json_diff = std::map<std::string, std::pair<nlohmann::json, nlohmann::json>>;  // field -> (a, b)
struct run_comparison {
  run_record a, b;
  json_diff config_diff, environment_diff;
  int64_t common_steps = 0, first_differing_step = -1;  // loss curves at the steps both logged
  double max_abs_loss_diff = 0;
  metric_summary summary_a, summary_b;
};
// Both runs must exist (nullopt otherwise).
std::optional<run_comparison> compare_runs(run_store& s, int64_t a, int64_t b);

nlohmann::json summary_json(const metric_summary& m);
nlohmann::json run_json(const run_record& r);
nlohmann::json details_json(const run_details& d);
nlohmann::json comparison_json(const run_comparison& c);

}  // namespace lorapipe
