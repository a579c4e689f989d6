// Hugging Face tokenizer.json: added tokens, normalizers, pre-tokenizers, the BPE model (byte-level or
// SentencePiece-style with byte fallback), post-processor templates and decoders, reproducing the
// `tokenizers` library. Every piece of text carries a byte-offset map back to the input so tokens
// know where they start. Unsupported components are rejected by name when the file is loaded.
#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <functional>
#include <mutex>
#include <queue>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/base/safetensors.h"
#include "core/text/text_unicode.h"
#include "core/text/tokenizer.h"

namespace lorapipe {
namespace {
using json = nlohmann::json;

// Text with, for every byte, the input byte offset it came from.
struct piece {
  std::string text;
  std::vector<uint32_t> off;
  bool first = false;  // starts the whole input (Metaspace prepend_scheme "first")
  piece sub(size_t b, size_t e) const {
    piece p;
    p.text = text.substr(b, e - b);
    p.off.assign(off.begin() + static_cast<std::ptrdiff_t>(b), off.begin() + static_cast<std::ptrdiff_t>(e));
    p.first = first && b == 0;
    return p;
  }
};

// GPT-2's reversible byte <-> printable character table.
struct byte_level_table {
  std::array<std::string, 256> to_char;
  std::unordered_map<uint32_t, uint8_t> to_byte;
  byte_level_table() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      append_utf8(to_char[b], cp);
      to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};

const char* const gpt2_pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A pattern given as {"String": s} or {"Regex": r}.
struct pattern_t {
  std::string literal;
  std::shared_ptr<unicode_regex> regex;
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    if (regex) return regex->find_all(s);
    std::vector<std::pair<size_t, size_t>> out;
    if (literal.empty()) return out;
    for (size_t p = s.find(literal); p != std::string_view::npos; p = s.find(literal, p + literal.size()))
      out.emplace_back(p, p + literal.size());
    return out;
  }
};

result<pattern_t> parse_pattern(const json& j, const std::string& where) {
  pattern_t p;
  if (j.is_object() && j.contains("String") && j["String"].is_string()) p.literal = j["String"].get<std::string>();
  else if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
    auto r = unicode_regex::compile(j["Regex"].get<std::string>());
    if (!r) return make_error("{}: {}", where, r.message());
    p.regex = std::make_shared<unicode_regex>(std::move(*r));
  } else return make_error("{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}", where);
  return p;
}

// Replaces every match with `content`; inserted bytes map to the match start.
piece replace_all(const piece& in, const pattern_t& pat, const std::string& content) {
  auto m = pat.find_all(in.text);
  if (m.empty()) return in;
  piece out;
  out.first = in.first;
  size_t pos = 0;
  for (auto [b, e] : m) {
    out.text.append(in.text, pos, b - pos);
    out.off.insert(out.off.end(), in.off.begin() + static_cast<std::ptrdiff_t>(pos), in.off.begin() + static_cast<std::ptrdiff_t>(b));
    out.text += content;
    out.off.insert(out.off.end(), content.size(), in.off[b]);
    pos = e;
  }
  out.text.append(in.text, pos);
  out.off.insert(out.off.end(), in.off.begin() + static_cast<std::ptrdiff_t>(pos), in.off.end());
  return out;
}

// ---- normalizers -------------------------------------------------------------------------------
using normalizer_fn = std::function<result<piece>(piece)>;

