// One pipeline training case shared by the multi-process test (rank 0, and the one-process
// reference) and its peer processes (lorapipe_dist_pipeline_peer): stories260K, fixed data and LoRA
// initialisation, `steps` AdamW steps of a schedule on cpu:D, device positions split over ranks in
// contiguous blocks (rank_of_positions). Returns the losses and the LoRA parameters of the stages
// this rank ran.
#pragma once

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include <csignal>
#include <string>
#include <vector>

#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule.h"
#include "offload/device.h"
#include "offload/process_group.h"

namespace lorapipe::dist_case {

struct outcome {
  std::vector<double> losses, norms;
  std::vector<at::Tensor> lora;  // every LoRA parameter (A, B per target per layer)
  std::vector<int32_t> param_layer;  // the layer of each
  std::vector<int32_t> layers;   // the layers whose parameters this rank trained
};

// `die_before_step` >= 0: this process SIGKILLs itself when that step begins (a rank lost mid-run).
// Over several processes each rank reads only the frozen tensors of the stages its devices compute
// (the others are meta tensors: any use of them would throw) and creates only its own devices.
// `fail_instead`: at that step the run returns an error instead (a rank that fails without dying).
inline result<outcome> run(const std::string& data_dir, const std::string& schedule, int devices, int steps,
                           process_group* group, int die_before_step = -1, bool fail_instead = false) {
  const int world = group != nullptr ? group->world() : 1, rank = group != nullptr ? group->rank() : 0;
  schedule_options so;
  so.devices = devices;
  so.micro_batches = 4;
  LP_TRY_ASSIGN(prog, make_schedule(schedule, 5, so));
  // Device positions in contiguous blocks per rank, as the trainer places them.
  const std::vector<int> rank_of = rank_of_positions(devices, world);
  std::vector<bool> here;
  for (int d = 0; d < devices; ++d) here.push_back(rank_of[static_cast<size_t>(d)] == rank);
  load_options lo{at::kFloat};
  if (group != nullptr)
    lo.select = [&](const llama_config& mc) -> result<weight_selection> { return rank_weight_selection(prog, mc.num_layers, rank_of, rank); };
  const auto w = load_llama(data_dir + "/models/stories260K/hf", lo);
  if (!w.ok()) return w.err();
  torch::manual_seed(3);
  const auto t = torch::randint(3, 512, {8, 33}, torch::kLong);  // i64 [8,33]
  const auto x = t.slice(1, 0, 32).contiguous(), y = t.slice(1, 1).contiguous();  // i64 [8,32]
  lora_config lc;
  lc.r = 4;
  lc.alpha = 8;
  lc.targets = {lora_target::q, lora_target::k, lora_target::v, lora_target::o, lora_target::gate, lora_target::up, lora_target::down};
  auto lora = init_lora(*w, lc, 5);
  {
    torch::NoGradGuard ng;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
    for (auto& p : lora.parameters()) p.uniform_(-0.2, 0.2, gen);  // non-zero B: every gradient is non-trivial
  }
  cpu_device_options dopt;
  dopt.compute_threads = 1;
  LP_TRY_ASSIGN(owned, make_devices(fmt::format("cpu:{}", devices), dopt, here));
  pipeline_options po;
  std::vector<compute_device*> devs;
  outcome out;
  for (int d = 0; d < devices; ++d) {
    const int r = rank_of[static_cast<size_t>(d)];
    po.processes.rank_of.push_back(r);
    devs.push_back(owned[static_cast<size_t>(d)].get());
    if ((devs.back() != nullptr) != (r == rank)) return make_error("make_devices created device {} {}", d, r == rank ? "not" : "elsewhere");
  }
  po.processes.group = group;
  for (int d = 0; d < devices; ++d)
    for (const auto& in : prog.devices[static_cast<size_t>(d)])
      if (in.kind == op::optimizer_step && po.processes.rank_of[static_cast<size_t>(d)] == rank)
        for (int32_t l = prog.stages[static_cast<size_t>(in.stage)].first_layer; l < prog.stages[static_cast<size_t>(in.stage)].last_layer; ++l)
          out.layers.push_back(l);
  adamw_config ac;
  pipeline_executor ex(*w, lora, prog, devs, ac, po);
  std::vector<micro_batch> mbs;
  auto xs = x.chunk(4), ys = y.chunk(4);
  for (int i = 0; i < 4; ++i) mbs.push_back({xs[i].contiguous(), ys[i].contiguous()});
  for (int s = 0; s < steps; ++s) {
    if (s == die_before_step && fail_instead) return make_error("injected failure before step {}", s);
    if (s == die_before_step) ::raise(SIGKILL);
    LP_TRY_ASSIGN(r, ex.step(mbs, 1e-2, 1.0));
    out.losses.push_back(r.loss);
    out.norms.push_back(r.grad_norm);
  }
  for (const auto& p : lora.parameters()) out.lora.push_back(p.detach().clone());
  for (int32_t l = 0; l < static_cast<int32_t>(lora.layers.size()); ++l)
    for (const auto& pair : lora.layers[static_cast<size_t>(l)])
      if (pair.a.defined()) out.param_layer.insert(out.param_layer.end(), {l, l});
  return out;
}

}  // namespace lorapipe::dist_case
