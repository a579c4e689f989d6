// lorapipe_refdump: runs the engine on fixed inputs and dumps what the PyTorch oracle compares:
// logits, loss and LoRA gradients for a given adapter; then one AdamW step, the saved adapter,
// and the logits after the step. Used by tests/reference/check_engine.py.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/model/optimizer.h"
#include "core/base/safetensors.h"
#include "core/model/tensor_io.h"
#include "core/train/trainer.h"

using namespace lorapipe;

int main(int argc, char** argv) {
  CLI::App app{"engine dump for the numerics oracle"};
  std::string model, adapter, tokens_path, out, adapter_out, dtype = "float32";
  double lr = 1e-2, wd = 0.1;
  app.add_option("--model", model)->required();
  app.add_option("--adapter", adapter)->required();
  app.add_option("--tokens", tokens_path)->required();
  app.add_option("--out", out)->required();
  app.add_option("--adapter-out", adapter_out)->required();
  app.add_option("--dtype", dtype);
  app.add_option("--lr", lr);
  app.add_option("--weight-decay", wd);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(2);
  auto fail = [](const std::string& m) {
    fmt::print(stderr, "error: {}\n", m);
    return 1;
  };
  auto dt = parse_dtype_name(dtype);
  if (!dt) return fail(dt.message());
  auto w = load_llama(model, {*dt});
  if (!w) return fail(w.message());
  auto lora = load_peft_adapter(adapter, *w);
  if (!lora) return fail(lora.message());
  auto tf = safetensors_file::open(tokens_path);
  if (!tf) return fail(tf.message());
  auto tokens = read_tensor(*tf, *tf->find("tokens"), torch::kLong);  // i64 [B,T+1]
  if (!tokens) return fail(tokens.message());
  const int64_t T = tokens->size(1) - 1;
  auto x = tokens->slice(1, 0, T), y = tokens->slice(1, 1, T + 1);

  auto logits = forward(*w, &*lora, x, 0, nullptr, false);  // [B,T,V]
  auto loss = causal_lm_loss(logits, y);
  loss.backward();
  std::vector<std::pair<std::string, at::Tensor>> dump;
  dump.emplace_back("logits", logits.detach().to(torch::kFloat));
  dump.emplace_back("loss", loss.detach().reshape({1}));
  auto params = lora->parameters();
  auto names = lora->parameter_names();
  for (size_t i = 0; i < params.size(); ++i) dump.emplace_back("grad." + names[i], params[i].grad().clone());

  adamw opt(params, {lr, 0.9, 0.999, 1e-8, wd});
  opt.step(lr);
  opt.zero_grad();
  if (auto st = save_peft_adapter(*lora, adapter_out); !st) return fail(st.message());
  torch::NoGradGuard ng;
  dump.emplace_back("logits_after", forward(*w, &*lora, x).to(torch::kFloat));
  if (auto st = write_tensors(out, dump); !st) return fail(st.message());
  return 0;
}
