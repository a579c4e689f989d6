// Names of the projections LoRA can adapt (torch-free, shared by the project file and the model).
// qkv and gate_up are Phi-3's fused projections; a model has either those or the separate ones.
#pragma once

#include <optional>
#include <string>

namespace lorapipe {

enum class lora_target { q, k, v, o, gate, up, down, qkv, gate_up };
inline constexpr int num_lora_targets = 9;
const char* lora_target_name(lora_target t);             // "q_proj", ...
const char* lora_target_module(lora_target t);           // "self_attn.q_proj", "mlp.gate_proj", ...
std::optional<lora_target> lora_target_from_name(const std::string& s);  // accepts "q" or "q_proj"

}  // namespace lorapipe
