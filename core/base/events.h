// The engine reports through one observer interface of plain event structs (no Qt, no torch).
// Events are emitted on the thread that runs the engine call, in order. The CLI prints them;
// ui/ adapts them to Qt signals; runs/run_recorder persists them; core/engine/event_json.h turns
// them into the versioned JSON-lines protocol a front-end reads from a child process.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace lorapipe {

// A stretch of work before, between or after steps, with progress where it is countable.
enum class phase {
  loading_model,      // done/total: tensors
  tokenizing,         // done/total: examples (total 0 = unknown until the end)
  building_pipeline,  // devices, program, memory plan, transports
  evaluating,         // done/total: validation batches
  sampling,           // done/total: tokens
  checkpointing,      // detail: the checkpoint folder
  saving_adapter,     // detail: the adapter folder
  exporting,          // detail: the merged folder
};
const char* phase_name(phase p);

struct phase_event {
  phase what = phase::loading_model;
  int64_t done = 0, total = 0;  // progress within the phase (0/0 = started, no count)
  int64_t step = 0;             // training step the phase belongs to
  std::string detail;
};

struct run_started_event {
  std::string model;
  int64_t parameters = 0;
  int64_t lora_parameters = 0;
  int64_t train_sequences = 0;
  int64_t val_sequences = 0;
  int64_t total_steps = 0;
  int64_t tokens_per_step = 0;
  int threads = 0;
  // The run as recorded (0 / empty when training outside a run database).
  int64_t run_id = 0;
  int64_t start_step = 0;       // > 0 when resumed
  std::string config_json;      // resolved project (absolute paths)
  std::vector<std::string> devices;  // "cpu" or pipeline devices in stage order
  std::string output_dir, adapter_dir, checkpoint_dir, database;
};

// The pipeline as it will run: the memory plan and the transports, as values.
struct plan_stage {
  int32_t device = 0;
  int32_t first_layer = 0, last_layer = 0;  // [first, last)
  bool has_embed = false, has_head = false;
  int64_t weight_bytes = 0;  // exact bytes of its frozen weights in a device weight arena
};
struct plan_arena {
  std::string device;
  int64_t bytes = 0;         // weight arena reserved up front
  int32_t stages_at_once = 0;
  int64_t slot_bytes = 0;    // > 0: fixed slots
};
struct plan_link {
  int32_t from = 0, to = 0;
  std::string kind, reason;
};
struct plan_event {
  std::string schedule;
  int32_t micro_batches = 0;
  std::string program;  // text form (core/pipeline/schedule.h)
  std::vector<plan_stage> stages;
  std::vector<plan_arena> arenas;
  std::vector<plan_link> links;
  double simulated_step_s = 0, bubble_ratio = 0;  // unit costs (forward 1, backward 2)
};

// Every run.trace_interval steps: what each device did during one pipeline step, measured, next to
// what the simulator predicts for the same program (same instruction order; times in seconds from
// the step's start; the prediction uses costs calibrated from this measurement).
struct trace_entry {
  int32_t device = 0;
  std::string instr;  // text form, e.g. "2F0"
  double start_s = 0, end_s = 0;
  int64_t bytes = 0;  // bytes moved (copies) or weight bytes used (compute)
};
struct trace_event {
  int64_t step = 0;
  std::vector<trace_entry> measured, predicted;
  double measured_step_s = 0, predicted_step_s = 0;
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
  std::string status;  // completed, stopped or failed (set by the run session)
  std::string error;   // failed: why
};

using engine_event = std::variant<run_started_event, step_event, eval_event, checkpoint_event, sample_event, log_event,
                                  run_finished_event, phase_event, plan_event, trace_event>;

class observer {
 public:
  virtual ~observer() = default;
  virtual void on_event(const engine_event& e) = 0;
  // Called before a checkpoint is committed: persist everything reported so far (the run database
  // must never lack metrics a checkpoint already covers). A non-empty error aborts the run.
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

// Drops everything (library calls made without an observer).
class null_observer final : public observer {
 public:
  void on_event(const engine_event&) override {}
};

inline const char* phase_name(phase p) {
  switch (p) {
    case phase::loading_model: return "loading_model";
    case phase::tokenizing: return "tokenizing";
    case phase::building_pipeline: return "building_pipeline";
    case phase::evaluating: return "evaluating";
    case phase::sampling: return "sampling";
    case phase::checkpointing: return "checkpointing";
    case phase::saving_adapter: return "saving_adapter";
    case phase::exporting: return "exporting";
  }
  return "?";
}

}  // namespace lorapipe
