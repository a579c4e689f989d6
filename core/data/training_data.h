// The project's training data as the trainer and `lorapipe-cli data inspect` see it: plain text
// corpora or JSONL instruction data (format from data.format, autodetected by default), rendered with
// the chat template data.chat_template resolves to, tokenised, masked and windowed.
#pragma once

#include <string>
#include <vector>

#include "core/data/instruct_dataset.h"
#include "core/project/project.h"
#include "core/base/result.h"
#include "core/text/tokenizer.h"

namespace lorapipe {

struct training_data {
  token_windows train, val;
  dataset_stats stats;
  std::vector<tokenized_example> preview;
  std::string template_source;  // "tokenizer_config.json", "built-in", a file path, or "" for text
};

// tok_dir: the folder of the tokenizer (for tokenizer_config.json: chat template, BOS/EOS text).
result<training_data> load_training_data(const project_config& cfg, const tokenizer& tok, const std::filesystem::path& tok_dir,
                                         size_t preview = 3, const progress_fn& progress = {});

}  // namespace lorapipe
