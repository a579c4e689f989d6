// Torch-free tests: safetensors reader (good and malformed files), config.json, project files,
// SentencePiece golden ids, text datasets and sampling, the memory arena. Also built with
// AddressSanitizer (io_tests_asan) since this is where untrusted input is parsed.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

#include "core/data/dataset.h"
#include "core/project/llama_config.h"
#include "core/project/project.h"
#include "core/base/safetensors.h"
#include "core/text/tokenizer.h"
#include "offload/memory_arena.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;
using namespace lorapipe;
using json = nlohmann::json;

namespace {
fs::path temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("lorapipe_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
void write_bytes(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}
std::string st_image(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}
}  // namespace

TEST(Safetensors, RoundTripAndMetadata) {
  auto d = temp_dir("st_rt");
  std::vector<float> a{1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> b{7, 8};
  ASSERT_TRUE(write_safetensors(d / "x.safetensors", {{"a", st_dtype::f32, {2, 3}, a.data()}, {"b", st_dtype::bf16, {2}, b.data()}},
                                {{"format", "pt"}}).ok());
  auto f = safetensors_file::open(d / "x.safetensors");
  ASSERT_TRUE(f.ok()) << f.message();
  ASSERT_EQ(f->tensors().size(), 2u);
  const auto* ta = f->find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(f->data(*ta), a.data(), 24), 0);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->find("nope"), nullptr);
}

TEST(Safetensors, StreamedWriteAsksForOneTensorAtATimeAndLeavesNothingOnError) {
  auto d = temp_dir("st_stream");
  std::vector<float> a{1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> b{7, 8};
  const std::vector<st_tensor_to_write> like{{"a", st_dtype::f32, {2, 3}, nullptr}, {"b", st_dtype::bf16, {2}, nullptr}};
  std::vector<size_t> asked;
  ASSERT_TRUE(write_safetensors_streamed(d / "s.safetensors", like, {{"format", "pt"}}, [&](size_t i) -> result<const void*> {
                asked.push_back(i);
                return i == 0 ? static_cast<const void*>(a.data()) : static_cast<const void*>(b.data());
              }).ok());
  EXPECT_EQ(asked, (std::vector<size_t>{0, 1}));
  ASSERT_TRUE(write_safetensors(d / "w.safetensors", {{"a", st_dtype::f32, {2, 3}, a.data()}, {"b", st_dtype::bf16, {2}, b.data()}},
                                {{"format", "pt"}}).ok());
  EXPECT_EQ(read_text_file(d / "s.safetensors").value(), read_text_file(d / "w.safetensors").value());
  // The second tensor cannot be made: an error, the file as it was, no temporary left.
  auto failed = write_safetensors_streamed(d / "s.safetensors", like, {}, [&](size_t i) -> result<const void*> {
    if (i == 1) return make_error("tensor b is gone");
    return static_cast<const void*>(a.data());
  });
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.message(), "tensor b is gone");
  EXPECT_EQ(read_text_file(d / "s.safetensors").value(), read_text_file(d / "w.safetensors").value());
  size_t files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d)) ++files;
  EXPECT_EQ(files, 2u);
}