result<normalizer_fn> make_normalizer(const json& j) {
  if (j.is_null()) return normalizer_fn();
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<normalizer_fn> parts;
    for (const auto& n : j.value("normalizers", json::array())) {
      LP_TRY_ASSIGN(f, make_normalizer(n));
      if (f) parts.push_back(std::move(f));
    }
    return normalizer_fn([parts](piece p) -> result<piece> {
      for (const auto& f : parts) {
        LP_TRY_ASSIGN(q, f(std::move(p)));
        p = std::move(q);
      }
      return p;
    });
  }
  auto unicode = [](unicode_form form) {
    return normalizer_fn([form](piece p) -> result<piece> {
      LP_TRY_ASSIGN(t, normalize_unicode(p.text, form));
      if (t == p.text) return p;
      // Align the common prefix and suffix exactly; the changed middle maps to where it starts.
      size_t pre = 0;
      while (pre < t.size() && pre < p.text.size() && t[pre] == p.text[pre]) ++pre;
      while (pre > 0 && (static_cast<unsigned char>(t[pre]) & 0xc0) == 0x80) --pre;
      size_t suf = 0;
      while (suf < t.size() - pre && suf < p.text.size() - pre && t[t.size() - 1 - suf] == p.text[p.text.size() - 1 - suf]) ++suf;
      while (suf > 0 && (static_cast<unsigned char>(t[t.size() - suf]) & 0xc0) == 0x80) --suf;
      piece q;
      q.first = p.first;
      q.text = std::move(t);
      q.off.assign(p.off.begin(), p.off.begin() + static_cast<std::ptrdiff_t>(pre));
      const uint32_t mid = pre < p.off.size() ? p.off[pre] : (p.off.empty() ? 0 : p.off.back());
      q.off.insert(q.off.end(), q.text.size() - pre - suf, mid);
      q.off.insert(q.off.end(), p.off.end() - static_cast<std::ptrdiff_t>(suf), p.off.end());
      return q;
    });
  };
  if (type == "NFC") return unicode(unicode_form::nfc);
  if (type == "NFD") return unicode(unicode_form::nfd);
  if (type == "NFKC") return unicode(unicode_form::nfkc);
  if (type == "NFKD") return unicode(unicode_form::nfkd);
  if (type == "Lowercase")
    return normalizer_fn([](piece p) -> result<piece> {
      piece q;
      q.first = p.first;
      for (size_t i = 0; i < p.text.size();) {
        const uint32_t o = p.off[i];
        const size_t b = i;
        const std::string lower = lowercase_utf8(std::string_view(p.text).substr(b, utf8_len(static_cast<unsigned char>(p.text[b]))));
        next_code_point(p.text, i);
        q.text += lower;
        q.off.insert(q.off.end(), lower.size(), o);
      }
      return q;
    });
  if (type == "Prepend") {
    const std::string pre = j.value("prepend", "");
    return normalizer_fn([pre](piece p) -> result<piece> {
      if (p.text.empty()) return p;
      p.text.insert(0, pre);
      p.off.insert(p.off.begin(), pre.size(), p.off.front());
      return p;
    });
  }
  if (type == "Replace") {
    LP_TRY_ASSIGN(pat, parse_pattern(j.value("pattern", json()), "normalizer Replace"));
    const std::string content = j.value("content", "");
    return normalizer_fn([pat, content](piece p) -> result<piece> { return replace_all(p, pat, content); });
  }
  if (type == "Strip") {
    const bool left = j.value("strip_left", true), right = j.value("strip_right", true);
    return normalizer_fn([left, right](piece p) -> result<piece> {
      size_t b = 0, e = p.text.size();
      auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
      if (left) while (b < e && ws(p.text[b])) ++b;
      if (right) while (e > b && ws(p.text[e - 1])) --e;
      return p.sub(b, e);
    });
  }
  return make_error("tokenizer.json: normalizer type \"{}\" is not supported", type);
}

// ---- pre-tokenizers ----------------------------------------------------------------------------
using pretok_fn = std::function<void(std::vector<piece>&)>;

enum class split_behavior { isolated, removed, merged_previous, merged_next, contiguous };

void split_pieces(std::vector<piece>& pieces, const pattern_t& pat, split_behavior beh, bool invert) {
  std::vector<piece> out;
  out.reserve(pieces.size() * 2);
  for (const auto& p : pieces) {
    auto m = pat.find_all(p.text);
    // (begin, end, is_match) spans covering the piece.
    std::vector<std::tuple<size_t, size_t, bool>> spans;
    size_t pos = 0;
    for (auto [b, e] : m) {
      if (b > pos) spans.emplace_back(pos, b, invert);
      spans.emplace_back(b, e, !invert);
      pos = e;
    }
    if (pos < p.text.size()) spans.emplace_back(pos, p.text.size(), invert);
    std::vector<std::pair<size_t, size_t>> parts;
    bool prev_match = false;
    for (auto [b, e, is_match] : spans) {
      switch (beh) {
        case split_behavior::isolated: parts.emplace_back(b, e); break;
        case split_behavior::removed: if (!is_match) parts.emplace_back(b, e); break;
        case split_behavior::merged_previous:
          if (is_match && !parts.empty() && !prev_match) parts.back().second = e;
          else parts.emplace_back(b, e);
          break;
        case split_behavior::merged_next:
          if (!is_match && prev_match && !parts.empty()) parts.back().second = e;
          else parts.emplace_back(b, e);
          break;
        case split_behavior::contiguous:
          if (is_match && prev_match && !parts.empty()) parts.back().second = e;
          else parts.emplace_back(b, e);
          break;
      }
      prev_match = is_match;
    }
    for (auto [b, e] : parts)
      if (e > b) out.push_back(p.sub(b, e));
  }
  pieces = std::move(out);
}

