// Plain-text corpora -> tokens -> packed fixed-length training windows, with a held-out validation
// part and a deterministic, seedable sampler whose only state is a cursor (so runs can resume).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "core/base/cancel.h"
#include "core/base/result.h"
#include "core/text/tokenizer.h"

namespace lorapipe {

// Windows of seq_len+1 tokens over one token stream: inputs = w[0..T), labels = w[1..T]. With a
// loss mask (one byte per token, 1 = trained on), label t is -100 where mask[t+1] == 0.
struct token_windows {
  int64_t seq_len = 0;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;  // empty: every token is a target
  std::vector<int64_t> starts;
  // Disk-backed storage (memory-mapped files) used instead of the vectors when set.
  const int32_t* mapped_tokens = nullptr;
  const uint8_t* mapped_mask = nullptr;
  std::shared_ptr<const void> mapping;
  int64_t size() const { return static_cast<int64_t>(starts.size()); }
  const int32_t* window(int64_t i) const { return (mapped_tokens != nullptr ? mapped_tokens : tokens.data()) + starts[i]; }
  const uint8_t* window_mask(int64_t i) const {
    if (mapped_mask != nullptr) return mapped_mask + starts[i];
    return mask.empty() ? nullptr : mask.data() + starts[i];
  }
  bool has_mask() const { return mapped_mask != nullptr || !mask.empty(); }
};

struct text_dataset_options {
  std::filesystem::path path;
  int64_t seq_len = 128;
  double val_fraction = 0.05;  // last fraction of the token stream is held out
  bool add_bos = true;         // each document starts with BOS
  bool add_eos = true;         // and ends with EOS
  progress_fn progress;        // called every 64 documents; false stops with "cancelled"
  size_t preview = 0;          // keep the ids of this many first documents (data inspection)
};

// FNV-1a over every window's tokens and loss mask, in order: equal for equal training data (what
// the ranks of a run over several processes compare before the first step).
uint64_t windows_fingerprint(const token_windows& w);

// Adds a length to a histogram of (upper bound, count) buckets at powers of two.
void add_to_length_histogram(std::vector<std::pair<int64_t, int64_t>>& histogram, int64_t length);

struct text_dataset {
  token_windows train, val;
  int64_t documents = 0;
  int64_t total_tokens = 0;
  int64_t min_len = 0, max_len = 0;                      // tokens per document (with BOS/EOS)
  std::vector<std::pair<int64_t, int64_t>> histogram;    // of document lengths, sorted by bound
  std::vector<std::vector<int32_t>> preview;             // the first opt.preview documents
};

// Documents are separated by blank lines. Errors: missing/empty file, corpus too small for one window.
result<text_dataset> load_text_dataset(const text_dataset_options& opt, const tokenizer& tok);

// An endless, per-epoch reshuffled stream over n sequences; position `cursor` -> sequence index.
// Deterministic in (seed, cursor), so the cursor is the whole data-loader state.
class epoch_sampler {
 public:
  epoch_sampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {}
  int64_t at(int64_t cursor);

 private:
  int64_t n_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> perm_;
};

}  // namespace lorapipe
