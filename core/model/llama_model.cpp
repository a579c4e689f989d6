// Llama forward pass: see llama_model.h.
#include "core/model/llama_model.h"

#include <torch/torch.h>

namespace lorapipe {
namespace F = torch::nn::functional;

namespace {

at::Tensor rms_norm(const at::Tensor& x /*[B,T,D]*/, const at::Tensor& weight /*[D]*/, double eps) {
  // HF LlamaRMSNorm: normalise in f32, cast back, then scale.
  auto xf = x.to(torch::kFloat);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
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

at::Tensor project(const layer_weights& lw, const std::array<lora_pair, num_lora_targets>* lora, double scale,
                   double dropout, bool training, uint64_t dropout_seed, lora_target t, const at::Tensor& x) {
  const int i = static_cast<int>(t);
  auto y = torch::linear(x, lw.proj[i]);
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

at::Tensor attention(const at::Tensor& q /*[B,nh,T,hd]*/, const at::Tensor& k /*[B,nh,S,hd]*/,
                     const at::Tensor& v /*[B,nh,S,hd]*/, int64_t start_pos) {
  const int64_t T = q.size(2), S = k.size(2);
  // Query i (absolute position start_pos+i) sees keys 0..start_pos+i.
  const bool plain_causal = (start_pos == 0 && T == S);
  const bool no_mask = (T == 1);
#if TORCH_VERSION_MAJOR >= 2
  if (plain_causal || no_mask) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, plain_causal);
  auto mask = torch::ones({T, S}, q.options().dtype(torch::kBool)).tril(start_pos);  // bool [T,S]
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false);
#else
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (!no_mask) {
    auto mask = torch::ones({T, S}, torch::kBool).tril(start_pos);
    scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  }
  return torch::matmul(torch::softmax(scores.to(torch::kFloat), -1).to(q.scalar_type()), v);
#endif
}

}  // namespace

uint64_t dropout_key(uint64_t seed, int64_t step, int64_t micro_batch) {
  return mix64(mix64(mix64(seed) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(micro_batch));
}

at::Tensor embed_tokens(const llama_weights& w, const at::Tensor& tokens) {
  return F::embedding(tokens, w.embed);  // [B,T,D]
}

at::Tensor decoder_layer(const layer_context& ctx, int64_t layer, const layer_weights& lw, const at::Tensor& x,
                         int64_t start_pos, kv_cache* cache) {
  const auto& cfg = ctx.cfg;
  const auto* lp = ctx.lora != nullptr ? &ctx.lora->layers[layer] : nullptr;
  const double scale = ctx.lora != nullptr ? ctx.lora->cfg.scale() : 0.0;
  const double drop = ctx.lora != nullptr ? ctx.lora->cfg.dropout : 0.0;
  const bool training = ctx.training;
  const int64_t B = x.size(0), T = x.size(1), hd = cfg.head_dim;
  const uint64_t layer_seed = mix64(ctx.dropout_seed ^ static_cast<uint64_t>(layer));
  auto proj = [&](lora_target t, const at::Tensor& in) { return project(lw, lp, scale, drop, training, layer_seed, t, in); };

  auto h = rms_norm(x, lw.input_norm, cfg.rms_norm_eps);                               // [B,T,D]
  auto q = proj(lora_target::q, h).view({B, T, cfg.num_heads, hd}).transpose(1, 2);     // [B,nh,T,hd]
  auto k = proj(lora_target::k, h).view({B, T, cfg.num_kv_heads, hd}).transpose(1, 2);  // [B,nkv,T,hd]
  auto v = proj(lora_target::v, h).view({B, T, cfg.num_kv_heads, hd}).transpose(1, 2);  // [B,nkv,T,hd]
  auto cos = ctx.rope.cos.slice(0, start_pos, start_pos + T).to(x.device(), x.scalar_type());  // [T,hd]
  auto sin = ctx.rope.sin.slice(0, start_pos, start_pos + T).to(x.device(), x.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (cache != nullptr) {
    if (static_cast<int64_t>(cache->k.size()) <= layer) {
      cache->k.resize(layer + 1);
      cache->v.resize(layer + 1);
    }
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
  auto att = attention(q, k, v, start_pos);                           // [B,nh,T,hd]
  att = att.transpose(1, 2).reshape({B, T, cfg.num_heads * hd});      // [B,T,nh*hd]
  auto x1 = x + proj(lora_target::o, att);                            // [B,T,D]
  auto h2 = rms_norm(x1, lw.post_norm, cfg.rms_norm_eps);
  auto mlp = proj(lora_target::down, torch::silu(proj(lora_target::gate, h2)) * proj(lora_target::up, h2));
  return x1 + mlp;
}

at::Tensor decoder_layer(const llama_weights& w, int64_t layer, const lora_adapters* lora, const at::Tensor& x,
                         int64_t start_pos, kv_cache* cache, bool training, uint64_t dropout_seed) {
  return decoder_layer(layer_context{w.cfg, w.rope, lora, training, dropout_seed}, layer, w.layers[layer], x, start_pos, cache);
}

at::Tensor head_logits(const llama_config& cfg, const at::Tensor& final_norm, const at::Tensor& lm_head, const at::Tensor& x) {
  return torch::linear(rms_norm(x, final_norm, cfg.rms_norm_eps), lm_head);  // [B,T,V]
}

at::Tensor lm_logits(const llama_weights& w, const at::Tensor& x) { return head_logits(w.cfg, w.final_norm, w.lm_head, x); }

at::Tensor forward(const llama_weights& w, const lora_adapters* lora, const at::Tensor& tokens, int64_t start_pos,
                   kv_cache* cache, bool training, uint64_t dropout_seed) {
  auto x = embed_tokens(w, tokens);
  for (int64_t l = 0; l < w.cfg.num_layers; ++l) x = decoder_layer(w, l, lora, x, start_pos, cache, training, dropout_seed);
  if (cache != nullptr) cache->length = start_pos + tokens.size(1);
  return lm_logits(w, x);
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return F::cross_entropy(logits.reshape({-1, V}).to(torch::kFloat), labels.reshape({-1}),
                          F::CrossEntropyFuncOptions().ignore_index(-100));
}

at::Tensor causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return F::cross_entropy(logits.reshape({-1, V}).to(torch::kFloat), labels.reshape({-1}),
                          F::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
}

}  // namespace lorapipe
