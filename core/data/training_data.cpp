// Project training data: see training_data.h.
#include "core/data/training_data.h"

#include "core/base/safetensors.h"

namespace lorapipe {
namespace fs = std::filesystem;

result<training_data> load_training_data(const project_config& cfg, const tokenizer& tok, const fs::path& tok_dir, size_t preview, const progress_fn& progress) {
  const fs::path path = cfg.resolve(cfg.data.train);
  data_format fmt;
  if (cfg.data.format == "auto") {
    auto f = detect_data_format(path);
    if (!f) return make_error("data.train: {}", f.message());
    fmt = *f;
  } else {
    auto f = parse_data_format(cfg.data.format);
    if (!f) return make_error("data.format: {}", f.message());
    fmt = *f;
  }
  training_data td;
  const bool jsonl = fmt != data_format::text || path.extension() == ".jsonl";
  if (!jsonl) {
    text_dataset_options o{path, cfg.data.seq_len, cfg.data.val_fraction, cfg.data.add_bos, cfg.data.add_eos, progress, preview};
    LP_TRY_ASSIGN(ds, load_text_dataset(o, tok));
    td.train = std::move(ds.train);
    td.val = std::move(ds.val);
    td.stats.format = data_format::text;
    td.stats.records = td.stats.examples = ds.documents;
    td.stats.tokens = td.stats.trained_tokens = ds.total_tokens;
    td.stats.min_len = ds.min_len, td.stats.max_len = ds.max_len;
    td.stats.mean_len = ds.documents > 0 ? static_cast<double>(ds.total_tokens) / static_cast<double>(ds.documents) : 0;
    td.stats.histogram = std::move(ds.histogram);
    for (size_t i = 0; i < ds.preview.size(); ++i) {  // plain text: every token is trained on
      tokenized_example ex;
      ex.ids = std::move(ds.preview[i]);
      ex.mask.assign(ex.ids.size(), 1);
      ex.line = static_cast<int64_t>(i) + 1;
      td.preview.push_back(std::move(ex));
    }
    return td;
  }
  instruct_options o;
  o.path = path;
  o.format = data_format_name(fmt);
  o.train_on = cfg.data.train_on;
  o.seq_len = cfg.data.seq_len;
  o.packing = cfg.data.packing;
  o.truncation = cfg.data.truncation;
  o.on_error = cfg.data.on_error;
  o.val_fraction = cfg.data.val_fraction;
  o.add_bos = cfg.data.add_bos;
  o.add_eos = cfg.data.add_eos;
  o.seed = static_cast<uint64_t>(cfg.run.seed);
  o.progress = progress;
  if (cfg.data.on_disk) o.spill_dir = cfg.resolve(cfg.run.output_dir) / "data-cache";
  LP_TRY_ASSIGN(settings, load_tokenizer_settings(tok_dir));
  std::string source;
  if (cfg.data.chat_template == "auto" && !settings.chat_template.empty()) {
    source = settings.chat_template;
    td.template_source = (tok_dir / "tokenizer_config.json").string();
  } else if (cfg.data.chat_template != "auto" && cfg.data.chat_template != "builtin") {
    auto text = read_text_file(cfg.resolve(cfg.data.chat_template));
    if (!text) return make_error("data.chat_template: {}", text.message());
    source = *text;
    td.template_source = cfg.resolve(cfg.data.chat_template).string();
  } else {
    source = chat_template::builtin_source();
    td.template_source = "built-in";
  }
  auto templ = chat_template::parse(source);
  if (!templ) return make_error("data.chat_template ({}): {}", td.template_source, templ.message());
  o.templ = std::move(*templ);
  o.template_vars = special_token_vars(tok, settings);
  auto ds = load_instruct_dataset(o, tok, preview);
  if (!ds) return is_cancelled(ds.err()) ? ds.err() : make_error("data.train: {}", ds.message());
  td.train = std::move(ds->train);
  td.val = std::move(ds->val);
  td.stats = std::move(ds->stats);
  td.preview = std::move(ds->preview);
  return td;
}

}  // namespace lorapipe
