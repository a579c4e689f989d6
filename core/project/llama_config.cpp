// config.json parsing and validation for the supported decoder families (see llama_config.h).
#include "core/project/llama_config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/base/json_parse.h"

#include "core/base/safetensors.h"

namespace lorapipe {
using json = nlohmann::json;

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> types{"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"};
  return types;
}

namespace {

bool is_gemma(const std::string& t) { return t == "gemma2" || t == "gemma3_text"; }
bool is_qwen(const std::string& t) { return t == "qwen2" || t == "qwen3"; }

// Keys that cannot change the numerics: bookkeeping, ids, generation defaults, inference switches.
const std::set<std::string>& ignored_keys() {
  static const std::set<std::string> keys{
      "_name_or_path", "architectures", "transformers_version", "initializer_range", "use_cache", "pad_token_id",
      "sep_token_id", "decoder_start_token_id", "output_attentions", "output_hidden_states", "return_dict",
      "return_dict_in_generate", "output_scores", "id2label", "label2id", "problem_type", "torchscript",
      "tokenizer_class", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
      "tie_encoder_decoder", "cross_attention_hidden_size", "prefix", "task_specific_params", "finetuning_task",
      "pruned_heads", "tf_legacy_loss", "use_bfloat16", "bad_words_ids", "begin_suppress_tokens", "suppress_tokens",
      "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size",
      "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id", "length_penalty",
      "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams", "num_return_sequences",
      "remove_invalid_values", "repetition_penalty", "temperature", "top_k", "top_p", "typical_p",
      "cache_implementation", "auto_map", "pretraining_tp", "unsloth_version", "unsloth_fixed",
      "_attn_implementation_autoset", "_sliding_window_pattern"};
  return keys;
}

// Keys read for every family; the families add their own.
const std::set<std::string>& common_keys() {
  static const std::set<std::string> keys{
      "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
      "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
      "rope_parameters", "partial_rotary_factor", "tie_word_embeddings", "bos_token_id", "eos_token_id",
      "torch_dtype", "dtype", "hidden_act", "attention_dropout"};
  return keys;
}

std::set<std::string> family_keys(const std::string& t) {
  if (t == "llama") return {"attention_bias", "mlp_bias"};
  if (t == "mistral") return {"sliding_window"};
  if (is_qwen(t)) return {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "use_mrope"};
  if (t == "phi3") return {"attention_bias", "sliding_window", "embd_pdrop", "resid_pdrop", "original_max_position_embeddings"};
  if (is_gemma(t))
    return {"attention_bias", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
            "final_logit_softcapping", "sliding_window", "layer_types", "use_bidirectional_attention",
            "rope_local_base_freq", "sliding_window_pattern", "sliding_window_size"};
  return {};
}

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
status read_bool(const json& j, const char* key, bool& out, const std::string& label) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return ok_status();
  if (!it->is_boolean()) return make_error("{}: field '{}' must be true or false", label, key);
  out = it->get<bool>();
  return ok_status();
}
// A key that must be absent, null or equal to its harmless value.
status must_be_zero(const json& j, const char* key, const std::string& label) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return ok_status();
  if (it->is_number() && it->get<double>() == 0) return ok_status();
  return make_error("{}: field '{}' = {} is not supported (dropout in the base model would change the numerics; must be 0)",
                    label, key, it->dump());
}

