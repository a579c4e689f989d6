// Single-device LoRA training driven by a project: load model, tokenizer and data, train with
// AdamW + warmup/cosine + clipping + accumulation, validate, sample, save the PEFT adapter.
#pragma once

#include <atomic>
#include <filesystem>
#include <string>

#include "core/checkpoint.h"
#include "core/events.h"
#include "core/project.h"
#include "core/result.h"

namespace lorapipe {

struct train_summary {
  int64_t steps = 0;
  double first_val_loss = 0;
  double final_val_loss = 0;
  double mean_tokens_per_s = 0;
  std::string adapter_dir;
  int64_t start_step = 0;  // > 0 when resumed
  bool stopped = false;    // `stop` was raised: a checkpoint was written (when enabled) before returning
  std::string last_checkpoint;
};

struct train_options {
  const std::atomic<bool>* stop = nullptr;  // polled between steps (Ctrl-C)
  // Checkpoints (run.checkpoint_interval, keep-last-N, one at the end and on stop) go here; empty = none.
  std::filesystem::path checkpoint_root;
  std::filesystem::path resume_from;  // a checkpoint folder to continue from (verified before use)
  std::string config_hash;            // recorded in checkpoints and checked on resume
  probe_fn probe;                     // kill-test hook at named points of checkpoint writes
};

// Runs (or, with resume_from, continues) the training a project describes. A resumed run reproduces
// the uninterrupted one bit for bit: LoRA weights, AdamW state, LR schedule position, RNG and data
// cursor all come from the checkpoint.
result<train_summary> run_training(const project_config& cfg, observer& obs, const train_options& opts = {});

// Hex sha256 of the config snapshot that defines a run's results (paths absolute, the output and
// database locations excluded): two runs with the same hash compute the same thing.
std::string config_hash(const project_config& cfg);

struct eval_summary {
  double loss = 0;        // token-weighted mean cross-entropy (nats)
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // label tokens scored
  int64_t sequences = 0;
  std::string dataset;
};

// Perplexity of the project's model (with the adapter, if given) on the project's validation split,
// or on the whole of `data_file` (any format the project's data settings accept).
result<eval_summary> evaluate_project(const project_config& cfg, const std::filesystem::path& adapter_dir,
                                      const std::string& data_file);

// Sets LibTorch's intra-op thread count (0 = all cores); returns the count in use.
int configure_threads(int64_t requested);

}  // namespace lorapipe
