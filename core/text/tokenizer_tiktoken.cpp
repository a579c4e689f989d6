// tiktoken BPE files (`<base64 token> <rank>` per line: OpenAI's r50k/p50k/cl100k/o200k and Meta's
// original Llama-3 `tokenizer.model`): rank-ordered byte-pair merging over regex pre-tokens. The
// split pattern and special tokens follow the vocabulary size (r50k: GPT-2; 128000: Llama 3;
// otherwise cl100k). Special tokens are matched only when asked (as tiktoken's encode_ordinary
// does not); decoding concatenates bytes.
#include <algorithm>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "core/base/safetensors.h"
#include "core/text/text_unicode.h"
#include "core/text/tokenizer.h"

namespace lorapipe {
namespace {

result<std::string> base64_decode(std::string_view s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    if (c == '=') break;
    const int v = val(c);
    if (v < 0) return make_error("invalid base64 character '{}'", c);
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

const char* const gpt2_split = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const cl100k_split = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

class tiktoken_tokenizer final : public tokenizer {
 public:
  static result<std::unique_ptr<tiktoken_tokenizer>> parse(const std::string& text, const std::string& label) {
    auto t = std::make_unique<tiktoken_tokenizer>();
    size_t pos = 0;
    int64_t line = 0;
    while (pos < text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      std::string_view l(text.data() + pos, end - pos);
      pos = end + 1;
      ++line;
      if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
      if (l.empty()) continue;
      const size_t sp = l.find(' ');
      if (sp == std::string_view::npos) return make_error("{}:{}: expected \"<base64> <rank>\"", label, line);
      auto bytes = base64_decode(l.substr(0, sp));
      if (!bytes) return make_error("{}:{}: {}", label, line, bytes.message());
      int64_t rank = 0;
      for (char c : l.substr(sp + 1)) {
        if (c < '0' || c > '9' || rank > (1 << 24)) return make_error("{}:{}: bad rank", label, line);
        rank = rank * 10 + (c - '0');
      }
      if (!t->ranks_.emplace(*bytes, static_cast<int32_t>(rank)).second) return make_error("{}:{}: duplicate token", label, line);
      if (static_cast<size_t>(rank) >= t->bytes_.size()) t->bytes_.resize(static_cast<size_t>(rank) + 1);
      t->bytes_[static_cast<size_t>(rank)] = std::move(*bytes);
    }
    if (t->ranks_.size() < 256) return make_error("{}: not a tiktoken BPE file ({} ranks)", label, t->ranks_.size());
    const auto n = static_cast<int32_t>(t->bytes_.size());
    std::vector<std::string> specials;
    if (n == 50256) specials = {"<|endoftext|>"};
    else if (n == 128000) {
      specials = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                  "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"};
      for (int i = 2; static_cast<int>(specials.size()) < 256; ++i) specials.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
    } else specials = {"<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"};
    for (const auto& s : specials) {
      t->specials_.emplace_back(s, static_cast<int32_t>(t->bytes_.size()));
      t->bytes_.push_back(s);
    }
    auto re = unicode_regex::compile(n == 50256 ? gpt2_split : cl100k_split);
    if (!re) return make_error("{}", re.message());
    t->split_ = std::make_unique<unicode_regex>(std::move(*re));
    if (n == 128000) t->bos_ = n, t->eos_ = n + 1;
    else t->eos_ = n;
    return t;
  }

  result<encoding> encode_with_offsets(std::string_view text, bool parse_special) const override {
    if (auto bad = find_invalid_utf8(text); bad != std::string_view::npos) return make_error("invalid UTF-8 at byte {}", bad);
    encoding enc;
    static const std::vector<std::pair<std::string, int32_t>> none;
    LP_TRY(split_on_specials(text, parse_special ? specials_ : none, enc, [&](size_t b, size_t e) -> status {
      const std::string_view seg = text.substr(b, e - b);
      for (auto [pb, pe] : split_->find_all(seg)) encode_piece(seg.substr(pb, pe - pb), b + pb, enc);
      return ok_status();
    }));
    return enc;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids)
      if (id >= 0 && static_cast<size_t>(id) < bytes_.size()) out += bytes_[static_cast<size_t>(id)];
    return out;
  }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  int32_t vocab_size() const override { return static_cast<int32_t>(bytes_.size()); }
  std::string kind() const override { return "tiktoken BPE"; }
  bool parses_special_by_default() const override { return false; }
  std::optional<int32_t> token_id(std::string_view token) const override {
    for (const auto& [s, id] : specials_)
      if (s == token) return id;
    auto it = ranks_.find(std::string(token));
    if (it == ranks_.end()) return std::nullopt;
    return it->second;
  }
  std::string id_to_token(int32_t id) const override {
    return id >= 0 && static_cast<size_t>(id) < bytes_.size() ? bytes_[static_cast<size_t>(id)] : std::string();
  }

 private:
  int32_t rank_of(std::string_view s) const {
    auto it = ranks_.find(std::string(s));
    return it == ranks_.end() ? std::numeric_limits<int32_t>::max() : it->second;
  }
  // tiktoken's byte_pair_merge: repeatedly merge the adjacent pair whose concatenation ranks lowest.
  void encode_piece(std::string_view piece, size_t base, encoding& enc) const {
    if (auto it = ranks_.find(std::string(piece)); it != ranks_.end()) {
      enc.ids.push_back(it->second);
      enc.offsets.push_back(static_cast<uint32_t>(base));
      return;
    }
    std::vector<size_t> cut(piece.size() + 1);
    for (size_t i = 0; i <= piece.size(); ++i) cut[i] = i;
    for (;;) {
      int32_t best = std::numeric_limits<int32_t>::max();
      size_t at = 0;
      for (size_t i = 0; i + 2 < cut.size(); ++i) {
        const int32_t r = rank_of(piece.substr(cut[i], cut[i + 2] - cut[i]));
        if (r < best) best = r, at = i;
      }
      if (best == std::numeric_limits<int32_t>::max()) break;
      cut.erase(cut.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    for (size_t i = 0; i + 1 < cut.size(); ++i) {
      enc.ids.push_back(rank_of(piece.substr(cut[i], cut[i + 1] - cut[i])));
      enc.offsets.push_back(static_cast<uint32_t>(base + cut[i]));
    }
  }

  std::unordered_map<std::string, int32_t> ranks_;
  std::vector<std::string> bytes_;
  std::vector<std::pair<std::string, int32_t>> specials_;
  std::unique_ptr<unicode_regex> split_;
  int32_t bos_ = -1, eos_ = -1;
};

}  // namespace

bool looks_like_tiktoken(std::string_view head) {
  const size_t nl = head.find('\n');
  const std::string_view line = head.substr(0, nl);
  const size_t sp = line.find(' ');
  if (sp == std::string_view::npos || sp == 0) return false;
  for (size_t i = 0; i < sp; ++i) {
    const char c = line[i];
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '=')) return false;
  }
  for (size_t i = sp + 1; i < line.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(line[i])) && line[i] != '\r') return false;
  return sp + 1 < line.size();
}

result<std::unique_ptr<tokenizer>> load_tiktoken_tokenizer(const std::filesystem::path& file) {
  LP_TRY_ASSIGN(text, read_text_file(file));
  LP_TRY_ASSIGN(t, tiktoken_tokenizer::parse(text, file.string()));
  return std::unique_ptr<tokenizer>(std::move(t));
}

}  // namespace lorapipe
