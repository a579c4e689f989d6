// Real-world text inputs: HF tokenizer.json goldens (Qwen3 from ../shared/data, plus fixtures made by
// the `tokenizers` library in tests/fixtures), tokenizer edge cases, chat templates vs Jinja2 goldens,
// instruction datasets with loss masking and packing.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/text/chat_template.h"
#include "core/data/instruct_dataset.h"
#include "core/text/text_unicode.h"
#include "core/text/tokenizer.h"
#include "test_paths.h"

namespace fs = std::filesystem;
using namespace lorapipe;
using json = nlohmann::json;

namespace {
fs::path fixtures() { return LORAPIPE_FIXTURES; }

std::vector<json> read_jsonl(const fs::path& p) {
  std::ifstream in(p);
  std::vector<json> rows;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

// Code-point index of byte offset `b` in s (HF reports offsets in characters).
size_t char_index(const std::string& s, size_t b) {
  size_t n = 0;
  for (size_t i = 0; i < b && i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xc0) != 0x80) ++n;
  if (b < s.size() && (static_cast<unsigned char>(s[b]) & 0xc0) == 0x80) --n;  // inside a character
  return n;
}

// Every golden row: ids, decode(ids), ids with the post-processor, offsets.
void check_golden(const tokenizer& tok, const fs::path& golden, bool check_offsets) {
  auto rows = read_jsonl(golden);
  ASSERT_GT(rows.size(), 30u) << golden;
  int n = 0;
  for (const auto& r : rows) {
    const std::string text = r["text"];
    auto enc = tok.encode_with_offsets(text, true);
    ASSERT_TRUE(enc) << enc.message();
    EXPECT_EQ(enc->ids, r["ids"].get<std::vector<int32_t>>()) << golden << ": " << text;
    if (r.contains("decoded")) EXPECT_EQ(tok.decode(enc->ids), r["decoded"].get<std::string>()) << text;
    else EXPECT_EQ(tok.decode(enc->ids), text);
    if (r.contains("with_special")) {
      std::vector<int32_t> full = tok.special_prefix();
      full.insert(full.end(), enc->ids.begin(), enc->ids.end());
      for (int32_t s : tok.special_suffix()) full.push_back(s);
      EXPECT_EQ(full, r["with_special"].get<std::vector<int32_t>>()) << text;
    }
    if (check_offsets && r.contains("offsets") && enc->ids == r["ids"].get<std::vector<int32_t>>()) {
      std::vector<size_t> got;
      for (auto o : enc->offsets) got.push_back(char_index(text, o));
      EXPECT_EQ(got, r["offsets"].get<std::vector<size_t>>()) << text;
    }
    ++n;
  }
  std::printf("%s: %d golden rows equal\n", golden.string().c_str(), n);
}
}  // namespace

TEST(HfTokenizer, Qwen3GoldenIdsAndRoundTrip) {
  auto tok = load_tokenizer(test_data_dir() / "tokenizers/qwen3");  // folder: tokenizer.json is picked
  ASSERT_TRUE(tok) << tok.message();
  EXPECT_EQ((*tok)->vocab_size(), 151669);
  EXPECT_EQ((*tok)->eos_id(), 151645);  // tokenizer_config.json: <|im_end|>
  EXPECT_EQ((*tok)->bos_id(), -1);      // Qwen has none
  check_golden(**tok, test_data_dir() / "tokenizers/qwen3/golden.jsonl", false);
}

TEST(HfTokenizer, SentencePieceStyleFixtures) {
  // tok512 converted by transformers: Metaspace (prepend_scheme first) + byte_fallback, and the older
  // Llama-2 layout (Prepend/Replace normalizers, string-form merges, "<s> $A" post-processor).
  for (const char* v : {"tok512-metaspace", "tok512-legacy"}) {
    auto tok = load_tokenizer(fixtures() / "tokenizers" / v / "tokenizer.json");
    ASSERT_TRUE(tok) << tok.message();
    check_golden(**tok, fixtures() / "tokenizers" / v / "golden.jsonl", true);
  }
  // The same strings through tokenizer.json and through SentencePiece itself agree.
  auto hf = load_tokenizer(fixtures() / "tokenizers/tok512-metaspace/tokenizer.json");
  auto sp = load_tokenizer(test_data_dir() / "tokenizers/tok512/tok512.model");
  ASSERT_TRUE(hf && sp);
  for (const char* s : {"Once upon a time, there was a little girl named Lily.", "two words", "emoji \xf0\x9f\x99\x82 here"})
    EXPECT_EQ(*(*hf)->encode(s), *(*sp)->encode(s)) << s;
}

