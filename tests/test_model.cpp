// Model tests on the real stories260K checkpoint: golden greedy text from the HF folder and the
// llama2.c .bin, reference logits and losses, KV cache, sharded checkpoints, PEFT adapters,
// merged export, and clear errors for malformed model folders.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/generate.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/base/safetensors.h"
#include "core/model/tensor_io.h"
#include "core/text/tokenizer.h"
#include "core/train/trainer.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;
using namespace lorapipe;
using json = nlohmann::json;

namespace {
fs::path stories() { return test_data_dir() / "models/stories260K"; }
json reference() { return json::parse(read_text_file(stories() / "reference.json").value()); }
llama_weights load(const fs::path& p, at::ScalarType dt = at::kFloat) {
  auto w = load_llama(p, {dt});
  EXPECT_TRUE(w.ok()) << (w.ok() ? "" : w.message());
  return std::move(w).value();
}
fs::path temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("lorapipe_mt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
double maxdiff(const at::Tensor& a, const at::Tensor& b) { return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>(); }
at::Tensor ids_tensor(const std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong).unsqueeze(0); }
}  // namespace

class GoldenGreedy : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenGreedy, ReproducesReferenceTextExactly) {
  at::set_num_threads(2);
  auto ref = reference();
  auto w = load(stories() / GetParam());
  auto tok = load_tokenizer(stories() / GetParam()).value();
  auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  auto want40 = ref["greedy_40_ids"].get<std::vector<int32_t>>();
  sampling_options so;
  so.max_new_tokens = static_cast<int64_t>(want40.size() - prompt.size());
  auto got = generate(w, nullptr, prompt, so);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), got.begin(), got.end());
  EXPECT_EQ(all, want40);
  EXPECT_EQ(tok->decode(all), ref["greedy_40_text"].get<std::string>());
  auto want200 = ref["greedy_from_bos_200_ids"].get<std::vector<int32_t>>();
  so.max_new_tokens = 200;
  auto g200 = generate(w, nullptr, {1}, so);
  g200.insert(g200.begin(), 1);
  EXPECT_EQ(g200, want200);
  EXPECT_EQ(tok->decode(g200), ref["greedy_from_bos_200_text"].get<std::string>());
}
INSTANTIATE_TEST_SUITE_P(Stories, GoldenGreedy, ::testing::Values("hf", "llama2c/stories260K.bin"),
                         [](const auto& i) { return i.param == "hf" ? std::string("hf") : std::string("llama2c"); });

TEST(Model, PromptLogitsAndLossesMatchReference) {
  auto ref = reference();
  auto want = torch::tensor(ref["prompt_last_position_logits_fp32"].get<std::vector<float>>());
  for (const char* src : {"hf", "llama2c/stories260K.bin"}) {
    auto w = load(stories() / src);
    torch::NoGradGuard ng;
    auto logits = forward(w, nullptr, ids_tensor(ref["prompt_ids"].get<std::vector<int64_t>>()));
    double d = maxdiff(logits[0][-1], want);
    std::printf("%s: prompt logits maxdiff vs reference %.3e\n", src, d);
    EXPECT_LE(d, 1e-4) << src;
  }
  auto w32 = load(stories() / "hf");
  auto wbf = load(stories() / "hf-bf16");
  for (const auto& row : ref["loss"]) {
    torch::NoGradGuard ng;
    auto ids = row["ids"].get<std::vector<int64_t>>();
    auto t = ids_tensor(ids);
    auto x = t.slice(1, 0, t.size(1) - 1), y = t.slice(1, 1);
    double l32 = causal_lm_loss(forward(w32, nullptr, x), y).item<double>();
    double lbf = causal_lm_loss(forward(wbf, nullptr, x), y).item<double>();
    std::printf("%s: loss fp32 %.5f (ref %.5f), bf16 weights %.5f (ref %.5f)\n", row["name"].get<std::string>().c_str(), l32,
                row["mean_nll_hf_fp32"].get<double>(), lbf, row["mean_nll_hf_bf16"].get<double>());
    EXPECT_NEAR(l32, row["mean_nll_hf_fp32"].get<double>(), 2e-5);
    EXPECT_NEAR(lbf, row["mean_nll_hf_bf16"].get<double>(), 2e-3);
  }
}

TEST(Model, Bf16ComputeStaysCloseToFp32) {
  auto ref = reference();
  auto w = load(stories() / "hf-bf16", at::kBFloat16);
  EXPECT_EQ(w.embed.scalar_type(), at::kBFloat16);
  torch::NoGradGuard ng;
  auto logits = forward(w, nullptr, ids_tensor(ref["prompt_ids"].get<std::vector<int64_t>>()));
  auto want = torch::tensor(ref["prompt_last_position_logits_fp32"].get<std::vector<float>>());
  EXPECT_LE(maxdiff(logits[0][-1], want), 0.5);
  EXPECT_EQ(logits[0][-1].argmax().item<int64_t>(), want.argmax().item<int64_t>());
}

