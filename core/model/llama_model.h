// Decoder model in LibTorch for every supported family: frozen base weights, the layer-level
// forward pieces (embedding, decoder layer, head) that the pipeline executor calls per stage, and
// the whole-model forward. Llama layout (RMSNorm, RoPE with rotate_half, grouped-query attention,
// gated MLP, tied or untied head) plus what the families add, each switched by llama_config:
// q/k/v (and o, MLP) biases, per-head q/k norms, fused qkv/gate_up (Phi-3), Gemma's (1 + w) norms,
// sandwich norms, GeGLU, scaled embeddings, soft-capping and query scale, sliding-window layers, and
// the RoPE scalings (linear, dynamic, yarn, llama3). Weights come from an HF folder (single or
// sharded safetensors) or a llama2.c .bin and are frozen (requires_grad false) in the compute dtype.
#pragma once

#include <array>
#include <utility>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/base/cancel.h"
#include "core/project/llama_config.h"
#include "core/model/lora.h"
#include "core/base/result.h"

namespace lorapipe {

// One decoder layer's frozen tensors by layer_slot (layer_tensor_specs gives the ones a family
// has; the others stay undefined). Projections are in HF [out, in] layout.
struct layer_weights {
  std::array<at::Tensor, num_layer_slots> t;
  at::Tensor& operator[](layer_slot s) { return t[static_cast<size_t>(s)]; }
  const at::Tensor& operator[](layer_slot s) const { return t[static_cast<size_t>(s)]; }
  const at::Tensor& proj(lora_target x) const { return (*this)[proj_slot(x)]; }
};

// RoPE cos/sin tables (attention factor applied) for positions [0, max_position_embeddings), and
// the inverse frequencies to extend them (longer sequences, dynamic NTK scaling).
struct rope_table {
  at::Tensor cos;       // f32 [P, head_dim]
  at::Tensor sin;       // f32 [P, head_dim]
  at::Tensor inv_freq;  // f32 [head_dim/2]
  double attention_factor = 1.0;
};
struct rope_tables {
  rope_table full;
  rope_table local;  // sliding-window layers when their RoPE differs (Gemma 3); else undefined
  rope_tables to(c10::Device d) const;
};

struct llama_weights {
  llama_config cfg;
  at::ScalarType dtype;       // compute dtype of the weights
  at::Tensor embed;           // [V, D]
  std::vector<layer_weights> layers;
  at::Tensor final_norm;      // [D]
  at::Tensor lm_head;         // [V, D]; same storage as embed when tied
  rope_tables rope;
  std::string source;         // path it was loaded from
};

// Per-layer key/value cache for incremental decoding.
struct kv_cache {
  std::vector<at::Tensor> k, v;  // [B, n_kv, S, hd] per layer
  int64_t length = 0;
};

// Which frozen tensors to read (a pipeline rank needs only its own stages'). The others become meta
// tensors of the right shape and dtype: shapes, byte counts and LoRA initialisation work, and any read
// of their data throws instead of computing with something that was never loaded.
struct weight_selection {
  std::vector<bool> layers;  // per layer; empty: every layer
  bool embed = true;         // the token embedding (and a tied head)
  bool head = true;          // lm_head (the final norm is always read)
  bool layer(int64_t l) const { return layers.empty() || layers.at(static_cast<size_t>(l)); }
};

struct load_options {
  at::ScalarType dtype;  // compute dtype: Float, BFloat16 or Half
  progress_fn progress = {};  // per layer loaded; false stops with "cancelled"
  // Called with the model's config before any tensor is read; unset: read everything.
  std::function<result<weight_selection>(const llama_config&)> select = {};
};
// Whether every frozen tensor holds data (false after a load that selected a part).
bool weights_complete(const llama_weights& w);

// Path: an HF folder (config.json + model.safetensors[.index.json]) or a llama2.c .bin file.
result<llama_weights> load_llama(const std::filesystem::path& path, const load_options& opt);
rope_tables make_rope_tables(const llama_config& cfg);
// cos/sin f32 [T, head_dim] for positions start_pos .. start_pos+T-1 of `layer` (its RoPE variant;
// dynamic scaling for the sequence length start_pos+T as transformers computes it).
std::pair<at::Tensor, at::Tensor> rope_for(const llama_config& cfg, const rope_tables& rope, int64_t layer, int64_t start_pos,
                                           int64_t T);

// What a decoder layer needs besides its own weights (the pipeline executor passes device copies).
struct layer_context {
  const llama_config& cfg;
  const rope_tables& rope;
  const lora_adapters* lora;  // may be null
  bool training;
  // LoRA dropout masks are counter-based: drawn from a generator seeded by (dropout_seed, layer,
  // target), so a recompute reproduces its forward's masks and no process-global RNG is used.
  // The trainer passes dropout_key(run seed, step, micro-batch).
  uint64_t dropout_seed = 0;
};
uint64_t dropout_key(uint64_t seed, int64_t step, int64_t micro_batch);
at::Tensor decoder_layer(const layer_context& ctx, int64_t layer, const layer_weights& lw, const at::Tensor& x /*[B,T,D]*/,
                         int64_t start_pos, kv_cache* cache);
at::Tensor head_logits(const llama_config& cfg, const at::Tensor& final_norm, const at::Tensor& lm_head,
                       const at::Tensor& x /*[B,T,D]*/);
// Token embedding of the family (Gemma scales by sqrt(hidden_size)): [B,T,D] in the weight's dtype.
at::Tensor embed_with(const llama_config& cfg, const at::Tensor& embed /*[V,D]*/, const at::Tensor& tokens /*i64 [B,T]*/);

// Forward pieces. `lora` may be null (base model). `training` enables LoRA dropout.
at::Tensor embed_tokens(const llama_weights& w, const at::Tensor& tokens /*i64 [B,T]*/);
at::Tensor decoder_layer(const llama_weights& w, int64_t layer, const lora_adapters* lora, const at::Tensor& x /*[B,T,D]*/,
                         int64_t start_pos, kv_cache* cache, bool training, uint64_t dropout_seed = 0);
at::Tensor lm_logits(const llama_weights& w, const at::Tensor& x /*[B,T,D]*/);  // -> [B,T,V] in compute dtype

// Whole model: logits [B,T,V] (compute dtype).
at::Tensor forward(const llama_weights& w, const lora_adapters* lora, const at::Tensor& tokens, int64_t start_pos = 0,
                   kv_cache* cache = nullptr, bool training = false, uint64_t dropout_seed = 0);

// The hidden state after the last decoder layer (no final norm, no head): [B,T,D].
at::Tensor forward_hidden(const llama_weights& w, const lora_adapters* lora, const at::Tensor& tokens, bool training = false,
                          uint64_t dropout_seed = 0);

// Summed token cross-entropy (f32 scalar) over the positions whose label is not -100, without the
// full logits: only those rows of x go through the final norm, the head (soft-capped where the
// family does) and the loss, in chunks of rows whose f32 logits fit `chunk_bytes`; the backward
// recomputes each chunk's logits instead of keeping them. Equal to causal_lm_loss_sum(head_logits(x))
// to fp32 rounding; 0 when no position is labelled.
at::Tensor head_loss_sum(const llama_config& cfg, const at::Tensor& final_norm, const at::Tensor& lm_head,
                         const at::Tensor& x /*[B,T,D]*/, const at::Tensor& labels /*i64 [B,T]*/,
                         int64_t chunk_bytes = default_head_chunk_bytes);

// Mean token cross-entropy (f32 scalar) of logits [B,T,V] against labels i64 [B,T]; -100 = ignored.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);
// Summed token cross-entropy (f32 scalar) over the labels that are not -100 (0 when there are none).
at::Tensor causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace lorapipe
