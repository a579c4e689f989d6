// What training, evaluation and samples share: the project's inputs (model, tokenizer, tokenised
// data) loaded with progress and cancellation, batches from token windows, the token-weighted
// validation loss, and the before/after sample. Internal to core/train and core/engine.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/base/cancel.h"
#include "core/base/events.h"
#include "core/data/training_data.h"
#include "core/model/generate.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/project/project.h"
#include "core/text/tokenizer.h"

namespace lorapipe {

// Sets LibTorch's intra-op thread count for a scope (0 = all cores) and restores the previous one:
// a run's setting does not leak into other work of the same process.
class thread_count_scope {
 public:
  explicit thread_count_scope(int64_t requested);
  ~thread_count_scope();
  thread_count_scope(const thread_count_scope&) = delete;
  thread_count_scope& operator=(const thread_count_scope&) = delete;
  int threads() const { return now_; }

 private:
  int before_, now_;
};

// What a project trains on or evaluates: the model, its tokenizer and the tokenised data.
struct project_inputs {
  llama_weights weights;
  std::unique_ptr<tokenizer> tok;
  std::filesystem::path tok_path;
  training_data data;
};
// Emits phase events (loading_model per layer, tokenizing per batch of examples); a cancel request
// returns the error "cancelled". `preloaded`: weights already in memory for this model.path and
// model.dtype (a model session's), shared instead of loaded again (the frozen tensors are never
// written). `select`: which frozen tensors to read (load_options::select; a pipeline rank's own).
result<project_inputs> load_project_inputs(const project_config& cfg, observer& obs, const cancel_token* cancel,
                                           const llama_weights* preloaded = nullptr,
                                           const std::function<result<weight_selection>(const llama_config&)>& select = {});

// Inputs and labels (i64 [B,T] each) of the given windows; labels -100 where the mask says untrained.
std::pair<at::Tensor, at::Tensor> make_batch(const token_windows& w, const std::vector<int64_t>& idx);
int64_t trained_labels(const at::Tensor& labels);

struct eval_result {
  double loss = 0;     // token-weighted mean
  int64_t tokens = 0;  // label tokens scored
};
// Validation over `set` (max_batches > 0: only that many batches), phase events per batch; throws
// cancelled_error on a cancel request. `score` returns a batch's summed cross-entropy over its labels
// (inputs, labels: i64 [b,T], b <= batch).
using batch_scorer = std::function<double(const at::Tensor& x, const at::Tensor& y)>;
eval_result evaluate_windows(const token_windows& set, int64_t batch, int64_t max_batches, observer& obs, int64_t step,
                             const cancel_token* cancel, const batch_scorer& score);
// ... scored on the host weights.
eval_result evaluate_windows(const llama_weights& w, const lora_adapters* lora, const token_windows& set, int64_t batch,
                             int64_t max_batches, observer& obs, int64_t step, const cancel_token* cancel);

// The run's sample: run.sample_prompt through prepare_prompt (BOS only where the tokenizer has one),
// run.sample_tokens greedy tokens; throws cancelled_error on a cancel request.
std::string sample_text(const llama_weights& w, const lora_adapters& lora, const tokenizer& tok, const project_config& cfg,
                        observer& obs, int64_t step, const cancel_token* cancel);
// ... with another generator of greedy ids (the pipeline's): gen(prompt, options) returns the new ids.
using token_generator = std::function<std::vector<int32_t>(const std::vector<int32_t>& prompt, const sampling_options& so)>;
std::string sample_text(const tokenizer& tok, const project_config& cfg, observer& obs, int64_t step, const cancel_token* cancel,
                        const token_generator& gen);

}  // namespace lorapipe
