// LoRA training driven by a project, on one device or as a pipeline: load model, tokenizer and
// data, train with AdamW + warmup/cosine + clipping + accumulation, validate, sample, checkpoint,
// save the PEFT adapter. Front-ends call it through core/engine (run sessions), not directly.
#pragma once

#include <filesystem>
#include <string>

#include "core/base/cancel.h"
#include "core/base/events.h"
#include "core/base/result.h"
#include "core/project/project.h"
#include "core/runs/checkpoint.h"

namespace lorapipe {
struct llama_weights;
class process_group;
}

namespace lorapipe {

struct train_summary {
  int64_t steps = 0;
  double first_val_loss = 0;
  double final_val_loss = 0;
  double mean_tokens_per_s = 0;
  std::string adapter_dir;
  int64_t start_step = 0;  // > 0 when resumed
  bool stopped = false;    // a stop was requested: a checkpoint was written (when enabled) before returning
  std::string last_checkpoint;
};

struct train_options {
  // A stop request: checked while loading, tokenising, evaluating, sampling and before every
  // pipeline instruction; the run ends within one step with a checkpoint (summary.stopped).
  const cancel_token* cancel = nullptr;
  // Checkpoints (run.checkpoint_interval, keep-last-N, one at the end and on stop) go here; empty = none.
  std::filesystem::path checkpoint_root;
  std::filesystem::path resume_from;  // a checkpoint folder to continue from (verified before use)
  std::string config_hash;            // recorded in checkpoints and checked on resume
  probe_fn probe;                     // test hook at named points (checkpoint writes, pipeline instructions)
  run_started_event run;              // run id, paths, database (the run session fills them in)
  // Frozen weights already loaded for this model.path and model.dtype (shared, not copied); null = load.
  const llama_weights* preloaded = nullptr;
  // Several processes (distributed.processes > 1): this process's membership. Every rank runs the same
  // loop in step; the device positions are split in contiguous blocks; rank 0 alone writes the
  // output folder, checkpoints and adapter (after gathering every stage's state), the others only compute.
  process_group* group = nullptr;
};

// Runs (or, with resume_from, continues) the training a project describes. A resumed run reproduces
// the uninterrupted one bit for bit: LoRA weights, AdamW state, LR schedule position and data
// cursor come from the checkpoint; LoRA dropout masks are counter-based. Never throws: LibTorch,
// device and database failures come back as error values.
result<train_summary> run_training(const project_config& cfg, observer& obs, const train_options& opts = {});

struct eval_summary {
  double loss = 0;        // token-weighted mean cross-entropy (nats)
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // label tokens scored
  int64_t sequences = 0;
  std::string dataset;
};

// Perplexity of the project's model (with the adapter, if given) on the project's validation split,
// or on the whole of `data_file` (any format the project's data settings accept). Never throws.
result<eval_summary> evaluate_project(const project_config& cfg, const std::filesystem::path& adapter_dir,
                                      const std::string& data_file, observer& obs, const cancel_token* cancel = nullptr);

}  // namespace lorapipe