TEST(HfTokenizer, ByteLevelLlama3StyleFixture) {
  // Llama-3 split regex, ignore_merges, NFC normaliser, special and non-special added tokens.
  auto tok = load_tokenizer(fixtures() / "tokenizers/bytelevel-llama3style/tokenizer.json");
  ASSERT_TRUE(tok) << tok.message();
  EXPECT_EQ((*tok)->bos_id(), 0);  // from the post-processor template
  check_golden(**tok, fixtures() / "tokenizers/bytelevel-llama3style/golden.jsonl", true);
}

TEST(HfTokenizer, EdgeCases) {
  auto tok = load_tokenizer(test_data_dir() / "tokenizers/qwen3/tokenizer.json");
  ASSERT_TRUE(tok);
  const auto& t = **tok;
  for (std::string s : {std::string(), std::string("   "), std::string(1000, ' '), std::string(500, '\n'), std::string("\t \n \r\n"),
                        std::string("mixed Русский 中文 العربية हिन्दी \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7"),
                        std::string(3000, 'a'), std::string("<|im_start|>user\nhi<|im_end|>")}) {
    auto ids = t.encode(s);
    ASSERT_TRUE(ids) << ids.message();
    EXPECT_EQ(t.decode(*ids), s);
  }
  EXPECT_TRUE(t.encode("").value().empty());
  // Special tokens: matched by default, plain text when parse_special is off.
  EXPECT_EQ(t.encode("<|im_start|>").value(), std::vector<int32_t>{151644});
  auto plain = t.encode_with_offsets("<|im_start|>", false);
  ASSERT_TRUE(plain);
  EXPECT_GT(plain->ids.size(), 1u);
  // Invalid UTF-8 is an error naming the byte, never a crash.
  auto bad = t.encode(std::string("ok \xff\xfe bad"));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("invalid UTF-8 at byte 3"), std::string::npos) << bad.message();
  auto sp = load_tokenizer(test_data_dir() / "tokenizers/llama2/tokenizer.model");
  ASSERT_TRUE(sp);
  EXPECT_FALSE((*sp)->encode(std::string("\xc3\x28")));
}

TEST(HfTokenizer, MalformedFilesAreClearErrors) {
  struct bad_case {
    const char* json;
    const char* message;
  };
  for (const auto& c : std::vector<bad_case>{
           {"{", "invalid JSON"},
           {"[]", "no \"model\""},
           {R"({"model":{"type":"Unigram","vocab":[]}})", "Unigram"},
           {R"({"model":{"type":"BPE","vocab":{"a":0},"merges":["a b"]}})", "missing from the vocabulary"},
           {R"({"model":{"type":"BPE","vocab":{"a":-4}}})", "not a valid id"},
           {R"({"model":{"type":"BPE","vocab":{"a":0}},"pre_tokenizer":{"type":"Split","pattern":{"Regex":"(("},"behavior":"Isolated"}})", "regex"},
           {R"({"model":{"type":"BPE","vocab":{"a":0}},"normalizer":{"type":"BertNormalizer"}})", "BertNormalizer"},
           {R"({"model":{"type":"BPE","vocab":{"a":0}},"decoder":{"type":"CTC"}})", "CTC"},
           {R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[3]}})", "neither"},
       }) {
    auto t = parse_hf_tokenizer(c.json, {});
    ASSERT_FALSE(t) << c.json;
    EXPECT_NE(t.message().find(c.message), std::string::npos) << t.message();
  }
}