result<split_behavior> parse_behavior(const std::string& s) {
  if (s == "Isolated") return split_behavior::isolated;
  if (s == "Removed") return split_behavior::removed;
  if (s == "MergedWithPrevious") return split_behavior::merged_previous;
  if (s == "MergedWithNext") return split_behavior::merged_next;
  if (s == "Contiguous") return split_behavior::contiguous;
  return make_error("tokenizer.json: split behavior \"{}\" is not supported", s);
}

struct pretok_context {
  const byte_level_table* bytes;
  bool byte_level = false;  // some pre-tokenizer maps bytes to characters (the decoder must undo it)
};

result<pretok_fn> make_pretokenizer(const json& j, pretok_context& ctx) {
  if (j.is_null()) return pretok_fn();
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<pretok_fn> parts;
    for (const auto& n : j.value("pretokenizers", json::array())) {
      LP_TRY_ASSIGN(f, make_pretokenizer(n, ctx));
      if (f) parts.push_back(std::move(f));
    }
    return pretok_fn([parts](std::vector<piece>& ps) {
      for (const auto& f : parts) f(ps);
    });
  }
  if (type == "Split") {
    LP_TRY_ASSIGN(pat, parse_pattern(j.value("pattern", json()), "pre_tokenizer Split"));
    LP_TRY_ASSIGN(beh, parse_behavior(j.value("behavior", "Isolated")));
    const bool invert = j.value("invert", false);
    return pretok_fn([pat, beh, invert](std::vector<piece>& ps) { split_pieces(ps, pat, beh, invert); });
  }
  auto regex_split = [](const char* re, split_behavior beh, bool invert) -> result<pretok_fn> {
    LP_TRY_ASSIGN(r, unicode_regex::compile(re));
    pattern_t pat;
    pat.regex = std::make_shared<unicode_regex>(std::move(r));
    return pretok_fn([pat, beh, invert](std::vector<piece>& ps) { split_pieces(ps, pat, beh, invert); });
  };
  if (type == "Whitespace") return regex_split(R"(\w+|[^\w\s]+)", split_behavior::removed, true);
  if (type == "WhitespaceSplit") return regex_split(R"(\s+)", split_behavior::removed, false);
  if (type == "Digits") return regex_split(j.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)", split_behavior::isolated, false);
  if (type == "ByteLevel") {
    ctx.byte_level = true;
    const bool prefix = j.value("add_prefix_space", false), use_regex = j.value("use_regex", true);
    pretok_fn split;
    if (use_regex) {
      LP_TRY_ASSIGN(f, regex_split(gpt2_pattern, split_behavior::isolated, false));
      split = f;
    }
    const byte_level_table* table = ctx.bytes;
    return pretok_fn([prefix, split, table](std::vector<piece>& ps) {
      if (prefix)
        for (auto& p : ps)
          if (!p.text.empty() && p.text[0] != ' ') {
            p.text.insert(0, " ");
            p.off.insert(p.off.begin(), p.off.front());
          }
      if (split) split(ps);
      for (auto& p : ps) {
        piece q;
        q.first = p.first;
        q.text.reserve(p.text.size() * 2);
        q.off.reserve(p.text.size() * 2);
        for (size_t i = 0; i < p.text.size(); ++i) {
          const std::string& c = table->to_char[static_cast<unsigned char>(p.text[i])];
          q.text += c;
          q.off.insert(q.off.end(), c.size(), p.off[i]);
        }
        p = std::move(q);
      }
    });
  }
  if (type == "Metaspace") {
    const std::string rep = j.value("replacement", "\xe2\x96\x81");
    std::string scheme = j.value("prepend_scheme", "");
    if (scheme.empty()) scheme = j.value("add_prefix_space", true) ? "always" : "never";
    const bool do_split = j.value("split", true);
    if (scheme != "always" && scheme != "first" && scheme != "never")
      return make_error("tokenizer.json: Metaspace prepend_scheme \"{}\" is not supported", scheme);
    pattern_t space{" ", nullptr}, repl{rep, nullptr};
    return pretok_fn([rep, scheme, do_split, space, repl](std::vector<piece>& ps) {
      for (auto& p : ps) {
        p = replace_all(p, space, rep);
        const bool prepend = scheme == "always" || (scheme == "first" && p.first);
        if (prepend && !p.text.empty() && p.text.compare(0, rep.size(), rep) != 0) {
          p.text.insert(0, rep);
          p.off.insert(p.off.begin(), rep.size(), p.off.front());
        }
      }
      if (do_split) split_pieces(ps, repl, split_behavior::merged_next, false);
    });
  }
  return make_error("tokenizer.json: pre_tokenizer type \"{}\" is not supported", type);
}

