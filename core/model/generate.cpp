// Sampling loop: see generate.h.
#include "core/model/generate.h"

#include <limits>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

namespace lorapipe {

std::vector<int32_t> generate(const llama_weights& w, const lora_adapters* lora, const std::vector<int32_t>& prompt,
                              const sampling_options& opt) {
  torch::NoGradGuard no_grad;
  std::vector<int32_t> out;
  if (prompt.empty() || opt.max_new_tokens <= 0) return out;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(opt.seed);
  kv_cache cache;
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  const int64_t ctx = w.cfg.context_length();
  if (static_cast<int64_t>(ids.size()) > ctx) ids.erase(ids.begin(), ids.end() - ctx);
  auto input = torch::tensor(ids, torch::kLong).unsqueeze(0);  // i64 [1,T]
  int64_t pos = 0;
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    if (pos + input.size(1) > ctx || cancel_requested(opt.cancel)) break;
    auto logits = forward(w, lora, input, pos, &cache, false);   // [1,T,V]
    pos += input.size(1);
    auto last = logits.select(1, -1).squeeze(0).to(torch::kFloat);  // f32 [V]
    int64_t next;
    if (opt.temperature <= 0) {
      next = last.argmax().item<int64_t>();
    } else {
      auto probs = torch::softmax(last / opt.temperature, -1);  // f32 [V]
      if (opt.top_p < 1.0) {
        auto [sorted, idx] = probs.sort(-1, /*descending=*/true);
        auto cum = sorted.cumsum(-1);
        auto drop = (cum - sorted) > opt.top_p;  // keep the smallest prefix whose mass reaches top_p
        sorted.masked_fill_(drop, 0.0);
        probs = torch::zeros_like(probs).scatter(0, idx, sorted);
      }
      next = torch::multinomial(probs, 1, false, gen).item<int64_t>();
    }
    out.push_back(static_cast<int32_t>(next));
    if (next == opt.stop_id) break;
    if (opt.on_token && !opt.on_token(static_cast<int32_t>(next))) break;
    input = torch::tensor({next}, torch::kLong).unsqueeze(0);
  }
  return out;
}

}  // namespace lorapipe