TEST(HfTokenizer, SpeedOnOneMegabyte) {
  auto tok = load_tokenizer(test_data_dir() / "tokenizers/qwen3/tokenizer.json");
  ASSERT_TRUE(tok);
  std::ifstream in(test_data_dir() / "text/tinyshakespeare.txt", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const auto t0 = std::chrono::steady_clock::now();
  auto ids = (*tok)->encode(text);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(ids);
  EXPECT_EQ((*tok)->decode(*ids), text);
  std::printf("qwen3 tokenizer.json: %zu bytes -> %zu tokens in %.3f s (%.1f MB/s)\n", text.size(), ids->size(), s, text.size() / s / 1e6);
}

// ---- chat templates ---------------------------------------------------------------------------
namespace {
std::string template_source(const std::string& name) {
  if (name == "qwen3") {
    auto s = load_tokenizer_settings(test_data_dir() / "tokenizers/qwen3");
    return s ? s->chat_template : std::string();
  }
  std::ifstream in(fixtures() / "chat" / (name + ".jinja"));
  return std::string((std::istreambuf_iterator<char>(in)), {});
}
jinja::dict_t vars_of(const json& j) {
  jinja::dict_t d;
  for (auto it = j.begin(); it != j.end(); ++it) d.emplace_back(it.key(), jinja::value::from_json(nlohmann::ordered_json::parse(it.value().dump())));
  return d;
}
}  // namespace

TEST(ChatTemplate, MatchesJinja2Goldens) {
  // Fixtures rendered by transformers' render_jinja_template (tests/fixtures/make_fixtures.py).
  std::ifstream in(fixtures() / "chat/golden.jsonl");
  int rendered = 0, errors = 0;
  for (std::string line; std::getline(in, line);) {
    auto row = nlohmann::ordered_json::parse(line);
    const std::string name = row["template"];
    auto t = chat_template::parse(template_source(name));
    ASSERT_TRUE(t) << name << ": " << t.message();
    auto out = t->render(row["messages"], row["add_generation_prompt"].get<bool>(), vars_of(json::parse(row["vars"].dump())));
    if (row.contains("error")) {
      ASSERT_FALSE(out) << name << " should raise: " << row["error"];
      EXPECT_NE(out.message().find(row["error"].get<std::string>()), std::string::npos) << out.message();
      ++errors;
      continue;
    }
    ASSERT_TRUE(out) << name << ": " << out.message();
    EXPECT_EQ(*out, row["output"].get<std::string>()) << name << " messages " << row["messages"].dump();
    ++rendered;
  }
  EXPECT_GE(rendered, 40);
  EXPECT_GE(errors, 2);
  std::printf("chat templates: %d renders byte-identical to Jinja2, %d raise_exception cases\n", rendered, errors);
}

TEST(ChatTemplate, LanguageFeaturesAndErrors) {
  auto render = [](const std::string& src, const jinja::dict_t& vars = {}) -> result<std::string> {
    LP_TRY_ASSIGN(p, jinja::template_program::parse(src));
    return p.render(vars);
  };
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }}{% if not loop.last %},{% endif %}{% endfor %}").value(), "a=1,b=2");
  EXPECT_EQ(render("{{ [1,2,3][::-1] }} {{ 'abc'[1:] }} {{ 7 // 2 }} {{ 7 / 2 }} {{ -7 % 3 }}").value(), "[3, 2, 1] bc 3 3.5 2");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}").value(), "3");
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}").value(), "1");  // loop scope
  EXPECT_EQ(render("{{ {'b': [1, 'x'], 'a': none} | tojson }}|{{ 'é\"' | tojson }}").value(), "{\"b\": [1, \"x\"], \"a\": null}|\"é\\\"\"");
  EXPECT_EQ(render("{{ x | default('d') }}{{ y is defined }}{{ 'a,b'.split(',') | join('+') }}{{ ' t '|trim|upper }}").value(), "dFalsea+bT");
  EXPECT_EQ(render("{% macro f(a, b='B') %}<{{ a }}{{ b }}>{% endmacro %}{{ f(1) }}{{ f(2, b='c') }}").value(), "<1B><2c>");
  EXPECT_EQ(render("{{ xs | selectattr('r', 'equalto', 'u') | map(attribute='c') | list }}",
                   {{"xs", jinja::value::from_json(nlohmann::ordered_json::parse(R"([{"r":"u","c":1},{"r":"a","c":2},{"r":"u","c":3}])"))}})
                .value(),
            "[1, 3]");
  // Whitespace control: trim_blocks + lstrip_blocks + "-".
  EXPECT_EQ(render("a\n  {% if true %}\n  b\n  {%- endif %}\nc").value(), "a\n  bc");  // as jinja2 renders it
  for (const char* bad : {"{% include 'x' %}", "{{ x | frobnicate }}", "{% if x %}", "{{ 1 + }}", "{{ x is wobbly }}", "{% for %}"}) {
    auto r = render(bad);
    ASSERT_FALSE(r) << bad;
    std::printf("  %-24s -> %s\n", bad, r.message().c_str());
  }
  EXPECT_NE(render("{% include 'x' %}").message().find("include"), std::string::npos);
  EXPECT_NE(render("{{ x | frobnicate }}").message().find("frobnicate"), std::string::npos);
  EXPECT_NE(render("{{ raise_exception('nope') }}").message().find("nope"), std::string::npos);
}

