// Prompt preparation, shared by the trainer's samples, `generate` and the GUI's chat: the text as is
// or, in chat mode, as one user turn (plus an optional system turn) through the model's chat
// template (tokenizer_config.json, else the built-in one), then encoded with BOS prepended only when
// the tokenizer has one and the template did not already emit it. Tokenizers without BOS (Qwen3,
// GPT-2 style) get none.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/base/result.h"
#include "core/text/tokenizer.h"

namespace lorapipe {

struct prompt_options {
  bool chat = false;        // render through the chat template as a user turn
  std::string system;       // chat: an optional system message
  bool add_bos = true;      // prepend BOS when the tokenizer has one (and it is not there yet)
  std::filesystem::path settings_dir;  // where tokenizer_config.json lives (chat mode)
};

// Token ids of the prompt; an empty result is an error ("empty prompt").
result<std::vector<int32_t>> prepare_prompt(const tokenizer& tok, const std::string& text, const prompt_options& opt);

// The folder that holds a tokenizer's files (its settings): the path itself, or its parent for a file.
std::filesystem::path tokenizer_dir(const std::filesystem::path& tokenizer_path);

}  // namespace lorapipe
