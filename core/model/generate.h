// Text generation with a KV cache: greedy (temperature 0), temperature and nucleus (top-p) sampling.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/base/cancel.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"

namespace lorapipe {

struct sampling_options {
  double temperature = 0.0;  // 0 = greedy
  double top_p = 1.0;
  uint64_t seed = 0;
  int64_t max_new_tokens = 64;
  int32_t stop_id = -1;  // stop after emitting this id (e.g. EOS); -1 = never
  // Called with every new id as soon as it is chosen (streaming); returning false stops after it.
  std::function<bool(int32_t id)> on_token;
  // Checked before every token: a request stops generation (the ids so far are returned).
  const cancel_token* cancel = nullptr;
};

// Returns only the new ids. Stops at max_new_tokens, at stop_id, at the model's context length, when
// on_token returns false, or on a cancel request.
std::vector<int32_t> generate(const llama_weights& w, const lora_adapters* lora, const std::vector<int32_t>& prompt,
                              const sampling_options& opt);

}  // namespace lorapipe
