// Instruction datasets: see instruct_dataset.h.
#include "core/data/instruct_dataset.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/base/safetensors.h"

namespace lorapipe {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

result<data_format> parse_data_format(const std::string& name) {
  if (name == "text") return data_format::text;
  if (name == "alpaca") return data_format::alpaca;
  if (name == "chat") return data_format::chat;
  if (name == "completion") return data_format::completion;
  return make_error("unknown data format \"{}\" (auto, text, alpaca, chat, completion)", name);
}

const char* data_format_name(data_format f) {
  switch (f) {
    case data_format::text: return "text";
    case data_format::alpaca: return "alpaca";
    case data_format::chat: return "chat";
    case data_format::completion: return "completion";
  }
  return "?";
}

result<jsonl_reader> jsonl_reader::open(const fs::path& path) {
  jsonl_reader r;
  r.path_ = path;
  r.in_ = std::make_unique<std::ifstream>(path, std::ios::binary);
  if (!*r.in_) return make_error("{}: cannot open", path.string());
  return r;
}

result<std::optional<ojson>> jsonl_reader::next() {
  std::string line;
  while (std::getline(*in_, line)) {
    ++line_;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    try {
      return std::optional<ojson>(ojson::parse(line));
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
      return make_error("{}:{}: invalid JSON: {}", path_.string(), line_, what);
    }
  }
  if (in_->bad()) return make_error("{}: read error after line {}", path_.string(), line_);
  return std::optional<ojson>();
}

result<data_format> detect_data_format(const fs::path& path) {
  const auto ext = path.extension().string();
  if (ext == ".txt" || ext == ".md") return data_format::text;
  LP_TRY_ASSIGN(r, jsonl_reader::open(path));
  auto rec = r.next();
  if (!rec) return data_format::text;  // not JSON lines: plain text
  if (!rec->has_value()) return make_error("{}: empty file", path.string());
  const ojson& j = **rec;
  if (!j.is_object()) return make_error("{}:{}: a JSONL record must be an object", path.string(), r.line());
  if (j.contains("messages") || j.contains("conversations")) return data_format::chat;
  if (j.contains("instruction")) return data_format::alpaca;
  if (j.contains("prompt") && j.contains("completion")) return data_format::completion;
  if (j.contains("text")) return data_format::text;
  std::string keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys += (keys.empty() ? "" : ", ") + it.key();
  return make_error("{}:{}: cannot tell the format from the keys ({}); expected messages, instruction/output, prompt/completion "
                    "or text (or set data.format)",
                    path.string(), r.line(), keys);
}

namespace {
result<std::string> string_field(const ojson& rec, const char* key, bool required) {
  if (!rec.contains(key)) {
    if (required) return make_error("missing \"{}\"", key);
    return std::string();
  }
  if (!rec[key].is_string()) return make_error("\"{}\" must be a string", key);
  return rec[key].get<std::string>();
}

// Mask from byte spans: token t covers [offset[t], offset[t+1]) and is trained when that range
// overlaps a span (so "\u2581answer" counts although its space belongs to the prompt).
std::vector<uint8_t> mask_from_spans(const encoding& enc, const std::vector<std::pair<size_t, size_t>>& spans, size_t text_size) {
  std::vector<uint8_t> m(enc.ids.size(), 0);
  for (size_t t = 0; t < enc.ids.size(); ++t) {
    const size_t b = enc.offsets[t];
    size_t e = t + 1 < enc.ids.size() ? enc.offsets[t + 1] : text_size;
    if (e <= b) e = b + 1;  // several tokens from one byte (byte fallback): each covers that byte
    for (const auto& [sb, se] : spans)
      if (b < se && sb < e) {
        m[t] = 1;
        break;
      }
  }
  return m;
}
}  // namespace

result<tokenized_example> tokenize_record(const ojson& rec, data_format fmt, const instruct_options& opt, const chat_template& templ,
                                          const tokenizer& tok) {
  if (!rec.is_object()) return make_error("record must be a JSON object");
  tokenized_example ex;
  std::vector<std::pair<size_t, size_t>> spans;
  bool add_eos = false;
  switch (fmt) {
    case data_format::text: {
      LP_TRY_ASSIGN(t, string_field(rec, "text", true));
      ex.text = t;
      spans.emplace_back(0, ex.text.size());
      add_eos = opt.add_eos;
      break;
    }
    case data_format::completion: {
      LP_TRY_ASSIGN(p, string_field(rec, "prompt", true));
      LP_TRY_ASSIGN(c, string_field(rec, "completion", true));
      ex.text = p + c;
      spans.emplace_back(p.size(), ex.text.size());
      add_eos = opt.add_eos;
      break;
    }
    case data_format::alpaca:
    case data_format::chat: {
      ojson messages = ojson::array();
      if (fmt == data_format::alpaca) {
        LP_TRY_ASSIGN(ins, string_field(rec, "instruction", true));
        LP_TRY_ASSIGN(in, string_field(rec, "input", false));
        LP_TRY_ASSIGN(out, string_field(rec, "output", true));
        LP_TRY_ASSIGN(sys, string_field(rec, "system", false));
        if (!sys.empty()) messages.push_back({{"role", "system"}, {"content", sys}});
        messages.push_back({{"role", "user"}, {"content", in.empty() ? ins : ins + "\n\n" + in}});
        messages.push_back({{"role", "assistant"}, {"content", out}});
      } else {
        if (rec.contains("conversations") && !rec.contains("messages")) {  // ShareGPT: {"from": human|gpt|system, "value"}
          if (!rec["conversations"].is_array()) return make_error("\"conversations\" must be a list");
          for (const auto& turn : rec["conversations"]) {
            if (!turn.is_object() || !turn.contains("from") || !turn["from"].is_string() || !turn.contains("value") || !turn["value"].is_string())
              return make_error("every conversations entry needs string \"from\" and \"value\"");
            const std::string from = turn["from"].get<std::string>();
            const std::string role = from == "human" || from == "user" ? "user" : from == "gpt" || from == "assistant" ? "assistant" : from;
            messages.push_back({{"role", role}, {"content", turn["value"]}});
          }
        } else {
          if (!rec.contains("messages") || !rec["messages"].is_array()) return make_error("\"messages\" must be a list");
          messages = rec["messages"];
        }
        for (size_t i = 0; i < messages.size(); ++i) {
          const auto& m = messages[i];
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
            return make_error("messages[{}]: needs a string \"role\"", i);
          if (!m.contains("content") || !m["content"].is_string()) return make_error("messages[{}]: needs a string \"content\"", i);
        }
        if (messages.empty()) return make_error("\"messages\" is empty");
      }
      auto rc = templ.render_for_training(messages, opt.template_vars);
      if (!rc) return make_error("{}", rc.message());
      ex.text = std::move(rc->text);
      spans = std::move(rc->assistant_spans);
      break;
    }
  }
  auto enc = tok.encode_with_offsets(ex.text, true);
  if (!enc) return make_error("{}", enc.message());
  ex.mask = opt.train_on == "all" ? std::vector<uint8_t>(enc->ids.size(), 1) : mask_from_spans(*enc, spans, ex.text.size());
  ex.ids = std::move(enc->ids);
  if (opt.add_bos && tok.bos_id() >= 0 && (ex.ids.empty() || ex.ids.front() != tok.bos_id())) {
    ex.ids.insert(ex.ids.begin(), tok.bos_id());
    ex.mask.insert(ex.mask.begin(), 0);
  }
  if (add_eos && tok.eos_id() >= 0) {
    ex.ids.push_back(tok.eos_id());
    ex.mask.push_back(1);
  }
  if (!ex.mask.empty()) ex.mask[0] = 0;  // never train across an example boundary
  return ex;
}

namespace {
void shuffle(std::vector<size_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x5851F42D4C957F2Dull);
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(rng() % i)]);
}

