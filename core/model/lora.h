// LoRA adapters: configuration, initialisation, PEFT-layout save/load, and merging into base weights.
// A target projection W [out,in] gets A [r,in] and B [out,r]; its output becomes
// x·Wᵀ + (alpha/r)·dropout(x)·Aᵀ·Bᵀ. Only A and B are trainable.
#pragma once

#include <array>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/project/lora_target.h"
#include "core/base/result.h"

namespace lorapipe {

struct lora_config {
  int64_t r = 8;
  double alpha = 16;
  double dropout = 0.0;
  std::vector<lora_target> targets{lora_target::q, lora_target::k, lora_target::v, lora_target::o};
  double scale() const { return alpha / static_cast<double>(r); }
};

struct lora_pair {
  at::Tensor a;  // f32 [r, in], requires_grad
  at::Tensor b;  // f32 [out, r], requires_grad
};

struct llama_weights;
struct llama_config;

struct lora_adapters {
  lora_config cfg;
  // layers[l][target]: undefined tensors where the target is not adapted.
  std::vector<std::array<lora_pair, num_lora_targets>> layers;
  std::string base_model;

  // A then B for every adapted projection, in layer/target order (stable; optimizer state relies on it).
  std::vector<at::Tensor> parameters() const;
  // PEFT tensor name for a parameter in parameters() order.
  std::vector<std::string> parameter_names() const;
  int64_t num_parameters() const;
};

// Every target must be a projection the architecture has (Phi-3: qkv_proj, o_proj, gate_up_proj,
// down_proj; the others: q/k/v/o and gate/up/down); the error names lora.targets.
status check_lora_targets(const llama_config& c, const std::vector<lora_target>& targets);

// PEFT initialisation: A ~ kaiming_uniform(a=sqrt(5)) (bound 1/sqrt(in)), B = 0. Seeded.
lora_adapters init_lora(const llama_weights& w, const lora_config& cfg, uint64_t seed);

// PEFT layout: adapter_config.json + adapter_model.safetensors (f32).
status save_peft_adapter(const lora_adapters& a, const std::filesystem::path& dir);
result<lora_adapters> load_peft_adapter(const std::filesystem::path& dir, const llama_weights& w);

// W + scale·B·A for every adapted projection, written as an HF folder in the base's dtype, one tensor
// at a time (memory for one layer, not a second model). Tensors `w` holds as meta (a pipeline rank
// read only its stages') are read from w.source a layer at a time.
status export_merged(const llama_weights& w, const lora_adapters& a, const std::filesystem::path& dir,
                     const std::filesystem::path& tokenizer_source);

}  // namespace lorapipe
