// Loading Llama weights: HF folders (single or sharded safetensors) and llama2.c .bin checkpoints.
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/base/json_parse.h"
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/base/safetensors.h"
#include "core/model/tensor_io.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// transformers' default inverse frequencies (f32): 1 / theta^(2i/hd).
at::Tensor default_inv_freq(double theta, int64_t hd) {
  auto idx = torch::arange(0, hd, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(hd);  // f32 [hd/2]
  return 1.0 / torch::pow(torch::tensor(theta, torch::kDouble).to(torch::kFloat), idx);
}

double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// Inverse frequencies f32 [hd/2] and the cos/sin factor of a RoPE variant (modeling_rope_utils.py).
std::pair<at::Tensor, double> rope_inv_freq(const llama_config& cfg, const rope_config& r) {
  const int64_t hd = cfg.head_dim;
  auto inv = default_inv_freq(r.theta, hd);
  if (r.type == "linear") return {inv / r.factor, 1.0};
  if (r.type == "llama3") {
    const double old_len = static_cast<double>(r.original_max_position_embeddings);
    const double low_wl = old_len / r.low_freq_factor, high_wl = old_len / r.high_freq_factor;
    auto wavelen = 2 * M_PI / inv;
    auto llama = torch::where(wavelen > low_wl, inv / r.factor, inv);
    auto smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    auto smoothed = (1 - smooth) * llama / r.factor + smooth * llama;
    auto medium = torch::logical_and((wavelen < high_wl).logical_not(), (wavelen > low_wl).logical_not());
    return {torch::where(medium, smoothed, llama), 1.0};
  }
  if (r.type == "yarn") {
    const double dim = static_cast<double>(hd), base = r.theta;
    double att = r.attention_factor;
    if (att <= 0)
      att = (r.mscale > 0 && r.mscale_all_dim > 0) ? yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
                                                   : yarn_mscale(r.factor, 1.0);
    auto pos_freqs = torch::pow(torch::tensor(base, torch::kDouble).to(torch::kFloat),
                                torch::arange(0, hd, 2, torch::kLong).to(torch::kFloat) / dim);  // f32 [hd/2]
    auto extrap = 1.0 / pos_freqs, interp = 1.0 / (r.factor * pos_freqs);
    auto corr = [&](double rot) {
      return dim * std::log(static_cast<double>(r.original_max_position_embeddings) / (rot * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = corr(r.beta_fast), high = corr(r.beta_slow);
    if (r.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0), high = std::min(high, dim - 1);
    if (low == high) high += 0.001;
    auto ramp = torch::clamp((torch::arange(hd / 2, torch::kFloat) - low) / (high - low), 0, 1);
    auto ef = 1 - ramp;
    return {interp * (1 - ef) + extrap * ef, att};
  }
  return {inv, 1.0};  // default; dynamic equals it up to max_position_embeddings
}

// Dynamic NTK scaling for a sequence of `seq_len` positions, in f32 as transformers computes it at run time.
at::Tensor dynamic_inv_freq(const llama_config& cfg, const rope_config& r, int64_t seq_len) {
  const int64_t hd = cfg.head_dim;
  const double dim = static_cast<double>(hd);
  auto s = torch::tensor(std::max(seq_len, cfg.max_position_embeddings), torch::kLong);
  auto base = r.theta * torch::pow(r.factor * s / static_cast<double>(cfg.max_position_embeddings) - (r.factor - 1), dim / (dim - 2));
  return 1.0 / torch::pow(base, torch::arange(0, hd, 2, torch::kLong).to(torch::kFloat) / dim);  // f32 [hd/2]
}

// cos/sin f32 [T, hd] for positions start .. start+T-1.
std::pair<at::Tensor, at::Tensor> cos_sin(const at::Tensor& inv_freq, int64_t start, int64_t T, double factor) {
  auto t = torch::arange(start, start + T, torch::kLong).to(torch::kFloat);  // f32 [T]
  auto freqs = torch::outer(t, inv_freq.to(torch::kCPU));                     // f32 [T, hd/2]
  auto emb = torch::cat({freqs, freqs}, -1);                                  // f32 [T, hd]
  if (factor == 1.0) return {emb.cos(), emb.sin()};
  return {emb.cos() * factor, emb.sin() * factor};
}

// Positions tabulated up front; longer sequences compute theirs from inv_freq (a 128k-context model
// with head_dim 256 would otherwise hold 256 MiB of tables on every device).
constexpr int64_t tabulated_positions = 8192;

rope_table make_table(const llama_config& cfg, const rope_config& r) {
  auto [inv, factor] = rope_inv_freq(cfg, r);
  auto [cos, sin] = cos_sin(inv, 0, std::min(cfg.max_position_embeddings, tabulated_positions), factor);
  return {cos, sin, inv, factor};
}

bool same_rope(const rope_config& a, const rope_config& b) {
  return a.type == b.type && a.theta == b.theta && a.factor == b.factor && a.low_freq_factor == b.low_freq_factor &&
         a.high_freq_factor == b.high_freq_factor && a.original_max_position_embeddings == b.original_max_position_embeddings &&
         a.attention_factor == b.attention_factor && a.beta_fast == b.beta_fast && a.beta_slow == b.beta_slow &&
         a.mscale == b.mscale && a.mscale_all_dim == b.mscale_all_dim && a.truncate == b.truncate;
}

}  // namespace

rope_tables make_rope_tables(const llama_config& cfg) {
  rope_tables t;
  t.full = make_table(cfg, cfg.rope);
  bool any_sliding = false;
  for (int64_t l = 0; l < cfg.num_layers; ++l) any_sliding = any_sliding || cfg.is_sliding(l);
  if (any_sliding && !same_rope(cfg.rope, cfg.rope_local)) t.local = make_table(cfg, cfg.rope_local);
  return t;
}

rope_tables rope_tables::to(c10::Device d) const {
  auto move = [&](const rope_table& r) {
    return r.cos.defined() ? rope_table{r.cos.to(d), r.sin.to(d), r.inv_freq, r.attention_factor} : rope_table{};
  };
  return {move(full), move(local)};
}

std::pair<at::Tensor, at::Tensor> rope_for(const llama_config& cfg, const rope_tables& rope, int64_t layer, int64_t start_pos,
                                           int64_t T) {
  const bool local = cfg.is_sliding(layer) && rope.local.cos.defined();
  const rope_table& tab = local ? rope.local : rope.full;
  const rope_config& rc = local ? cfg.rope_local : cfg.rope;
  const int64_t end = start_pos + T;
  if (rc.type == "dynamic" && end > cfg.max_position_embeddings) return cos_sin(dynamic_inv_freq(cfg, rc, end), start_pos, T, 1.0);
  if (end > tab.cos.size(0)) return cos_sin(tab.inv_freq, start_pos, T, tab.attention_factor);
  return {tab.cos.slice(0, start_pos, end), tab.sin.slice(0, start_pos, end)};
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

// A tensor of this shape and dtype that was not read (weight_selection).
at::Tensor not_loaded(at::IntArrayRef shape, at::ScalarType dt) { return at::empty(shape, at::TensorOptions().dtype(dt).device(at::kMeta)); }

result<weight_selection> selection_of(const load_options& opt, const llama_config& cfg) {
  if (!opt.select) return weight_selection{};
  LP_TRY_ASSIGN(sel, opt.select(cfg));
  if (!sel.layers.empty() && static_cast<int64_t>(sel.layers.size()) != cfg.num_layers)
    return make_error("weight selection names {} layers, the model has {}", sel.layers.size(), cfg.num_layers);
  if (cfg.tie_word_embeddings && sel.head) sel.embed = true;  // the head is the embedding
  return sel;
}

void finish(llama_weights& w) {
  for (auto* t : {&w.embed, &w.final_norm, &w.lm_head}) t->set_requires_grad(false);
  for (auto& l : w.layers)
    for (auto& t : l.t)
      if (t.defined()) t.set_requires_grad(false);
  w.rope = make_rope_tables(w.cfg);
}

result<llama_weights> load_hf(const fs::path& dir, const load_options& opt) {
  LP_TRY_ASSIGN(cfg, load_llama_config(dir / "config.json"));
  LP_TRY_ASSIGN(shards, open_shards(dir));
  llama_weights w;
  w.cfg = cfg;
  w.dtype = opt.dtype;
  w.source = dir.string();
  const int64_t D = cfg.hidden_size, V = cfg.vocab_size;
  std::set<std::string> used;
  LP_TRY_ASSIGN(sel, selection_of(opt, cfg));
  auto take_named = [&](const std::string& name, std::vector<int64_t> shape, bool read = true) -> result<at::Tensor> {
    used.insert(name);
    if (read) return take(shards, name, std::move(shape), opt.dtype, dir);
    auto it = shards.index.find(name);  // not read, but the checkpoint must still have it as config.json says
    if (it == shards.index.end()) return make_error("{}: missing tensor '{}'", dir.string(), name);
    if (it->second.second->shape != shape)
      return make_error("{}: tensor '{}' has shape [{}], config.json implies [{}]", it->second.first->label(), name,
                        fmt::join(it->second.second->shape, ","), fmt::join(shape, ","));
    return not_loaded(shape, opt.dtype);
  };
  LP_TRY_ASSIGN(embed, take_named("model.embed_tokens.weight", {V, D}, sel.embed));
  w.embed = embed;
  const auto specs = layer_tensor_specs(cfg);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (opt.progress && !opt.progress(l, cfg.num_layers)) return make_error("cancelled");
    const std::string p = fmt::format("model.layers.{}.", l);
    layer_weights lw;
    for (const auto& spec : specs) {
      LP_TRY_ASSIGN(t, take_named(p + spec.name, spec.shape, sel.layer(l)));
      lw[spec.slot] = t;
    }
    w.layers.push_back(std::move(lw));
  }
  LP_TRY_ASSIGN(norm, take_named("model.norm.weight", {D}));
  w.final_norm = norm;
  if (cfg.tie_word_embeddings) {
    w.lm_head = w.embed;
    // A tied checkpoint may carry a copy of the embedding; transformers unties when it differs.
    if (shards.index.count("lm_head.weight")) {
      LP_TRY_ASSIGN(head, take_named("lm_head.weight", {V, D}, sel.embed));
      if (sel.embed && !torch::equal(head, w.embed))
        return make_error("{}: lm_head.weight differs from model.embed_tokens.weight although tie_word_embeddings is true",
                          dir.string());
    }
  } else {
    LP_TRY_ASSIGN(head, take_named("lm_head.weight", {V, D}, sel.head));
    w.lm_head = head;
  }
  // A tensor this architecture does not use means the config does not describe the checkpoint.
  for (const auto& [name, where] : shards.index)
    if (!used.count(name) && name.find("rotary_emb.inv_freq") == std::string::npos)
      return make_error("{}: tensor '{}' is not part of a '{}' model as config.json describes it", where.first->label(), name,
                        cfg.model_type);
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
    auto t = all.slice(0, pos, pos + k).view(shape);  // a view of the mapping: cvt copies what is kept
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
  LP_TRY_ASSIGN(sel, selection_of(opt, w.cfg));
  bool keep = true;
  auto cvt = [&](const at::Tensor& t) { return keep ? t.to(opt.dtype, false, /*copy=*/true).contiguous() : not_loaded(t.sizes(), opt.dtype); };
  keep = sel.embed;
  w.embed = cvt(tok);
  for (int64_t l = 0; l < L; ++l) {
    if (opt.progress && !opt.progress(l, L)) return make_error("cancelled");
    keep = sel.layer(l);
    layer_weights lw;
    lw[layer_slot::input_norm] = cvt(rms_att[l]);
    lw[layer_slot::post_attention_norm] = cvt(rms_ffn[l]);
    lw[layer_slot::q] = keep ? cvt(permute(wq[l], NH)) : cvt(wq[l]);  // not kept: the shape alone, which permuting keeps
    lw[layer_slot::k] = keep ? cvt(permute(wk[l], NKV)) : cvt(wk[l]);
    lw[layer_slot::v] = cvt(wv[l]);
    lw[layer_slot::o] = cvt(wo[l]);
    lw[layer_slot::gate] = cvt(w1[l]);
    lw[layer_slot::up] = cvt(w3[l]);
    lw[layer_slot::down] = cvt(w2[l]);
    w.layers.push_back(std::move(lw));
  }
  keep = true;
  w.final_norm = cvt(rms_final);
  keep = sel.head;
  w.lm_head = shared ? w.embed : cvt(cls);
  finish(w);
  return w;
}

}  // namespace

bool weights_complete(const llama_weights& w) {
  for (const auto* t : {&w.embed, &w.final_norm, &w.lm_head})
    if (t->defined() && t->is_meta()) return false;
  for (const auto& l : w.layers)
    for (const auto& t : l.t)
      if (t.defined() && t.is_meta()) return false;
  return true;
}

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