TEST(ChatTemplate, AssistantSpansFromPrefixesAndGenerationBlocks) {
  auto msgs = nlohmann::ordered_json::parse(R"([{"role":"system","content":"S"},{"role":"user","content":"Q1"},
      {"role":"assistant","content":"A1"},{"role":"user","content":"Q2"},{"role":"assistant","content":"  A2\n"}])");
  const jinja::dict_t vars{{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  for (const std::string name : {"qwen3", "llama3", "llama31"}) {
    auto t = chat_template::parse(template_source(name));
    ASSERT_TRUE(t);
    auto rc = t->render_for_training(msgs, vars);
    ASSERT_TRUE(rc) << rc.message();
    ASSERT_EQ(rc->assistant_spans.size(), 2u) << name;
    std::vector<std::string> parts;
    for (auto [b, e] : rc->assistant_spans) parts.push_back(rc->text.substr(b, e - b));
    const std::string eot = name == "qwen3" ? "<|im_end|>" : "<|eot_id|>";
    EXPECT_EQ(parts[0], "A1" + eot) << name;
    EXPECT_NE(parts[1].find("A2"), std::string::npos) << name;
    EXPECT_EQ(parts[1].substr(parts[1].size() - eot.size()), eot) << name;
  }
  auto b = chat_template::parse(chat_template::builtin_source());
  ASSERT_TRUE(b);
  auto rc = b->render_for_training(msgs, vars);
  ASSERT_TRUE(rc);
  EXPECT_EQ(rc->text, "S\n\nUser: Q1\nAssistant: A1</s>\nUser: Q2\nAssistant:   A2\n</s>\n");
  ASSERT_EQ(rc->assistant_spans.size(), 2u);
  EXPECT_EQ(rc->text.substr(rc->assistant_spans[0].first, rc->assistant_spans[0].second - rc->assistant_spans[0].first), " A1</s>");
}

// ---- instruction datasets ---------------------------------------------------------------------
namespace {
// One token per character (printable ASCII + newline) plus <unk>, <s>, </s>: token counts are
// countable by hand.
std::unique_ptr<tokenizer> char_tokenizer() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int c = 32; c < 127; ++c) vocab[std::string(1, static_cast<char>(c))] = c - 29;
  vocab["\n"] = 98;
  json added = json::array();
  for (int i = 0; i < 3; ++i)
    added.push_back({{"id", i}, {"content", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>"}, {"special", true}});
  json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}, {"unk_token", "<unk>"}}},
            {"added_tokens", added},
            {"post_processor", {{"type", "TemplateProcessing"},
                                {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                                {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}}};
  auto t = parse_hf_tokenizer(j.dump(), {});
  EXPECT_TRUE(t) << t.message();
  return std::move(*t);
}
fs::path write_temp(const std::string& name, const std::string& text) {
  const fs::path p = fs::temp_directory_path() / ("lorapipe_test_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(p, std::ios::binary) << text;
  return p;
}
}  // namespace

TEST(InstructDataset, MaskedTokenCountsAreExact) {
  auto tok = char_tokenizer();
  ASSERT_EQ(tok->bos_id(), 1);
  ASSERT_EQ(tok->eos_id(), 2);
  instruct_options o;
  o.seq_len = 64;
  o.val_fraction = 0;
  o.template_vars = {{"eos_token", "</s>"}, {"bos_token", "<s>"}};
  // Built-in template: "User: hi\nAssistant:" is prompt; " yo</s>" trained (4 tokens), "\n" not.
  o.path = write_temp("chat.jsonl",
                      R"({"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]})" "\n\n"
                      R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"bb"},{"role":"user","content":"c"},{"role":"assistant","content":"ddd"}]})" "\n");
  auto ds = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(ds) << ds.message();
  EXPECT_EQ(ds->stats.format, data_format::chat);
  EXPECT_EQ(ds->stats.examples, 2);
  EXPECT_EQ(ds->stats.trained_tokens, 4 + (4 + 5));
  EXPECT_EQ(ds->preview[0].ids.size(), 1u + 19 + 4 + 1);  // BOS, "User: hi\nAssistant:", " yo</s>", "\n"
  EXPECT_EQ(render_masked(ds->preview[0], *tok), "<s>User: hi\nAssistant:[[ yo</s>]]\n");
  // ShareGPT "conversations" are chat too.
  o.path = write_temp("sharegpt.jsonl", R"({"conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"yo"}]})" "\n");
  ds = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(ds) << ds.message();
  EXPECT_EQ(ds->stats.format, data_format::chat);
  EXPECT_EQ(render_masked(ds->preview[0], *tok), "<s>User: hi\nAssistant:[[ yo</s>]]\n");
  // Alpaca: instruction + "\n\n" + input as the user turn; " 3</s>" trained.
  o.path = write_temp("alpaca.jsonl", R"({"instruction":"add","input":"1 2","output":"3"})" "\n");
  ds = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(ds) << ds.message();
  EXPECT_EQ(ds->stats.format, data_format::alpaca);
  EXPECT_EQ(ds->stats.trained_tokens, 3);
  EXPECT_EQ(render_masked(ds->preview[0], *tok), "<s>User: add\n\n1 2\nAssistant:[[ 3</s>]]\n");
  // Prompt/completion: " A" + EOS trained; train_on=all trains everything but the first token.
  o.path = write_temp("completion.jsonl", R"({"prompt":"Q:","completion":" A"})" "\n");
  ds = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(ds);
  EXPECT_EQ(ds->stats.trained_tokens, 3);
  o.train_on = "all";
  ds = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(ds);
  EXPECT_EQ(ds->stats.trained_tokens, 1 + 4 + 1 - 1);
  // Labels: the window's label t is -100 unless token t+1 is trained.
  o.train_on = "completion";
  o.packing = false;
  ds = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(ds);
  ASSERT_EQ(ds->train.size(), 1);
  const uint8_t* m = ds->train.window_mask(0);
  int trained_labels = 0;
  for (int t = 0; t < 64; ++t) trained_labels += m[t + 1];
  EXPECT_EQ(trained_labels, 3);
  EXPECT_EQ(ds->train.window(0)[6], 2);  // padded with EOS after "<s>Q: A</s>"
}

