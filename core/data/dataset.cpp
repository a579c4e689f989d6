// Text datasets and sampling: see dataset.h.
#include "core/data/dataset.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "core/base/safetensors.h"

namespace lorapipe {

namespace {
// Splits at blank lines ("\n\n" possibly with spaces between); keeps inner newlines.
std::vector<std::string_view> split_documents(std::string_view text) {
  std::vector<std::string_view> docs;
  size_t start = 0, i = 0;
  auto push = [&](size_t end) {
    auto d = text.substr(start, end - start);
    while (!d.empty() && (d.back() == '\n' || d.back() == '\r' || d.back() == ' ')) d.remove_suffix(1);
    while (!d.empty() && (d.front() == '\n' || d.front() == '\r')) d.remove_prefix(1);
    if (!d.empty()) docs.push_back(d);
  };
  while (i < text.size()) {
    if (text[i] == '\n') {
      size_t j = i + 1;
      while (j < text.size() && (text[j] == ' ' || text[j] == '\t' || text[j] == '\r')) ++j;
      if (j < text.size() && text[j] == '\n') {
        push(i);
        while (j < text.size() && (text[j] == '\n' || text[j] == '\r' || text[j] == ' ' || text[j] == '\t')) ++j;
        start = i = j;
        continue;
      }
    }
    ++i;
  }
  push(text.size());
  return docs;
}

token_windows make_windows(std::vector<int32_t> tokens, int64_t seq_len) {
  token_windows w;
  w.seq_len = seq_len;
  w.tokens = std::move(tokens);
  for (int64_t s = 0; s + seq_len + 1 <= static_cast<int64_t>(w.tokens.size()); s += seq_len) w.starts.push_back(s);
  return w;
}
}  // namespace

void add_to_length_histogram(std::vector<std::pair<int64_t, int64_t>>& histogram, int64_t length) {
  int64_t bound = 1;
  while (bound < length) bound *= 2;
  auto it = std::find_if(histogram.begin(), histogram.end(), [&](const auto& h) { return h.first == bound; });
  if (it == histogram.end()) histogram.emplace_back(bound, 1);
  else ++it->second;
}

result<text_dataset> load_text_dataset(const text_dataset_options& opt, const tokenizer& tok) {
  if (opt.seq_len < 2) return make_error("seq_len must be at least 2 (got {})", opt.seq_len);
  if (opt.val_fraction < 0 || opt.val_fraction >= 1) return make_error("val_fraction must be in [0, 1)");
  LP_TRY_ASSIGN(text, read_text_file(opt.path));
  auto docs = split_documents(text);
  if (docs.empty()) return make_error("{}: corpus is empty", opt.path.string());
  std::vector<int32_t> stream;
  stream.reserve(text.size() / 3);
  int64_t done = 0;
  text_dataset ds;
  ds.min_len = std::numeric_limits<int64_t>::max();
  for (auto d : docs) {
    if (opt.progress && done++ % 64 == 0 && !opt.progress(done - 1, static_cast<int64_t>(docs.size())))
      return make_error("cancelled");
    LP_TRY_ASSIGN(ids, tok.encode(d));
    const size_t start = stream.size();
    if (opt.add_bos && tok.bos_id() >= 0) stream.push_back(tok.bos_id());
    stream.insert(stream.end(), ids.begin(), ids.end());
    if (opt.add_eos && tok.eos_id() >= 0) stream.push_back(tok.eos_id());
    const auto n = static_cast<int64_t>(stream.size() - start);
    ds.min_len = std::min(ds.min_len, n);
    ds.max_len = std::max(ds.max_len, n);
    add_to_length_histogram(ds.histogram, n);
    if (ds.preview.size() < opt.preview) ds.preview.emplace_back(stream.begin() + static_cast<std::ptrdiff_t>(start), stream.end());
  }
  std::sort(ds.histogram.begin(), ds.histogram.end());
  ds.documents = static_cast<int64_t>(docs.size());
  ds.total_tokens = static_cast<int64_t>(stream.size());
  const int64_t n = ds.total_tokens;
  int64_t n_val = opt.val_fraction > 0 ? static_cast<int64_t>(std::ceil(n * opt.val_fraction)) : 0;
  if (n_val > 0) n_val = std::max(n_val, opt.seq_len + 1);
  if (n - n_val < opt.seq_len + 1)
    return make_error("{}: corpus too small: {} tokens ({} held out for validation) cannot fill one window of {}",
                      opt.path.string(), n, n_val, opt.seq_len + 1);
  std::vector<int32_t> val(stream.end() - n_val, stream.end());
  stream.resize(n - n_val);
  ds.train = make_windows(std::move(stream), opt.seq_len);
  ds.val = make_windows(std::move(val), opt.seq_len);
  return ds;
}

int64_t epoch_sampler::at(int64_t cursor) {
  const int64_t epoch = cursor / n_;
  if (epoch != epoch_) {
    // Fisher-Yates with our own RNG draws so the order is the same with every standard library.
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) + 1);
    perm_.resize(n_);
    for (int64_t i = 0; i < n_; ++i) perm_[i] = i;
    for (int64_t i = n_ - 1; i > 0; --i) {
      int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(perm_[i], perm_[j]);
    }
    epoch_ = epoch;
  }
  return perm_[cursor % n_];
}

uint64_t windows_fingerprint(const token_windows& w) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, a token (or a mask byte) at a time
  const size_t n = static_cast<size_t>(w.seq_len + 1);
  for (int64_t i = 0; i < w.size(); ++i) {
    const int32_t* t = w.window(i);
    for (size_t k = 0; k < n; ++k) h = (h ^ static_cast<uint32_t>(t[k])) * 1099511628211ull;
    if (const uint8_t* m = w.window_mask(i))
      for (size_t k = 0; k < n; ++k) h = (h ^ m[k]) * 1099511628211ull;
  }
  return h;
}

}  // namespace lorapipe
