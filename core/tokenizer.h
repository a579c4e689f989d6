// Tokenizers behind one interface. Today: SentencePiece (tokenizer.model). A model folder is
// searched for a tokenizer automatically; encode() never adds BOS/EOS (callers decide).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace lorapipe {

class tokenizer {
 public:
  virtual ~tokenizer() = default;
  virtual result<std::vector<int32_t>> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual std::string kind() const = 0;

  // Text of `ids` as it continues `prefix` (SentencePiece drops a leading space on its own).
  std::string decode_continuation(const std::vector<int32_t>& prefix, const std::vector<int32_t>& ids) const;
};

// path: a tokenizer.model file, or a folder (model folder) holding one; for a llama2.c .bin model
// the folder of the .bin is searched (tokenizer.model, then any *.model).
result<std::unique_ptr<tokenizer>> load_tokenizer(const std::filesystem::path& path);
// Where load_tokenizer would look for a model given by `model_path`; error if none found.
result<std::filesystem::path> find_tokenizer_for_model(const std::filesystem::path& model_path);

}  // namespace lorapipe
