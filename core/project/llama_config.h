// Decoder architecture hyper-parameters of every supported family (Llama 2/3.x, Mistral, Qwen2/2.5,
// Qwen3, Phi-3, Gemma 2/3 text), read from a Hugging Face config.json or a llama2.c header. Every
// config.json field that changes the numerics is read into a member here or refused by name
// (config_key_status lists each key's treatment); nothing is silently ignored.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/base/result.h"
#include "core/project/lora_target.h"

namespace lorapipe {

// RoPE parameters as transformers' rope_parameters (or rope_scaling + rope_theta) give them.
struct rope_config {
  std::string type = "default";  // default | linear | dynamic | yarn | llama3
  double theta = 10000.0;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;       // llama3
  int64_t original_max_position_embeddings = 0;               // llama3, yarn
  double attention_factor = 0;                                // yarn; 0: derived from factor/mscale
  double beta_fast = 32, beta_slow = 1, mscale = 0, mscale_all_dim = 0;
  bool truncate = true;                                       // yarn
};

struct llama_config {
  std::string model_type = "llama";  // llama | mistral | qwen2 | qwen3 | phi3 | gemma2 | gemma3_text
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // dim
  int64_t intermediate_size = 0;  // gated MLP hidden
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  rope_config rope;               // full-attention layers
  rope_config rope_local;         // sliding-window layers (Gemma 3: its own theta); = rope otherwise
  bool tie_word_embeddings = false;
  int64_t bos_token_id = 1;
  int64_t eos_token_id = 2;
  std::string torch_dtype = "float32";

  // Family features (all off for Llama 2).
  bool qkv_bias = false;          // bias on q/k/v (Qwen2, Llama attention_bias)
  bool o_bias = false;            // bias on o_proj (Llama attention_bias)
  bool mlp_bias = false;          // bias on gate/up/down (Llama mlp_bias)
  bool qk_norm = false;           // RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
  bool fused_proj = false;        // qkv_proj and gate_up_proj (Phi-3)
  bool gemma_norm = false;        // RMSNorm scales by (1 + w), in f32 (Gemma)
  bool sandwich_norm = false;     // post-attention, pre- and post-feed-forward norms (Gemma 2/3)
  bool gelu_tanh = false;         // GeGLU with gelu(tanh) instead of SwiGLU (Gemma)
  bool scale_embeddings = false;  // embeddings times sqrt(hidden_size) (Gemma)
  double query_scale = 0;         // attention score scale; 0: 1/sqrt(head_dim)
  double attn_softcap = 0;        // tanh soft-capping of attention scores (0: none)
  double final_softcap = 0;       // tanh soft-capping of the logits (0: none)
  int64_t sliding_window = 0;     // keys visible to a query in sliding layers (0: none)
  std::vector<bool> sliding_layers;  // per layer: uses the sliding window (empty: none does)
  std::string hf_config_json;     // config.json as read (a merged export writes it back); empty for llama2.c

  int64_t kv_groups() const { return num_heads / num_kv_heads; }
  bool is_sliding(int64_t layer) const {
    return sliding_window > 0 && layer < static_cast<int64_t>(sliding_layers.size()) && sliding_layers[layer];
  }
  double attention_scale() const;
  // Attention as explicit score matrices (softmax over [T, S] scores kept for the backward) rather
  // than a fused kernel: soft-capped scores, and Gemma 2 always (transformers runs it eager).
  bool eager_attention() const { return attn_softcap > 0 || model_type == "gemma2"; }
  // Longest sequence the model runs: max_position_embeddings, unbounded with dynamic NTK scaling
  // (which exists to run past it).
  int64_t context_length() const;
  int64_t num_parameters() const;
};

// The LM head and loss run on labelled positions only, in chunks of rows whose f32 logits fit this
// budget (head_loss_sum in core/model); the backward recomputes a chunk's logits.
inline constexpr int64_t default_head_chunk_bytes = int64_t{64} << 20;
// Rows of one chunk, and the head's peak working set (a chunk's logits, softmax and gradient, f32)
// for `labelled` labelled positions in a micro-batch.
int64_t head_chunk_rows(const llama_config& c, int64_t chunk_bytes = default_head_chunk_bytes);
int64_t head_working_bytes(const llama_config& c, int64_t labelled, int64_t chunk_bytes = default_head_chunk_bytes);

// Parses and validates config.json contents; `label` names the file in errors.
result<llama_config> parse_llama_config(const nlohmann::json& j, const std::string& label);
result<llama_config> load_llama_config(const std::filesystem::path& config_json);
// config.json for a model with this architecture (the merged export).
nlohmann::json llama_config_to_hf_json(const llama_config& c);

// The model types lorapipe implements, in the order error messages list them.
const std::vector<std::string>& supported_model_types();
// How the parser treats a config.json key for a model type: "read", "ignored" (cannot change the
// numerics: ids, bookkeeping, inference switches) or "refused" (would change them and is not
// implemented, or is unknown). Values matter too: a read key with an unimplemented value is refused.
std::string config_key_status(const std::string& model_type, const std::string& key);

// One frozen tensor of a decoder layer: its slot, its name under model.layers.N. and its shape.
enum class layer_slot {
  input_norm, post_attention_norm, pre_ffn_norm, post_ffn_norm, q_norm, k_norm,
  q, k, v, o, gate, up, down, qkv, gate_up,                              // projections (by lora_target)
  q_bias, k_bias, v_bias, o_bias, gate_bias, up_bias, down_bias,
};
inline constexpr int num_layer_slots = 22;
layer_slot proj_slot(lora_target t);
struct layer_tensor_spec {
  layer_slot slot;
  std::string name;            // "self_attn.q_proj.weight", ...
  std::vector<int64_t> shape;  // [out, in] for projections
};
// The tensors of one decoder layer, in the order the loader reads them and the executor lays them
// out in a stage's weight block.
std::vector<layer_tensor_spec> layer_tensor_specs(const llama_config& c);
// The projections this architecture has (what LoRA can target).
std::vector<lora_target> model_targets(const llama_config& c);
// LoRA target names carried over to this architecture: q/k/v become qkv_proj and gate/up become
// gate_up_proj on fused models (and back on the others); unknown names are kept for validation.
std::vector<std::string> fit_lora_targets(const llama_config& c, const std::vector<std::string>& names);

}  // namespace lorapipe
