// Work with a model outside a training run, as library calls: a loaded model (weights, tokenizer,
// optional adapter) that can be reused across calls (train, then chat without reloading), token-
// streaming generation with cancel, tokenisation, evaluation, export, and the data report.
// Nothing here throws or prints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/base/cancel.h"
#include "core/base/events.h"
#include "core/base/result.h"
#include "core/data/data_report.h"
#include "core/project/project.h"
#include "core/train/trainer.h"

namespace lorapipe {

struct llama_weights;

struct model_request {
  std::string model;      // HF folder or llama2.c .bin
  std::string adapter;    // PEFT folder ("" = base model)
  std::string tokenizer;  // "" = found next to the model
  std::string dtype = "float32";
  int64_t threads = 0;    // LibTorch CPU threads while this session computes (0 = all)
};

struct generate_request {
  std::string prompt;
  bool chat = false;      // the prompt as a user turn through the chat template
  std::string system;     // chat: a system message
  bool add_bos = true;
  int64_t max_new_tokens = 64;
  double temperature = 0, top_p = 1;
  uint64_t seed = 0;
  std::vector<int32_t> prompt_ids;  // when not empty: the prompt as token ids, verbatim (prompt, chat, add_bos unused)
};

struct generation {
  std::vector<int32_t> prompt_ids, ids;  // ids: the new tokens (EOS dropped)
  std::string text;                      // the continuation
  bool stopped_at_eos = false;           // generation ended on EOS (not on max_new_tokens or the context)
};

class model_session {
 public:
  static result<model_session> open(const model_request& req);
  model_session(model_session&&) noexcept;
  model_session& operator=(model_session&&) noexcept;
  ~model_session();

  // on_token(id, text piece) is called as each token is chosen (the piece: what it adds to the
  // decoded continuation); returning false stops after it. A cancel request stops before the next.
  result<generation> generate(const generate_request& req,
                              const std::function<bool(int32_t id, const std::string& piece)>& on_token = {},
                              const cancel_token* cancel = nullptr);
  // Replaces the adapter ("" = base model) without reloading the base weights.
  status set_adapter(const std::string& adapter);
  // The loaded base weights when they are the ones `cfg` trains (same model.path and model.dtype),
  // for a run to share (execute_options::model): train, then chat, without loading twice.
  const llama_weights* weights_for(const project_config& cfg) const;

 private:
  struct state;
  explicit model_session(std::unique_ptr<state> s);
  std::unique_ptr<state> s_;
};

// What a model path holds, read from its config.json (or llama2.c header) without loading weights:
// for the GUI's model chooser and for `lorapipe-cli` messages.
struct model_info {
  std::string format;        // "hf" or "llama2c"
  std::string architecture;  // config.json model_type (llama2.c: "llama")
  std::string dtype;         // stored weights (config torch_dtype; llama2.c: float32)
  int64_t parameters = 0, context_length = 0, layers = 0, hidden_size = 0, heads = 0, kv_heads = 0, vocab_size = 0;
  bool tied_embeddings = false;
  std::string tokenizer;     // the tokenizer file found for it ("" when none; tokenizer_error says why)
  std::string tokenizer_error;
};
result<model_info> describe_model(const std::string& path);

// Token ids of `text` (no BOS/EOS) with the tokenizer at `path` (file or model folder).
result<std::vector<int32_t>> tokenize_text(const std::string& path, const std::string& text);

// Merged HF folder (W + alpha/r·B·A) or, with format "peft", the adapter re-saved after checking it
// against the model.
status export_adapter(const std::string& model, const std::string& adapter, const std::string& output, const std::string& format,
                      const std::string& dtype, observer& obs);

// Loss and perplexity (see evaluate_project) with phase events.
result<eval_summary> evaluate_model(const project_config& cfg, const std::filesystem::path& adapter, const std::string& data_file,
                                    observer& obs, const cancel_token* cancel = nullptr);

// The data report of a project (see core/data/data_report.h).
result<data_report> inspect_data(const project_config& cfg, int64_t examples, const std::string& open = "[[",
                                 const std::string& close = "]]");

}  // namespace lorapipe