// One RoPE dict (rope_parameters, or rope_scaling with the top-level rope_theta).
status parse_rope(const json& r, const std::string& where, rope_config& out, const std::string& label) {
  static const std::set<std::string> keys{"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                                          "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                                          "mscale", "mscale_all_dim", "truncate", "partial_rotary_factor"};
  if (!r.is_object()) return make_error("{}: field '{}' must be an object", label, where);
  std::string type = "default";
  for (const char* k : {"rope_type", "type"})
    if (r.contains(k) && !r[k].is_null()) {
      if (!r[k].is_string()) return make_error("{}: field '{}.{}' must be a string", label, where, k);
      type = r[k].get<std::string>();
      break;
    }
  static const std::set<std::string> types{"default", "linear", "dynamic", "yarn", "llama3"};
  if (!types.count(type))
    return make_error("{}: field '{}.rope_type': '{}' is not supported (supported: default, linear, dynamic, yarn, llama3)",
                      label, where, type);
  for (auto it = r.begin(); it != r.end(); ++it)
    if (!keys.count(it.key()))
      return make_error("{}: field '{}.{}' is not supported (it would change the RoPE numerics)", label, where, it.key());
  // transformers raises without these; a default here would be a guess.
  auto required = [&](const char* k) -> status {
    if (!r.contains(k) || r[k].is_null()) return make_error("{}: field '{}.{}' is required for rope_type '{}'", label, where, k, type);
    return ok_status();
  };
  if (type != "default") LP_TRY(required("factor"));
  if (type == "llama3") {
    LP_TRY(required("low_freq_factor"));
    LP_TRY(required("high_freq_factor"));
  }
  out.type = type;
  auto num = [&](const char* k, double& v) -> status {
    if (!r.contains(k) || r[k].is_null()) return ok_status();
    if (!r[k].is_number()) return make_error("{}: field '{}.{}' must be a number", label, where, k);
    v = r[k].get<double>();
    return ok_status();
  };
  LP_TRY(num("rope_theta", out.theta));
  LP_TRY(num("factor", out.factor));
  LP_TRY(num("low_freq_factor", out.low_freq_factor));
  LP_TRY(num("high_freq_factor", out.high_freq_factor));
  LP_TRY(num("attention_factor", out.attention_factor));
  LP_TRY(num("beta_fast", out.beta_fast));
  LP_TRY(num("beta_slow", out.beta_slow));
  LP_TRY(num("mscale", out.mscale));
  LP_TRY(num("mscale_all_dim", out.mscale_all_dim));
  double partial = 1;
  LP_TRY(num("partial_rotary_factor", partial));
  if (partial != 1) return make_error("{}: field '{}.partial_rotary_factor' = {} is not supported (only 1)", label, where, partial);
  if (r.contains("original_max_position_embeddings") && !r["original_max_position_embeddings"].is_null()) {
    if (!r["original_max_position_embeddings"].is_number_integer())
      return make_error("{}: field '{}.original_max_position_embeddings' must be an integer", label, where);
    out.original_max_position_embeddings = r["original_max_position_embeddings"].get<int64_t>();
  }
  if (r.contains("truncate") && r["truncate"].is_boolean()) out.truncate = r["truncate"].get<bool>();
  if (!(out.theta > 0)) return make_error("{}: field '{}.rope_theta' must be positive", label, where);
  if (type != "default" && !(out.factor > 0))
    return make_error("{}: field '{}.factor' must be positive for rope_type '{}'", label, where, type);
  if (type == "llama3" && !(out.high_freq_factor > out.low_freq_factor))
    return make_error("{}: field '{}.high_freq_factor' must exceed low_freq_factor", label, where);
  return ok_status();
}