TEST(Safetensors, ReadsRealCheckpoint) {
  auto f = safetensors_file::open(test_data_dir() / "models/stories260K/hf/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.message();
  const auto* e = f->find("model.embed_tokens.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(e->dtype, st_dtype::f32);
}

struct bad_case {
  const char* name;
  std::string bytes;
  const char* expect;  // substring of the error
};

TEST(Safetensors, MalformedFilesGiveClearErrors) {
  const std::string four(4, '\0');
  std::vector<bad_case> cases = {
      {"empty", "", "not a safetensors file"},
      {"short", "abc", "not a safetensors file"},
      {"huge header length", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "exceeds"},
      {"truncated header", st_image("{\"a\":{}}", "").substr(0, 12), "truncated"},
      {"not json", st_image("{not json", ""), "not valid JSON"},
      {"not object", st_image("[1,2]", ""), "not a JSON object"},
      {"no dtype", st_image(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", four), "no dtype"},
      {"bad dtype", st_image(R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", four), "unsupported dtype"},
      {"negative dim", st_image(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", four), "negative"},
      {"size mismatch", st_image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", four), "span 4 bytes"},
      {"out of bounds", st_image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", four), "outside"},
      {"begin > end", st_image(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})", four), "begin > end"},
      {"overlap", st_image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", four), "overlaps"},
      {"hole", st_image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", four + four), "hole"},
      {"trailing bytes", st_image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", four + four), "cover"},
      {"overflowing shape", st_image(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", four), "overflow"},
      {"bad metadata", st_image(R"({"__metadata__":{"k":1}})", ""), "not a string"},
      {"offsets not ints", st_image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":["0",4]}})", four), "invalid data_offsets"},
  };
  auto d = temp_dir("st_bad");
  for (const auto& c : cases) {
    write_bytes(d / "bad.safetensors", c.bytes);
    auto f = safetensors_file::open(d / "bad.safetensors");
    ASSERT_FALSE(f.ok()) << c.name;
    EXPECT_NE(f.message().find(c.expect), std::string::npos) << c.name << ": " << f.message();
    EXPECT_EQ(f.message().find('\n'), std::string::npos) << c.name;
  }
  EXPECT_FALSE(safetensors_file::open(d / "missing.safetensors").ok());
  EXPECT_FALSE(safetensors_file::open(d).ok());  // a folder
}

TEST(Safetensors, TruncatedRealFileAtEveryCut) {
  auto src = read_text_file(test_data_dir() / "models/stories260K/hf-bf16/model.safetensors");
  ASSERT_TRUE(src.ok());
  auto d = temp_dir("st_trunc");
  std::mt19937 rng(5);
  for (size_t cut : {size_t{0}, size_t{7}, size_t{8}, size_t{100}, src->size() / 2, src->size() - 1}) {
    write_bytes(d / "t.safetensors", src->substr(0, cut));
    EXPECT_FALSE(safetensors_file::open(d / "t.safetensors").ok()) << cut;
  }
  // Garbled header bytes: never a crash, either a clean parse or an error.
  for (int i = 0; i < 200; ++i) {
    std::string g = *src;
    size_t hl = 8 + 200;
    for (int k = 0; k < 4; ++k) g[8 + rng() % hl] = static_cast<char>(rng());
    write_bytes(d / "g.safetensors", g);
    auto f = safetensors_file::open(d / "g.safetensors");
    if (f.ok()) {
      EXPECT_FALSE(f->tensors().empty());
    }
  }
}

TEST(LlamaConfig, ParsesStoriesAndRejectsBadConfigs) {
  auto c = load_llama_config(test_data_dir() / "models/stories260K/hf/config.json");
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_TRUE(c->tie_word_embeddings);
  json good = json::parse(read_text_file(test_data_dir() / "models/stories260K/hf/config.json").value());
  auto with = [&](const char* k, json v) {
    json j = good;
    if (v.is_null()) j.erase(k);
    else j[k] = v;
    return parse_llama_config(j, "config.json");
  };
  EXPECT_NE(with("hidden_size", nullptr).message().find("missing required field 'hidden_size'"), std::string::npos);
  EXPECT_NE(with("num_attention_heads", "8").message().find("must be an integer"), std::string::npos);
  EXPECT_NE(with("num_key_value_heads", 3).message().find("multiple"), std::string::npos);
  EXPECT_NE(with("model_type", "gpt2").message().find("not supported"), std::string::npos);
  EXPECT_NE(with("vocab_size", -5).message().find("positive"), std::string::npos);
  EXPECT_NE(with("hidden_act", "gelu").message().find("silu"), std::string::npos);
  EXPECT_FALSE(parse_llama_config(json::array(), "config.json").ok());
}

TEST(Project, DefaultsRoundTripAndRelativePaths) {
  project_config c;
  c.model.path = "m";
  auto text = project_to_json(c);
  auto back = parse_project(text, "/x/y/p.json");
  ASSERT_TRUE(back.ok()) << back.message();
  EXPECT_EQ(project_to_json(*back), text);
  EXPECT_EQ(back->resolve("m"), fs::path("/x/y/m"));
  EXPECT_EQ(back->resolve("/abs"), fs::path("/abs"));
}

TEST(Project, ReportsEveryProblemWithItsField) {
  auto r = parse_project(R"({"lora":{"r":"eight","alpah":3},"run":{"steps":1.5},"bogus":1})", "p.json");
  ASSERT_FALSE(r.ok());
  for (const char* s : {"lora.r: must be an integer", "lora.alpah: unknown field", "run.steps: must be an integer",
                        "bogus: unknown field"})
    EXPECT_NE(r.message().find(s), std::string::npos) << s << " in " << r.message();
  EXPECT_NE(parse_project("{\"a\":", "p.json").message().find("malformed JSON"), std::string::npos);
  EXPECT_NE(parse_project(R"({"schema_version": 99})", "p.json").message().find("newer"), std::string::npos);
  project_config c;
  c.lora.r = 0;
  c.lora.targets = {"q_proj", "qq"};
  c.model.path = "/nonexistent/model";
  auto v = validate_project(c);
  ASSERT_FALSE(v.ok());
  for (const char* s : {"lora.r:", "lora.targets: unknown projection 'qq'", "model.path:", "data.train: is required"})
    EXPECT_NE(v.message().find(s), std::string::npos) << s << " in " << v.message();
}

// The field table front-ends build their forms from: one entry per visit_fields() field, in order,
// with its JSON type, default, unit and the choices validation checks against.
TEST(Project, FieldTableCarriesTypesUnitsAndChoices) {
  project_config c;
  std::vector<std::string> visited;
  visit_fields(c, [&](const char* path, auto&, const char*) { visited.push_back(path); });
  const auto fields = project_fields();
  ASSERT_EQ(fields.size(), visited.size());
  std::map<std::string, project_field> by_path;
  for (size_t i = 0; i < fields.size(); ++i) {
    EXPECT_EQ(fields[i].path, visited[i]);
    EXPECT_FALSE(fields[i].doc.empty()) << fields[i].path;
    by_path[fields[i].path] = fields[i];
  }
  EXPECT_EQ(by_path["data.seq_len"].type, "integer");
  EXPECT_EQ(by_path["data.seq_len"].unit, "tokens");
  EXPECT_EQ(by_path["data.seq_len"].default_json, "128");
  EXPECT_EQ(by_path["optimizer.lr"].type, "number");
  EXPECT_EQ(by_path["data.packing"].type, "bool");
  EXPECT_EQ(by_path["lora.targets"].type, "list");
  EXPECT_EQ(by_path["offload.device_memory_mb"].unit, "MiB");
  EXPECT_EQ(by_path["parallel.schedule"].choices,
            (std::vector<std::string>{"auto", "single", "gpipe", "1f1b", "interleaved", "round-robin"}));
  EXPECT_EQ(by_path["parallel.schedule"].default_json, "\"auto\"");
  EXPECT_TRUE(by_path["model.path"].is_path);
  EXPECT_TRUE(by_path["run.output_dir"].is_folder);
  EXPECT_FALSE(by_path["name"].is_path);
  // Every default of a choice field is one of its choices; validation names the choices.
  for (const auto& f : fields)
    if (!f.choices.empty())
      EXPECT_NE(std::find(f.choices.begin(), f.choices.end(), json::parse(f.default_json).get<std::string>()), f.choices.end()) << f.path;
  project_config bad;
  bad.data.truncation = "middle";
  EXPECT_NE(validate_project(bad).message().find("data.truncation: must be one of right, left, drop"), std::string::npos);
  const auto table = project_field_table();
  EXPECT_NE(table.find("| `data.seq_len` | `128` | tokens |"), std::string::npos);
  EXPECT_NE(table.find("One of: auto, single, gpipe, 1f1b, interleaved, round-robin."), std::string::npos);
}

// Golden ids from ../shared/data/tokenizers/*/golden.tsv (SentencePiece, no BOS/EOS).
static void check_golden(const fs::path& model, const fs::path& tsv) {
  auto tok = load_tokenizer(model);
  ASSERT_TRUE(tok.ok()) << tok.message();
  std::ifstream in(tsv);
  std::string line;
  std::getline(in, line);  // header
  int rows = 0;
  while (std::getline(in, line)) {
    auto tab = line.find('\t');
    ASSERT_NE(tab, std::string::npos);
    auto text = json::parse(line.substr(0, tab)).get<std::string>();
    std::vector<int32_t> want;
    std::stringstream ss(line.substr(tab + 1));
    for (int32_t id; ss >> id;) want.push_back(id);
    auto got = (*tok)->encode(text);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(*got, want) << "text: " << text;
    ++rows;
  }
  EXPECT_GT(rows, 10);
}

TEST(Tokenizer, SentencePieceGoldenIds) {
  check_golden(test_data_dir() / "tokenizers/tok512/tok512.model", test_data_dir() / "tokenizers/tok512/golden.tsv");
  check_golden(test_data_dir() / "tokenizers/llama2/tokenizer.model", test_data_dir() / "tokenizers/llama2/golden.tsv");
}

TEST(Tokenizer, FindsTokenizerAndReportsMissing) {
  auto t = load_tokenizer(test_data_dir() / "models/stories260K/hf");
  ASSERT_TRUE(t.ok()) << t.message();
  EXPECT_EQ((*t)->vocab_size(), 512);
  EXPECT_EQ((*t)->bos_id(), 1);
  auto ids = (*t)->encode("Once upon a time");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{403, 407, 261, 378}));
  EXPECT_EQ((*t)->decode(*ids), "Once upon a time");
  auto bin = load_tokenizer(test_data_dir() / "models/stories260K/llama2c/stories260K.bin");
  EXPECT_TRUE(bin.ok()) << bin.message();
  auto d = temp_dir("tok_missing");
  auto m = load_tokenizer(d);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.message().find("no tokenizer found"), std::string::npos);
  write_bytes(d / "tokenizer.model", "garbage");
  EXPECT_NE(load_tokenizer(d).message().find("not a SentencePiece model"), std::string::npos);
}

TEST(Dataset, PacksWindowsSplitsAndRejectsEmpty) {
  auto tok = load_tokenizer(test_data_dir() / "models/stories260K/hf");
  ASSERT_TRUE(tok.ok());
  auto d = temp_dir("ds");
  write_bytes(d / "c.txt", "Once upon a time.\n\nThe end came.\n  \n\nA third one here.\n");
  text_dataset_options o{d / "c.txt", 4, 0.0, true, true, {}};
  auto ds = load_text_dataset(o, **tok);
  ASSERT_TRUE(ds.ok()) << ds.message();
  EXPECT_EQ(ds->documents, 3);
  // Stream = per document BOS + ids + EOS.
  std::vector<int32_t> want;
  for (const char* doc : {"Once upon a time.", "The end came.", "A third one here."}) {
    want.push_back(1);
    auto ids = (*tok)->encode(doc).value();
    want.insert(want.end(), ids.begin(), ids.end());
    want.push_back(2);
  }
  EXPECT_EQ(ds->train.tokens, want);
  EXPECT_EQ(ds->train.size(), static_cast<int64_t>((want.size() - 1) / 4));
  EXPECT_EQ(ds->train.window(1)[0], want[4]);
  // The fingerprint the ranks of a run compare: equal data, equal print (also read through a mapping);
  // one token or one mask byte changed, another.
  const uint64_t fp = windows_fingerprint(ds->train);
  token_windows same = ds->train;
  EXPECT_EQ(windows_fingerprint(same), fp);
  token_windows mapped = ds->train;
  mapped.mapped_tokens = ds->train.tokens.data();
  mapped.tokens.clear();
  EXPECT_EQ(windows_fingerprint(mapped), fp);
  same.tokens[5] ^= 1;
  EXPECT_NE(windows_fingerprint(same), fp);
  token_windows masked = ds->train;
  masked.mask.assign(masked.tokens.size(), 1);
  const uint64_t fm = windows_fingerprint(masked);
  EXPECT_NE(fm, fp);
  masked.mask[3] = 0;
  EXPECT_NE(windows_fingerprint(masked), fm);
  // Document statistics (data inspection): lengths with BOS/EOS, power-of-two histogram, previews.
  std::vector<int64_t> lens;
  for (const char* doc : {"Once upon a time.", "The end came.", "A third one here."})
    lens.push_back(static_cast<int64_t>((*tok)->encode(doc).value().size()) + 2);
  EXPECT_EQ(ds->min_len, *std::min_element(lens.begin(), lens.end()));
  EXPECT_EQ(ds->max_len, *std::max_element(lens.begin(), lens.end()));
  int64_t counted = 0;
  for (auto [bound, n] : ds->histogram) {
    counted += n;
    for (int64_t l : lens)
      if (l <= bound && l > bound / 2) EXPECT_GT(n, 0) << bound;
  }
  EXPECT_EQ(counted, 3);
  EXPECT_TRUE(ds->preview.empty());  // none asked for
  text_dataset_options op{d / "c.txt", 4, 0.0, true, true, {}, 2};
  auto dp = load_text_dataset(op, **tok);
  ASSERT_TRUE(dp.ok());
  ASSERT_EQ(dp->preview.size(), 2u);
  EXPECT_EQ(dp->preview[1].front(), 1);
  EXPECT_EQ(static_cast<int64_t>(dp->preview[1].size()), lens[1]);
  // Validation split comes from the end of the stream.
  text_dataset_options o2{d / "c.txt", 4, 0.3, true, true, {}};
  auto ds2 = load_text_dataset(o2, **tok);
  ASSERT_TRUE(ds2.ok());
  EXPECT_EQ(ds2->train.tokens.size() + ds2->val.tokens.size(), want.size());
  EXPECT_EQ(ds2->val.tokens.back(), 2);
  write_bytes(d / "empty.txt", "\n\n  \n");
  auto e = load_text_dataset({d / "empty.txt", 4, 0.0, true, true, {}}, **tok);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.message().find("corpus is empty"), std::string::npos);
  EXPECT_NE(load_text_dataset({d / "none.txt", 4, 0.0, true, true, {}}, **tok).message().find("not found"), std::string::npos);
  EXPECT_NE(load_text_dataset({d / "c.txt", 500, 0.0, true, true, {}}, **tok).message().find("too small"), std::string::npos);
}

TEST(Dataset, SamplerIsAPermutationPerEpochAndDeterministic) {
  epoch_sampler a(10, 3), b(10, 3), c(10, 4);
  std::set<int64_t> seen;
  std::vector<int64_t> e0, e1, other;
  for (int i = 0; i < 10; ++i) e0.push_back(a.at(i));
  for (int i = 10; i < 20; ++i) e1.push_back(a.at(i));
  for (int i = 0; i < 10; ++i) other.push_back(c.at(i));
  seen.insert(e0.begin(), e0.end());
  EXPECT_EQ(seen.size(), 10u);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, other);
  EXPECT_EQ(b.at(13), e1[3]);  // random access by cursor
}

TEST(MemoryArena, ExactSizesOomAndCoalescing) {
  memory_arena a("dev0", 1000, 100);
  auto x = a.allocate(250);  // rounded to 300
  ASSERT_TRUE(x.ok());
  auto y = a.allocate(300);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(a.used(), 600u);
  auto z = a.allocate(500);
  ASSERT_FALSE(z.ok());
  EXPECT_NE(z.message().find("out of memory"), std::string::npos);
  a.release(*x);
  a.release(*y);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.peak(), 600u);
  EXPECT_TRUE(a.allocate(1000).ok());  // free list coalesced back to one block
}
