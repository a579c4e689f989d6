// Inputs, batches, validation and samples: see evaluate.h.
#include "core/train/evaluate.h"

#include <algorithm>
#include <thread>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/generate.h"
#include "core/model/tensor_io.h"
#include "core/text/prompt.h"

namespace lorapipe {
namespace fs = std::filesystem;

thread_count_scope::thread_count_scope(int64_t requested) : before_(at::get_num_threads()) {
  const int n = requested > 0 ? static_cast<int>(requested) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
  now_ = at::get_num_threads();
}

thread_count_scope::~thread_count_scope() { at::set_num_threads(before_); }

namespace {
result<llama_weights> load_weights(const project_config& cfg, observer& obs, const cancel_token* cancel,
                                   const std::function<result<weight_selection>(const llama_config&)>& select) {
  LP_TRY_ASSIGN(dtype, parse_dtype_name(cfg.model.dtype));
  const fs::path model_path = cfg.resolve(cfg.model.path);
  load_options lo{dtype};
  lo.progress = [&](int64_t done, int64_t total) {
    obs.on_event(phase_event{phase::loading_model, done, total, 0, model_path.string()});
    return !cancel_requested(cancel);
  };
  lo.select = select;
  return load_llama(model_path, lo);
}
}  // namespace

result<project_inputs> load_project_inputs(const project_config& cfg, observer& obs, const cancel_token* cancel,
                                           const llama_weights* preloaded,
                                           const std::function<result<weight_selection>(const llama_config&)>& select) {
  const fs::path model_path = cfg.resolve(cfg.model.path);
  LP_TRY_ASSIGN(w, preloaded != nullptr ? result<llama_weights>(*preloaded) : load_weights(cfg, obs, cancel, select));
  const fs::path tok_path = cfg.tokenizer.path.empty() ? model_path : cfg.resolve(cfg.tokenizer.path);
  LP_TRY_ASSIGN(tok, load_tokenizer(tok_path));
  if (tok->vocab_size() > w.cfg.vocab_size)
    return make_error("tokenizer has {} tokens but the model only {}", tok->vocab_size(), w.cfg.vocab_size);
  if (cfg.data.seq_len > w.cfg.context_length())
    return make_error("data.seq_len: {} exceeds the model's context length {}", cfg.data.seq_len, w.cfg.max_position_embeddings);
  const std::string data_path = cfg.resolve(cfg.data.train).string();
  auto progress = [&](int64_t done, int64_t total) {
    obs.on_event(phase_event{phase::tokenizing, done, total, 0, data_path});
    return !cancel_requested(cancel);
  };
  LP_TRY_ASSIGN(data, load_training_data(cfg, *tok, tokenizer_dir(tok_path), 3, progress));
  obs.on_event(phase_event{phase::tokenizing, data.stats.examples, data.stats.examples, 0, data_path});
  return project_inputs{std::move(w), std::move(tok), tok_path, std::move(data)};
}

std::pair<at::Tensor, at::Tensor> make_batch(const token_windows& w, const std::vector<int64_t>& idx) {
  const int64_t B = static_cast<int64_t>(idx.size()), T = w.seq_len;
  auto all = torch::empty({B, T + 1}, torch::kLong);  // i64 [B,T+1]
  auto* p = all.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* src = w.window(idx[b]);
    for (int64_t t = 0; t <= T; ++t) p[b * (T + 1) + t] = src[t];
  }
  auto labels = all.slice(1, 1, T + 1).clone();  // i64 [B,T]
  if (w.has_mask()) {  // loss mask: -100 where the target token is not trained on
    auto* l = labels.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* m = w.window_mask(idx[b]);
      for (int64_t t = 0; t < T; ++t)
        if (m[t + 1] == 0) l[b * T + t] = -100;
    }
  }
  return {all.slice(1, 0, T).contiguous(), labels};
}

int64_t trained_labels(const at::Tensor& y) { return y.ne(-100).sum().item<int64_t>(); }

eval_result evaluate_windows(const llama_weights& w, const lora_adapters* lora, const token_windows& set, int64_t batch,
                             int64_t max_batches, observer& obs, int64_t step, const cancel_token* cancel) {
  return evaluate_windows(set, batch, max_batches, obs, step, cancel, [&](const at::Tensor& x, const at::Tensor& y) {
    torch::NoGradGuard no_grad;
    return head_loss_sum(w.cfg, w.final_norm, w.lm_head, forward_hidden(w, lora, x), y).item<double>();
  });
}

eval_result evaluate_windows(const token_windows& set, int64_t batch, int64_t max_batches, observer& obs, int64_t step,
                             const cancel_token* cancel, const batch_scorer& score) {
  double sum = 0;
  int64_t count = 0;
  const int64_t n = set.size();
  const int64_t limit = max_batches > 0 ? std::min(n, max_batches * batch) : n;
  const int64_t batches = (limit + batch - 1) / batch;
  for (int64_t s = 0, k = 0; s < limit; s += batch, ++k) {
    obs.on_event(phase_event{phase::evaluating, k, batches, step, {}});
    throw_if_cancelled(cancel);
    std::vector<int64_t> idx;
    for (int64_t i = s; i < std::min(limit, s + batch); ++i) idx.push_back(i);
    auto [x, y] = make_batch(set, idx);
    const int64_t labels = trained_labels(y);
    if (labels == 0) continue;
    sum += score(x, y);
    count += labels;
  }
  obs.on_event(phase_event{phase::evaluating, batches, batches, step, {}});
  return {count > 0 ? sum / static_cast<double>(count) : 0.0, count};
}

std::string sample_text(const llama_weights& w, const lora_adapters& lora, const tokenizer& tok, const project_config& cfg,
                        observer& obs, int64_t step, const cancel_token* cancel) {
  return sample_text(tok, cfg, obs, step, cancel, [&](const std::vector<int32_t>& prompt, const sampling_options& so) {
    return generate(w, &lora, prompt, so);
  });
}

std::string sample_text(const tokenizer& tok, const project_config& cfg, observer& obs, int64_t step, const cancel_token* cancel,
                        const token_generator& gen) {
  prompt_options po;
  auto prompt = prepare_prompt(tok, cfg.run.sample_prompt, po);
  if (!prompt) return {};
  sampling_options so;
  so.max_new_tokens = cfg.run.sample_tokens;
  so.stop_id = tok.eos_id();
  so.cancel = cancel;
  int64_t done = 0;
  so.on_token = [&](int32_t) {
    obs.on_event(phase_event{phase::sampling, ++done, so.max_new_tokens, step, {}});
    return true;
  };
  auto out = gen(*prompt, so);
  throw_if_cancelled(cancel);
  if (!out.empty() && out.back() == tok.eos_id()) out.pop_back();
  return tok.decode_continuation(*prompt, out);
}

}  // namespace lorapipe