// Where examples live between tokenisation and windowing: in memory, or appended to a file
// (ids as int32 then the mask bytes) and read back by offset, so only a 12-byte index per example
// stays in RAM.
class example_store {
 public:
  explicit example_store(const fs::path& spill) : spill_(spill) {}
  status open() {
    if (spill_.empty()) return ok_status();
    out_.open(spill_, std::ios::binary | std::ios::trunc);
    if (!out_) return make_error("{}: cannot create the data cache", spill_.string());
    return ok_status();
  }
  status add(tokenized_example ex) {
    if (spill_.empty()) {
      mem_.push_back(std::move(ex));
      return ok_status();
    }
    index_.push_back({offset_, static_cast<uint32_t>(ex.ids.size())});
    out_.write(reinterpret_cast<const char*>(ex.ids.data()), static_cast<std::streamsize>(ex.ids.size() * 4));
    out_.write(reinterpret_cast<const char*>(ex.mask.data()), static_cast<std::streamsize>(ex.mask.size()));
    offset_ += ex.ids.size() * 5;
    if (!out_) return make_error("{}: write failed (disk full?)", spill_.string());
    return ok_status();
  }
  status finish() {
    if (spill_.empty()) return ok_status();
    out_.close();
    in_.open(spill_, std::ios::binary);
    if (!in_) return make_error("{}: cannot reopen the data cache", spill_.string());
    return ok_status();
  }
  size_t size() const { return spill_.empty() ? mem_.size() : index_.size(); }
  // Example i's ids and mask (valid until the next get()).
  std::pair<const std::vector<int32_t>*, const std::vector<uint8_t>*> get(size_t i) {
    if (spill_.empty()) return {&mem_[i].ids, &mem_[i].mask};
    const auto [off, n] = index_[i];
    ids_.resize(n);
    mask_.resize(n);
    in_.seekg(static_cast<std::streamoff>(off));
    in_.read(reinterpret_cast<char*>(ids_.data()), static_cast<std::streamsize>(n) * 4);
    in_.read(reinterpret_cast<char*>(mask_.data()), static_cast<std::streamsize>(n));
    return {&ids_, &mask_};
  }

