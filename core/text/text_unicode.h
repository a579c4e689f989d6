// UTF-8 and Unicode helpers shared by the tokenizers and the chat-template engine: validation,
// code-point iteration, normalisation (utf8proc) and a PCRE2 regex with Unicode classes (\p{L}).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

// Byte offset of the first invalid UTF-8 sequence, or npos when `s` is valid.
size_t find_invalid_utf8(std::string_view s);
// Length in bytes of the UTF-8 sequence starting with byte `b` (1 for invalid lead bytes).
inline size_t utf8_len(unsigned char b) { return b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1; }
// Appends code point `cp` as UTF-8.
void append_utf8(std::string& out, uint32_t cp);
// Decodes the code point at s[i] (valid UTF-8 assumed) and advances i.
uint32_t next_code_point(std::string_view s, size_t& i);

enum class unicode_form { nfc, nfd, nfkc, nfkd };
// Normalises valid UTF-8 text.
result<std::string> normalize_unicode(std::string_view s, unicode_form form);
std::string lowercase_utf8(std::string_view s);

// A compiled PCRE2 pattern (UTF + UCP, JIT when available). Move-only; RAII over the PCRE2 handles.
class unicode_regex {
 public:
  static result<unicode_regex> compile(const std::string& pattern);
  unicode_regex(unicode_regex&&) noexcept;
  unicode_regex& operator=(unicode_regex&&) noexcept;
  ~unicode_regex();
  // All non-overlapping matches in `s` (valid UTF-8) as [begin, end) byte ranges; empty matches skipped.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;
  const std::string& pattern() const { return pattern_; }

 private:
  unicode_regex() = default;
  struct impl;
  std::unique_ptr<impl> impl_;
  std::string pattern_;
};

}  // namespace lorapipe
