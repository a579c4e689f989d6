// Model families against transformers: tiny random models of every supported family, made by
// make_family_models.py with transformers' own classes, are loaded by lorapipe and compared on
// logits (base and with a real PEFT adapter), loss, LoRA gradients and greedy continuations (KV cache,
// sequences longer than the sliding window). Then each family goes through the engine: a 20-step
// chat fine-tune (the family's chat template from tokenizer_config.json) on one device and through
// cpu:2 1F1B, stopped and resumed from a checkpoint; the trained adapter, the merged export and
// lorapipe's logits with them are left for check_peft.py, which loads them in real PEFT/transformers.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/file_io.h"
#include "core/base/safetensors.h"
#include "core/model/generate.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/model/tensor_io.h"
#include "core/project/project.h"
#include "core/runs/checkpoint.h"
#include "core/train/layer_profile.h"
#include "core/train/trainer.h"
#include "tests/test_observer.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace lorapipe;

namespace {

fs::path families_dir() {
  const char* d = std::getenv("LORAPIPE_FAMILIES");
  return d != nullptr ? fs::path(d) : fs::path("families");
}

const std::vector<std::string> all_families{"llama3", "llama_linear", "llama_dynamic", "llama_yarn", "qwen2",
                                            "qwen3",  "mistral",      "phi3",          "gemma2",     "gemma3"};

struct golden {
  std::map<std::string, at::Tensor> t;
  json meta;
};

golden read_golden(const std::string& family) {
  golden g;
  const auto dir = families_dir() / family;
  auto f = safetensors_file::open(dir / "golden.safetensors");
  EXPECT_TRUE(f.ok()) << f.message();
  for (const auto& info : f->tensors()) g.t[info.name] = read_tensor(*f, info, at::ScalarType::Undefined).value();
  g.meta = json::parse(read_text_file(dir / "golden.json").value());
  return g;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) { return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>(); }

class Family : public ::testing::TestWithParam<std::string> {};

TEST_P(Family, EqualsTransformersLogitsGradientsAndGreedyTokens) {
  at::set_num_threads(2);
  const auto fam = GetParam();
  const auto dir = families_dir() / fam;
  auto g = read_golden(fam);
  auto w = load_llama(dir / "model", {at::kFloat});
  ASSERT_TRUE(w.ok()) << w.message();
  EXPECT_EQ(w->cfg.model_type, json::parse(read_text_file(dir / "model/config.json").value())["model_type"]);
  const auto tokens = g.t.at("tokens"), labels = g.t.at("labels");  // i64 [2,T]
  {
    torch::NoGradGuard ng;
    auto logits = forward(*w, nullptr, tokens);  // f32 [2,T,V]
    const double d = max_abs(logits, g.t.at("base_logits"));
    std::printf("%-14s base logits max |diff| %.2e\n", fam.c_str(), d);
    EXPECT_LE(d, 1e-4) << fam;
  }
  auto lora = load_peft_adapter(dir / "adapter", *w);
  ASSERT_TRUE(lora.ok()) << lora.message();
  auto logits = forward(*w, &*lora, tokens, 0, nullptr, /*training=*/true);
  EXPECT_LE(max_abs(logits.detach(), g.t.at("adapter_logits")), 1e-4) << fam;
  auto loss = causal_lm_loss(logits, labels);
  EXPECT_NEAR(loss.item<double>(), g.meta["loss"].get<double>(), 1e-5 * g.meta["loss"].get<double>()) << fam;
  loss.backward();
  const auto names = lora->parameter_names();
  const auto params = lora->parameters();
  ASSERT_EQ(names.size(), static_cast<size_t>(std::count_if(g.t.begin(), g.t.end(), [](auto& kv) { return kv.first.rfind("grad:", 0) == 0; })));
  double worst = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = g.t.find("grad:" + names[i]);
    ASSERT_NE(it, g.t.end()) << names[i];
    ASSERT_TRUE(params[i].grad().defined()) << names[i];
    const double rel = (params[i].grad() - it->second).norm().item<double>() / it->second.norm().item<double>();
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-4) << fam << " " << names[i];
  }
  std::printf("%-14s loss %.6f (transformers %.6f), %zu LoRA gradients, worst relative diff %.2e\n", fam.c_str(), loss.item<double>(),
              g.meta["loss"].get<double>(), names.size(), worst);

  std::vector<int32_t> prompt = g.meta["prompt"].get<std::vector<int32_t>>();
  sampling_options so;
  so.max_new_tokens = static_cast<int64_t>(g.meta["greedy"].size());
  so.stop_id = -1;  // the fixture generated past EOS too
  auto ids = generate(*w, nullptr, prompt, so);
  const auto want = g.meta["greedy"].get<std::vector<int32_t>>();
  EXPECT_EQ(ids, want) << fam << ": greedy continuation (prompt " << prompt.size() << " tokens, window " << w->cfg.sliding_window << ")";
}

