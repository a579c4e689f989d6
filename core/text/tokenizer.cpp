// Tokenizer loading and the SentencePiece tokenizer: see tokenizer.h.
#include "core/text/tokenizer.h"

#include <fstream>

#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>

#include "core/base/json_parse.h"
#include "core/base/safetensors.h"
#include "core/text/text_unicode.h"

namespace lorapipe {
namespace fs = std::filesystem;

result<std::vector<int32_t>> tokenizer::encode(std::string_view text) const {
  LP_TRY_ASSIGN(enc, encode_with_offsets(text, parses_special_by_default()));
  return std::move(enc.ids);
}

std::string tokenizer::decode_continuation(const std::vector<int32_t>& prefix, const std::vector<int32_t>& ids) const {
  std::vector<int32_t> all = prefix;
  all.insert(all.end(), ids.begin(), ids.end());
  std::string whole = decode(all), head = decode(prefix);
  if (whole.compare(0, head.size(), head) == 0) return whole.substr(head.size());
  return decode(ids);
}

status split_on_specials(std::string_view text, const std::vector<std::pair<std::string, int32_t>>& specials, encoding& enc,
                         const std::function<status(size_t, size_t)>& segment) {
  size_t pos = 0;
  for (;;) {
    size_t next = std::string_view::npos, len = 0;
    int32_t id = -1;
    for (const auto& [s, sid] : specials) {
      if (s.empty()) continue;
      const size_t f = text.find(s, pos);
      if (f != std::string_view::npos && (next == std::string_view::npos || f < next || (f == next && s.size() > len)))
        next = f, len = s.size(), id = sid;
    }
    const size_t end = next == std::string_view::npos ? text.size() : next;
    if (end > pos) LP_TRY(segment(pos, end));
    if (id < 0) return ok_status();
    enc.ids.push_back(id);
    enc.offsets.push_back(static_cast<uint32_t>(next));
    pos = next + len;
  }
}

namespace {
class sentencepiece_tokenizer final : public tokenizer {
 public:
  explicit sentencepiece_tokenizer(std::unique_ptr<sentencepiece::SentencePieceProcessor> sp) : sp_(std::move(sp)) {}
  result<encoding> encode_with_offsets(std::string_view text, bool parse_special) const override {
    if (auto bad = find_invalid_utf8(text); bad != std::string_view::npos)
      return make_error("invalid UTF-8 at byte {}", bad);
    encoding enc;
    std::vector<std::pair<std::string, int32_t>> specials;
    if (parse_special)
      for (int32_t id : {sp_->bos_id(), sp_->eos_id()})
        if (id >= 0) specials.emplace_back(sp_->IdToPiece(id), id);
    LP_TRY(split_on_specials(text, specials, enc, [&](size_t b, size_t e) -> status {
      sentencepiece::ImmutableSentencePieceText spt;
      auto st = sp_->Encode(absl::string_view(text.data() + b, e - b), spt.mutable_proto());
      if (!st.ok()) return make_error("sentencepiece encode failed: {}", st.ToString());
      for (const auto& p : spt.pieces()) {
        enc.ids.push_back(static_cast<int32_t>(p.id()));
        enc.offsets.push_back(static_cast<uint32_t>(b + p.begin()));
      }
      return ok_status();
    }));
    return enc;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> v(ids.begin(), ids.end());
    std::string out;
    for (auto& i : v)
      if (i < 0 || i >= sp_->GetPieceSize()) i = sp_->unk_id();
    (void)sp_->Decode(v, &out);
    return out;
  }
  int32_t bos_id() const override { return sp_->bos_id(); }
  int32_t eos_id() const override { return sp_->eos_id(); }
  int32_t vocab_size() const override { return sp_->GetPieceSize(); }
  std::string kind() const override { return "sentencepiece"; }
  bool parses_special_by_default() const override { return false; }
  std::optional<int32_t> token_id(std::string_view token) const override {
    const int id = sp_->PieceToId(absl::string_view(token.data(), token.size()));
    if (id == sp_->unk_id() && token != sp_->IdToPiece(id)) return std::nullopt;
    return id;
  }
  std::string id_to_token(int32_t id) const override {
    return id >= 0 && id < sp_->GetPieceSize() ? sp_->IdToPiece(id) : std::string();
  }

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

std::string token_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}
}  // namespace

result<tokenizer_settings> load_tokenizer_settings(const fs::path& dir) {
  tokenizer_settings s;
  std::error_code ec;
  const fs::path file = dir / "tokenizer_config.json";
  if (!fs::is_regular_file(file, ec)) return s;
  LP_TRY_ASSIGN(text, read_text_file(file));
  auto j = parse_json_or_discarded(text);
  if (j.is_discarded() || !j.is_object()) return make_error("{}: not a JSON object", file.string());
  if (j.contains("chat_template")) {
    const auto& t = j["chat_template"];
    if (t.is_string()) s.chat_template = t.get<std::string>();
    else if (t.is_array())
      for (const auto& e : t)
        if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
          s.chat_template = e["template"].get<std::string>();
  }
  if (j.contains("bos_token")) s.bos_token = token_text(j["bos_token"]);
  if (j.contains("eos_token")) s.eos_token = token_text(j["eos_token"]);
  if (j.contains("add_bos_token") && j["add_bos_token"].is_boolean()) s.add_bos_token = j["add_bos_token"].get<bool>();
  if (j.contains("add_eos_token") && j["add_eos_token"].is_boolean()) s.add_eos_token = j["add_eos_token"].get<bool>();
  return s;
}

result<fs::path> find_tokenizer_for_model(const fs::path& model_path) {
  std::error_code ec;
  fs::path dir = fs::is_directory(model_path, ec) ? model_path : model_path.parent_path();
  if (dir.empty()) dir = ".";
  if (fs::is_regular_file(dir / "tokenizer.json", ec)) return dir / "tokenizer.json";
  if (fs::is_regular_file(dir / "tokenizer.model", ec)) return dir / "tokenizer.model";
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().extension() == ".model") return e.path();
  return make_error("{}: no tokenizer found (expected tokenizer.json or tokenizer.model in {})", model_path.string(), dir.string());
}

result<std::unique_ptr<tokenizer>> load_tokenizer(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return make_error("{}: tokenizer not found", path.string());
  fs::path file = path;
  if (fs::is_directory(path, ec) || path.extension() == ".bin") {
    LP_TRY_ASSIGN(found, find_tokenizer_for_model(path));
    file = found;
  }
  if (file.extension() == ".json") {
    LP_TRY_ASSIGN(settings, load_tokenizer_settings(file.parent_path().empty() ? fs::path(".") : file.parent_path()));
    return load_hf_tokenizer(file, settings);
  }
  if (file.extension() == ".tiktoken") return load_tiktoken_tokenizer(file);
  {
    std::ifstream in(file, std::ios::binary);
    std::string head(256, '\0');
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    head.resize(static_cast<size_t>(in.gcount()));
    if (looks_like_tiktoken(head)) return load_tiktoken_tokenizer(file);
  }
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  auto st = sp->Load(file.string());
  if (!st.ok()) return make_error("{}: not a SentencePiece model: {}", file.string(), st.ToString());
  return std::unique_ptr<tokenizer>(std::make_unique<sentencepiece_tokenizer>(std::move(sp)));
}

}  // namespace lorapipe