TEST(Model, KvCacheMatchesFullForward) {
  auto w = load(stories() / "hf");
  torch::NoGradGuard ng;
  auto tokens = torch::randint(0, 512, {2, 12}, torch::kLong);
  auto full = forward(w, nullptr, tokens);
  kv_cache cache;
  auto a = forward(w, nullptr, tokens.slice(1, 0, 5), 0, &cache);
  auto b = forward(w, nullptr, tokens.slice(1, 5, 9), 5, &cache);  // several tokens with a past: masked
  std::vector<at::Tensor> parts{a, b};
  for (int64_t t = 9; t < 12; ++t) parts.push_back(forward(w, nullptr, tokens.slice(1, t, t + 1), t, &cache));
  EXPECT_LE(maxdiff(torch::cat(parts, 1), full), 1e-4);  // logits up to ~17: fp32 reassociation
  EXPECT_EQ(cache.length, 12);
}

TEST(Model, ShardedCheckpointLoadsLikeSingleFile) {
  auto d = temp_dir("sharded");
  auto src = safetensors_file::open(stories() / "hf/model.safetensors").value();
  std::vector<std::pair<std::string, at::Tensor>> a, b;
  json wm;
  int i = 0;
  for (const auto& t : src.tensors()) {
    auto tensor = read_tensor(src, t, at::ScalarType::Undefined).value();
    auto file = (i++ % 2 == 0) ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    ((i % 2 == 1) ? a : b).emplace_back(t.name, tensor);
    wm[t.name] = file;
  }
  ASSERT_TRUE(write_tensors(d / "model-00001-of-00002.safetensors", a).ok());
  ASSERT_TRUE(write_tensors(d / "model-00002-of-00002.safetensors", b).ok());
  std::ofstream(d / "model.safetensors.index.json") << json{{"metadata", json::object()}, {"weight_map", wm}}.dump();
  fs::copy_file(stories() / "hf/config.json", d / "config.json");
  auto ws = load(d), w1 = load(stories() / "hf");
  torch::NoGradGuard ng;
  auto tokens = torch::randint(0, 512, {1, 8}, torch::kLong);
  EXPECT_EQ(maxdiff(forward(ws, nullptr, tokens), forward(w1, nullptr, tokens)), 0.0);
}

TEST(Model, MalformedModelFoldersGiveClearErrors) {
  auto d = temp_dir("badmodel");
  auto expect_error = [&](const std::string& needle) {
    auto w = load_llama(d, {at::kFloat});
    ASSERT_FALSE(w.ok()) << needle;
    EXPECT_NE(w.message().find(needle), std::string::npos) << w.message();
  };
  expect_error("config.json: file not found");
  auto cfg = json::parse(read_text_file(stories() / "hf/config.json").value());
  std::ofstream(d / "config.json") << "{ not json";
  expect_error("not valid JSON");
  cfg["hidden_size"] = 72;
  cfg["head_dim"] = 8;
  std::ofstream(d / "config.json") << cfg.dump();
  expect_error("no model.safetensors");
  fs::copy_file(stories() / "hf/model.safetensors", d / "model.safetensors");
  expect_error("config.json implies");  // shape mismatch names the tensor
  cfg["hidden_size"] = 64;
  std::ofstream(d / "config.json") << cfg.dump();
  EXPECT_TRUE(load_llama(d, {at::kFloat}).ok());
  auto bytes = read_text_file(d / "model.safetensors").value();
  std::ofstream(d / "model.safetensors", std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  expect_error("truncated");
  EXPECT_NE(load_llama(d / "nothing.bin", {at::kFloat}).message().find("not found"), std::string::npos);
  std::ofstream(d / "bad.bin", std::ios::binary) << std::string(64, '\x01');
  auto b = load_llama(d / "bad.bin", {at::kFloat});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.message().find("bad.bin"), std::string::npos) << b.message();
}

