// lorapipe_bench_train: times full LoRA training steps (forward, loss, backward, clip, AdamW) on an
// HF model folder with random tokens; prints one JSON line with tokens/s. Driven side by side with
// PyTorch eager by tests/bench/bench_train_step.py.
#include <chrono>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <thread>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/model/optimizer.h"
#include "core/train/trainer.h"

using namespace lorapipe;

int main(int argc, char** argv) {
  CLI::App app{"LoRA training-step benchmark"};
  std::string model;
  int64_t batch = 4, seq = 256, rank = 8, steps = 5, warmup = 2, threads = 0;
  app.add_option("--model", model)->required();
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--rank", rank);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--threads", threads);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::thread::hardware_concurrency()));
  const int nthreads = at::get_num_threads();
  auto w = load_llama(model, {at::kFloat});
  if (!w) {
    fmt::print(stderr, "error: {}\n", w.message());
    return 1;
  }
  lora_config lc;
  lc.r = rank;
  lc.alpha = 2.0 * rank;
  auto lora = init_lora(*w, lc, 1);
  auto params = lora.parameters();
  adamw opt(params, {1e-4, 0.9, 0.999, 1e-8, 0.0});
  torch::manual_seed(0);
  auto tokens = torch::randint(0, w->cfg.vocab_size, {batch, seq + 1}, torch::kLong);  // i64 [B,T+1]
  auto x = tokens.slice(1, 0, seq), y = tokens.slice(1, 1);
  double total = 0;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    auto loss = causal_lm_loss(forward(*w, &lora, x, 0, nullptr, true), y);
    loss.backward();
    clip_grad_norm(params, 1.0);
    opt.step(1e-4);
    opt.zero_grad();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) total += dt;
  }
  fmt::print("{{\"engine\": \"lorapipe\", \"tokens_per_s\": {:.1f}, \"step_s\": {:.4f}, \"threads\": {}, \"params\": {}}}\n",
             batch * seq * steps / total, total / steps, nthreads, w->cfg.num_parameters());
  return 0;
}
