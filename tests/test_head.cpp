// The LM head and loss on trained tokens only (head_loss_sum): equal to the full-logits path on a
// masked batch (tied, untied and soft-capped heads, many chunks), and one training step with a
// Qwen3-size vocabulary (151,936) whose peak memory stays far below what its full logits need.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;
using namespace lorapipe;

namespace {

// A chat-like mask: labels only on a few spans ("assistant turns"), ~30% of positions.
at::Tensor masked_labels(const at::Tensor& tokens, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto labels = torch::full_like(tokens, -100);
  const int64_t B = tokens.size(0), T = tokens.size(1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < T; s += 20) {
      const int64_t len = 3 + torch::randint(5, {1}, gen).item<int64_t>();
      labels[b].slice(0, s + 10, std::min(T - 1, s + 10 + len)).copy_(tokens[b].slice(0, s + 11, std::min(T, s + 11 + len)));
    }
  return labels;
}

struct grads {
  double loss;
  std::vector<at::Tensor> g;
};

grads run(const llama_weights& w, lora_adapters& lora, const at::Tensor& x, const at::Tensor& y, bool chunked) {
  for (auto& p : lora.parameters()) p.mutable_grad() = at::Tensor();
  auto h = forward_hidden(w, &lora, x, true, 7);
  auto loss = chunked ? head_loss_sum(w.cfg, w.final_norm, w.lm_head, h, y, /*chunk_bytes=*/7 * w.cfg.vocab_size * 4)
                      : causal_lm_loss_sum(head_logits(w.cfg, w.final_norm, w.lm_head, h), y);
  loss.backward();
  grads out{loss.item<double>(), {}};
  for (const auto& p : lora.parameters()) out.g.push_back(p.grad().clone());
  return out;
}

}  // namespace

TEST(HeadLoss, EqualsTheFullLogitsOnAMaskedBatch) {
  at::set_num_threads(2);
  auto tied = load_llama(test_data_dir() / "models/stories260K/hf", {at::kFloat}).value();
  auto untied = tied;
  untied.cfg.tie_word_embeddings = false;
  untied.lm_head = (tied.embed + 0.01 * torch::randn_like(tied.embed)).set_requires_grad(false);
  auto capped = untied;
  capped.cfg.final_softcap = 2.0;  // Gemma-style logit soft-capping, tight enough to bend the logits
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto x = torch::randint(3, 512, {3, 96}, gen);
  auto y = masked_labels(x, 5);
  ASSERT_GT(y.ne(-100).sum().item<int64_t>(), 40);
  for (const auto* w : {&tied, &untied, &capped}) {
    lora_config lc;
    lc.targets = {lora_target::q, lora_target::v, lora_target::gate, lora_target::down};
    lc.dropout = 0.1;
    auto lora = init_lora(*w, lc, 11);
    {
      torch::NoGradGuard ng;
      for (auto& l : lora.layers)
        for (auto& p : l)
          if (p.b.defined()) p.b.normal_(0, 0.02);
    }
    auto full = run(*w, lora, x, y, false), chunked = run(*w, lora, x, y, true);
    EXPECT_NEAR(chunked.loss, full.loss, 1e-5 * std::abs(full.loss));
    double worst = 0;
    for (size_t i = 0; i < full.g.size(); ++i)
      worst = std::max(worst, (chunked.g[i] - full.g[i]).norm().item<double>() / full.g[i].norm().item<double>());
    std::printf("head %s: loss %.6f vs full logits %.6f, LoRA gradients worst relative diff %.2e (%zu tensors)\n",
                w == &tied ? "tied" : w == &untied ? "untied" : "soft-capped", chunked.loss, full.loss, worst, full.g.size());
    EXPECT_LE(worst, 1e-5);
  }
  // No labelled position: zero loss, zero gradients, no NaN.
  auto none = torch::full_like(y, -100);
  lora_config lc;
  auto lora = init_lora(tied, lc, 1);
  auto r = run(tied, lora, x, none, true);
  EXPECT_EQ(r.loss, 0.0);
  for (const auto& g : r.g) EXPECT_EQ(g.abs().sum().item<double>(), 0.0);
}

namespace {
// Synthetic small Llama with the Qwen3 vocabulary, built in memory (random weights).
llama_weights qwen_vocab_model() {
  llama_weights w;
  auto& c = w.cfg;
  c.vocab_size = 151936, c.hidden_size = 64, c.intermediate_size = 128, c.num_layers = 2, c.num_heads = 4, c.num_kv_heads = 4;
  c.head_dim = 16, c.max_position_embeddings = 1024, c.tie_word_embeddings = true;
  w.dtype = at::kFloat;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto rnd = [&](std::vector<int64_t> shape, double s) { return (torch::randn(shape, gen) * s).set_requires_grad(false); };
  w.embed = rnd({c.vocab_size, c.hidden_size}, 0.02);
  w.lm_head = w.embed;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    layer_weights lw;
    for (const auto& spec : layer_tensor_specs(c)) lw[spec.slot] = spec.shape.size() == 1 ? torch::ones(spec.shape) : rnd(spec.shape, 0.05);
    w.layers.push_back(lw);
  }
  w.final_norm = torch::ones({c.hidden_size});
  w.rope = make_rope_tables(c);
  return w;
}
long max_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}
}  // namespace

// Runs only as the child of the next test (its own process, so the peak RSS is this step's).
TEST(HeadLoss, PeakChild) {
  if (std::getenv("LORAPIPE_HEAD_PEAK_CHILD") == nullptr) GTEST_SKIP() << "run by PeakMemoryWithQwenVocabulary";
  at::set_num_threads(2);
  auto w = qwen_vocab_model();
  lora_config lc;
  auto lora = init_lora(w, lc, 2);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  auto x = torch::randint(0, w.cfg.vocab_size, {4, 1024}, gen);  // seq 1024 x batch 4, as the bench
  auto y = masked_labels(x, 6);
  const long before = max_rss_kb();
  auto loss = head_loss_sum(w.cfg, w.final_norm, w.lm_head, forward_hidden(w, &lora, x, true, 1), y);
  loss.backward();
  const long after = max_rss_kb();
  std::printf("PEAK_STEP_KB %ld TRAINED %ld LOSS %.4f\n", after - before, y.ne(-100).sum().item<long>(), loss.item<double>());
}

TEST(HeadLoss, PeakMemoryWithQwenVocabulary) {
  const std::string cmd = "LORAPIPE_HEAD_PEAK_CHILD=1 timeout 300 /proc/" + std::to_string(::getpid()) +
                          "/exe --gtest_filter=HeadLoss.PeakChild 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  ASSERT_TRUE(pipe);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, pipe.get()) != nullptr) out += buf;
  const auto at = out.find("PEAK_STEP_KB ");
  ASSERT_NE(at, std::string::npos) << out;
  const double peak_mb = std::stod(out.substr(at + 13)) / 1024.0;
  // Full f32 logits of 4 x 1024 positions x 151,936: 2,489 MB, and their gradient as much again.
  const double full_logits_mb = 4.0 * 1024 * 151936 * 4 / (1 << 20);
  std::printf("one step, vocab 151,936, 4 x 1024 tokens: peak RSS growth %.0f MB (full logits alone: %.0f MB)\n", peak_mb,
              full_logits_mb);
  EXPECT_LT(peak_mb, 1024.0);
  EXPECT_GT(full_logits_mb, 2 * 1024.0);
}