// ---- decoders ----------------------------------------------------------------------------------
using decoder_fn = std::function<void(std::vector<std::string>&)>;

result<decoder_fn> make_decoder(const json& j, const byte_level_table* table) {
  if (j.is_null()) return decoder_fn();
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<decoder_fn> parts;
    for (const auto& n : j.value("decoders", json::array())) {
      LP_TRY_ASSIGN(f, make_decoder(n, table));
      if (f) parts.push_back(std::move(f));
    }
    return decoder_fn([parts](std::vector<std::string>& t) {
      for (const auto& f : parts) f(t);
    });
  }
  if (type == "ByteLevel")
    return decoder_fn([table](std::vector<std::string>& toks) {
      for (auto& t : toks) {
        std::string out;
        bool ok = true;
        for (size_t i = 0; i < t.size() && ok;) {
          auto it = table->to_byte.find(next_code_point(t, i));
          if (it == table->to_byte.end()) ok = false;
          else out += static_cast<char>(it->second);
        }
        if (ok) t = std::move(out);
      }
    });
  if (type == "Metaspace") {
    const std::string rep = j.value("replacement", "\xe2\x96\x81");
    std::string scheme = j.value("prepend_scheme", "");
    if (scheme.empty()) scheme = j.value("add_prefix_space", true) ? "always" : "never";
    return decoder_fn([rep, scheme](std::vector<std::string>& toks) {
      pattern_t p{rep, nullptr};
      for (size_t i = 0; i < toks.size(); ++i) {
        piece x{toks[i], std::vector<uint32_t>(toks[i].size(), 0)};
        toks[i] = replace_all(x, p, " ").text;
        if (i == 0 && scheme != "never" && !toks[i].empty() && toks[i][0] == ' ') toks[i].erase(0, 1);
      }
    });
  }
  if (type == "Replace") {
    LP_TRY_ASSIGN(pat, parse_pattern(j.value("pattern", json()), "decoder Replace"));
    const std::string content = j.value("content", "");
    return decoder_fn([pat, content](std::vector<std::string>& toks) {
      for (auto& t : toks) t = replace_all(piece{t, std::vector<uint32_t>(t.size(), 0)}, pat, content).text;
    });
  }
  if (type == "ByteFallback")
    return decoder_fn([](std::vector<std::string>& toks) {
      std::vector<std::string> out;
      std::string bytes;
      size_t nbytes = 0;
      auto flush = [&] {
        if (nbytes == 0) return;
        if (find_invalid_utf8(bytes) == std::string_view::npos) out.push_back(bytes);
        else
          for (size_t k = 0; k < nbytes; ++k) out.emplace_back("\xef\xbf\xbd");
        bytes.clear();
        nbytes = 0;
      };
      for (auto& t : toks) {
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
            std::isxdigit(static_cast<unsigned char>(t[4]))) {
          bytes += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
          ++nbytes;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      toks = std::move(out);
    });
  if (type == "Fuse")
    return decoder_fn([](std::vector<std::string>& toks) {
      std::string all;
      for (auto& t : toks) all += t;
      toks.assign(1, std::move(all));
    });
  if (type == "Strip") {
    const std::string content = j.value("content", " ");
    const int64_t start = j.value("start", int64_t{0}), stop = j.value("stop", int64_t{0});
    return decoder_fn([content, start, stop](std::vector<std::string>& toks) {
      for (auto& t : toks) {
        for (int64_t k = 0; k < start && t.compare(0, content.size(), content) == 0 && !content.empty(); ++k) t.erase(0, content.size());
        for (int64_t k = 0; k < stop && t.size() >= content.size() && !content.empty() &&
                            t.compare(t.size() - content.size(), content.size(), content) == 0; ++k)
          t.erase(t.size() - content.size());
      }
    });
  }
  return make_error("tokenizer.json: decoder type \"{}\" is not supported", type);
}

