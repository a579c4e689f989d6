// Loading Llama weights: HF folders (single or sharded safetensors) and llama2.c .bin checkpoints.
#include <cstring>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/base/json_parse.h"
#include <torch/torch.h>

#include "core/model/llama_model.h"
#include "core/base/safetensors.h"
#include "core/model/tensor_io.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

rope_tables make_rope_tables(const llama_config& cfg) {
  // Same arithmetic as HF LlamaRotaryEmbedding (f32): inv_freq = 1/theta^(2i/hd), emb = cat(freqs, freqs).
  auto idx = torch::arange(0, cfg.head_dim, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(cfg.head_dim);
  auto inv_freq = 1.0 / torch::pow(torch::tensor(cfg.rope_theta, torch::kDouble).to(torch::kFloat), idx);  // f32 [hd/2]
  auto t = torch::arange(cfg.max_position_embeddings, torch::kLong).to(torch::kFloat);                   // f32 [P]
  auto freqs = torch::outer(t, inv_freq);                                                                // f32 [P, hd/2]
  auto emb = torch::cat({freqs, freqs}, -1);                                                             // f32 [P, hd]
  return {emb.cos(), emb.sin()};
}

namespace {

// A name -> (file, tensor) lookup over one or more safetensors shards.
struct shard_set {
  std::vector<std::unique_ptr<safetensors_file>> files;
  std::map<std::string, std::pair<const safetensors_file*, const st_tensor_info*>> index;
};

result<shard_set> open_shards(const fs::path& dir) {
  shard_set s;
  std::vector<fs::path> paths;
  if (fs::exists(dir / "model.safetensors")) {
    paths.push_back(dir / "model.safetensors");
  } else if (fs::exists(dir / "model.safetensors.index.json")) {
    LP_TRY_ASSIGN(text, read_text_file(dir / "model.safetensors.index.json"));
    json j = parse_json_or_discarded(text);
    auto label = (dir / "model.safetensors.index.json").string();
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      return make_error("{}: expected a JSON object with a 'weight_map' object", label);
    std::map<std::string, int> seen;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) return make_error("{}: weight_map['{}'] must be a file name", label, it.key());
      auto file = it.value().get<std::string>();
      if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
        return make_error("{}: shard name '{}' must be a plain file name", label, file);
      if (!seen.count(file)) {
        seen[file] = 1;
        paths.push_back(dir / file);
      }
    }
  } else {
    return make_error("{}: no model.safetensors or model.safetensors.index.json", dir.string());
  }
  for (const auto& p : paths) {
    LP_TRY_ASSIGN(f, safetensors_file::open(p));
    s.files.push_back(std::make_unique<safetensors_file>(std::move(f)));
    for (const auto& t : s.files.back()->tensors()) {
      if (s.index.count(t.name)) return make_error("{}: tensor '{}' appears in two shards", p.string(), t.name);
      s.index[t.name] = {s.files.back().get(), &t};
    }
  }
  return s;
}

result<at::Tensor> take(const shard_set& s, const std::string& name, std::vector<int64_t> shape, at::ScalarType dt,
                        const fs::path& dir) {
  auto it = s.index.find(name);
  if (it == s.index.end()) return make_error("{}: missing tensor '{}'", dir.string(), name);
  const auto& [file, info] = it->second;
  if (info->shape != shape)
    return make_error("{}: tensor '{}' has shape [{}], config.json implies [{}]", file->label(), name,
                      fmt::join(info->shape, ","), fmt::join(shape, ","));
  switch (info->dtype) {
    case st_dtype::f32:
    case st_dtype::f16:
    case st_dtype::bf16:
      break;
    default:
      return make_error("{}: tensor '{}' has dtype {}, expected F32, F16 or BF16", file->label(), name,
                        st_dtype_name(info->dtype));
  }
  return read_tensor(*file, *info, dt);
}

void finish(llama_weights& w) {
  for (auto* t : {&w.embed, &w.final_norm, &w.lm_head}) t->set_requires_grad(false);
  for (auto& l : w.layers) {
    l.input_norm.set_requires_grad(false);
    l.post_norm.set_requires_grad(false);
    for (auto& p : l.proj) p.set_requires_grad(false);
  }
  w.rope = make_rope_tables(w.cfg);
}