TEST(InstructDataset, PackingTruncationShuffleAndErrors) {
  auto tok = char_tokenizer();
  std::string lines;
  for (int i = 0; i < 40; ++i) lines += R"({"prompt":"p)" + std::to_string(i) + R"(","completion":"c)" + std::string(static_cast<size_t>(i % 7 + 1), 'x') + "\"}\n";
  instruct_options o;
  o.path = write_temp("many.jsonl", lines);
  o.seq_len = 16;
  o.val_fraction = 0.1;
  auto a = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->stats.examples, 40);
  // Packed: all tokens appear exactly once across train+val windows (the overlap token aside).
  int64_t covered = 0;
  for (const auto* w : {&a->train, &a->val}) covered += static_cast<int64_t>(w->tokens.size());
  EXPECT_GE(covered, a->stats.tokens);
  // Same seed, same order; another seed, another order.
  auto b = load_instruct_dataset(o, *tok);
  EXPECT_EQ(a->train.tokens, b->train.tokens);
  o.seed = 99;
  auto c = load_instruct_dataset(o, *tok);
  EXPECT_NE(a->train.tokens, c->train.tokens);
  // Truncation: right keeps the start, left keeps the end, drop skips.
  o.seq_len = 6;
  o.packing = false;
  o.path = write_temp("long.jsonl", R"({"prompt":"P","completion":"abcdefghij"})" "\n" R"({"prompt":"P","completion":"k"})" "\n");
  o.val_fraction = 0;
  o.truncation = "right";
  auto r = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->stats.truncated, 1);
  EXPECT_EQ(render_masked(r->preview[0], *tok), "<s>P[[abcde]]");
  o.truncation = "left";
  r = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(r);
  EXPECT_EQ(render_masked(r->preview[0], *tok), "e[[fghij</s>]]");
  o.truncation = "drop";
  r = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->stats.dropped, 1);
  EXPECT_EQ(r->stats.examples, 1);
  // Malformed records: stop names file and line; skip counts them.
  o.truncation = "right";
  o.seq_len = 64;
  o.path = write_temp("bad.jsonl", R"({"prompt":"a","completion":"b"})" "\n" "{not json\n" R"({"prompt":"a"})" "\n" R"({"prompt":"c","completion":"d"})" "\n");
  auto s = load_instruct_dataset(o, *tok);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find(":2: invalid JSON"), std::string::npos) << s.message();
  o.on_error = "skip";
  s = load_instruct_dataset(o, *tok);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(s->stats.skipped, 2);
  EXPECT_EQ(s->stats.examples, 2);
  ASSERT_EQ(s->stats.skipped_errors.size(), 2u);
  EXPECT_NE(s->stats.skipped_errors[1].find(":3: missing \"completion\""), std::string::npos) << s->stats.skipped_errors[1];
  // Autodetection and its failure.
  EXPECT_EQ(detect_data_format(test_data_dir() / "instruct/quiz_alpaca.jsonl").value(), data_format::alpaca);
  EXPECT_EQ(detect_data_format(test_data_dir() / "instruct/quiz_chat.jsonl").value(), data_format::chat);
  EXPECT_EQ(detect_data_format(test_data_dir() / "text/tinyshakespeare.txt").value(), data_format::text);
  auto unknown = detect_data_format(write_temp("odd.jsonl", R"({"question":"q","answer":"a"})" "\n"));
  ASSERT_FALSE(unknown);
  EXPECT_NE(unknown.message().find("question, answer"), std::string::npos) << unknown.message();
}