// rope / rope_local from rope_parameters (transformers 5, flat or per layer type) or the older
// rope_theta + rope_scaling (+ Gemma 3's rope_local_base_freq, Phi-3's original_max_position_embeddings).
status parse_ropes(const json& j, llama_config& c, const std::string& label) {
  const bool gemma3 = c.model_type == "gemma3_text";
  double theta = gemma3 ? 1e6 : 10000.0, local_theta = 10000.0;
  LP_TRY(read_num(j, "rope_theta", theta, label));
  LP_TRY(read_num(j, "rope_local_base_freq", local_theta, label));
  double partial = 1;
  LP_TRY(read_num(j, "partial_rotary_factor", partial, label));
  if (partial != 1) return make_error("{}: field 'partial_rotary_factor' = {} is not supported (only 1)", label, partial);
  c.rope = rope_config{};
  c.rope.theta = theta;
  c.rope_local = rope_config{};
  c.rope_local.theta = gemma3 ? local_theta : theta;
  auto rp = j.find("rope_parameters");
  auto rs = j.find("rope_scaling");
  const bool has_rp = rp != j.end() && !rp->is_null(), has_rs = rs != j.end() && !rs->is_null();
  if (has_rp && has_rs) return make_error("{}: fields 'rope_parameters' and 'rope_scaling' are both set (give one)", label);
  if (has_rp) {
    if (!rp->is_object()) return make_error("{}: field 'rope_parameters' must be an object", label);
    const bool nested = rp->contains("full_attention") || rp->contains("sliding_attention");
    if (nested != gemma3)
      return make_error("{}: field 'rope_parameters' must {}be given per layer type for model_type '{}'", label, gemma3 ? "" : "not ",
                        c.model_type);
    if (nested) {
      for (auto it = rp->begin(); it != rp->end(); ++it)
        if (it.key() != "full_attention" && it.key() != "sliding_attention")
          return make_error("{}: field 'rope_parameters.{}' is not supported", label, it.key());
      if (rp->contains("full_attention")) LP_TRY(parse_rope((*rp)["full_attention"], "rope_parameters.full_attention", c.rope, label));
      if (rp->contains("sliding_attention"))
        LP_TRY(parse_rope((*rp)["sliding_attention"], "rope_parameters.sliding_attention", c.rope_local, label));
    } else {
      LP_TRY(parse_rope(*rp, "rope_parameters", c.rope, label));
      c.rope_local = c.rope;
    }
  } else {
    if (has_rs) LP_TRY(parse_rope(*rs, "rope_scaling", c.rope, label));  // its own rope_theta wins, as setdefault does
    if (!gemma3) c.rope_local = c.rope;
  }
  if (c.model_type == "phi3" && c.rope.type != "default")  // transformers reads Phi-3's scaled RoPE as longrope
    return make_error("{}: rope type '{}' is not supported for model_type 'phi3' (transformers runs it as longrope, which "
                      "lorapipe does not implement)", label, c.rope.type);
  // Pretraining length for the scaled types: Phi-3 keeps it at the top level, which wins.
  int64_t top_orig = 0;
  LP_TRY(read_int(j, "original_max_position_embeddings", top_orig, false, label));
  for (auto* r : {&c.rope, &c.rope_local}) {
    if (r->type != "llama3" && r->type != "yarn") continue;
    if (top_orig > 0) r->original_max_position_embeddings = top_orig;
    if (r->original_max_position_embeddings <= 0) r->original_max_position_embeddings = c.max_position_embeddings;
  }
  return ok_status();
}

// Which layers use the sliding window (layer_types, else the family's rule).
status parse_sliding(const json& j, llama_config& c, const std::string& label) {
  const auto& t = c.model_type;
  int64_t window = 0;
  if (j.contains("sliding_window") && !j["sliding_window"].is_null()) LP_TRY(read_int(j, "sliding_window", window, false, label));
  if (is_qwen(t)) {
    bool use = false;
    LP_TRY(read_bool(j, "use_sliding_window", use, label));
    if (!use) window = 0;
  }
  if (is_gemma(t)) {
    bool bidirectional = false;
    LP_TRY(read_bool(j, "use_bidirectional_attention", bidirectional, label));
    if (bidirectional) return make_error("{}: field 'use_bidirectional_attention' = true is not supported", label);
    if (window == 0) return make_error("{}: field 'sliding_window' must be set for model_type '{}'", label, t);
    int64_t size = window;
    LP_TRY(read_int(j, "sliding_window_size", size, false, label));
    if (size != window)
      return make_error("{}: field 'sliding_window_size' ({}) differs from 'sliding_window' ({})", label, size, window);
  }
  c.sliding_window = window;
  c.sliding_layers.assign(c.num_layers, false);
  if (window == 0) return ok_status();
  auto lt = j.find("layer_types");
  if (lt != j.end() && !lt->is_null()) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != c.num_layers)
      return make_error("{}: field 'layer_types' must list one type per layer ({})", label, c.num_layers);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const auto& v = (*lt)[l];
      if (!v.is_string() || (v != "full_attention" && v != "sliding_attention"))
        return make_error("{}: field 'layer_types[{}]' = {} is not supported (full_attention or sliding_attention)", label, l,
                          v.dump());
      c.sliding_layers[l] = v == "sliding_attention";
    }
    return ok_status();
  }
  int64_t pattern = t == "gemma2" ? 2 : 6, first_sliding = 0;
  if (t == "gemma3_text")
    LP_TRY(read_int(j, "sliding_window_pattern", pattern, false, label));
  if (is_qwen(t)) {
    first_sliding = 28;
    LP_TRY(read_int(j, "max_window_layers", first_sliding, false, label));
  }
  for (int64_t l = 0; l < c.num_layers; ++l)
    c.sliding_layers[l] = is_gemma(t) ? (l + 1) % pattern != 0 : (is_qwen(t) ? l >= first_sliding : true);
  return ok_status();
}