TEST(Lora, ZeroInitIsIdentityAndPeftRoundTrip) {
  auto w = load(stories() / "hf");
  lora_config cfg;
  cfg.r = 4;
  cfg.alpha = 8;
  cfg.targets = {lora_target::q, lora_target::v, lora_target::gate, lora_target::down};
  auto a = init_lora(w, cfg, 42);
  EXPECT_EQ(a.parameters().size(), 5u * 4 * 2);
  auto tokens = torch::randint(0, 512, {2, 10}, torch::kLong);
  torch::NoGradGuard ng;
  EXPECT_EQ(maxdiff(forward(w, &a, tokens), forward(w, nullptr, tokens)), 0.0);  // B = 0
  for (auto& p : a.parameters()) p.uniform_(-0.1, 0.1);
  auto d = temp_dir("peft");
  ASSERT_TRUE(save_peft_adapter(a, d / "ad").ok());
  auto cfgj = json::parse(read_text_file(d / "ad/adapter_config.json").value());
  EXPECT_EQ(cfgj["peft_type"], "LORA");
  EXPECT_EQ(cfgj["task_type"], "CAUSAL_LM");
  EXPECT_EQ(cfgj["r"], 4);
  EXPECT_EQ(cfgj["target_modules"], json({"q_proj", "v_proj", "gate_proj", "down_proj"}));
  auto st = safetensors_file::open(d / "ad/adapter_model.safetensors").value();
  const auto* qa = st.find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  const auto* db = st.find("base_model.model.model.layers.4.mlp.down_proj.lora_B.weight");
  ASSERT_NE(qa, nullptr);
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(qa->shape, (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(db->shape, (std::vector<int64_t>{64, 4}));
  auto back = load_peft_adapter(d / "ad", w);
  ASSERT_TRUE(back.ok()) << back.message();
  auto pa = a.parameters(), pb = back->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i]));
  EXPECT_EQ(maxdiff(forward(w, &*back, tokens), forward(w, &a, tokens)), 0.0);
  // Merged export: the merged model alone gives the adapted model's logits.
  ASSERT_TRUE(export_merged(w, a, d / "merged", stories() / "hf").ok());
  EXPECT_TRUE(fs::exists(d / "merged/tokenizer.model"));
  auto wm = load(d / "merged");
  EXPECT_LE(maxdiff(forward(wm, nullptr, tokens), forward(w, &a, tokens)), 1e-4);
  // From weights a pipeline rank loaded (layers 1 and 3, no embedding: the rest meta tensors), the
  // export reads the others from the model a layer at a time: the very same file.
  load_options part{at::kFloat};
  part.select = [](const llama_config& mc) -> result<weight_selection> {
    weight_selection sel{std::vector<bool>(static_cast<size_t>(mc.num_layers), false), false, false};
    sel.layers[1] = sel.layers[3] = true;
    return sel;
  };
  auto wp = load_llama(stories() / "hf", part);
  ASSERT_TRUE(wp.ok()) << wp.message();
  ASSERT_FALSE(weights_complete(*wp));
  ASSERT_TRUE(export_merged(*wp, a, d / "merged-part", stories() / "hf").ok());
  EXPECT_EQ(read_text_file(d / "merged-part/model.safetensors").value(), read_text_file(d / "merged/model.safetensors").value());
  // A source that cannot be read any more fails the export with the reason and leaves no file.
  wp->source = (d / "gone").string();
  auto gone = export_merged(*wp, a, d / "merged-gone", stories() / "hf");
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.message().find("did not load"), std::string::npos) << gone.message();
  EXPECT_TRUE(fs::is_empty(d / "merged-gone"));  // not even the temporary
  // An adapter for a different model is rejected with a reason.
  auto other = load(d / "merged");
  other.layers.pop_back();
  EXPECT_FALSE(load_peft_adapter(d / "ad", other).ok());
  auto cfg_text = read_text_file(d / "ad/adapter_config.json").value();
  std::ofstream(d / "ad/adapter_config.json") << "{\"peft_type\":\"LORA\",\"r\":16,\"lora_alpha\":8,\"target_modules\":[\"q_proj\"]}";
  auto bad = load_peft_adapter(d / "ad", w);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("shape"), std::string::npos) << bad.message();
}

