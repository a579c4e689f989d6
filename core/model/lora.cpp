// LoRA adapters: see lora.h.
#include "core/model/lora.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <stdexcept>
#include <set>

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
std::string peft_name(int64_t layer, int t, char ab) {
  return fmt::format("base_model.model.model.layers.{}.{}.lora_{}.weight", layer,
                     lora_target_module(static_cast<lora_target>(t)), ab);
}
}  // namespace

std::vector<at::Tensor> lora_adapters::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& l : layers)
    for (const auto& p : l)
      if (p.a.defined()) {
        out.push_back(p.a);
        out.push_back(p.b);
      }
  return out;
}

std::vector<std::string> lora_adapters::parameter_names() const {
  std::vector<std::string> out;
  for (size_t l = 0; l < layers.size(); ++l)
    for (int t = 0; t < num_lora_targets; ++t)
      if (layers[l][t].a.defined()) {
        out.push_back(peft_name(static_cast<int64_t>(l), t, 'A'));
        out.push_back(peft_name(static_cast<int64_t>(l), t, 'B'));
      }
  return out;
}

int64_t lora_adapters::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

lora_adapters init_lora(const llama_weights& w, const lora_config& cfg, uint64_t seed) {
  lora_adapters a;
  a.cfg = cfg;
  a.base_model = w.source;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  a.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (auto t : cfg.targets) {
      const int i = static_cast<int>(t);
      const auto& W = w.layers[l].proj(t);  // [out, in]
      if (!W.defined())
        throw std::invalid_argument(fmt::format("LoRA target {} is not a module of model_type '{}'", lora_target_name(t), w.cfg.model_type));
      const int64_t out = W.size(0), in = W.size(1);
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));  // kaiming_uniform(a=sqrt(5))
      auto A = torch::empty({cfg.r, in}, torch::kFloat);
      A.uniform_(-bound, bound, gen);
      a.layers[l][i].a = A.set_requires_grad(true);
      a.layers[l][i].b = torch::zeros({out, cfg.r}, torch::kFloat).set_requires_grad(true);
    }
  return a;
}

status check_lora_targets(const llama_config& c, const std::vector<lora_target>& targets) {
  const auto have = model_targets(c);
  for (auto t : targets)
    if (std::find(have.begin(), have.end(), t) == have.end()) {
      std::vector<std::string> names;
      for (auto h : have) names.push_back(lora_target_name(h));
      return make_error("lora.targets: '{}' is not a module of model_type '{}' (its modules: {})", lora_target_name(t),
                        c.model_type, fmt::join(names, ", "));
    }
  return ok_status();
}

status save_peft_adapter(const lora_adapters& a, const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return make_error("{}: cannot create folder: {}", dir.string(), ec.message());
  std::vector<std::string> modules;
  for (auto t : a.cfg.targets) modules.push_back(lora_target_name(t));
  json cfg = {{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"r", a.cfg.r},
              {"lora_alpha", a.cfg.alpha},
              {"lora_dropout", a.cfg.dropout},
              {"target_modules", modules},
              {"base_model_name_or_path", a.base_model},
              {"bias", "none"},
              {"fan_in_fan_out", false},
              {"inference_mode", true},
              {"init_lora_weights", true},
              {"use_rslora", false},
              {"use_dora", false},
              {"modules_to_save", nullptr},
              {"revision", nullptr}};
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  auto names = a.parameter_names();
  auto params = a.parameters();
  for (size_t i = 0; i < params.size(); ++i) tensors.emplace_back(names[i], params[i].detach().to(torch::kFloat));
  LP_TRY(write_tensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}}));
  return write_file_atomic(dir / "adapter_config.json", cfg.dump(2) + "\n");
}