TEST(InstructDataset, QuizChatWithRealTokenizers) {
  // stories260K's SentencePiece tokenizer with the built-in template, and Qwen3 with its own template.
  auto sp = load_tokenizer(test_data_dir() / "models/stories260K/hf");
  ASSERT_TRUE(sp);
  instruct_options o;
  o.path = test_data_dir() / "instruct/quiz_chat.jsonl";
  o.seq_len = 64;
  o.template_vars = {{"eos_token", "</s>"}, {"bos_token", "<s>"}};
  auto ds = load_instruct_dataset(o, **sp);
  ASSERT_TRUE(ds) << ds.message();
  // Rows longer than seq_len+1 tokens are cut at the right; those whose answer is cut away are dropped.
  EXPECT_EQ(ds->stats.examples + ds->stats.dropped, 600);
  EXPECT_LE(ds->stats.dropped, ds->stats.truncated);
  EXPECT_GT(ds->stats.trained_tokens, ds->stats.examples * 2);
  EXPECT_LT(ds->stats.trained_tokens, ds->stats.tokens / 2);
  const auto& ex = ds->preview[0];
  EXPECT_NE(std::find(ex.ids.begin(), ex.ids.end(), (*sp)->eos_id()), ex.ids.end());  // "</s>" became EOS
  std::printf("quiz_chat (tok512, seq_len 64): %lld truncated, %lld dropped; %lld examples, %lld tokens, %lld trained; first: %s\n",
              static_cast<long long>(ds->stats.truncated), static_cast<long long>(ds->stats.dropped), static_cast<long long>(ds->stats.examples),
              static_cast<long long>(ds->stats.tokens), static_cast<long long>(ds->stats.trained_tokens), render_masked(ex, **sp).c_str());

  // The same data spilled to memory-mapped files (data larger than RAM): identical windows, no vectors.
  o.spill_dir = fs::temp_directory_path() / ("lorapipe_spill_" + std::to_string(::getpid()));
  auto disk = load_instruct_dataset(o, **sp);
  ASSERT_TRUE(disk) << disk.message();
  EXPECT_TRUE(disk->train.tokens.empty() && disk->train.mask.empty());
  ASSERT_EQ(disk->train.starts, ds->train.starts);
  ASSERT_EQ(disk->val.starts, ds->val.starts);
  for (int64_t i = 0; i < ds->train.size(); ++i) {
    ASSERT_TRUE(std::equal(ds->train.window(i), ds->train.window(i) + 65, disk->train.window(i)));
    ASSERT_TRUE(std::equal(ds->train.window_mask(i), ds->train.window_mask(i) + 65, disk->train.window_mask(i)));
  }
  EXPECT_EQ(disk->stats.trained_tokens, ds->stats.trained_tokens);
  EXPECT_TRUE(fs::exists(o.spill_dir / "train.tokens"));
  fs::remove_all(o.spill_dir);
  o.spill_dir.clear();

  auto qwen = load_tokenizer(test_data_dir() / "tokenizers/qwen3");
  auto settings = load_tokenizer_settings(test_data_dir() / "tokenizers/qwen3");
  ASSERT_TRUE(qwen && settings);
  auto t = chat_template::parse(settings->chat_template);
  ASSERT_TRUE(t);
  o.templ = *t;
  o.template_vars = {{"eos_token", settings->eos_token}};
  auto dq = load_instruct_dataset(o, **qwen);
  ASSERT_TRUE(dq) << dq.message();
  const std::string shown = render_masked(dq->preview[0], **qwen);
  EXPECT_EQ(shown.find("<|im_start|>user"), 0u) << shown;
  EXPECT_NE(shown.find("<|im_start|>assistant\n[[<think>\n\n</think>\n\n"), std::string::npos) << shown;
  EXPECT_EQ(shown.substr(shown.size() - 13), "<|im_end|>]]\n") << shown;
}

TEST(Tiktoken, Gpt2R50kGoldenIds) {
  // OpenAI's r50k_base ranks (GPT-2), special-token text encoded as plain text as in the golden file.
  auto tok = load_tokenizer(test_data_dir() / "tokenizers/gpt2/r50k_base.tiktoken");
  ASSERT_TRUE(tok) << tok.message();
  EXPECT_EQ((*tok)->vocab_size(), 50257);
  EXPECT_EQ((*tok)->eos_id(), 50256);
  int n = 0;
  for (const auto& r : read_jsonl(test_data_dir() / "tokenizers/gpt2/golden.jsonl")) {
    const std::string text = r["text"];
    auto ids = (*tok)->encode(text);
    ASSERT_TRUE(ids) << ids.message();
    EXPECT_EQ(*ids, r["ids"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ((*tok)->decode(*ids), text);
    ++n;
  }
  EXPECT_EQ(n, 39);
  EXPECT_EQ((*tok)->encode_with_offsets("a<|endoftext|>", true).value().ids, (std::vector<int32_t>{64, 50256}));
}
