// Projection names: see lora_target.h.
#include "core/project/lora_target.h"

namespace lorapipe {
namespace {
constexpr const char* target_names[num_lora_targets] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj", "qkv_proj", "gate_up_proj"};
constexpr const char* target_modules[num_lora_targets] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                           "mlp.down_proj", "self_attn.qkv_proj", "mlp.gate_up_proj"};
}  // namespace

const char* lora_target_name(lora_target t) { return target_names[static_cast<int>(t)]; }
const char* lora_target_module(lora_target t) { return target_modules[static_cast<int>(t)]; }

std::optional<lora_target> lora_target_from_name(const std::string& s) {
  for (int i = 0; i < num_lora_targets; ++i) {
    std::string n = target_names[i];
    if (s == n || s == n.substr(0, n.size() - 5)) return static_cast<lora_target>(i);
  }
  return std::nullopt;
}

}  // namespace lorapipe