result<llama_weights> load_hf(const fs::path& dir, const load_options& opt) {
  LP_TRY_ASSIGN(cfg, load_llama_config(dir / "config.json"));
  LP_TRY_ASSIGN(shards, open_shards(dir));
  llama_weights w;
  w.cfg = cfg;
  w.dtype = opt.dtype;
  w.source = dir.string();
  const int64_t D = cfg.hidden_size, H = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t q_out = cfg.num_heads * cfg.head_dim, kv_out = cfg.num_kv_heads * cfg.head_dim;
  LP_TRY_ASSIGN(embed, take(shards, "model.embed_tokens.weight", {V, D}, opt.dtype, dir));
  w.embed = embed;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (opt.progress && !opt.progress(l, cfg.num_layers)) return make_error("cancelled");
    const std::string p = fmt::format("model.layers.{}.", l);
    layer_weights lw;
    LP_TRY_ASSIGN(in_norm, take(shards, p + "input_layernorm.weight", {D}, opt.dtype, dir));
    LP_TRY_ASSIGN(post_norm, take(shards, p + "post_attention_layernorm.weight", {D}, opt.dtype, dir));
    lw.input_norm = in_norm;
    lw.post_norm = post_norm;
    const std::array<std::vector<int64_t>, num_lora_targets> shapes{
        std::vector<int64_t>{q_out, D}, {kv_out, D}, {kv_out, D}, {D, q_out}, {H, D}, {H, D}, {D, H}};
    for (int t = 0; t < num_lora_targets; ++t) {
      LP_TRY_ASSIGN(pw, take(shards, p + lora_target_module(static_cast<lora_target>(t)) + ".weight", shapes[t],
                             opt.dtype, dir));
      lw.proj[t] = pw;
    }
    w.layers.push_back(std::move(lw));
  }
  LP_TRY_ASSIGN(norm, take(shards, "model.norm.weight", {D}, opt.dtype, dir));
  w.final_norm = norm;
  if (cfg.tie_word_embeddings) {
    w.lm_head = w.embed;
  } else {
    LP_TRY_ASSIGN(head, take(shards, "lm_head.weight", {V, D}, opt.dtype, dir));
    w.lm_head = head;
  }
  finish(w);
  return w;
}

