// Synthetic Llama models for tests and benches: a config of a given size and random weights in the
// layout the loader gives (nothing written to disk). Header-only; needs LibTorch.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/project/llama_config.h"

namespace lorapipe {

inline llama_config synthetic_llama_config(int64_t dim, int64_t ffn, int64_t layers, int64_t vocab, int64_t max_positions = 1024) {
  return parse_llama_config(nlohmann::json{{"model_type", "llama"}, {"hidden_size", dim}, {"intermediate_size", ffn},
                                           {"num_hidden_layers", layers}, {"num_attention_heads", dim / 64},
                                           {"num_key_value_heads", dim / 64}, {"vocab_size", vocab},
                                           {"max_position_embeddings", max_positions}, {"rms_norm_eps", 1e-5}},
                            "synthetic")
      .value();
}

inline llama_weights random_llama(const llama_config& c, uint64_t seed = 11) {
  torch::manual_seed(seed);
  llama_weights w;
  w.cfg = c;
  w.dtype = at::kFloat;
  w.embed = torch::randn({c.vocab_size, c.hidden_size}) * 0.02;  // f32 [V,D]
  for (int64_t l = 0; l < c.num_layers; ++l) {
    layer_weights lw;
    for (const auto& spec : layer_tensor_specs(c))
      lw[spec.slot] = spec.shape.size() == 1 ? torch::ones(spec.shape) : torch::randn(spec.shape) * 0.02;
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = torch::ones({c.hidden_size});                     // f32 [D]
  w.lm_head = torch::randn({c.vocab_size, c.hidden_size}) * 0.02;  // f32 [V,D]
  w.rope = make_rope_tables(c);
  return w;
}

}  // namespace lorapipe
