// Tokenizers behind one interface: SentencePiece (tokenizer.model) and Hugging Face tokenizer.json
// (hf_tokenizer.cpp). A model folder is searched automatically (tokenizer.json first, as transformers'
// fast tokenizers do). encode() never adds BOS/EOS (callers decide); encode_with_offsets() also gives
// where each token starts in the input, which the datasets use to map loss masks onto tokens.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

struct encoding {
  std::vector<int32_t> ids;
  std::vector<uint32_t> offsets;  // byte offset in the input where each token starts
};

class tokenizer {
 public:
  virtual ~tokenizer() = default;
  // parse_special: text of special tokens (e.g. "<|im_start|>", "</s>") becomes their ids.
  // Invalid UTF-8 is rejected with the byte offset in the error.
  virtual result<encoding> encode_with_offsets(std::string_view text, bool parse_special) const = 0;
  // Ids with this tokenizer's default special-token handling (HF tokenizer.json: special tokens are
  // matched, as transformers does; SentencePiece: plain sp.encode, special text is ordinary text).
  result<std::vector<int32_t>> encode(std::string_view text) const;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when the tokenizer has none
  virtual int32_t eos_id() const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual std::string kind() const = 0;
  virtual bool parses_special_by_default() const = 0;
  virtual std::optional<int32_t> token_id(std::string_view token) const = 0;
  virtual std::string id_to_token(int32_t id) const = 0;
  // Ids the tokenizer's post-processor puts around a single sequence (e.g. BOS); informational.
  virtual std::vector<int32_t> special_prefix() const { return {}; }
  virtual std::vector<int32_t> special_suffix() const { return {}; }

  // Text of `ids` as it continues `prefix` (SentencePiece drops a leading space on its own).
  std::string decode_continuation(const std::vector<int32_t>& prefix, const std::vector<int32_t>& ids) const;
};

// Splits `text` at special-token strings (leftmost match, longest on ties): calls segment(begin, end)
// for the text between them and appends each special token's id and offset to `enc`. Shared by the
// SentencePiece and tiktoken tokenizers (tokenizer.json has its own added-token rules).
status split_on_specials(std::string_view text, const std::vector<std::pair<std::string, int32_t>>& specials, encoding& enc,
                         const std::function<status(size_t, size_t)>& segment);

// What tokenizer_config.json next to a tokenizer says (all optional).
struct tokenizer_settings {
  std::string chat_template;  // Jinja source; empty when none
  std::string bos_token, eos_token;
  std::optional<bool> add_bos_token, add_eos_token;
};
// Reads tokenizer_config.json from `dir` (missing file: empty settings). Templates given as a list of
// {name, template} use the one named "default".
result<tokenizer_settings> load_tokenizer_settings(const std::filesystem::path& dir);

// path: tokenizer.json, tokenizer.model (SentencePiece, or tiktoken ranks as in Meta's Llama-3
// release), *.tiktoken, or a folder holding one (tokenizer.json preferred); for a llama2.c .bin model
// the folder of the .bin is searched.
result<std::unique_ptr<tokenizer>> load_tokenizer(const std::filesystem::path& path);
// Where load_tokenizer would look for a model given by `model_path`; error if none found.
result<std::filesystem::path> find_tokenizer_for_model(const std::filesystem::path& model_path);
// HF tokenizer.json (hf_tokenizer.cpp); `settings` supplies BOS/EOS names when present.
result<std::unique_ptr<tokenizer>> load_hf_tokenizer(const std::filesystem::path& json_file, const tokenizer_settings& settings);
result<std::unique_ptr<tokenizer>> parse_hf_tokenizer(std::string_view json_text, const tokenizer_settings& settings);
// tiktoken rank files (*.tiktoken, or Meta's original Llama-3 tokenizer.model); tiktoken_tokenizer.cpp.
result<std::unique_ptr<tokenizer>> load_tiktoken_tokenizer(const std::filesystem::path& file);
bool looks_like_tiktoken(std::string_view head);

}  // namespace lorapipe