// ---- the tokenizer -----------------------------------------------------------------------------
struct added_token {
  int32_t id;
  std::string content;
  bool special, lstrip, rstrip, single_word;
};

class hf_tokenizer final : public tokenizer {
 public:
  static result<std::unique_ptr<hf_tokenizer>> parse(std::string_view text, const tokenizer_settings& settings);

  result<encoding> encode_with_offsets(std::string_view text, bool parse_special) const override {
    if (auto bad = find_invalid_utf8(text); bad != std::string_view::npos)
      return make_error("invalid UTF-8 at byte {}", bad);
    encoding enc;
    size_t pos = 0;
    bool at_start = true;
    while (pos < text.size()) {
      size_t mb = 0, me = 0;
      const added_token* tok = next_added(text, pos, parse_special, &mb, &me);
      const size_t seg_end = tok != nullptr ? mb : text.size();
      if (seg_end > pos) LP_TRY(encode_segment(text, pos, seg_end, at_start && pos == 0, enc));
      if (tok == nullptr) break;
      enc.ids.push_back(tok->id);
      enc.offsets.push_back(static_cast<uint32_t>(mb));
      pos = me;
      at_start = false;
    }
    return enc;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (int32_t id : ids)
      if (id >= 0 && static_cast<size_t>(id) < id_to_token_.size()) toks.push_back(id_to_token_[static_cast<size_t>(id)]);
    if (decoder_) decoder_(toks);
    std::string out;
    for (const auto& t : toks) out += t;
    return out;
  }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_token_.size()); }
  std::string kind() const override { return byte_level_ ? "tokenizer.json (byte-level BPE)" : "tokenizer.json (BPE)"; }
  bool parses_special_by_default() const override { return true; }
  std::optional<int32_t> token_id(std::string_view token) const override {
    for (const auto& a : added_)
      if (a.content == token) return a.id;
    auto it = vocab_.find(std::string(token));
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  std::string id_to_token(int32_t id) const override {
    return id >= 0 && static_cast<size_t>(id) < id_to_token_.size() ? id_to_token_[static_cast<size_t>(id)] : std::string();
  }
  std::vector<int32_t> special_prefix() const override { return prefix_; }
  std::vector<int32_t> special_suffix() const override { return suffix_; }

 private:
  // Leftmost-longest added token at or after `pos`.
  const added_token* next_added(std::string_view text, size_t pos, bool parse_special, size_t* mb, size_t* me) const {
    for (size_t i = pos; i < text.size(); ++i) {
      for (int idx : by_first_[static_cast<unsigned char>(text[i])]) {  // longest first
        const auto& a = added_[static_cast<size_t>(idx)];
        if (a.special && !parse_special) continue;
        if (text.compare(i, a.content.size(), a.content) != 0) continue;
        size_t b = i, e = i + a.content.size();
        if (a.single_word) {
          auto word = [](unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; };
          if ((b > 0 && word(static_cast<unsigned char>(text[b - 1]))) || (e < text.size() && word(static_cast<unsigned char>(text[e]))))
            continue;
        }
        if (a.lstrip) while (b > pos && std::isspace(static_cast<unsigned char>(text[b - 1]))) --b;
        if (a.rstrip) while (e < text.size() && std::isspace(static_cast<unsigned char>(text[e]))) ++e;
        *mb = b;
        *me = e;
        return &a;
      }
    }
    return nullptr;
  }

  status encode_segment(std::string_view text, size_t b, size_t e, bool first, encoding& enc) const {
    piece p;
    p.text.assign(text.substr(b, e - b));
    p.off.resize(p.text.size());
    for (size_t i = 0; i < p.off.size(); ++i) p.off[i] = static_cast<uint32_t>(b + i);
    p.first = first;
    if (normalizer_) {
      LP_TRY_ASSIGN(q, normalizer_(std::move(p)));
      p = std::move(q);
    }
    std::vector<piece> pieces;
    pieces.push_back(std::move(p));
    if (pretok_) pretok_(pieces);
    std::vector<std::pair<int32_t, uint32_t>> word;
    for (const auto& pc : pieces) {
      if (pc.text.empty()) continue;
      bpe_word(pc.text, word);
      for (auto [id, at] : word) {
        enc.ids.push_back(id);
        enc.offsets.push_back(pc.off[at]);
      }
    }
    return ok_status();
  }

  // BPE of one pre-token: (id, byte position of the token in `w`).
  void bpe_word(const std::string& w, std::vector<std::pair<int32_t, uint32_t>>& out) const {
    const bool cacheable = w.size() <= 64;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mu_);
      auto it = cache_.find(w);
      if (it != cache_.end()) {
        out = it->second;
        return;
      }
    }
    out.clear();
    if (ignore_merges_) {
      auto it = vocab_.find(w);
      if (it != vocab_.end()) {
        out.emplace_back(it->second, 0);
        store(w, out, cacheable);
        return;
      }
    }
    struct sym {
      int32_t id;
      uint32_t at;
      int prev, next;
      bool alive;
    };
    std::vector<sym> s;
    for (size_t i = 0; i < w.size();) {
      const size_t b = i;
      i += utf8_len(static_cast<unsigned char>(w[i]));
      std::string ch = w.substr(b, i - b);
      if (b > 0 && !prefix_cont_.empty()) ch.insert(0, prefix_cont_);
      if (i >= w.size() && !suffix_eow_.empty()) ch += suffix_eow_;
      auto it = vocab_.find(ch);
      if (it != vocab_.end()) {
        s.push_back({it->second, static_cast<uint32_t>(b), 0, 0, true});
      } else if (byte_fallback_ && byte_ids_[static_cast<unsigned char>(w[b])] >= 0) {
        for (size_t k = b; k < i; ++k) s.push_back({byte_ids_[static_cast<unsigned char>(w[k])], static_cast<uint32_t>(b), 0, 0, true});
      } else if (unk_ >= 0) {
        if (fuse_unk_ && !s.empty() && s.back().id == unk_) continue;
        s.push_back({unk_, static_cast<uint32_t>(b), 0, 0, true});
      }
    }
    const int n = static_cast<int>(s.size());
    for (int i = 0; i < n; ++i) s[static_cast<size_t>(i)].prev = i - 1, s[static_cast<size_t>(i)].next = i + 1 < n ? i + 1 : -1;
    // (rank, left index, left id, right id): stale entries are skipped when popped.
    using cand = std::tuple<int32_t, int, int32_t, int32_t>;
    std::priority_queue<cand, std::vector<cand>, std::greater<cand>> heap;
    auto push = [&](int l) {
      if (l < 0) return;
      const int r = s[static_cast<size_t>(l)].next;
      if (r < 0) return;
      auto it = merges_.find(key(s[static_cast<size_t>(l)].id, s[static_cast<size_t>(r)].id));
      if (it != merges_.end()) heap.emplace(it->second.first, l, s[static_cast<size_t>(l)].id, s[static_cast<size_t>(r)].id);
    };
    for (int i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      auto [rank, l, lid, rid] = heap.top();
      heap.pop();
      auto& L = s[static_cast<size_t>(l)];
      if (!L.alive || L.id != lid || L.next < 0) continue;
      auto& R = s[static_cast<size_t>(L.next)];
      if (R.id != rid) continue;
      L.id = merges_.at(key(lid, rid)).second;
      R.alive = false;
      L.next = R.next;
      if (R.next >= 0) s[static_cast<size_t>(R.next)].prev = l;
      push(L.prev);
      push(l);
    }
    for (int i = n > 0 ? 0 : -1; i >= 0; i = s[static_cast<size_t>(i)].next) out.emplace_back(s[static_cast<size_t>(i)].id, s[static_cast<size_t>(i)].at);
    store(w, out, cacheable);
  }
  void store(const std::string& w, const std::vector<std::pair<int32_t, uint32_t>>& out, bool cacheable) const {
    if (!cacheable) return;
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() > 200000) cache_.clear();
    cache_.emplace(w, out);
  }
  static uint64_t key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

  std::unique_ptr<byte_level_table> table_ = std::make_unique<byte_level_table>();
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (left,right) -> (rank, merged id)
  std::vector<std::string> id_to_token_;
  std::vector<added_token> added_;
  std::array<std::vector<int>, 256> by_first_;
  std::array<int32_t, 256> byte_ids_{};
  normalizer_fn normalizer_;
  pretok_fn pretok_;
  decoder_fn decoder_;
  std::vector<int32_t> prefix_, suffix_;
  std::string prefix_cont_, suffix_eow_;
  int32_t unk_ = -1, bos_ = -1, eos_ = -1;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false, byte_level_ = false;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<std::pair<int32_t, uint32_t>>> cache_;
};

