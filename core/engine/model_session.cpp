// Model sessions and model-level library calls: see model_session.h.
#include "core/engine/model_session.h"

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include <cstring>

#include <nlohmann/json.hpp>

#include "core/base/file_io.h"
#include "core/project/llama_config.h"
#include "core/model/generate.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/model/tensor_io.h"
#include "core/text/prompt.h"
#include "core/text/tokenizer.h"
#include "core/train/evaluate.h"
#include "core/train/guard.h"

namespace lorapipe {
namespace fs = std::filesystem;

struct model_session::state {
  model_request req;
  llama_weights weights;
  std::unique_ptr<tokenizer> tok;
  fs::path tok_path;
  std::optional<lora_adapters> lora;
};

model_session::model_session(std::unique_ptr<state> s) : s_(std::move(s)) {}
model_session::model_session(model_session&&) noexcept = default;
model_session& model_session::operator=(model_session&&) noexcept = default;
model_session::~model_session() = default;

result<model_session> model_session::open(const model_request& req) {
  return guarded([&]() -> result<model_session> {
    thread_count_scope threads(req.threads);
    auto s = std::make_unique<state>();
    s->req = req;
    LP_TRY_ASSIGN(dt, parse_dtype_name(req.dtype));
    LP_TRY_ASSIGN(w, load_llama(req.model, {dt}));
    s->weights = std::move(w);
    s->tok_path = req.tokenizer.empty() ? fs::path(req.model) : fs::path(req.tokenizer);
    LP_TRY_ASSIGN(tok, load_tokenizer(s->tok_path));
    s->tok = std::move(tok);
    model_session m(std::move(s));
    LP_TRY(m.set_adapter(req.adapter));
    return m;
  });
}

const llama_weights* model_session::weights_for(const project_config& cfg) const {
  std::error_code ec;
  const auto same = fs::equivalent(cfg.resolve(cfg.model.path), fs::path(s_->req.model), ec);
  return same && !ec && cfg.model.dtype == s_->req.dtype ? &s_->weights : nullptr;
}

status model_session::set_adapter(const std::string& adapter) {
  return guarded([&]() -> status {
    if (adapter.empty()) {
      s_->lora.reset();
      return ok_status();
    }
    LP_TRY_ASSIGN(l, load_peft_adapter(adapter, s_->weights));
    s_->lora = std::move(l);
    return ok_status();
  });
}

result<generation> model_session::generate(const generate_request& req, const std::function<bool(int32_t, const std::string&)>& on_token,
                                           const cancel_token* cancel) {
  return guarded([&]() -> result<generation> {
    thread_count_scope threads(s_->req.threads);
    generation g;
    if (!req.prompt_ids.empty()) {
      for (auto id : req.prompt_ids)
        if (id < 0 || id >= s_->weights.cfg.vocab_size)
          return make_error("prompt id {} is outside the vocabulary (0..{})", id, s_->weights.cfg.vocab_size - 1);
      g.prompt_ids = req.prompt_ids;
    } else {
      prompt_options po{req.chat, req.system, req.add_bos, tokenizer_dir(s_->tok_path)};
      auto prompt = prepare_prompt(*s_->tok, req.prompt, po);
      if (!prompt && prompt.message().rfind("empty prompt", 0) == 0) return make_error("empty prompt (give --prompt text, or drop --no-bos)");
      if (!prompt) return prompt.err();
      g.prompt_ids = *prompt;
    }
    sampling_options so;
    so.temperature = req.temperature;
    so.top_p = req.top_p;
    so.seed = req.seed;
    so.max_new_tokens = req.max_new_tokens;
    so.stop_id = s_->tok->eos_id();
    so.cancel = cancel;
    std::vector<int32_t> so_far;
    std::string text_so_far;
    if (on_token)
      so.on_token = [&](int32_t id) {
        so_far.push_back(id);
        std::string text = s_->tok->decode_continuation(g.prompt_ids, so_far);
        std::string piece = text.size() >= text_so_far.size() && text.compare(0, text_so_far.size(), text_so_far) == 0
                                ? text.substr(text_so_far.size()) : text;
        text_so_far = std::move(text);
        return on_token(id, piece);
      };
    g.ids = lorapipe::generate(s_->weights, s_->lora ? &*s_->lora : nullptr, g.prompt_ids, so);
    if (!g.ids.empty() && g.ids.back() == s_->tok->eos_id()) {
      g.ids.pop_back();
      g.stopped_at_eos = true;
    }
    g.text = s_->tok->decode_continuation(g.prompt_ids, g.ids);
    return g;
  });
}

result<std::vector<int32_t>> tokenize_text(const std::string& path, const std::string& text) {
  return guarded([&]() -> result<std::vector<int32_t>> {
    LP_TRY_ASSIGN(tok, load_tokenizer(path));
    return tok->encode(text);
  });
}

status export_adapter(const std::string& model, const std::string& adapter, const std::string& output, const std::string& format,
                      const std::string& dtype, observer& obs) {
  return guarded([&]() -> status {
    LP_TRY_ASSIGN(dt, parse_dtype_name(format == "peft" ? std::string("float32") : dtype));
    obs.on_event(phase_event{phase::loading_model, 0, 0, 0, model});
    // Shapes and dtypes only (meta tensors): the adapter is checked against them, and export_merged
    // reads the frozen weights a layer at a time, so the export needs memory for a layer.
    load_options lo{dt};
    lo.select = [](const llama_config& mc) -> result<weight_selection> {
      return weight_selection{std::vector<bool>(static_cast<size_t>(mc.num_layers), false), false, false};
    };
    LP_TRY_ASSIGN(w, load_llama(model, lo));
    LP_TRY_ASSIGN(l, load_peft_adapter(adapter, w));  // checked against the model before anything is written
    obs.on_event(phase_event{phase::exporting, 0, 0, 0, output});
    if (format == "peft") return save_peft_adapter(l, output);
    auto tok_src = find_tokenizer_for_model(model);
    return export_merged(w, l, output, tok_src ? *tok_src : fs::path(model));
  });
}

result<eval_summary> evaluate_model(const project_config& cfg, const fs::path& adapter, const std::string& data_file, observer& obs,
                                    const cancel_token* cancel) {
  return evaluate_project(cfg, adapter, data_file, obs, cancel);
}

result<data_report> inspect_data(const project_config& cfg, int64_t examples, const std::string& open, const std::string& close) {
  return guarded([&]() -> result<data_report> { return make_data_report(cfg, examples, open, close); });
}

result<model_info> describe_model(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  model_info info;
  llama_config c;
  if (fs::is_directory(p, ec)) {
    LP_TRY_ASSIGN(text, read_text_file(p / "config.json"));
    auto j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded()) return make_error("{}: not valid JSON", (p / "config.json").string());
    LP_TRY_ASSIGN(parsed, parse_llama_config(j, (p / "config.json").string()));
    c = parsed;
    info.format = "hf";
    info.architecture = j.value("model_type", std::string("?"));
  } else if (fs::is_regular_file(p, ec)) {
    // llama2.c header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (< 0: untied), seq_len
    LP_TRY_ASSIGN(map, mapped_file::open(p));
    if (map->size() < 7 * sizeof(int32_t)) return make_error("{}: too short for a llama2.c model", path);
    int32_t h[7];
    std::memcpy(h, map->data(), sizeof h);
    c.hidden_size = h[0], c.intermediate_size = h[1], c.num_layers = h[2], c.num_heads = h[3], c.num_kv_heads = h[4];
    c.vocab_size = std::abs(static_cast<int64_t>(h[5])), c.max_position_embeddings = h[6], c.tie_word_embeddings = h[5] > 0;
    const bool sane = c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0 && c.num_layers <= 4096 && c.num_heads > 0 &&
                      c.num_kv_heads > 0 && c.hidden_size % c.num_heads == 0 && c.num_heads % c.num_kv_heads == 0 &&
                      c.vocab_size > 0 && c.max_position_embeddings > 0;
    if (!sane) return make_error("{}: not a llama2.c model (implausible header)", path);
    c.head_dim = c.hidden_size / c.num_heads;
    // The weights that must follow the header (float32), without the optional RoPE tables.
    const double D = static_cast<double>(c.hidden_size), H = static_cast<double>(c.intermediate_size), L = static_cast<double>(c.num_layers);
    const double kv = static_cast<double>(c.num_kv_heads * c.head_dim), V = static_cast<double>(c.vocab_size);
    const double floats = V * D + L * (2 * D + 2 * D * D + 2 * D * kv + 3 * D * H) + D + (c.tie_word_embeddings ? 0 : V * D);
    if (static_cast<double>(map->size()) < 28 + 4 * floats)
      return make_error("{}: not a llama2.c model ({} bytes, its header needs at least {:.0f})", path, map->size(), 28 + 4 * floats);
    info.format = "llama2c";
    info.architecture = "llama";
    c.torch_dtype = "float32";
  } else {
    return make_error("{} does not exist", path);
  }
  info.dtype = c.torch_dtype;
  info.parameters = c.num_parameters();
  info.context_length = c.max_position_embeddings;
  info.layers = c.num_layers, info.hidden_size = c.hidden_size, info.heads = c.num_heads, info.kv_heads = c.num_kv_heads;
  info.vocab_size = c.vocab_size, info.tied_embeddings = c.tie_word_embeddings;
  if (auto tok = find_tokenizer_for_model(p)) info.tokenizer = tok->string();
  else info.tokenizer_error = tok.message();
  return info;
}

}  // namespace lorapipe
