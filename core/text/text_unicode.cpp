// UTF-8, normalisation and regex helpers: see text_unicode.h.
#include "core/text/text_unicode.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>

namespace lorapipe {

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    const unsigned char b = p[i];
    if (b < 0x80) { ++i; continue; }
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if ((b >> 5) == 6) { n = 2; cp = b & 0x1f; min = 0x80; }
    else if ((b >> 4) == 14) { n = 3; cp = b & 0x0f; min = 0x800; }
    else if ((b >> 3) == 30) { n = 4; cp = b & 0x07; min = 0x10000; }
    else return i;
    if (i + n > s.size()) return i;
    for (size_t k = 1; k < n; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += n;
  }
  return std::string_view::npos;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) out += static_cast<char>(cp);
  else if (cp < 0x800) { out += static_cast<char>(0xc0 | (cp >> 6)); out += static_cast<char>(0x80 | (cp & 0x3f)); }
  else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12)); out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18)); out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f)); out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

uint32_t next_code_point(std::string_view s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = utf8_len(b);
  uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1f) : n == 3 ? (b & 0x0f) : (b & 0x07);
  for (size_t k = 1; k < n && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  i += n;
  return cp;
}

result<std::string> normalize_unicode(std::string_view s, unicode_form form) {
  if (s.empty()) return std::string();
  int opts = UTF8PROC_STABLE;
  switch (form) {
    case unicode_form::nfc: opts |= UTF8PROC_COMPOSE; break;
    case unicode_form::nfd: opts |= UTF8PROC_DECOMPOSE; break;
    case unicode_form::nfkc: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case unicode_form::nfkd: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* out = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                              &out, static_cast<utf8proc_option_t>(opts));
  if (n < 0) return make_error("unicode normalisation failed: {}", utf8proc_errmsg(n));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> guard(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
}

std::string lowercase_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(next_code_point(s, i)))));
  return out;
}

struct unicode_regex::impl {
  pcre2_code* code = nullptr;
  ~impl() { if (code != nullptr) pcre2_code_free(code); }
};

unicode_regex::unicode_regex(unicode_regex&&) noexcept = default;
unicode_regex& unicode_regex::operator=(unicode_regex&&) noexcept = default;
unicode_regex::~unicode_regex() = default;

result<unicode_regex> unicode_regex::compile(const std::string& pattern) {
  int err = 0;
  PCRE2_SIZE off = 0;
  unicode_regex r;
  r.pattern_ = pattern;
  r.impl_ = std::make_unique<impl>();
  r.impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (r.impl_->code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return make_error("regex /{}/ at offset {}: {}", pattern, off, reinterpret_cast<const char*>(msg));
  }
  (void)pcre2_jit_compile(r.impl_->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter
  return r;
}

std::vector<std::pair<size_t, size_t>> unicode_regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(pcre2_match_data_create_from_pattern(impl_->code, nullptr),
                                                                         &pcre2_match_data_free);
  size_t start = 0;
  while (start <= s.size()) {
    const int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), start, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    size_t b = ov[0], e = ov[1];
    if (e == b) {  // empty match: step one code point
      if (b >= s.size()) break;
      start = b + utf8_len(static_cast<unsigned char>(s[b]));
      continue;
    }
    out.emplace_back(b, e);
    start = e;
  }
  return out;
}

}  // namespace lorapipe