// Post-processor: ids placed before/after a single sequence.
status parse_post_processor(const json& j, std::vector<int32_t>& prefix, std::vector<int32_t>& suffix) {
  if (j.is_null()) return ok_status();
  const std::string type = j.value("type", "");
  if (type == "ByteLevel") return ok_status();
  if (type == "Sequence") {
    for (const auto& p : j.value("processors", json::array())) LP_TRY(parse_post_processor(p, prefix, suffix));
    return ok_status();
  }
  if (type == "TemplateProcessing") {
    bool seen_a = false;
    for (const auto& item : j.value("single", json::array())) {
      if (item.contains("Sequence")) {
        seen_a = true;
        continue;
      }
      if (!item.contains("SpecialToken")) return make_error("tokenizer.json: post_processor template item {} is not supported", item.dump());
      const std::string name = item["SpecialToken"].value("id", "");
      const auto& st = j.value("special_tokens", json::object());
      if (!st.contains(name)) return make_error("tokenizer.json: post_processor names unknown special token \"{}\"", name);
      for (const auto& id : st[name].value("ids", json::array())) (seen_a ? suffix : prefix).push_back(id.get<int32_t>());
    }
    return ok_status();
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    prefix.push_back(j["cls"][1].get<int32_t>());
    suffix.push_back(j["sep"][1].get<int32_t>());
    return ok_status();
  }
  return make_error("tokenizer.json: post_processor type \"{}\" is not supported", type);
}