 private:
  fs::path spill_;
  std::vector<tokenized_example> mem_;
  std::vector<std::pair<uint64_t, uint32_t>> index_;
  uint64_t offset_ = 0;
  std::ofstream out_;
  std::ifstream in_;
  std::vector<int32_t> ids_;
  std::vector<uint8_t> mask_;
};

// Destination of a split's windows: vectors, or two files memory-mapped afterwards.
class window_sink {
 public:
  explicit window_sink(const fs::path& prefix) : prefix_(prefix) {}
  status open() {
    if (prefix_.empty()) return ok_status();
    tok_.open(path(".tokens"), std::ios::binary | std::ios::trunc);
    mask_.open(path(".mask"), std::ios::binary | std::ios::trunc);
    if (!tok_ || !mask_) return make_error("{}: cannot create the data cache", path(".tokens").string());
    return ok_status();
  }
  void append(const int32_t* ids, const uint8_t* m, size_t n) {
    if (prefix_.empty()) {
      w.tokens.insert(w.tokens.end(), ids, ids + n);
      w.mask.insert(w.mask.end(), m, m + n);
    } else {
      tok_.write(reinterpret_cast<const char*>(ids), static_cast<std::streamsize>(n * 4));
      mask_.write(reinterpret_cast<const char*>(m), static_cast<std::streamsize>(n));
    }
    size_ += n;
  }
  void pad(size_t n, int32_t id) {
    std::vector<int32_t> ids(n, id);
    std::vector<uint8_t> m(n, 0);
    append(ids.data(), m.data(), n);
  }
  int64_t size() const { return static_cast<int64_t>(size_); }
  result<token_windows> finish() {
    if (prefix_.empty() || size_ == 0) return std::move(w);
    tok_.close();
    mask_.close();
    if (!tok_ || !mask_) return make_error("{}: write failed (disk full?)", path(".tokens").string());
    LP_TRY_ASSIGN(t, mapped_file::open(path(".tokens")));
    LP_TRY_ASSIGN(m, mapped_file::open(path(".mask")));
    w.mapped_tokens = reinterpret_cast<const int32_t*>(t->data());
    w.mapped_mask = reinterpret_cast<const uint8_t*>(m->data());
    w.mapping = std::make_shared<std::pair<std::shared_ptr<mapped_file>, std::shared_ptr<mapped_file>>>(t, m);
    return std::move(w);
  }
  token_windows w;

