// The engine reports through one observer interface of plain event structs (no Qt, no torch).
// The CLI prints them; ui/ adapts them to Qt signals; the run store will persist them.
#pragma once

#include <cstdint>
#include <string>
#include <variant>

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
  double elapsed_s = 0;
};
struct eval_event {
  int64_t step = 0;
  double val_loss = 0;
  int64_t tokens = 0;
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

using engine_event = std::variant<run_started_event, step_event, eval_event, sample_event, log_event, run_finished_event>;

class observer {
 public:
  virtual ~observer() = default;
  virtual void on_event(const engine_event& e) = 0;
};

}  // namespace lorapipe