struct losses : observer {
  std::vector<double> step;
  cancel_token stop;
  int64_t stop_at = -1;
  void on_event(const engine_event& e) override {
    if (auto* s = std::get_if<step_event>(&e)) {
      step.push_back(s->loss);
      if (s->step == stop_at) stop.request();
    }
  }
};

project_config chat_project(const std::string& fam, const std::string& tag) {
  const auto dir = families_dir() / fam;
  auto meta = json::parse(read_text_file(dir / "golden.json").value());
  project_config c;
  c.model.path = (dir / "model").string();
  c.data.train = (test_data_dir() / "instruct/quiz_chat.jsonl").string();
  c.data.format = "chat";
  c.data.seq_len = 128;
  c.data.truncation = "left";  // Llama 3.1's template opens with a long system header: keep the answers
  c.lora.targets = meta["targets"].get<std::vector<std::string>>();
  c.lora.r = 4;
  c.lora.alpha = 8;
  c.run.steps = 20;
  c.run.batch_size = 4;
  c.optimizer.lr = 5e-3;
  c.run.threads = 2;
  c.run.eval_interval = 0;
  c.run.eval_batches = 0;
  c.run.sample_tokens = 0;
  c.run.output_dir = (fs::temp_directory_path() / fmt::format("lorapipe_family_{}_{}_{}", fam, tag, ::getpid())).string();
  fs::remove_all(c.run.output_dir);
  return c;
}