 private:
  fs::path path(const char* ext) const { return fs::path(prefix_.string() + ext); }
  fs::path prefix_;
  std::ofstream tok_, mask_;
  size_t size_ = 0;
};

// Windows over the examples `order`: packed back to back (the tail padded into one last window), or
// one padded window per example.
result<token_windows> build_windows(example_store& exs, const std::vector<size_t>& order, int64_t T, bool packing, int32_t pad,
                                    const fs::path& prefix) {
  window_sink sink(prefix);
  LP_TRY(sink.open());
  sink.w.seq_len = T;
  if (packing) {
    int64_t next_start = 0;
    for (size_t i : order) {
      auto [ids, m] = exs.get(i);
      sink.append(ids->data(), m->data(), ids->size());
      for (; next_start + T + 1 <= sink.size(); next_start += T) sink.w.starts.push_back(next_start);
    }
    if (sink.size() - next_start > 1) {  // leftover targets: one more window, padded
      sink.pad(static_cast<size_t>(next_start + T + 1 - sink.size()), pad);
      sink.w.starts.push_back(next_start);
    }
  } else {
    for (size_t i : order) {
      auto [ids, m] = exs.get(i);
      sink.w.starts.push_back(sink.size());
      sink.append(ids->data(), m->data(), ids->size());
      sink.pad(static_cast<size_t>(T + 1) - ids->size(), pad);
    }
  }
  return sink.finish();
}
}  // namespace

