// Tokenizers: see tokenizer.h.
#include "core/tokenizer.h"

#include <sentencepiece_processor.h>

namespace lorapipe {
namespace fs = std::filesystem;

std::string tokenizer::decode_continuation(const std::vector<int32_t>& prefix, const std::vector<int32_t>& ids) const {
  std::vector<int32_t> all = prefix;
  all.insert(all.end(), ids.begin(), ids.end());
  std::string whole = decode(all), head = decode(prefix);
  if (whole.compare(0, head.size(), head) == 0) return whole.substr(head.size());
  return decode(ids);
}

namespace {
class sentencepiece_tokenizer final : public tokenizer {
 public:
  explicit sentencepiece_tokenizer(std::unique_ptr<sentencepiece::SentencePieceProcessor> sp) : sp_(std::move(sp)) {}
  result<std::vector<int32_t>> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto st = sp_->Encode(absl::string_view(text.data(), text.size()), &ids);
    if (!st.ok()) return make_error("sentencepiece encode failed: {}", st.ToString());
    return std::vector<int32_t>(ids.begin(), ids.end());
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

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};
}  // namespace

result<fs::path> find_tokenizer_for_model(const fs::path& model_path) {
  std::error_code ec;
  fs::path dir = fs::is_directory(model_path, ec) ? model_path : model_path.parent_path();
  if (dir.empty()) dir = ".";
  if (fs::is_regular_file(dir / "tokenizer.model", ec)) return dir / "tokenizer.model";
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().extension() == ".model") return e.path();
  return make_error("{}: no tokenizer found (expected tokenizer.model in {})", model_path.string(), dir.string());
}

result<std::unique_ptr<tokenizer>> load_tokenizer(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return make_error("{}: tokenizer not found", path.string());
  fs::path file = path;
  if (fs::is_directory(path, ec) || path.extension() == ".bin") {
    LP_TRY_ASSIGN(found, find_tokenizer_for_model(path));
    file = found;
  }
  if (file.extension() == ".json")
    return make_error("{}: tokenizer.json is not supported yet; use tokenizer.model", file.string());
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  auto st = sp->Load(file.string());
  if (!st.ok()) return make_error("{}: not a SentencePiece model: {}", file.string(), st.ToString());
  return std::unique_ptr<tokenizer>(std::make_unique<sentencepiece_tokenizer>(std::move(sp)));
}

}  // namespace lorapipe