// The family's structure and the keys only some families have.
status parse_family(const json& j, llama_config& c, const std::string& label) {
  const auto& t = c.model_type;
  bool attention_bias = false;
  if (t == "llama" || is_gemma(t) || t == "qwen3" || t == "phi3") LP_TRY(read_bool(j, "attention_bias", attention_bias, label));
  if (attention_bias && t != "llama")
    return make_error("{}: field 'attention_bias' = true is not supported for model_type '{}'", label, t);
  c.qkv_bias = t == "qwen2" || attention_bias;
  c.o_bias = attention_bias;
  if (t == "llama") LP_TRY(read_bool(j, "mlp_bias", c.mlp_bias, label));
  if (t == "qwen2") {
    bool mrope = false;
    LP_TRY(read_bool(j, "use_mrope", mrope, label));
    if (mrope) return make_error("{}: field 'use_mrope' = true is not supported", label);
  }
  c.qk_norm = t == "qwen3" || t == "gemma3_text";
  c.fused_proj = t == "phi3";
  LP_TRY(must_be_zero(j, "attention_dropout", label));
  if (t == "phi3") {
    LP_TRY(must_be_zero(j, "embd_pdrop", label));
    LP_TRY(must_be_zero(j, "resid_pdrop", label));
  }
  std::string act = is_gemma(t) ? "gelu_pytorch_tanh" : "silu";
  const char* act_key = is_gemma(t) && j.contains("hidden_activation") && !j["hidden_activation"].is_null() ? "hidden_activation" : "hidden_act";
  if (j.contains(act_key) && !j[act_key].is_null()) {
    if (!j[act_key].is_string()) return make_error("{}: field '{}' must be a string", label, act_key);
    act = j[act_key].get<std::string>();
  }
  if (act != "silu" && act != "gelu_pytorch_tanh")
    return make_error("{}: field '{}': '{}' is not supported (silu or gelu_pytorch_tanh)", label, act_key, act);
  c.gelu_tanh = act == "gelu_pytorch_tanh";
  if (is_gemma(t)) {
    c.gemma_norm = c.sandwich_norm = c.scale_embeddings = true;
    double qpas = 256;
    LP_TRY(read_num(j, "query_pre_attn_scalar", qpas, label));
    c.query_scale = 1.0 / std::sqrt(qpas);
    c.attn_softcap = t == "gemma2" ? 50.0 : 0.0;
    c.final_softcap = t == "gemma2" ? 30.0 : 0.0;
    for (auto [k, v] : {std::pair{"attn_logit_softcapping", &c.attn_softcap}, std::pair{"final_logit_softcapping", &c.final_softcap}}) {
      if (!j.contains(k)) continue;
      if (j[k].is_null()) *v = 0;
      else LP_TRY(read_num(j, k, *v, label));
    }
  }
  return ok_status();
}

}  // namespace

double llama_config::attention_scale() const {
  return query_scale > 0 ? query_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

int64_t llama_config::context_length() const {
  return rope.type == "dynamic" ? std::numeric_limits<int64_t>::max() / 4 : max_position_embeddings;
}

int64_t head_chunk_rows(const llama_config& c, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / (std::max<int64_t>(1, c.vocab_size) * 4));
}

int64_t head_working_bytes(const llama_config& c, int64_t labelled, int64_t chunk_bytes) {
  const int64_t rows = std::min(std::max<int64_t>(1, labelled), head_chunk_rows(c, chunk_bytes));
  return 3 * rows * c.vocab_size * 4;  // f32 logits, softmax and its gradient of one chunk
}

std::string config_key_status(const std::string& model_type, const std::string& key) {
  if (common_keys().count(key) || family_keys(model_type).count(key)) return "read";
  if (ignored_keys().count(key)) return "ignored";
  return "refused";
}