result<std::unique_ptr<hf_tokenizer>> hf_tokenizer::parse(std::string_view text, const tokenizer_settings& settings) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    return make_error("tokenizer.json: invalid JSON: {}", e.what());
  }
  try {
    auto t = std::make_unique<hf_tokenizer>();
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) return make_error("tokenizer.json: no \"model\" object");
    const auto& m = j["model"];
    const std::string type = m.value("type", "BPE");
    if (type != "BPE") return make_error("tokenizer.json: model type \"{}\" is not supported (only BPE)", type);
    if (!m.contains("vocab") || !m["vocab"].is_object()) return make_error("tokenizer.json: model.vocab must be an object");
    int32_t max_id = -1;
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() > (1 << 24))
        return make_error("tokenizer.json: model.vocab[\"{}\"] is not a valid id", it.key());
      const auto id = it.value().get<int32_t>();
      t->vocab_[it.key()] = id;
      max_id = std::max(max_id, id);
    }
    for (const auto& a : j.value("added_tokens", json::array())) {
      added_token at{a.at("id").get<int32_t>(), a.at("content").get<std::string>(), a.value("special", false),
                     a.value("lstrip", false), a.value("rstrip", false), a.value("single_word", false)};
      if (at.id < 0 || at.id > (1 << 24) || at.content.empty()) return make_error("tokenizer.json: invalid added token \"{}\"", at.content);
      max_id = std::max(max_id, at.id);
      t->added_.push_back(std::move(at));
    }
    t->id_to_token_.resize(static_cast<size_t>(max_id + 1));
    for (const auto& [s, id] : t->vocab_) t->id_to_token_[static_cast<size_t>(id)] = s;
    for (const auto& a : t->added_) t->id_to_token_[static_cast<size_t>(a.id)] = a.content;
    std::vector<int> order(t->added_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return t->added_[static_cast<size_t>(a)].content.size() > t->added_[static_cast<size_t>(b)].content.size(); });
    for (int i : order) t->by_first_[static_cast<unsigned char>(t->added_[static_cast<size_t>(i)].content[0])].push_back(i);

    auto opt_string = [&](const char* k) { return m.contains(k) && m[k].is_string() ? m[k].get<std::string>() : std::string(); };
    t->prefix_cont_ = opt_string("continuing_subword_prefix");
    t->suffix_eow_ = opt_string("end_of_word_suffix");
    t->byte_fallback_ = m.value("byte_fallback", false);
    t->fuse_unk_ = m.value("fuse_unk", false);
    t->ignore_merges_ = m.value("ignore_merges", false);
    if (const std::string unk = opt_string("unk_token"); !unk.empty()) {
      auto it = t->vocab_.find(unk);
      if (it == t->vocab_.end()) return make_error("tokenizer.json: unk_token \"{}\" is not in the vocabulary", unk);
      t->unk_ = it->second;
    }
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto it = t->vocab_.find(name);
      t->byte_ids_[static_cast<size_t>(b)] = it == t->vocab_.end() ? -1 : it->second;
    }
    int32_t rank = 0;
    for (const auto& mg : m.value("merges", json::array())) {
      std::string a, b;
      if (mg.is_string()) {
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) return make_error("tokenizer.json: merge \"{}\" is not \"a b\"", s);
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else if (mg.is_array() && mg.size() == 2) {
        a = mg[0].get<std::string>(), b = mg[1].get<std::string>();
      } else return make_error("tokenizer.json: merge {} is neither \"a b\" nor [a, b]", mg.dump());
      auto ia = t->vocab_.find(a), ib = t->vocab_.find(b);
      std::string merged = a + (t->prefix_cont_.empty() || b.compare(0, t->prefix_cont_.size(), t->prefix_cont_) != 0 ? b : b.substr(t->prefix_cont_.size()));
      auto im = t->vocab_.find(merged);
      if (ia == t->vocab_.end() || ib == t->vocab_.end() || im == t->vocab_.end())
        return make_error("tokenizer.json: merge #{} (\"{}\" \"{}\") uses a token missing from the vocabulary", rank, a, b);
      t->merges_.emplace(key(ia->second, ib->second), std::make_pair(rank++, im->second));
    }
    LP_TRY_ASSIGN(norm, make_normalizer(j.value("normalizer", json())));
    t->normalizer_ = std::move(norm);
    pretok_context ctx{t->table_.get()};
    LP_TRY_ASSIGN(pre, make_pretokenizer(j.value("pre_tokenizer", json()), ctx));
    t->pretok_ = std::move(pre);
    t->byte_level_ = ctx.byte_level;
    LP_TRY_ASSIGN(dec, make_decoder(j.value("decoder", json()), t->table_.get()));
    t->decoder_ = std::move(dec);
    LP_TRY(parse_post_processor(j.value("post_processor", json()), t->prefix_, t->suffix_));

    auto lookup = [&](const std::string& name) -> int32_t {
      if (name.empty()) return -1;
      auto id = t->token_id(name);
      return id ? *id : -1;
    };
    t->bos_ = lookup(settings.bos_token);
    if (t->bos_ < 0 && !t->prefix_.empty()) t->bos_ = t->prefix_.front();
    t->eos_ = lookup(settings.eos_token);
    if (t->eos_ < 0 && !t->suffix_.empty()) t->eos_ = t->suffix_.back();
    if (t->eos_ < 0)
      for (const char* name : {"</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<eos>"})
        if ((t->eos_ = lookup(name)) >= 0) break;
    return t;
  } catch (const json::exception& e) {
    return make_error("tokenizer.json: {}", e.what());
  }
}

}  // namespace

result<std::unique_ptr<tokenizer>> parse_hf_tokenizer(std::string_view json_text, const tokenizer_settings& settings) {
  LP_TRY_ASSIGN(t, hf_tokenizer::parse(json_text, settings));
  return std::unique_ptr<tokenizer>(std::move(t));
}

result<std::unique_ptr<tokenizer>> load_hf_tokenizer(const std::filesystem::path& json_file, const tokenizer_settings& settings) {
  LP_TRY_ASSIGN(text, read_text_file(json_file));
  auto t = parse_hf_tokenizer(text, settings);
  if (!t) return make_error("{}: {}", json_file.string(), t.message());
  return t;
}

}  // namespace lorapipe
