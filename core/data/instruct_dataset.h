// Training data beyond plain text: alpaca JSONL (instruction/input/output), chat JSONL (messages, or
// ShareGPT conversations with from/value),
// prompt/completion JSONL; format autodetection; rendering through the model's chat template; loss
// masks so only assistant/completion tokens are trained on; packing into fixed-length sequences or
// one padded sequence per example; truncation; a seeded shuffle; a line-streaming JSONL reader with
// line-numbered errors (stop, or skip and count); statistics for the CLI and GUI.
#pragma once

#include <array>
#include <functional>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/text/chat_template.h"
#include "core/data/dataset.h"
#include "core/base/result.h"
#include "core/text/tokenizer.h"

namespace lorapipe {

enum class data_format { text, alpaca, chat, completion };
result<data_format> parse_data_format(const std::string& name);  // text, alpaca, chat, completion
const char* data_format_name(data_format f);

// Reads a JSONL file one line at a time (never the whole file); blank lines are skipped.
class jsonl_reader {
 public:
  static result<jsonl_reader> open(const std::filesystem::path& path);
  // Next record; nullopt at the end; an error names the line ("file:line: ...").
  result<std::optional<nlohmann::ordered_json>> next();
  int64_t line() const { return line_; }

 private:
  std::filesystem::path path_;
  std::unique_ptr<std::ifstream> in_;
  int64_t line_ = 0;
};

// Looks at the first records of a file: .txt (or not JSON) = text, else by keys.
result<data_format> detect_data_format(const std::filesystem::path& path);

struct instruct_options {
  std::filesystem::path path;
  std::string format = "auto";       // auto | text | alpaca | chat | completion
  std::string train_on = "completion";  // completion (assistant / completion tokens only) | all
  int64_t seq_len = 128;
  bool packing = true;               // pack examples back to back; else one padded example per sequence
  std::string truncation = "right";  // right (keep the start) | left (keep the end) | drop (skip the example)
  std::string on_error = "stop";     // stop | skip (count and continue) for malformed records
  double val_fraction = 0.05;        // of the examples, after the seeded shuffle
  bool add_bos = true, add_eos = true;  // around each example (EOS only when the template adds none)
  uint64_t seed = 1234;
  std::optional<chat_template> templ;   // chat/alpaca rendering; nullopt = the built-in template
  // Non-empty: examples and windows are written to files here and memory-mapped, so only a small
  // index per example stays in RAM (datasets larger than memory). Empty: everything in memory.
  std::filesystem::path spill_dir;
  progress_fn progress;  // called every 256 records (done = records read); false stops with "cancelled"
  jinja::dict_t template_vars;          // bos_token, eos_token, ...
};

// One example after rendering and tokenisation.
struct tokenized_example {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;  // 1 = trained on
  std::string text;           // rendered text
  int64_t line = 0;
};

struct dataset_stats {
  data_format format = data_format::text;
  int64_t records = 0, examples = 0, skipped = 0, truncated = 0, dropped = 0;
  int64_t tokens = 0, trained_tokens = 0;
  int64_t min_len = 0, max_len = 0;
  double mean_len = 0;
  std::vector<std::pair<int64_t, int64_t>> histogram;  // (upper bound of the bucket, count); powers of two
  std::vector<std::string> skipped_errors;             // first few "line N: ..." messages
};

struct instruct_dataset {
  token_windows train, val;
  dataset_stats stats;
  std::vector<tokenized_example> preview;  // the first few examples, for `data inspect`
};

// Turns one record into an example (exposed for tests and `data inspect`).
result<tokenized_example> tokenize_record(const nlohmann::ordered_json& rec, data_format fmt, const instruct_options& opt,
                                          const chat_template& templ, const tokenizer& tok);

result<instruct_dataset> load_instruct_dataset(const instruct_options& opt, const tokenizer& tok, size_t preview = 3);

// Human-readable example: trained spans wrapped in the given markers.
std::string render_masked(const tokenized_example& ex, const tokenizer& tok, const std::string& open = "[[",
                          const std::string& close = "]]");

}  // namespace lorapipe
