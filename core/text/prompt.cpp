// Prompt preparation: see prompt.h.
#include "core/text/prompt.h"

#include <nlohmann/json.hpp>

#include "core/text/chat_template.h"

namespace lorapipe {
namespace fs = std::filesystem;

fs::path tokenizer_dir(const fs::path& tokenizer_path) {
  std::error_code ec;
  return fs::is_directory(tokenizer_path, ec) ? tokenizer_path : tokenizer_path.parent_path();
}

result<std::vector<int32_t>> prepare_prompt(const tokenizer& tok, const std::string& text, const prompt_options& opt) {
  std::string rendered = text;
  if (opt.chat) {
    LP_TRY_ASSIGN(settings, load_tokenizer_settings(opt.settings_dir));
    LP_TRY_ASSIGN(templ, chat_template::parse(settings.chat_template.empty() ? chat_template::builtin_source()
                                                                             : settings.chat_template));
    nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
    if (!opt.system.empty()) msgs.push_back({{"role", "system"}, {"content", opt.system}});
    msgs.push_back({{"role", "user"}, {"content", text}});
    LP_TRY_ASSIGN(r, templ.render(msgs, true, special_token_vars(tok, settings)));
    rendered = std::move(r);
  }
  LP_TRY_ASSIGN(enc, tok.encode_with_offsets(rendered, opt.chat || tok.parses_special_by_default()));
  std::vector<int32_t> ids;
  const int32_t bos = tok.bos_id();
  if (opt.add_bos && bos >= 0 && (enc.ids.empty() || enc.ids.front() != bos)) ids.push_back(bos);
  ids.insert(ids.end(), enc.ids.begin(), enc.ids.end());
  if (ids.empty()) return make_error("empty prompt (give some text, or allow BOS)");
  return ids;
}

}  // namespace lorapipe