TEST(Model, Llama2cVersion1ExportLoadsLikeLegacy) {
  // Rewrite the legacy checkpoint in llama2.c's version-1 layout ('ak42' header, norms first, no
  // RoPE tables) and check both load to the same weights.
  auto raw = read_text_file(stories() / "llama2c/stories260K.bin").value();
  int32_t h[7];
  std::memcpy(h, raw.data(), 28);
  const int64_t D = h[0], H = h[1], L = h[2], NH = h[3], NKV = h[4], V = std::abs(h[5]), S = h[6], hd = D / NH, KV = NKV * hd;
  const char* p = raw.data() + 28;
  auto take = [&](int64_t n) {
    std::string s(p, static_cast<size_t>(n * 4));
    p += n * 4;
    return s;
  };
  auto tok = take(V * D), rms_att = take(L * D), wq = take(L * D * D), wk = take(L * KV * D), wv = take(L * KV * D),
       wo = take(L * D * D), rms_ffn = take(L * D), w1 = take(L * H * D), w2 = take(L * D * H), w3 = take(L * H * D),
       rms_final = take(D);
  (void)S;
  std::string v1(256, '\0');
  const uint32_t magic = 0x616b3432u;
  const int32_t version = 1;
  std::memcpy(v1.data(), &magic, 4);
  std::memcpy(v1.data() + 4, &version, 4);
  int32_t hdr[7] = {h[0], h[1], h[2], h[3], h[4], static_cast<int32_t>(V), h[6]};
  std::memcpy(v1.data() + 8, hdr, 28);
  v1[36] = 1;  // shared classifier
  v1 += rms_att + rms_ffn + rms_final + tok + wq + wk + wv + wo + w1 + w2 + w3;
  auto d = temp_dir("v1");
  std::ofstream(d / "v1.bin", std::ios::binary) << v1;
  auto a = load(stories() / "llama2c/stories260K.bin"), b = load(d / "v1.bin");
  auto tokens = torch::randint(0, 512, {1, 9}, torch::kLong);
  torch::NoGradGuard ng;
  EXPECT_EQ(maxdiff(forward(a, nullptr, tokens), forward(b, nullptr, tokens)), 0.0);
  std::ofstream(d / "v1.bin", std::ios::binary | std::ios::trunc) << v1.substr(0, v1.size() - 4);
  auto bad = load_llama(d / "v1.bin", {at::kFloat});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("size mismatch"), std::string::npos) << bad.message();
}

// A pipeline rank reads only its stages' tensors: the selected ones equal a full load, the others are
// meta tensors of the right shape (LoRA initialisation still works on them, any read throws), and a
// selection for another layer count is refused. Both formats; a tied head keeps the embedding.
TEST(Model, SelectedLayersAloneAreRead) {
  for (const char* src : {"hf", "llama2c/stories260K.bin"}) {
    SCOPED_TRACE(src);
    auto full = load(stories() / src);
    load_options lo{at::kFloat};
    int64_t seen_layers = -1;
    lo.select = [&](const llama_config& mc) -> result<weight_selection> {
      seen_layers = mc.num_layers;
      return weight_selection{{false, true, true, false, false}, /*embed=*/false, /*head=*/false};
    };
    auto part = load_llama(stories() / src, lo);
    ASSERT_TRUE(part.ok()) << part.message();
    EXPECT_EQ(seen_layers, 5);
    EXPECT_TRUE(weights_complete(full));
    EXPECT_FALSE(weights_complete(*part));
    for (size_t l = 0; l < 5; ++l)
      for (size_t k = 0; k < part->layers[l].t.size(); ++k) {
        const auto &a = part->layers[l].t[k], &b = full.layers[l].t[k];
        ASSERT_EQ(a.defined(), b.defined());
        if (!a.defined()) continue;
        EXPECT_EQ(a.sizes(), b.sizes());
        EXPECT_EQ(a.scalar_type(), b.scalar_type());
        EXPECT_EQ(a.is_meta(), l != 1 && l != 2) << "layer " << l;
        if (!a.is_meta()) EXPECT_TRUE(torch::equal(a, b)) << "layer " << l;
      }
    // stories260K ties its head: no head, no embedding; the final norm is always read.
    EXPECT_TRUE(part->embed.is_meta());
    EXPECT_TRUE(part->lm_head.is_meta());
    EXPECT_TRUE(torch::equal(part->final_norm, full.final_norm));
    lora_config lc;
    lc.targets = {lora_target::q, lora_target::down};
    auto a = init_lora(*part, lc, 7), b = init_lora(full, lc, 7);
    for (size_t i = 0; i < a.parameters().size(); ++i) EXPECT_TRUE(torch::equal(a.parameters()[i], b.parameters()[i]));
    EXPECT_THROW((void)part->layers[0][layer_slot::q].sum().item<float>(), std::exception);
    lo.select = [](const llama_config&) -> result<weight_selection> { return weight_selection{{true, true}, true, true}; };
    auto wrong = load_llama(stories() / src, lo);
    ASSERT_FALSE(wrong.ok());
    EXPECT_NE(wrong.message().find("names 2 layers, the model has 5"), std::string::npos) << wrong.message();
    lo.select = [](const llama_config&) -> result<weight_selection> { return weight_selection{{}, false, true}; };
    auto tied = load_llama(stories() / src, lo);
    ASSERT_TRUE(tied.ok()) << tied.message();
    EXPECT_TRUE(weights_complete(*tied)) << "a tied head needs the embedding";
  }
}