// llama2.c: legacy header (7 int32) or version-1 export ('ak42', 256-byte header); fp32 weights.
result<llama_weights> load_llama2c(const fs::path& path, const load_options& opt) {
  LP_TRY_ASSIGN(m, mapped_file::open(path));
  const auto label = path.string();
  const std::byte* d = m->data();
  const size_t n = m->size();
  auto i32 = [&](size_t off) {
    int32_t v;
    std::memcpy(&v, d + off, 4);
    return v;
  };
  if (n < 28) return make_error("{}: too small for a llama2.c checkpoint", label);
  int version = 0;
  size_t off = 28;
  int32_t h[7];
  bool shared;
  uint32_t magic;
  std::memcpy(&magic, d, 4);
  if (magic == 0x616b3432u) {
    if (n < 256) return make_error("{}: truncated llama2.c v1 header", label);
    version = i32(4);
    if (version != 1) return make_error("{}: llama2.c export version {} is not supported (0 or 1)", label, version);
    for (int i = 0; i < 7; ++i) h[i] = i32(8 + 4 * i);
    shared = static_cast<uint8_t>(d[36]) != 0;
    off = 256;
  } else {
    for (int i = 0; i < 7; ++i) h[i] = i32(4 * i);
    shared = h[5] > 0;
    h[5] = h[5] < 0 ? -h[5] : h[5];
  }
  const int64_t D = h[0], H = h[1], L = h[2], NH = h[3], V = h[5], S = h[6];
  int64_t NKV = h[4] > 0 ? h[4] : NH;
  if (D <= 0 || H <= 0 || L <= 0 || NH <= 0 || V <= 0 || S <= 0 || D > (1 << 16) || H > (1 << 18) || L > 1024 ||
      V > (1 << 22) || S > (1 << 22))
    return make_error("{}: implausible llama2.c header (dim {}, hidden {}, layers {}, heads {}, vocab {}, seq {})", label,
                      D, H, L, NH, V, S);
  if (D % NH != 0 || (D / NH) % 2 != 0 || NH % NKV != 0)
    return make_error("{}: dim {} cannot be split into {} heads of even size with {} kv heads", label, D, NH, NKV);
  const int64_t hd = D / NH, KV = NKV * hd;
  int64_t floats = V * D + L * D * 2 + L * D * D * 2 + L * KV * D * 2 + L * H * D * 3 + D + (shared ? 0 : V * D);
  if (version == 0) floats += S * hd;  // freq_cis real + imag tables (unused)
  if (off + static_cast<size_t>(floats) * 4 != n)
    return make_error("{}: size mismatch: header implies {} bytes, file has {}", label, off + floats * 4, n);

  auto all = torch::from_blob(const_cast<std::byte*>(d + off), {floats}, torch::kFloat);  // f32 view of the mmap
  int64_t pos = 0;
  auto next = [&](std::vector<int64_t> shape) {
    int64_t k = 1;
    for (auto s : shape) k *= s;
    auto t = all.slice(0, pos, pos + k).view(shape).clone();
    pos += k;
    return t;
  };
  at::Tensor tok, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, cls;
  if (version == 0) {
    tok = next({V, D});
    rms_att = next({L, D});
    wq = next({L, D, D});
    wk = next({L, KV, D});
    wv = next({L, KV, D});
    wo = next({L, D, D});
    rms_ffn = next({L, D});
    w1 = next({L, H, D});
    w2 = next({L, D, H});
    w3 = next({L, H, D});
    rms_final = next({D});
    pos += S * hd;
  } else {
    rms_att = next({L, D});
    rms_ffn = next({L, D});
    rms_final = next({D});
    tok = next({V, D});
    wq = next({L, D, D});
    wk = next({L, KV, D});
    wv = next({L, KV, D});
    wo = next({L, D, D});
    w1 = next({L, H, D});
    w2 = next({L, D, H});
    w3 = next({L, H, D});
  }
  if (!shared) cls = next({V, D});
  // Interleaved-pair RoPE rows -> rotate_half rows, per head (HF convert_llama_weights_to_hf permute()).
  auto permute = [](const at::Tensor& x, int64_t heads) {  // f32 [rows, cols]
    const int64_t rows = x.size(0), cols = x.size(1);
    return x.view({heads, rows / heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols});
  };
  llama_weights w;
  w.cfg.vocab_size = V;
  w.cfg.hidden_size = D;
  w.cfg.intermediate_size = H;
  w.cfg.num_layers = L;
  w.cfg.num_heads = NH;
  w.cfg.num_kv_heads = NKV;
  w.cfg.head_dim = hd;
  w.cfg.max_position_embeddings = S;
  w.cfg.tie_word_embeddings = shared;
  w.dtype = opt.dtype;
  w.source = label;
  auto cvt = [&](const at::Tensor& t) { return t.to(opt.dtype).contiguous(); };
  w.embed = cvt(tok);
  for (int64_t l = 0; l < L; ++l) {
    if (opt.progress && !opt.progress(l, L)) return make_error("cancelled");
    layer_weights lw;
    lw.input_norm = cvt(rms_att[l]);
    lw.post_norm = cvt(rms_ffn[l]);
    lw.proj[static_cast<int>(lora_target::q)] = cvt(permute(wq[l], NH));
    lw.proj[static_cast<int>(lora_target::k)] = cvt(permute(wk[l], NKV));
    lw.proj[static_cast<int>(lora_target::v)] = cvt(wv[l]);
    lw.proj[static_cast<int>(lora_target::o)] = cvt(wo[l]);
    lw.proj[static_cast<int>(lora_target::gate)] = cvt(w1[l]);
    lw.proj[static_cast<int>(lora_target::up)] = cvt(w3[l]);
    lw.proj[static_cast<int>(lora_target::down)] = cvt(w2[l]);
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = cvt(rms_final);
  w.lm_head = shared ? w.embed : cvt(cls);
  finish(w);
  return w;
}

}  // namespace

result<llama_weights> load_llama(const fs::path& path, const load_options& opt) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return make_error("{}: model path not found", path.string());
  if (opt.dtype != at::kFloat && opt.dtype != at::kBFloat16 && opt.dtype != at::kHalf)
    return make_error("compute dtype must be float32, bfloat16 or float16");
  if (fs::is_directory(path, ec)) return load_hf(path, opt);
  if (path.extension() == ".bin") return load_llama2c(path, opt);
  return make_error("{}: expected an HF model folder or a llama2.c .bin file", path.string());
}

}  // namespace lorapipe