TEST_P(Family, FineTunesThroughThePipelineAndResumesFromACheckpoint) {
  at::set_num_threads(2);
  const auto fam = GetParam();
  auto single = chat_project(fam, "single");
  losses r1;
  auto s1 = run_training(single, r1);
  ASSERT_TRUE(s1.ok()) << s1.message();
  ASSERT_EQ(r1.step.size(), 20u);
  EXPECT_LT(r1.step.back(), r1.step.front()) << fam << ": the chat fine-tune should lower the loss";

  auto piped = chat_project(fam, "1f1b");
  piped.parallel.schedule = "1f1b";
  piped.parallel.devices = "cpu:2";
  piped.parallel.micro_batches = 2;
  losses r2;
  auto s2 = run_training(piped, r2);
  ASSERT_TRUE(s2.ok()) << s2.message();
  ASSERT_EQ(r2.step.size(), 20u);
  double worst = 0;
  for (size_t i = 0; i < 20; ++i) worst = std::max(worst, std::abs(r1.step[i] - r2.step[i]));
  std::printf("%-14s chat loss %.4f -> %.4f; cpu:2 1f1b max |diff| over 20 steps %.2e\n", fam.c_str(), r1.step.front(),
              r1.step.back(), worst);
  EXPECT_LE(worst, 1e-4) << fam;

  // The other schedules: the same loss curve as the single device.
  for (const std::string sched : {"gpipe", "interleaved", "round-robin"}) {
    auto c = chat_project(fam, sched);
    if (sched == "interleaved" && json::parse(read_text_file(fs::path(c.model.path) / "config.json").value())["num_hidden_layers"] < 4)
      continue;  // 2 devices x 2 virtual stages need 4 layers
    c.parallel.schedule = sched;
    c.parallel.devices = "cpu:2";
    c.parallel.micro_batches = 2;
    losses r;
    auto s = run_training(c, r);
    ASSERT_TRUE(s.ok()) << sched << ": " << s.message();
    ASSERT_EQ(r.step.size(), 20u);
    for (size_t i = 0; i < 20; ++i) EXPECT_NEAR(r.step[i], r1.step[i], 1e-4) << fam << " " << sched << " step " << i;
    fs::remove_all(c.run.output_dir);
  }

  // Stopped after step 8 with checkpoints, resumed: the same curve as the uninterrupted run.
  auto part = chat_project(fam, "part");
  part.run.checkpoint_interval = 4;
  losses first;
  first.stop_at = 8;
  train_options o;
  o.checkpoint_root = fs::path(part.run.output_dir) / "ck";
  o.cancel = &first.stop;
  auto p1 = run_training(part, first, o);
  ASSERT_TRUE(p1.ok()) << p1.message();
  ASSERT_TRUE(p1->stopped);
  auto cks = list_checkpoints(o.checkpoint_root);
  ASSERT_FALSE(cks.empty());
  losses second;
  train_options o2;
  o2.checkpoint_root = o.checkpoint_root;
  o2.resume_from = cks.back().dir;
  auto p2 = run_training(part, second, o2);
  ASSERT_TRUE(p2.ok()) << p2.message();
  std::vector<double> got = first.step;
  got.insert(got.end(), second.step.begin(), second.step.end());
  EXPECT_EQ(got, r1.step) << fam << ": resumed curve";

  // For check_peft.py: the trained adapter, the merged export and lorapipe's logits with them.
  auto w = load_llama(single.model.path, {at::kFloat}).value();
  auto trained = load_peft_adapter(fs::path(single.run.output_dir) / "adapter", w);
  ASSERT_TRUE(trained.ok()) << trained.message();
  const auto out = families_dir() / fam / "trained";
  fs::remove_all(out);
  ASSERT_TRUE(save_peft_adapter(*trained, out / "adapter").ok());
  ASSERT_TRUE(export_merged(w, *trained, out / "merged", single.model.path).ok());
  {  // From a pipeline rank's weights (layer 0 only; no embedding, no head): the others are read from
     // the model as the export goes, to the very same file (untied heads included).
    load_options sel{at::kFloat};
    sel.select = [](const llama_config& mc) -> result<weight_selection> {
      weight_selection s{std::vector<bool>(static_cast<size_t>(mc.num_layers), false), false, false};
      s.layers[0] = true;
      return s;
    };
    auto part_w = load_llama(single.model.path, sel);
    ASSERT_TRUE(part_w.ok()) << part_w.message();
    ASSERT_TRUE(export_merged(*part_w, *trained, out / "merged-part", single.model.path).ok());
    EXPECT_EQ(read_text_file(out / "merged-part/model.safetensors").value(), read_text_file(out / "merged/model.safetensors").value())
        << fam;
    fs::remove_all(out / "merged-part");
  }
  torch::NoGradGuard ng;
  auto g = read_golden(fam);
  auto logits = forward(w, &*trained, g.t.at("tokens"));  // f32 [2,T,V]
  ASSERT_TRUE(write_tensors(out / "logits.safetensors", {{"logits", logits.contiguous()}}).ok());
  for (const auto* c : {&single, &piped, &part}) fs::remove_all(c->run.output_dir);
}