result<lora_adapters> load_peft_adapter(const fs::path& dir, const llama_weights& w) {
  const auto cfg_path = dir / "adapter_config.json";
  LP_TRY_ASSIGN(text, read_text_file(cfg_path));
  json j = parse_json_or_discarded(text);
  const auto label = cfg_path.string();
  if (j.is_discarded() || !j.is_object()) return make_error("{}: not a JSON object", label);
  // PEFT writes null for unset options: read keys only when they hold the expected type.
  auto text_of = [&](const char* k) { return j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : std::string(); };
  auto flag = [&](const char* k) { return j.contains(k) && j[k].is_boolean() && j[k].get<bool>(); };
  if (text_of("peft_type") != "LORA") return make_error("{}: peft_type must be LORA", label);
  lora_adapters a;
  a.base_model = text_of("base_model_name_or_path");
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() <= 0)
    return make_error("{}: 'r' must be a positive integer", label);
  a.cfg.r = j["r"].get<int64_t>();
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number()) return make_error("{}: 'lora_alpha' must be a number", label);
  a.cfg.alpha = j["lora_alpha"].get<double>();
  if (j.contains("lora_dropout") && j["lora_dropout"].is_number()) a.cfg.dropout = j["lora_dropout"].get<double>();
  if (flag("use_rslora") || flag("use_dora"))
    return make_error("{}: rsLoRA and DoRA adapters are not supported", label);
  // Settings that would change what the adapter computes and are not implemented.
  for (const char* k : {"rank_pattern", "alpha_pattern"})
    if (j.contains(k) && !j[k].is_null() && !j[k].empty()) return make_error("{}: '{}' is not supported", label, k);
  for (const char* k : {"layers_to_transform", "modules_to_save", "trainable_token_indices", "target_parameters"})
    if (j.contains(k) && !j[k].is_null()) return make_error("{}: '{}' is not supported", label, k);
  if (flag("fan_in_fan_out")) return make_error("{}: 'fan_in_fan_out' is not supported", label);
  if (j.contains("bias") && j["bias"].is_string() && j["bias"] != "none") return make_error("{}: 'bias' must be none", label);
  if (flag("lora_bias")) return make_error("{}: 'lora_bias' is not supported", label);
  a.cfg.targets.clear();
  if (!j.contains("target_modules") || !j["target_modules"].is_array())
    return make_error("{}: 'target_modules' must be a list", label);
  for (const auto& m : j["target_modules"]) {
    auto t = m.is_string() ? lora_target_from_name(m.get<std::string>()) : std::nullopt;
    if (!t) return make_error("{}: unsupported target module {}", label, m.dump());
    a.cfg.targets.push_back(*t);
  }
  LP_TRY(check_lora_targets(w.cfg, a.cfg.targets));
  LP_TRY_ASSIGN(st, safetensors_file::open(dir / "adapter_model.safetensors"));
  a.layers.resize(w.layers.size());
  std::set<std::string> used;
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (auto t : a.cfg.targets) {
      const int i = static_cast<int>(t);
      const int64_t out = w.layers[l].proj(t).size(0), in = w.layers[l].proj(t).size(1);
      for (char ab : {'A', 'B'}) {
        auto name = peft_name(static_cast<int64_t>(l), i, ab);
        const auto* info = st.find(name);
        if (info == nullptr) return make_error("{}: missing tensor '{}'", st.label(), name);
        std::vector<int64_t> want = ab == 'A' ? std::vector<int64_t>{a.cfg.r, in} : std::vector<int64_t>{out, a.cfg.r};
        if (info->shape != want)
          return make_error("{}: tensor '{}' has shape [{}], expected [{}] for this model", st.label(), name,
                            fmt::join(info->shape, ","), fmt::join(want, ","));
        LP_TRY_ASSIGN(tensor, read_tensor(st, *info, torch::kFloat));
        (ab == 'A' ? a.layers[l][i].a : a.layers[l][i].b) = tensor.set_requires_grad(true);
        used.insert(name);
      }
    }
  for (const auto& t : st.tensors())
    if (!used.count(t.name)) return make_error("{}: unexpected tensor '{}' (wrong model?)", st.label(), t.name);
  return a;
}

namespace {

// The frozen tensors of `w`, those this process did not read (meta: a pipeline rank's selection)
// read from w.source one layer (or the embedding, or the head) at a time, the last part kept.
class frozen_tensors {
 public:
  explicit frozen_tensors(const llama_weights& w) : w_(w) {}
  result<at::Tensor> embed() { return pick(w_.embed, [](const llama_weights& p) { return p.embed; }, -1, true, false); }
  result<at::Tensor> lm_head() { return pick(w_.lm_head, [](const llama_weights& p) { return p.lm_head; }, -2, false, true); }
  result<at::Tensor> layer(size_t l, layer_slot slot) {
    return pick(w_.layers[l][slot], [=](const llama_weights& p) { return p.layers[l][slot]; }, static_cast<int64_t>(l), false, false);
  }

