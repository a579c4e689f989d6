// Single-device LoRA training driven by a project: load model, tokenizer and data, train with
// AdamW + warmup/cosine + clipping + accumulation, validate, sample, save the PEFT adapter.
#pragma once

#include <atomic>

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
};

// `stop` (optional) is polled between steps; when set, training ends early and the adapter is saved.
result<train_summary> run_training(const project_config& cfg, observer& obs, const std::atomic<bool>* stop = nullptr);

// Sets LibTorch's intra-op thread count (0 = all cores); returns the count in use.
int configure_threads(int64_t requested);

}  // namespace lorapipe