// Configs of published checkpoints (transformers 4.x layout) parse to what transformers builds.
TEST(FamilyConfig, PublishedCheckpointConfigs) {
  auto all = json::parse(read_text_file(fs::path(LORAPIPE_FAMILIES_SRC) / "hub_configs.json").value());
  std::map<std::string, llama_config> got;
  for (auto it = all.begin(); it != all.end(); ++it) {
    if (it.key()[0] == '_') continue;
    auto c = parse_llama_config(it.value(), it.key());
    if (it.key().find("(refused)") != std::string::npos) {
      ASSERT_FALSE(c.ok()) << it.key();
      EXPECT_NE(c.message().find("'longrope' is not supported"), std::string::npos) << c.message();
      continue;
    }
    ASSERT_TRUE(c.ok()) << c.message();
    got[it.key()] = *c;
  }
  const auto& l = got.at("Llama-3.2-1B");
  EXPECT_EQ(l.rope.type, "llama3");
  EXPECT_EQ(l.rope.factor, 32.0);
  EXPECT_EQ(l.rope.theta, 500000.0);
  EXPECT_EQ(l.rope.original_max_position_embeddings, 8192);
  EXPECT_TRUE(l.tie_word_embeddings);
  const auto& q = got.at("Qwen2.5-0.5B-Instruct");
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_FALSE(q.o_bias);
  EXPECT_EQ(q.sliding_window, 0);  // use_sliding_window false
  EXPECT_TRUE(got.at("Qwen3-0.6B").qk_norm);
  EXPECT_EQ(got.at("Qwen3-0.6B").head_dim, 128);
  const auto& m = got.at("Mistral-7B-v0.1");
  EXPECT_EQ(m.sliding_window, 4096);
  EXPECT_TRUE(m.is_sliding(0) && m.is_sliding(31));
  const auto& p = got.at("Phi-3-mini-4k-instruct");
  EXPECT_TRUE(p.fused_proj);
  EXPECT_EQ(p.sliding_window, 2047);
  const auto& g2 = got.at("gemma-2-2b");
  EXPECT_TRUE(g2.is_sliding(0));
  EXPECT_FALSE(g2.is_sliding(1));
  EXPECT_EQ(g2.attn_softcap, 50.0);
  EXPECT_EQ(g2.final_softcap, 30.0);
  EXPECT_EQ(g2.eos_token_id, 1);
  EXPECT_TRUE(g2.tie_word_embeddings && g2.gemma_norm && g2.sandwich_norm && g2.gelu_tanh && g2.scale_embeddings);
  const auto& g3 = got.at("gemma-3-1b-it");
  for (int64_t layer = 0; layer < 26; ++layer) EXPECT_EQ(g3.is_sliding(layer), (layer + 1) % 6 != 0) << layer;
  EXPECT_EQ(g3.rope.theta, 1e6);
  EXPECT_EQ(g3.rope_local.theta, 1e4);
  EXPECT_EQ(g3.attn_softcap, 0.0);
  EXPECT_EQ(g3.final_softcap, 0.0);
  EXPECT_TRUE(g3.qk_norm);
}

// The autograd graph one layer keeps, measured by the layer profiler through LibTorch's allocator,
// is covered by the memory plan's model (the executor reserves the model's bytes per graph): short
// of it a plan said to fit could run out of memory. Within reason above it, too.
TEST_P(Family, MemoryPlanCoversTheMeasuredAutogradGraph) {
  const auto fam = GetParam();
  auto c = chat_project(fam, "graph");
  c.parallel.devices = "cpu:2";
  c.parallel.schedule = "1f1b";
  c.parallel.micro_batches = 2;
  const llama_config mc = load_llama_config(fs::path(c.model.path) / "config.json").value();
  profile_options quick;
  quick.warmup = quick.repeats = 1;
  quick.warmup_seconds = quick.min_seconds = 0;
  for (int64_t T : {32, 128}) {
    c.data.seq_len = T;
    auto p = profile_layers(c, mc, quick);
    ASSERT_TRUE(p.ok()) << p.message();
    EXPECT_GE(p->graph_bytes_per_token_model, 0.98 * p->graph_bytes_per_token) << fam << " at " << T << " tokens";
    EXPECT_GE(p->graph_bytes_per_token, 0.6 * p->graph_bytes_per_token_model) << fam << " at " << T << " tokens";
    std::printf("%s, %lld tokens: autograd graph per token and layer measured %.0f B, memory plan %.0f B (%+.1f%%)\n", fam.c_str(),
                static_cast<long long>(T), p->graph_bytes_per_token, p->graph_bytes_per_token_model,
                100 * (p->graph_bytes_per_token_model / p->graph_bytes_per_token - 1));
  }
  fs::remove_all(c.run.output_dir);
}

