// Training checkpoint contents: see train_state.h.
#include "core/train/train_state.h"

#include <map>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/json_parse.h"
#include "core/base/safetensors.h"
#include "core/model/tensor_io.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

status save_train_state(const fs::path& dir, const lora_adapters& lora, const std::vector<optimizer_group>& groups,
                        const trainer_state& st) {
  LP_TRY(save_peft_adapter(lora, dir));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  json steps = json::array();
  for (const auto& g : groups) {
    for (size_t i = 0; i < g.names.size(); ++i) {
      tensors.emplace_back("exp_avg." + g.names[i], g.opt->exp_avg()[i]);      // f32, shape of the parameter
      tensors.emplace_back("exp_avg_sq." + g.names[i], g.opt->exp_avg_sq()[i]);
    }
    steps.push_back(g.opt->steps_taken());
  }
  // No RNG state: the run's only randomness after initialisation is LoRA dropout, whose masks are
  // counter-based (seed, step, micro-batch, layer, target), so the step alone restores it.
  LP_TRY(write_tensors(dir / "optimizer.safetensors", tensors, {{"format", "lorapipe-optimizer"}}));
  json j = {{"step", st.step},
            {"cursor", st.cursor},
            {"seed", st.seed},
            {"train_sequences", st.train_sequences},
            {"config_hash", st.config_hash},
            {"first_val_loss", st.first_val_loss},
            {"eval_pending", st.eval_pending},
            {"optimizer_steps", steps},
            {"lr_schedule",
             {{"kind", "linear_warmup_cosine"},
              {"peak_lr", st.schedule.peak_lr},
              {"warmup_steps", st.schedule.warmup_steps},
              {"total_steps", st.schedule.total_steps},
              {"min_lr_ratio", st.schedule.min_lr_ratio},
              {"next_lr", st.schedule.at(st.step)}}}};
  return write_file_atomic(dir / "trainer_state.json", j.dump(2) + "\n");
}

result<trainer_state> load_train_state(const fs::path& dir, lora_adapters& lora, const std::vector<optimizer_group>& groups) {
  const std::string label = dir.string();
  LP_TRY_ASSIGN(text, read_text_file(dir / "trainer_state.json"));
  json j = parse_json_or_discarded(text);
  auto int_field = [&](const char* k) -> result<int64_t> {
    if (!j.is_object() || !j.contains(k) || !j[k].is_number_integer())
      return make_error("{}/trainer_state.json: missing or bad field {}", label, k);
    return j[k].get<int64_t>();
  };
  trainer_state st;
  LP_TRY_ASSIGN(step, int_field("step"));
  LP_TRY_ASSIGN(cursor, int_field("cursor"));
  LP_TRY_ASSIGN(seed, int_field("seed"));
  LP_TRY_ASSIGN(seqs, int_field("train_sequences"));
  st.step = step;
  st.cursor = cursor;
  st.seed = seed;
  st.train_sequences = seqs;
  if (j.contains("config_hash") && j["config_hash"].is_string()) st.config_hash = j["config_hash"].get<std::string>();
  if (j.contains("first_val_loss") && j["first_val_loss"].is_number()) st.first_val_loss = j["first_val_loss"].get<double>();
  if (j.contains("eval_pending") && j["eval_pending"].is_boolean()) st.eval_pending = j["eval_pending"].get<bool>();
  if (!j.contains("optimizer_steps") || !j["optimizer_steps"].is_array() || j["optimizer_steps"].size() != groups.size())
    return make_error("{}/trainer_state.json: optimizer_steps does not match this run's {} optimizer(s)", label, groups.size());

  // LoRA weights: into the existing tensors (the optimizers hold references to them).
  LP_TRY_ASSIGN(adapter, safetensors_file::open(dir / "adapter_model.safetensors"));
  LP_TRY_ASSIGN(opt_file, safetensors_file::open(dir / "optimizer.safetensors"));
  auto copy_into = [&](const safetensors_file& f, const std::string& name, at::Tensor& dst) -> status {
    const auto* info = f.find(name);
    if (info == nullptr) return make_error("{}: tensor {} missing", f.label(), name);
    LP_TRY_ASSIGN(t, read_tensor(f, *info, at::kFloat));
    if (t.sizes() != dst.sizes()) return make_error("{}: tensor {} has shape {}, expected {}", f.label(), name, t.sizes(), dst.sizes());
    torch::NoGradGuard ng;
    dst.copy_(t);
    return ok_status();
  };
  auto params = lora.parameters();
  auto names = lora.parameter_names();
  for (size_t i = 0; i < params.size(); ++i) LP_TRY(copy_into(adapter, names[i], params[i]));
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].names.size(); ++i) {
      LP_TRY(copy_into(opt_file, "exp_avg." + groups[g].names[i], groups[g].opt->exp_avg()[i]));
      LP_TRY(copy_into(opt_file, "exp_avg_sq." + groups[g].names[i], groups[g].opt->exp_avg_sq()[i]));
    }
    if (!j["optimizer_steps"][g].is_number_integer()) return make_error("{}/trainer_state.json: bad optimizer_steps", label);
    groups[g].opt->set_steps_taken(j["optimizer_steps"][g].get<int64_t>());
  }
  return st;
}

}  // namespace lorapipe
