// Chat templates: see chat_template.h.
#include "core/text/chat_template.h"

namespace lorapipe {

const std::string& chat_template::builtin_source() {
  static const std::string src =
      "{%- for message in messages %}"
      "{%- if message.role == 'system' %}{{ message.content + '\\n\\n' }}"
      "{%- elif message.role == 'user' %}{{ 'User: ' + message.content + '\\n' }}"
      "{%- elif message.role == 'assistant' %}{{ 'Assistant:' }}{% generation %}{{ ' ' + message.content + eos_token }}{% endgeneration %}{{ '\\n' }}"
      "{%- else %}{{ raise_exception('unknown role: ' + message.role) }}"
      "{%- endif %}"
      "{%- endfor %}"
      "{%- if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}";
  return src;
}

jinja::dict_t special_token_vars(const tokenizer& tok, const tokenizer_settings& settings) {
  auto name = [&](int32_t id, const std::string& configured) {
    return !configured.empty() ? configured : id >= 0 ? tok.id_to_token(id) : std::string();
  };
  return {{"bos_token", name(tok.bos_id(), settings.bos_token)}, {"eos_token", name(tok.eos_id(), settings.eos_token)}};
}

result<chat_template> chat_template::parse(const std::string& source) {
  auto p = jinja::template_program::parse(source);
  if (!p) return make_error("chat template: {}", p.message());
  chat_template t;
  t.program_ = std::move(*p);
  return t;
}

namespace {
jinja::dict_t globals(const nlohmann::ordered_json& messages, bool gen, const jinja::dict_t& vars) {
  jinja::dict_t g = vars;
  g.emplace_back("messages", jinja::value::from_json(messages));
  g.emplace_back("add_generation_prompt", jinja::value(gen));
  return g;
}
size_t common_prefix(const std::string& a, const std::string& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}
std::string trim_ws(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}
}  // namespace

result<std::string> chat_template::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                          const jinja::dict_t& vars) const {
  auto out = program_.render(globals(messages, add_generation_prompt, vars));
  if (!out) return make_error("chat template: {}", out.message());
  return out;
}

result<rendered_chat> chat_template::render_for_training(const nlohmann::ordered_json& messages, const jinja::dict_t& vars) const {
  if (!messages.is_array() || messages.empty()) return make_error("messages must be a non-empty list");
  for (const auto& m : messages)
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") || !m["content"].is_string())
      return make_error("every message needs string \"role\" and \"content\"");
  rendered_chat rc;
  std::vector<std::pair<size_t, size_t>> gen_spans;
  auto full = program_.render(globals(messages, false, vars), &gen_spans);
  if (!full) return make_error("chat template: {}", full.message());
  rc.text = std::move(*full);
  if (!gen_spans.empty()) {
    rc.assistant_spans = std::move(gen_spans);
    return rc;
  }
  size_t cursor = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i]["role"] != "assistant") continue;
    nlohmann::ordered_json head = nlohmann::ordered_json::array();
    for (size_t k = 0; k < i; ++k) head.push_back(messages[k]);
    size_t start = cursor;
    if (!head.empty()) {
      auto prompt = program_.render(globals(head, true, vars));
      if (!prompt) return make_error("chat template (rendering messages[:{}]): {}", i, prompt.message());
      start = std::max(cursor, common_prefix(*prompt, rc.text));
    }
    const std::string content = trim_ws(messages[i]["content"].get<std::string>());
    size_t end = start;
    if (!content.empty()) {
      const size_t at = rc.text.find(content, start);
      if (at == std::string::npos) return make_error("chat template: cannot find assistant message {} in the rendered conversation", i);
      end = at + content.size();
    }
    // End-of-turn text that follows the content in a render up to this message (e.g. "<|im_end|>").
    nlohmann::ordered_json upto = head;
    upto.push_back(messages[i]);
    auto turn = program_.render(globals(upto, false, vars));
    if (!turn) return make_error("chat template (rendering messages[:{}]): {}", i + 1, turn.message());
    const size_t c_at = content.empty() ? std::string::npos : turn->rfind(content);
    if (c_at != std::string::npos) {
      std::string suffix = turn->substr(c_at + content.size());
      while (!suffix.empty() && std::isspace(static_cast<unsigned char>(suffix.back()))) suffix.pop_back();
      // Only the text directly after the content, up to the first whitespace-trimmed end marker.
      if (!suffix.empty() && rc.text.compare(end, suffix.size(), suffix) == 0) end += suffix.size();
    }
    rc.assistant_spans.emplace_back(start, end);
    cursor = end;
  }
  return rc;
}

}  // namespace lorapipe
