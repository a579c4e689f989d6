// What the trainer will see of a project's data, as a value: format, counts, token-length
// histogram, truncation, and a few examples with the trained (unmasked) tokens marked. The CLI
// prints it (`data inspect`), the GUI shows it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/cancel.h"
#include "core/base/result.h"
#include "core/data/instruct_dataset.h"
#include "core/project/project.h"

namespace lorapipe {

struct data_report_example {
  tokenized_example example;  // ids, loss mask, source line
  std::string marked;         // decoded text, trained tokens between the markers
};

struct data_report {
  std::string data_path, tokenizer_path, tokenizer_kind;
  std::string format;            // text, alpaca, chat, completion
  bool format_detected = false;  // data.format was auto
  std::string template_source;   // chat template used ("" for text)
  dataset_stats stats;
  int64_t train_sequences = 0, val_sequences = 0;
  int64_t seq_len = 0;
  bool packing = true;
  std::vector<data_report_example> preview;
};

// Loads the project's tokenizer and data as training would; `examples` previews, trained tokens
// marked with open/close (e.g. "[[" "]]", or terminal colour codes).
result<data_report> make_data_report(const project_config& cfg, int64_t examples, const std::string& open = "[[",
                                     const std::string& close = "]]", const progress_fn& progress = {});

}  // namespace lorapipe
