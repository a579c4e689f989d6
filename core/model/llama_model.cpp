// Llama forward pass: see llama_model.h.
#include "core/model/llama_model.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>
#include <torch/csrc/autograd/custom_function.h>

namespace lorapipe {
namespace {

at::Tensor rms_norm(const llama_config& cfg, const at::Tensor& x /*[...,N]*/, const at::Tensor& weight /*[N]*/) {
  auto xf = x.to(torch::kFloat);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + cfg.rms_norm_eps);
  // Gemma: (x * (1 + w)) in f32, then cast; Llama: cast, then scale.
  if (cfg.gemma_norm) return (normed * (1.0 + weight.to(torch::kFloat))).to(x.scalar_type());
  return weight * normed.to(x.scalar_type());
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return torch::cat({-x.slice(-1, h), x.slice(-1, 0, h)}, -1);
}

// Projection with optional LoRA: x·Wᵀ + scale·dropout(x)·Aᵀ·Bᵀ.
uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Inverted dropout with a mask from its own generator (see layer_context::dropout_seed).
at::Tensor lora_dropout(const at::Tensor& x, double p, uint64_t key) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(key);
  auto keep = at::empty(x.sizes(), at::kFloat).bernoulli_(1.0 - p, gen);  // f32 [B,T,in] on the host
  return x * (keep / (1.0 - p)).to(x.device(), x.scalar_type());
}

// The bias slot of a projection (undefined for the fused ones, which have none).
const at::Tensor& proj_bias(const layer_weights& lw, lora_target t) {
  static const at::Tensor none;
  if (static_cast<int>(t) >= static_cast<int>(lora_target::qkv)) return none;
  return lw[static_cast<layer_slot>(static_cast<int>(layer_slot::q_bias) + static_cast<int>(t))];
}

at::Tensor project(const layer_weights& lw, const std::array<lora_pair, num_lora_targets>* lora, double scale,
                   double dropout, bool training, uint64_t dropout_seed, lora_target t, const at::Tensor& x) {
  const int i = static_cast<int>(t);
  const auto& bias = proj_bias(lw, t);
  auto y = bias.defined() ? torch::linear(x, lw.proj(t), bias) : torch::linear(x, lw.proj(t));
  if (lora != nullptr && (*lora)[i].a.defined()) {
    const auto& p = (*lora)[i];
    auto xin = (training && dropout > 0) ? lora_dropout(x, dropout, mix64(dropout_seed ^ mix64(static_cast<uint64_t>(i)))) : x;
    // Scale folded into B ([out,r], tiny) instead of the [B,T,out] output.
    auto a = p.a.to(x.device(), x.scalar_type());
    auto b = (p.b * scale).to(x.device(), x.scalar_type());
    y = y + torch::linear(torch::linear(xin, a), b);
  }
  return y;
}

// Query i (absolute position start_pos+i) sees keys j <= start_pos+i, and in a sliding layer only
// those with j > start_pos+i-window (transformers' sliding_window_overlay).
at::Tensor attention_mask(int64_t T, int64_t S, int64_t start_pos, int64_t window, const at::TensorOptions& o) {
  auto mask = torch::ones({T, S}, o.dtype(torch::kBool)).tril(start_pos);  // bool [T,S]
  if (window > 0) mask = mask.triu(start_pos - window + 1);
  return mask;
}

// Eager attention as transformers' Gemma: scale, soft-cap, mask, f32 softmax.
at::Tensor eager_attention(const llama_config& cfg, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           int64_t start_pos, int64_t window) {
  const int64_t T = q.size(2), S = k.size(2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * cfg.attention_scale();  // [B,nh,T,S]
  if (cfg.attn_softcap > 0) scores = torch::tanh(scores / cfg.attn_softcap) * cfg.attn_softcap;
  if (T > 1 || window > 0)
    scores = scores.masked_fill(attention_mask(T, S, start_pos, window, q.options()).logical_not(),
                                -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1, torch::kFloat).to(q.scalar_type()), v);
}