result<llama_config> parse_llama_config(const json& j, const std::string& label) {
  if (!j.is_object()) return make_error("{}: expected a JSON object", label);
  llama_config c;
  if (auto mt = j.find("model_type"); mt != j.end()) {
    if (!mt->is_string()) return make_error("{}: field 'model_type' must be a string", label);
    c.model_type = mt->get<std::string>();
    const auto& types = supported_model_types();
    if (std::find(types.begin(), types.end(), c.model_type) == types.end())
      return make_error("{}: model_type '{}' is not supported; supported: {}", label, c.model_type, fmt::join(types, ", "));
  }
  for (auto it = j.begin(); it != j.end(); ++it)
    if (config_key_status(c.model_type, it.key()) == "refused")
      return make_error("{}: field '{}' is not supported for model_type '{}' (lorapipe does not implement what it would change)",
                        label, it.key(), c.model_type);
  const auto& t = c.model_type;
  LP_TRY(read_int(j, "vocab_size", c.vocab_size, true, label));
  LP_TRY(read_int(j, "hidden_size", c.hidden_size, true, label));
  LP_TRY(read_int(j, "intermediate_size", c.intermediate_size, true, label));
  LP_TRY(read_int(j, "num_hidden_layers", c.num_layers, true, label));
  LP_TRY(read_int(j, "num_attention_heads", c.num_heads, true, label));
  c.num_kv_heads = c.num_heads;
  LP_TRY(read_int(j, "num_key_value_heads", c.num_kv_heads, false, label));
  c.head_dim = c.hidden_size / c.num_heads;
  LP_TRY(read_int(j, "head_dim", c.head_dim, false, label));
  // transformers' defaults when the key is absent
  c.max_position_embeddings = t == "gemma3_text" || t == "mistral" ? 131072 : is_qwen(t) ? 32768 : t == "gemma2" ? 8192
                              : t == "phi3" ? 4096 : 2048;
  LP_TRY(read_int(j, "max_position_embeddings", c.max_position_embeddings, false, label));
  c.rms_norm_eps = t == "phi3" ? 1e-5 : 1e-6;  // transformers' defaults when the key is absent
  LP_TRY(read_num(j, "rms_norm_eps", c.rms_norm_eps, label));
  c.tie_word_embeddings = is_gemma(t);
  LP_TRY(read_bool(j, "tie_word_embeddings", c.tie_word_embeddings, label));
  if (auto b = j.find("bos_token_id"); b != j.end() && b->is_number_integer()) c.bos_token_id = b->get<int64_t>();
  if (auto e = j.find("eos_token_id"); e != j.end()) {
    if (e->is_number_integer()) c.eos_token_id = e->get<int64_t>();
    else if (e->is_array() && !e->empty() && (*e)[0].is_number_integer()) c.eos_token_id = (*e)[0].get<int64_t>();
  }
  for (const char* k : {"torch_dtype", "dtype"})
    if (auto d = j.find(k); d != j.end() && d->is_string()) c.torch_dtype = d->get<std::string>();
  LP_TRY(parse_family(j, c, label));
  LP_TRY(parse_ropes(j, c, label));
  LP_TRY(parse_sliding(j, c, label));
  if (c.num_heads % c.num_kv_heads != 0)
    return make_error("{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", label, c.num_heads,
                      c.num_kv_heads);
  if (c.head_dim % 2 != 0) return make_error("{}: head_dim ({}) must be even for RoPE", label, c.head_dim);
  if (!j.contains("head_dim") && c.hidden_size % c.num_heads != 0)
    return make_error("{}: hidden_size ({}) must be divisible by num_attention_heads ({})", label, c.hidden_size,
                      c.num_heads);
  c.hf_config_json = j.dump(2);
  return c;
}

result<llama_config> load_llama_config(const std::filesystem::path& p) {
  LP_TRY_ASSIGN(text, read_text_file(p));
  json j = parse_json_or_discarded(text);
  if (j.is_discarded()) return make_error("{}: not valid JSON", p.string());
  return parse_llama_config(j, p.string());
}

json llama_config_to_hf_json(const llama_config& c) {
  if (!c.hf_config_json.empty()) {  // the source's own config, with the export's dtype
    json j = json::parse(c.hf_config_json);
    j.erase("torch_dtype");
    j["dtype"] = c.torch_dtype;
    return j;
  }
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
              {"rope_theta", c.rope.theta},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"bos_token_id", c.bos_token_id},
              {"eos_token_id", c.eos_token_id},
              {"torch_dtype", c.torch_dtype}};
}

