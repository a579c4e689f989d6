// The data report: see data_report.h.
#include "core/data/data_report.h"

#include "core/data/training_data.h"
#include "core/text/prompt.h"

namespace lorapipe {
namespace fs = std::filesystem;

result<data_report> make_data_report(const project_config& cfg, int64_t examples, const std::string& open,
                                     const std::string& close, const progress_fn& progress) {
  const fs::path model = cfg.resolve(cfg.model.path);
  const fs::path tok_path = cfg.tokenizer.path.empty() ? model : cfg.resolve(cfg.tokenizer.path);
  auto tok = load_tokenizer(tok_path);
  if (!tok) return make_error("tokenizer: {}", tok.message());
  LP_TRY_ASSIGN(td, load_training_data(cfg, **tok, tokenizer_dir(tok_path), static_cast<size_t>(std::max<int64_t>(0, examples)),
                                       progress));
  data_report r;
  r.data_path = cfg.resolve(cfg.data.train).string();
  r.tokenizer_path = tok_path.string();
  r.tokenizer_kind = (*tok)->kind();
  r.format = data_format_name(td.stats.format);
  r.format_detected = cfg.data.format == "auto";
  r.template_source = td.template_source;
  r.stats = td.stats;
  r.train_sequences = td.train.size();
  r.val_sequences = td.val.size();
  r.seq_len = cfg.data.seq_len;
  r.packing = cfg.data.packing;
  for (auto& e : td.preview) {
    std::string marked = render_masked(e, **tok, open, close);
    r.preview.push_back({std::move(e), std::move(marked)});
  }
  return r;
}

}  // namespace lorapipe
