// lorapipe-cli data inspect: what the trainer will see — format, counts, token-length histogram,
// truncation, and a few examples rendered with the trained (unmasked) tokens marked.
#include "app/cli_data.h"

#include <unistd.h>

#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/engine/model_session.h"
#include "core/project/project.h"

namespace lorapipe {
namespace fs = std::filesystem;

result<std::string> data_inspect_report(const std::string& project_path, int64_t examples, bool as_json, bool color) {
  LP_TRY_ASSIGN(cfg, load_project(project_path));
  const std::string open = color ? "\x1b[1;32m" : "[[", close = color ? "\x1b[0m" : "]]";
  LP_TRY_ASSIGN(td, inspect_data(cfg, examples, open, close));
  const auto& s = td.stats;
  if (as_json) {
    nlohmann::ordered_json j = {{"format", td.format}, {"template", td.template_source},
                                {"records", s.records}, {"examples", s.examples}, {"skipped", s.skipped},
                                {"truncated", s.truncated}, {"dropped", s.dropped}, {"tokens", s.tokens},
                                {"trained_tokens", s.trained_tokens}, {"min_len", s.min_len}, {"max_len", s.max_len},
                                {"mean_len", s.mean_len}, {"train_sequences", td.train_sequences}, {"val_sequences", td.val_sequences},
                                {"skipped_errors", s.skipped_errors}};
    auto& h = j["histogram"] = nlohmann::ordered_json::array();
    for (auto [bound, n] : s.histogram) h.push_back({{"max_tokens", bound}, {"count", n}});
    auto& ex = j["preview"] = nlohmann::ordered_json::array();
    for (const auto& [e, marked] : td.preview)
      ex.push_back({{"line", e.line}, {"tokens", e.ids.size()}, {"text", marked}, {"ids", e.ids}, {"mask", e.mask}});
    return j.dump(2) + "\n";
  }
  std::string out = fmt::format("data      {} ({} format{})\ntokenizer {} ({})\n", td.data_path, td.format,
                                td.format_detected ? ", detected" : "", td.tokenizer_path, td.tokenizer_kind);
  if (!td.template_source.empty()) out += fmt::format("template  {}\n", td.template_source);
  out += fmt::format("examples  {} of {} records ({} skipped as malformed, {} truncated to {} tokens, {} dropped)\n", s.examples,
                     s.records > 0 ? s.records : s.examples, s.skipped, s.truncated, cfg.data.seq_len + 1, s.dropped);
  out += fmt::format("tokens    {} in all, {} trained on ({:.1f}%); per example min {} mean {:.1f} max {}\n", s.tokens, s.trained_tokens,
                     s.tokens > 0 ? 100.0 * static_cast<double>(s.trained_tokens) / static_cast<double>(s.tokens) : 0.0, s.min_len,
                     s.mean_len, s.max_len);
  out += fmt::format("sequences {} train, {} validation (seq_len {}, {})\n", td.train_sequences, td.val_sequences, cfg.data.seq_len,
                     cfg.data.packing ? "packed" : "one example each");
  for (const auto& e : s.skipped_errors) out += fmt::format("skipped   {}\n", e);
  if (!s.histogram.empty()) {
    out += "length histogram (tokens per example):\n";
    int64_t peak = 1;
    for (auto [b, n] : s.histogram) peak = std::max(peak, n);
    int64_t lo = 1;
    for (auto [b, n] : s.histogram) {
      out += fmt::format("  {:>6}-{:<6} {:>7}  {}\n", lo, b, n, std::string(static_cast<size_t>(40 * n / peak), '#'));
      lo = b + 1;
    }
  }
  for (size_t i = 0; i < td.preview.size(); ++i) {
    const auto& [e, marked] = td.preview[i];
    out += fmt::format("\n--- example {} (line {}, {} tokens; trained tokens {}) ---\n{}\n", i + 1, e.line, e.ids.size(),
                       color ? "in green" : "between [[ ]]", marked);
  }
  return out;
}

}  // namespace lorapipe
