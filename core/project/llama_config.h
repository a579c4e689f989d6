// Llama architecture hyper-parameters, read from a Hugging Face config.json or a llama2.c header.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "core/base/result.h"

namespace lorapipe {

struct llama_config {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // dim
  int64_t intermediate_size = 0;  // SwiGLU hidden
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = 1;
  int64_t eos_token_id = 2;
  std::string torch_dtype = "float32";

  int64_t kv_groups() const { return num_heads / num_kv_heads; }
  int64_t num_parameters() const;
};

// Parses and validates config.json contents; `label` names the file in errors.
result<llama_config> parse_llama_config(const nlohmann::json& j, const std::string& label);
result<llama_config> load_llama_config(const std::filesystem::path& config_json);
nlohmann::json llama_config_to_hf_json(const llama_config& c);

}  // namespace lorapipe
