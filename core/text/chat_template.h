// Chat templates as transformers applies them: the Jinja source from tokenizer_config.json rendered
// for a list of messages, plus where each assistant turn lies in the rendered text (the part a
// fine-tune trains on). Models without a template (e.g. base checkpoints) get a small built-in one.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/text/jinja.h"
#include "core/base/result.h"
#include "core/text/tokenizer.h"

namespace lorapipe {

struct rendered_chat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> assistant_spans;  // [begin, end) bytes in text, in order
};

// bos_token / eos_token for a template: tokenizer_config.json's names, else the tokenizer's own.
jinja::dict_t special_token_vars(const tokenizer& tok, const tokenizer_settings& settings);

class chat_template {
 public:
  static result<chat_template> parse(const std::string& source);
  // The built-in template: "User: ...\nAssistant: ...<eos>\n"; the assistant part starts at the space (assistant turns in {% generation %}).
  static const std::string& builtin_source();

  // messages: JSON array of {"role","content",...}; vars: extra globals (bos_token, eos_token, ...).
  result<std::string> render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                             const jinja::dict_t& vars) const;
  // Full conversation plus the assistant spans: from {% generation %} blocks when the template has
  // them, else located by rendering prefixes of the conversation (what transformers' trainers do):
  // a turn starts where render(messages[:i], add_generation_prompt) stops agreeing with the full text
  // and ends after its content and the template's end-of-turn text.
  result<rendered_chat> render_for_training(const nlohmann::ordered_json& messages, const jinja::dict_t& vars) const;

 private:
  jinja::template_program program_;
};

}  // namespace lorapipe
