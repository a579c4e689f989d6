// Reading and annotating the run database for front-ends, as values: runs with their summaries,
// one run in full, two runs compared, a run's stored project, and recording an evaluation.
// Database failures come back as error values.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "core/base/result.h"
#include "core/project/project.h"
#include "core/runs/run_summary.h"

namespace lorapipe {

struct run_overview {
  run_record record;
  metric_summary summary;
};
result<std::vector<run_overview>> list_runs(const std::filesystem::path& database, int64_t limit);
result<run_details> show_run(const std::filesystem::path& database, int64_t run);
result<run_comparison> compare_runs(const std::filesystem::path& database, int64_t a, int64_t b);

// The project a run was started with (absolute paths) and where its files are.
struct stored_run {
  project_config config;
  std::filesystem::path output_dir, adapter_dir;
  int64_t last_step = 0;
};
result<stored_run> stored_run_of(const std::filesystem::path& database, int64_t run);

// Deletes a run from the database; with_files also removes its checkpoints folder
// (output_dir/checkpoints/run-<id>). A live run (its process still running) is refused.
status delete_run(const std::filesystem::path& database, int64_t run, bool with_files);

// Adds an evaluation row (split "eval") to a run.
status record_evaluation(const std::filesystem::path& database, int64_t run, int64_t step, const std::string& dataset,
                         double loss, int64_t tokens);

}  // namespace lorapipe