result<instruct_dataset> load_instruct_dataset(const instruct_options& opt, const tokenizer& tok, size_t preview) {
  if (opt.seq_len < 2) return make_error("seq_len must be at least 2 (got {})", opt.seq_len);
  if (opt.val_fraction < 0 || opt.val_fraction >= 1) return make_error("val_fraction must be in [0, 1)");
  data_format fmt;
  if (opt.format == "auto") {
    LP_TRY_ASSIGN(f, detect_data_format(opt.path));
    fmt = f;
  } else {
    LP_TRY_ASSIGN(f, parse_data_format(opt.format));
    fmt = f;
  }
  chat_template builtin;
  if (!opt.templ) {
    LP_TRY_ASSIGN(b, chat_template::parse(chat_template::builtin_source()));
    builtin = std::move(b);
  }
  const chat_template& templ = opt.templ ? *opt.templ : builtin;
  if (!opt.spill_dir.empty()) {
    std::error_code ec;
    fs::create_directories(opt.spill_dir, ec);
    if (ec) return make_error("{}: cannot create the data cache folder: {}", opt.spill_dir.string(), ec.message());
  }

  instruct_dataset ds;
  auto& st = ds.stats;
  st.format = fmt;
  example_store exs(opt.spill_dir.empty() ? fs::path() : opt.spill_dir / "examples.bin");
  LP_TRY(exs.open());
  LP_TRY_ASSIGN(reader, jsonl_reader::open(opt.path));
  const int64_t max_tokens = opt.seq_len + 1;
  st.min_len = INT64_MAX;
  for (;;) {
    auto rec = reader.next();
    tokenized_example ex;
    std::string problem;
    if (!rec) problem = rec.message();
    else if (!rec->has_value()) break;
    else {
      ++st.records;
      auto t = tokenize_record(**rec, fmt, opt, templ, tok);
      if (!t) problem = fmt::format("{}:{}: {}", opt.path.string(), reader.line(), t.message());
      else ex = std::move(*t);
    }
    if (!problem.empty()) {
      if (opt.on_error != "skip") return make_error("{}", problem);
      ++st.skipped;
      if (st.skipped_errors.size() < 5) st.skipped_errors.push_back(problem);
      continue;
    }
    ex.line = reader.line();
    if (opt.progress && st.records % 256 == 0 && !opt.progress(st.records, 0)) return make_error("cancelled");
    if (static_cast<int64_t>(ex.ids.size()) > max_tokens) {
      if (opt.truncation == "drop") {
        ++st.dropped;
        continue;
      }
      ++st.truncated;
      const auto keep = static_cast<std::ptrdiff_t>(max_tokens);
      if (opt.truncation == "left") {
        ex.ids.erase(ex.ids.begin(), ex.ids.end() - keep);
        ex.mask.erase(ex.mask.begin(), ex.mask.end() - keep);
        ex.mask[0] = 0;
      } else {
        ex.ids.resize(static_cast<size_t>(max_tokens));
        ex.mask.resize(static_cast<size_t>(max_tokens));
      }
    }
    const int64_t trained = std::count(ex.mask.begin(), ex.mask.end(), uint8_t{1});
    if (trained == 0) {  // nothing left to learn from (e.g. the answer was truncated away)
      ++st.dropped;
      continue;
    }
    const auto n = static_cast<int64_t>(ex.ids.size());
    st.tokens += n;
    st.trained_tokens += trained;
    st.min_len = std::min(st.min_len, n);
    st.max_len = std::max(st.max_len, n);
    add_to_length_histogram(st.histogram, n);
    if (ds.preview.size() < preview) ds.preview.push_back(ex);
    ex.text.clear();  // only the previews keep their text
    ex.text.shrink_to_fit();
    LP_TRY(exs.add(std::move(ex)));
  }
  LP_TRY(exs.finish());
  st.examples = static_cast<int64_t>(exs.size());
  if (exs.size() == 0) return make_error("{}: no usable examples ({} records, {} skipped, {} dropped)", opt.path.string(), st.records, st.skipped, st.dropped);
  std::sort(st.histogram.begin(), st.histogram.end());
  st.mean_len = static_cast<double>(st.tokens) / static_cast<double>(exs.size());

  std::vector<size_t> order(exs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  shuffle(order, opt.seed);
  size_t n_val = opt.val_fraction > 0 ? static_cast<size_t>(std::ceil(static_cast<double>(exs.size()) * opt.val_fraction)) : 0;
  if (n_val >= exs.size()) n_val = exs.size() - 1;
  std::vector<size_t> train_idx(order.begin(), order.end() - static_cast<std::ptrdiff_t>(n_val));
  std::vector<size_t> val_idx(order.end() - static_cast<std::ptrdiff_t>(n_val), order.end());
  const int32_t pad = tok.eos_id() >= 0 ? tok.eos_id() : 0;
  const bool spill = !opt.spill_dir.empty();
  LP_TRY_ASSIGN(train, build_windows(exs, train_idx, opt.seq_len, opt.packing, pad, spill ? opt.spill_dir / "train" : fs::path()));
  LP_TRY_ASSIGN(val, build_windows(exs, val_idx, opt.seq_len, opt.packing, pad, spill ? opt.spill_dir / "val" : fs::path()));
  ds.train = std::move(train);
  ds.val = std::move(val);
  if (spill) {
    std::error_code ec;
    fs::remove(opt.spill_dir / "examples.bin", ec);  // the windows files hold everything now
  }
  if (ds.train.size() == 0) return make_error("{}: no training sequences", opt.path.string());
  return ds;
}

std::string render_masked(const tokenized_example& ex, const tokenizer& tok, const std::string& open, const std::string& close) {
  std::string out;
  size_t i = 0;
  while (i < ex.ids.size()) {
    size_t j = i;
    while (j < ex.ids.size() && ex.mask[j] == ex.mask[i]) ++j;
    std::vector<int32_t> run(ex.ids.begin() + static_cast<std::ptrdiff_t>(i), ex.ids.begin() + static_cast<std::ptrdiff_t>(j));
    std::vector<int32_t> prefix(ex.ids.begin(), ex.ids.begin() + static_cast<std::ptrdiff_t>(i));
    const std::string text = tok.decode_continuation(prefix, run);
    out += ex.mask[i] ? open + text + close : text;
    i = j;
  }
  return out;
}

}  // namespace lorapipe