layer_slot proj_slot(lora_target t) { return static_cast<layer_slot>(static_cast<int>(layer_slot::q) + static_cast<int>(t)); }

std::vector<lora_target> model_targets(const llama_config& c) {
  using lt = lora_target;
  if (c.fused_proj) return {lt::qkv, lt::o, lt::gate_up, lt::down};
  return {lt::q, lt::k, lt::v, lt::o, lt::gate, lt::up, lt::down};
}

std::vector<std::string> fit_lora_targets(const llama_config& c, const std::vector<std::string>& names) {
  using lt = lora_target;
  std::vector<std::string> out;
  auto add = [&](lt t) {
    const std::string n = lora_target_name(t);
    if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  };
  for (const auto& n : names) {
    auto t = lora_target_from_name(n);
    if (!t) {
      out.push_back(n);
      continue;
    }
    if (c.fused_proj && (*t == lt::q || *t == lt::k || *t == lt::v)) add(lt::qkv);
    else if (c.fused_proj && (*t == lt::gate || *t == lt::up)) add(lt::gate_up);
    else if (!c.fused_proj && *t == lt::qkv) add(lt::q), add(lt::k), add(lt::v);
    else if (!c.fused_proj && *t == lt::gate_up) add(lt::gate), add(lt::up);
    else add(*t);
  }
  return out;
}

std::vector<layer_tensor_spec> layer_tensor_specs(const llama_config& c) {
  const int64_t D = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t q = c.num_heads * hd, kv = c.num_kv_heads * hd;
  using s = layer_slot;
  std::vector<layer_tensor_spec> out{{s::input_norm, "input_layernorm.weight", {D}},
                                     {s::post_attention_norm, "post_attention_layernorm.weight", {D}}};
  if (c.sandwich_norm) {
    out.push_back({s::pre_ffn_norm, "pre_feedforward_layernorm.weight", {D}});
    out.push_back({s::post_ffn_norm, "post_feedforward_layernorm.weight", {D}});
  }
  if (c.qk_norm) {
    out.push_back({s::q_norm, "self_attn.q_norm.weight", {hd}});
    out.push_back({s::k_norm, "self_attn.k_norm.weight", {hd}});
  }
  auto add_proj = [&](lora_target t, std::vector<int64_t> shape) {
    out.push_back({proj_slot(t), std::string(lora_target_module(t)) + ".weight", std::move(shape)});
  };
  if (c.fused_proj) {
    add_proj(lora_target::qkv, {q + 2 * kv, D});
    add_proj(lora_target::o, {D, q});
    add_proj(lora_target::gate_up, {2 * I, D});
    add_proj(lora_target::down, {D, I});
    return out;
  }
  add_proj(lora_target::q, {q, D});
  add_proj(lora_target::k, {kv, D});
  add_proj(lora_target::v, {kv, D});
  add_proj(lora_target::o, {D, q});
  add_proj(lora_target::gate, {I, D});
  add_proj(lora_target::up, {I, D});
  add_proj(lora_target::down, {D, I});
  auto add_bias = [&](layer_slot sl, lora_target t, int64_t n) {
    out.push_back({sl, std::string(lora_target_module(t)) + ".bias", {n}});
  };
  if (c.qkv_bias) {
    add_bias(s::q_bias, lora_target::q, q);
    add_bias(s::k_bias, lora_target::k, kv);
    add_bias(s::v_bias, lora_target::v, kv);
  }
  if (c.o_bias) add_bias(s::o_bias, lora_target::o, D);
  if (c.mlp_bias) {
    add_bias(s::gate_bias, lora_target::gate, I);
    add_bias(s::up_bias, lora_target::up, I);
    add_bias(s::down_bias, lora_target::down, D);
  }
  return out;
}

int64_t llama_config::num_parameters() const {
  int64_t per_layer = 0;
  for (const auto& s : layer_tensor_specs(*this)) {
    int64_t n = 1;
    for (auto d : s.shape) n *= d;
    per_layer += n;
  }
  int64_t emb = vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2);
  return num_layers * per_layer + emb + hidden_size;
}

}  // namespace lorapipe