 private:
  // `part`: the layer, or -1 for the embedding, -2 for the head.
  template <class Get>
  result<at::Tensor> pick(const at::Tensor& have, Get get, int64_t part, bool embed, bool head) {
    if (!have.defined() || !have.is_meta()) return have;
    if (part_ != part || !read_) {
      read_.reset();  // the previous part first: at most one part in memory
      load_options lo{w_.dtype};
      lo.select = [&](const llama_config& mc) -> result<weight_selection> {
        weight_selection sel{std::vector<bool>(static_cast<size_t>(mc.num_layers), false), embed, head};
        if (part >= 0) sel.layers.at(static_cast<size_t>(part)) = true;
        return sel;
      };
      auto r = load_llama(w_.source, lo);
      if (!r) return make_error("merged export: reading the weights this process did not load from {}: {}", w_.source, r.message());
      read_ = std::move(r).value();
      part_ = part;
    }
    return get(*read_);
  }
  const llama_weights& w_;
  std::optional<llama_weights> read_;
  int64_t part_ = -3;
};

}  // namespace

status export_merged(const llama_weights& w, const lora_adapters& a, const fs::path& dir,
                     const fs::path& tokenizer_source) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return make_error("{}: cannot create folder: {}", dir.string(), ec.message());
  torch::NoGradGuard no_grad;
  const double scale = a.cfg.scale();
  // What is written, in order: (name, a tensor of its shape and dtype, how to make it).
  std::vector<std::pair<std::string, at::Tensor>> like;
  std::vector<std::function<result<at::Tensor>()>> make;
  frozen_tensors frozen(w);
  like.emplace_back("model.embed_tokens.weight", w.embed);
  make.emplace_back([&] { return frozen.embed(); });
  const auto specs = layer_tensor_specs(w.cfg);
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (const auto& spec : specs) {
      like.emplace_back(fmt::format("model.layers.{}.{}", l, spec.name), w.layers[l][spec.slot]);
      make.emplace_back([&, l, slot = spec.slot]() -> result<at::Tensor> {
        LP_TRY_ASSIGN(W, frozen.layer(l, slot));
        const int s = static_cast<int>(slot) - static_cast<int>(layer_slot::q);
        if (s < 0 || s >= num_lora_targets || l >= a.layers.size() || !a.layers[l][s].a.defined()) return W;
        auto delta = torch::matmul(a.layers[l][s].b, a.layers[l][s].a) * scale;  // f32 [out,in]
        return (W.to(torch::kFloat) + delta).to(W.scalar_type());
      });
    }
  like.emplace_back("model.norm.weight", w.final_norm);
  make.emplace_back([&]() -> result<at::Tensor> { return w.final_norm; });
  if (!w.cfg.tie_word_embeddings) {
    like.emplace_back("lm_head.weight", w.lm_head);
    make.emplace_back([&] { return frozen.lm_head(); });
  }
  LP_TRY(write_tensors_streamed(dir / "model.safetensors", like, {{"format", "pt"}}, [&](size_t i) { return make[i](); }));
  auto cfg = w.cfg;
  cfg.torch_dtype = dtype_hf_name(w.dtype);
  LP_TRY(write_file_atomic(dir / "config.json", llama_config_to_hf_json(cfg).dump(2) + "\n"));
  // Carry the tokenizer files along so the merged folder is self-contained.
  fs::path src = fs::is_directory(tokenizer_source, ec) ? tokenizer_source : tokenizer_source.parent_path();
  for (const char* name : {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    if (fs::exists(src / name, ec)) fs::copy_file(src / name, dir / name, fs::copy_options::overwrite_existing, ec);
  }
  if (fs::is_regular_file(tokenizer_source, ec) && tokenizer_source.extension() == ".model")
    fs::copy_file(tokenizer_source, dir / "tokenizer.model", fs::copy_options::overwrite_existing, ec);
  return ok_status();
}

}  // namespace lorapipe
