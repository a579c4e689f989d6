// config.json parsing and validation for Llama-family models.
#include "core/project/llama_config.h"

#include <nlohmann/json.hpp>

#include "core/base/json_parse.h"

#include "core/base/safetensors.h"

namespace lorapipe {
using json = nlohmann::json;

int64_t llama_config::num_parameters() const {
  int64_t attn = hidden_size * head_dim * (num_heads * 2 + num_kv_heads * 2);
  int64_t mlp = 3 * hidden_size * intermediate_size;
  int64_t per_layer = attn + mlp + 2 * hidden_size;
  int64_t emb = vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2);
  return num_layers * per_layer + emb + hidden_size;
}

namespace {
status read_int(const json& j, const char* key, int64_t& out, bool required, const std::string& label) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return make_error("{}: missing required field '{}'", label, key);
    return ok_status();
  }
  if (!it->is_number_integer()) return make_error("{}: field '{}' must be an integer", label, key);
  out = it->get<int64_t>();
  if (out <= 0) return make_error("{}: field '{}' must be positive (got {})", label, key, out);
  return ok_status();
}
status read_num(const json& j, const char* key, double& out, const std::string& label) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return ok_status();
  if (!it->is_number()) return make_error("{}: field '{}' must be a number", label, key);
  out = it->get<double>();
  if (!(out > 0)) return make_error("{}: field '{}' must be positive", label, key);
  return ok_status();
}
}  // namespace

result<llama_config> parse_llama_config(const json& j, const std::string& label) {
  if (!j.is_object()) return make_error("{}: expected a JSON object", label);
  llama_config c;
  if (auto mt = j.find("model_type"); mt != j.end()) {
    if (!mt->is_string()) return make_error("{}: field 'model_type' must be a string", label);
    auto t = mt->get<std::string>();
    if (t != "llama" && t != "mistral")
      return make_error("{}: model_type '{}' is not supported (expected 'llama' or 'mistral')", label, t);
  }
  LP_TRY(read_int(j, "vocab_size", c.vocab_size, true, label));
  LP_TRY(read_int(j, "hidden_size", c.hidden_size, true, label));
  LP_TRY(read_int(j, "intermediate_size", c.intermediate_size, true, label));
  LP_TRY(read_int(j, "num_hidden_layers", c.num_layers, true, label));
  LP_TRY(read_int(j, "num_attention_heads", c.num_heads, true, label));
  c.num_kv_heads = c.num_heads;
  LP_TRY(read_int(j, "num_key_value_heads", c.num_kv_heads, false, label));
  c.head_dim = c.hidden_size / c.num_heads;
  LP_TRY(read_int(j, "head_dim", c.head_dim, false, label));
  LP_TRY(read_int(j, "max_position_embeddings", c.max_position_embeddings, false, label));
  LP_TRY(read_num(j, "rms_norm_eps", c.rms_norm_eps, label));
  LP_TRY(read_num(j, "rope_theta", c.rope_theta, label));
  if (auto t = j.find("tie_word_embeddings"); t != j.end() && !t->is_null()) {
    if (!t->is_boolean()) return make_error("{}: field 'tie_word_embeddings' must be true or false", label);
    c.tie_word_embeddings = t->get<bool>();
  }
  if (auto b = j.find("bos_token_id"); b != j.end() && b->is_number_integer()) c.bos_token_id = b->get<int64_t>();
  if (auto e = j.find("eos_token_id"); e != j.end()) {
    if (e->is_number_integer()) c.eos_token_id = e->get<int64_t>();
    else if (e->is_array() && !e->empty() && (*e)[0].is_number_integer()) c.eos_token_id = (*e)[0].get<int64_t>();
  }
  if (auto d = j.find("torch_dtype"); d != j.end() && d->is_string()) c.torch_dtype = d->get<std::string>();
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null())
    return make_error("{}: rope_scaling is not supported yet", label);
  if (auto hb = j.find("attention_bias"); hb != j.end() && hb->is_boolean() && hb->get<bool>())
    return make_error("{}: attention_bias=true is not supported", label);
  if (auto ha = j.find("hidden_act"); ha != j.end() && ha->is_string() && ha->get<std::string>() != "silu")
    return make_error("{}: hidden_act '{}' is not supported (only silu)", label, ha->get<std::string>());
  if (c.num_heads % c.num_kv_heads != 0)
    return make_error("{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", label, c.num_heads,
                      c.num_kv_heads);
  if (c.head_dim % 2 != 0) return make_error("{}: head_dim ({}) must be even for RoPE", label, c.head_dim);
  if (!j.contains("head_dim") && c.hidden_size % c.num_heads != 0)
    return make_error("{}: hidden_size ({}) must be divisible by num_attention_heads ({})", label, c.hidden_size,
                      c.num_heads);
  return c;
}

result<llama_config> load_llama_config(const std::filesystem::path& p) {
  LP_TRY_ASSIGN(text, read_text_file(p));
  json j = parse_json_or_discarded(text);
  if (j.is_discarded()) return make_error("{}: not valid JSON", p.string());
  return parse_llama_config(j, p.string());
}

json llama_config_to_hf_json(const llama_config& c) {
  return json{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"num_hidden_layers", c.num_layers},
              {"num_attention_heads", c.num_heads},
              {"num_key_value_heads", c.num_kv_heads},
              {"head_dim", c.head_dim},
              {"vocab_size", c.vocab_size},
              {"max_position_embeddings", c.max_position_embeddings},
              {"rms_norm_eps", c.rms_norm_eps},
              {"rope_theta", c.rope_theta},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"bos_token_id", c.bos_token_id},
              {"eos_token_id", c.eos_token_id},
              {"torch_dtype", c.torch_dtype}};
}

}  // namespace lorapipe
