// The engine reports through one observer interface of plain event structs (no Qt, no torch).
// The CLI prints them; ui/ adapts them to Qt signals; run_recorder persists them in the run database.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace lorapipe {

struct run_started_event {
  std::string model;
  int64_t parameters = 0;
  int64_t lora_parameters = 0;
  int64_t train_sequences = 0;
  int64_t val_sequences = 0;
  int64_t total_steps = 0;
  int64_t tokens_per_step = 0;
  int threads = 0;
};
struct step_event {
  int64_t step = 0;  // 1-based, after the optimizer step
  int64_t total_steps = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  double elapsed_s = 0;       // since this process started training (or resumed)
  int64_t start_step = 0;     // step this process started from (resume), for the ETA
  std::vector<int64_t> device_peak_bytes;  // pipelines: arena peak per device during the step
  int64_t process_peak_rss = 0;            // peak resident memory of the process so far
  double bubble_ratio = -1;                // pipelines: the simulator's idle fraction (-1 = n/a)
};
struct eval_event {
  int64_t step = 0;
  double val_loss = 0;
  int64_t tokens = 0;  // trained (label) tokens evaluated
};
// A checkpoint was committed (renamed into place); removed_steps were pruned by keep-last-N.
struct checkpoint_event {
  int64_t step = 0;
  std::string path;
  std::string sha256;  // of its manifest
  int64_t bytes = 0;
  std::vector<int64_t> removed_steps;
};
struct sample_event {
  std::string when;  // "before" / "after"
  std::string prompt;
  std::string text;  // continuation only
};
struct log_event {
  enum class level { info, warning, error } lvl = level::info;
  std::string message;
};
struct run_finished_event {
  int64_t steps = 0;
  double first_val_loss = 0;
  double final_val_loss = 0;
  double mean_tokens_per_s = 0;
  std::string adapter_dir;
  bool stopped_early = false;
};

using engine_event = std::variant<run_started_event, step_event, eval_event, checkpoint_event, sample_event, log_event,
                                  run_finished_event>;

class observer {
 public:
  virtual ~observer() = default;
  virtual void on_event(const engine_event& e) = 0;
  // Called before a checkpoint is committed: persist everything reported so far (the run database
  // must never lack metrics a checkpoint already covers). An error aborts the run.
  virtual std::string sync() { return {}; }
};

// Passes every event to several observers (printer + run recorder).
class observer_tee final : public observer {
 public:
  explicit observer_tee(std::vector<observer*> to) : to_(std::move(to)) {}
  void on_event(const engine_event& e) override {
    for (auto* o : to_) o->on_event(e);
  }
  std::string sync() override {
    for (auto* o : to_)
      if (auto err = o->sync(); !err.empty()) return err;
    return {};
  }

 private:
  std::vector<observer*> to_;
};

}  // namespace lorapipe