INSTANTIATE_TEST_SUITE_P(Families, Family, ::testing::ValuesIn(all_families),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// Every key of every family's config.json is read or harmless; what would change the numerics
// and is not implemented is refused by name.
TEST(FamilyConfig, EveryKeyIsReadIgnoredOrRefused) {
  for (const auto& fam : all_families) {
    auto j = json::parse(read_text_file(families_dir() / fam / "model/config.json").value());
    const auto type = j["model_type"].get<std::string>();
    std::string read, ignored;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const auto st = config_key_status(type, it.key());
      EXPECT_NE(st, "refused") << fam << ": " << it.key();
      (st == "read" ? read : ignored) += it.key() + " ";
    }
    std::printf("%-14s read: %s\n%-14s ignored: %s\n", fam.c_str(), read.c_str(), "", ignored.c_str());
  }
  auto base = json::parse(read_text_file(families_dir() / "llama3/model/config.json").value());
  auto refused = [&](const std::function<void(json&)>& edit, const std::string& field) {
    json j = base;
    edit(j);
    auto r = parse_llama_config(j, "config.json");
    EXPECT_FALSE(r.ok()) << field;
    if (!r.ok()) EXPECT_NE(r.message().find(field), std::string::npos) << r.message();
  };
  refused([](json& j) { j["model_type"] = "gpt_neox"; }, "model_type 'gpt_neox' is not supported; supported: llama, mistral");
  refused([](json& j) { j["rope_parameters"]["rope_type"] = "longrope"; }, "rope_parameters.rope_type");
  refused([](json& j) { j["rope_parameters"]["short_factor"] = json::array({1.0}); }, "rope_parameters.short_factor");
  refused([](json& j) { j["quantization_config"] = json::object(); }, "quantization_config");
  refused([](json& j) { j["attention_dropout"] = 0.1; }, "attention_dropout");
  refused([](json& j) { j["partial_rotary_factor"] = 0.5; }, "partial_rotary_factor");
  refused([](json& j) { j["sliding_window"] = 8; }, "sliding_window");  // Llama has none
  refused([](json& j) { j["hidden_act"] = "gelu"; }, "hidden_act");
  refused([](json& j) { j["rope_parameters"].erase("low_freq_factor"); }, "rope_parameters.low_freq_factor' is required");
  refused([](json& j) { j["rope_scaling"] = j["rope_parameters"]; }, "'rope_parameters' and 'rope_scaling' are both set");
  refused([](json& j) { j["rope_parameters"] = {{"full_attention", j["rope_parameters"]}}; }, "must not be given per layer type");
  // transformers 4 layout: rope_theta + rope_scaling read like transformers 5's rope_parameters.
  json old = base;
  old["rope_theta"] = old["rope_parameters"]["rope_theta"];
  old["rope_scaling"] = old["rope_parameters"];
  old["rope_scaling"].erase("rope_theta");
  old.erase("rope_parameters");
  auto a = parse_llama_config(base, "new"), b = parse_llama_config(old, "old");
  ASSERT_TRUE(a.ok() && b.ok()) << a.message() << b.message();
  EXPECT_EQ(a->rope.type, "llama3");
  EXPECT_EQ(b->rope.type, "llama3");
  EXPECT_EQ(a->rope.theta, b->rope.theta);
  EXPECT_EQ(a->rope.factor, b->rope.factor);
  EXPECT_EQ(a->rope.original_max_position_embeddings, b->rope.original_max_position_embeddings);
  // A LoRA target the family does not have is refused by the project's validation, naming the field.
  auto phi = project_config{};
  phi.model.path = (families_dir() / "phi3/model").string();
  phi.data.train = (test_data_dir() / "instruct/quiz_chat.jsonl").string();
  auto st = validate_project(phi);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("lora.targets: 'q_proj' is not a module of model_type 'phi3'"), std::string::npos) << st.message();
}

}  // namespace