at::Tensor attention(const llama_config& cfg, const at::Tensor& q /*[B,nh,T,hd]*/, const at::Tensor& k /*[B,nh,S,hd]*/,
                     const at::Tensor& v /*[B,nh,S,hd]*/, int64_t start_pos, int64_t window) {
  const int64_t T = q.size(2), S = k.size(2);
  if (window >= S) window = 0;  // every key is inside the window
  if (!cfg.eager_attention()) {  // LibTorch >= 2 (a TORCH_VERSION test needs <torch/version.h>: it read 0 without)
    const double scale = cfg.attention_scale();
    if (window == 0 && ((start_pos == 0 && T == S) || T == 1))
      return at::scaled_dot_product_attention(q, k, v, {}, 0.0, T > 1, scale);
    return at::scaled_dot_product_attention(q, k, v, attention_mask(T, S, start_pos, window, q.options()), 0.0, false, scale);
  }
  return eager_attention(cfg, q, k, v, start_pos, window);
}

at::Tensor activation(const llama_config& cfg, const at::Tensor& x) {
  return cfg.gelu_tanh ? torch::gelu(x, "tanh") : torch::silu(x);
}

}  // namespace

uint64_t dropout_key(uint64_t seed, int64_t step, int64_t micro_batch) {
  return mix64(mix64(mix64(seed) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(micro_batch));
}

at::Tensor embed_with(const llama_config& cfg, const at::Tensor& embed, const at::Tensor& tokens) {
  auto x = at::embedding(embed, tokens);  // [B,T,D] (F::embedding without options)
  if (!cfg.scale_embeddings) return x;
  // transformers: the scale as a tensor cast to the weight dtype
  return x * torch::tensor(std::sqrt(static_cast<double>(cfg.hidden_size)), torch::kFloat).to(x.device(), x.scalar_type());
}

at::Tensor embed_tokens(const llama_weights& w, const at::Tensor& tokens) { return embed_with(w.cfg, w.embed, tokens); }

at::Tensor decoder_layer(const layer_context& ctx, int64_t layer, const layer_weights& lw, const at::Tensor& x,
                         int64_t start_pos, kv_cache* cache) {
  const auto& cfg = ctx.cfg;
  const auto* lp = ctx.lora != nullptr ? &ctx.lora->layers[layer] : nullptr;
  const double scale = ctx.lora != nullptr ? ctx.lora->cfg.scale() : 0.0;
  const double drop = ctx.lora != nullptr ? ctx.lora->cfg.dropout : 0.0;
  const bool training = ctx.training;
  const int64_t B = x.size(0), T = x.size(1), hd = cfg.head_dim;
  const int64_t nq = cfg.num_heads * hd, nkv = cfg.num_kv_heads * hd;
  const uint64_t layer_seed = mix64(ctx.dropout_seed ^ static_cast<uint64_t>(layer));
  auto proj = [&](lora_target t, const at::Tensor& in) { return project(lw, lp, scale, drop, training, layer_seed, t, in); };
  using s = layer_slot;

  auto h = rms_norm(cfg, x, lw[s::input_norm]);  // [B,T,D]
  at::Tensor q, k, v;                            // [B,T,nq] / [B,T,nkv]
  if (cfg.fused_proj) {
    auto qkv = proj(lora_target::qkv, h);  // [B,T,nq+2nkv]
    q = qkv.slice(-1, 0, nq), k = qkv.slice(-1, nq, nq + nkv), v = qkv.slice(-1, nq + nkv);
  } else {
    q = proj(lora_target::q, h), k = proj(lora_target::k, h), v = proj(lora_target::v, h);
  }
  q = q.reshape({B, T, cfg.num_heads, hd});     // [B,T,nh,hd]
  k = k.reshape({B, T, cfg.num_kv_heads, hd});  // [B,T,nkv,hd]
  if (cfg.qk_norm) {
    q = rms_norm(cfg, q, lw[s::q_norm]);
    k = rms_norm(cfg, k, lw[s::k_norm]);
  }
  q = q.transpose(1, 2);                                               // [B,nh,T,hd]
  k = k.transpose(1, 2);                                               // [B,nkv,T,hd]
  v = v.reshape({B, T, cfg.num_kv_heads, hd}).transpose(1, 2);         // [B,nkv,T,hd]
  auto [cos_f, sin_f] = rope_for(cfg, ctx.rope, layer, start_pos, T);  // f32 [T,hd]
  auto cos = cos_f.to(x.device(), x.scalar_type()), sin = sin_f.to(x.device(), x.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (cache != nullptr) {
    if (static_cast<int64_t>(cache->k.size()) <= layer) {
      cache->k.resize(layer + 1);
      cache->v.resize(layer + 1);
    }
    const int64_t cached = cache->k[layer].defined() ? cache->k[layer].size(2) : 0;
    if (cached != start_pos)  // the mask assumes keys 0 .. start_pos+T-1
      throw std::invalid_argument(fmt::format("KV cache of layer {} holds {} positions, the input starts at {}", layer, cached, start_pos));
    if (cache->k[layer].defined()) {
      k = torch::cat({cache->k[layer], k}, 2);
      v = torch::cat({cache->v[layer], v}, 2);
    }
    cache->k[layer] = k;
    cache->v[layer] = v;
  }
  if (cfg.num_kv_heads != cfg.num_heads) {  // GQA: kv head i serves query heads i*g .. i*g+g-1
    k = k.repeat_interleave(cfg.kv_groups(), 1);
    v = v.repeat_interleave(cfg.kv_groups(), 1);
  }
  const int64_t window = cfg.is_sliding(layer) ? cfg.sliding_window : 0;
  auto att = attention(cfg, q, k, v, start_pos, window);          // [B,nh,T,hd]
  att = att.transpose(1, 2).reshape({B, T, nq});                  // [B,T,nh*hd]
  auto o = proj(lora_target::o, att);                             // [B,T,D]
  at::Tensor x1, h2;
  if (cfg.sandwich_norm) {
    x1 = x + rms_norm(cfg, o, lw[s::post_attention_norm]);
    h2 = rms_norm(cfg, x1, lw[s::pre_ffn_norm]);
  } else {
    x1 = x + o;
    h2 = rms_norm(cfg, x1, lw[s::post_attention_norm]);
  }
  at::Tensor mlp;  // [B,T,D]
  if (cfg.fused_proj) {
    auto gu = proj(lora_target::gate_up, h2);  // [B,T,2I]
    const int64_t I = cfg.intermediate_size;
    mlp = proj(lora_target::down, gu.slice(-1, I) * activation(cfg, gu.slice(-1, 0, I)));
  } else {
    mlp = proj(lora_target::down, activation(cfg, proj(lora_target::gate, h2)) * proj(lora_target::up, h2));
  }
  if (cfg.sandwich_norm) mlp = rms_norm(cfg, mlp, lw[s::post_ffn_norm]);
  return x1 + mlp;
}

at::Tensor decoder_layer(const llama_weights& w, int64_t layer, const lora_adapters* lora, const at::Tensor& x,
                         int64_t start_pos, kv_cache* cache, bool training, uint64_t dropout_seed) {
  return decoder_layer(layer_context{w.cfg, w.rope, lora, training, dropout_seed}, layer, w.layers[layer], x, start_pos, cache);
}

at::Tensor head_logits(const llama_config& cfg, const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& x) {
  auto logits = torch::linear(rms_norm(cfg, x, final_norm), lm_head);  // [B,T,V]
  if (cfg.final_softcap > 0) logits = torch::tanh(logits / cfg.final_softcap) * cfg.final_softcap;
  return logits;
}

at::Tensor lm_logits(const llama_weights& w, const at::Tensor& x) { return head_logits(w.cfg, w.final_norm, w.lm_head, x); }

at::Tensor forward(const llama_weights& w, const lora_adapters* lora, const at::Tensor& tokens, int64_t start_pos,
                   kv_cache* cache, bool training, uint64_t dropout_seed) {
  auto x = embed_tokens(w, tokens);
  for (int64_t l = 0; l < w.cfg.num_layers; ++l) x = decoder_layer(w, l, lora, x, start_pos, cache, training, dropout_seed);
  if (cache != nullptr) cache->length = start_pos + tokens.size(1);
  return lm_logits(w, x);
}

at::Tensor forward_hidden(const llama_weights& w, const lora_adapters* lora, const at::Tensor& tokens, bool training,
                          uint64_t dropout_seed) {
  auto x = embed_tokens(w, tokens);
  for (int64_t l = 0; l < w.cfg.num_layers; ++l) x = decoder_layer(w, l, lora, x, 0, nullptr, training, dropout_seed);
  return x;  // [B,T,D]
}

namespace {

// Cross-entropy summed over rows h [N,D] (final-normed) against targets y i64 [N], chunk by chunk
// over the rows; the backward recomputes each chunk's logits. The head is frozen: no gradient for it.
struct chunked_head_ce : torch::autograd::Function<chunked_head_ce> {
  // logits of rows [s, e): soft-capped in the compute dtype as head_logits does, then f32 [e-s, V]
  static at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& w, double cap, int64_t s, int64_t e, at::Tensor* capped) {
    auto l = torch::linear(h.slice(0, s, e), w);  // [c,V] compute dtype
    if (cap > 0) l = torch::tanh(l / cap) * cap;
    if (capped != nullptr) *capped = l;
    return l.to(torch::kFloat);
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w, const at::Tensor& y,
                            double cap, int64_t rows) {
    const int64_t N = h.size(0);
    auto lse = torch::empty({N}, h.options().dtype(torch::kFloat));  // f32 [N]
    auto total = torch::zeros({}, h.options().dtype(torch::kFloat));
    for (int64_t s = 0; s < N; s += rows) {
      const int64_t e = std::min(N, s + rows);
      auto l = chunk_logits(h, w, cap, s, e, nullptr);  // f32 [c,V]
      auto z = torch::logsumexp(l, -1);                  // f32 [c]
      lse.slice(0, s, e).copy_(z);
      total += (z - l.gather(1, y.slice(0, s, e).unsqueeze(1)).squeeze(1)).sum();
    }
    ctx->save_for_backward({h, w, y, lse});
    ctx->saved_data["cap"] = cap;
    ctx->saved_data["rows"] = rows;
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &h = saved[0], &w = saved[1], &y = saved[2], &lse = saved[3];
    const double cap = ctx->saved_data["cap"].toDouble();
    const int64_t rows = ctx->saved_data["rows"].toInt(), N = h.size(0);
    const auto g = grads[0].to(torch::kFloat);  // f32 []
    auto gh = torch::empty_like(h);              // [N,D]
    for (int64_t s = 0; s < N; s += rows) {
      const int64_t e = std::min(N, s + rows);
      at::Tensor capped;
      auto l = chunk_logits(h, w, cap, s, e, &capped);                      // f32 [c,V]
      auto p = torch::exp(l - lse.slice(0, s, e).unsqueeze(1));             // softmax, f32 [c,V]
      p.scatter_add_(1, y.slice(0, s, e).unsqueeze(1), torch::full({e - s, 1}, -1.0, p.options()));
      auto dl = (p * g).to(h.scalar_type());                                // d loss / d capped logits [c,V]
      if (cap > 0) dl = dl * (1 - (capped / cap).pow(2));                   // tanh'
      gh.slice(0, s, e).copy_(torch::matmul(dl, w));                        // [c,D]
    }
    return {gh, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor head_loss_sum(const llama_config& cfg, const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& x,
                         const at::Tensor& labels, int64_t chunk_bytes) {
  const int64_t D = x.size(-1);
  auto flat = labels.reshape({-1});                                       // i64 [B*T]
  auto idx = flat.ne(-100).nonzero().squeeze(1);                          // i64 [N]
  if (idx.numel() == 0) return (x.sum() * 0).to(torch::kFloat);           // keeps the graph, value 0
  auto h = rms_norm(cfg, x.reshape({-1, D}).index_select(0, idx), final_norm);  // [N,D]
  const int64_t rows = head_chunk_rows(cfg, chunk_bytes);
  return chunked_head_ce::apply(h, lm_head, flat.index_select(0, idx), cfg.final_softcap, rows);  // f32 []
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(torch::kFloat), labels.reshape({-1}), {}, at::Reduction::Mean,
                                /*ignore_index=*/-100);
}

at::Tensor causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(torch::kFloat), labels.reshape({-1}), {}, at::Reduction::Sum,
                                /*ignore_index=*/-100);
}

}  // namespace lorapipe
