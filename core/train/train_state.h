// Training checkpoints (the torch part): what a resumed run needs to continue bit-identically.
// Files of one checkpoint folder (sealed by checkpoint.h):
//   adapter_config.json, adapter_model.safetensors  LoRA weights in PEFT layout (usable as is)
//   optimizer.safetensors                           AdamW exp_avg / exp_avg_sq per LoRA tensor
//   trainer_state.json                              step, AdamW step counts, LR schedule, data cursor,
//                                                   seed, data size, config hash
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/model/lora.h"
#include "core/model/optimizer.h"
#include "core/base/result.h"

namespace lorapipe {

// An optimizer and the PEFT names of its parameters, in its order.
struct optimizer_group {
  adamw* opt = nullptr;
  std::vector<std::string> names;
};

struct trainer_state {
  int64_t step = 0;          // optimizer steps done
  int64_t cursor = 0;        // next position in the shuffled training order
  int64_t seed = 0;
  int64_t train_sequences = 0;
  std::string config_hash;
  lr_schedule schedule;
  double first_val_loss = 0;  // for the run summary of a resumed run
  bool eval_pending = false;  // a stop interrupted the validation at `step`: the resumed run does it first
};

// Writes the checkpoint's files into `dir` (an unsealed checkpoint folder).
status save_train_state(const std::filesystem::path& dir, const lora_adapters& lora,
                        const std::vector<optimizer_group>& groups, const trainer_state& st);
// Loads a verified checkpoint into existing LoRA tensors and optimizers (shapes and names must match)
// and returns the trainer state.
result<trainer_state> load_train_state(const std::filesystem::path& dir, lora_adapters& lora,
                                       const std::vector<optimizer_group>& groups);

}  // namespace lorapipe
