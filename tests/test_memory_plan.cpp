// The memory plan against the executor on CPU virtual devices: for 15 configurations (every
// schedule, even and uneven partitions, weight streaming on and off, recompute and activation
// offload on and off, stage and layer recompute, two sequence lengths, stories260K and a synthetic
// ~24M-parameter Llama with random weights) the expected peak of every device is within 5% of the
// measured arena peak (one case 10%, see config::tolerance) and the bound the executor enforces is
// never below it; with each device's capacity at the bound the steps run (a plan said to fit does
// not run out of memory); with it 3% below, the step is refused before anything is allocated,
// naming the device and the buffer. The plan's compute times come from a first step's trace.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/pipeline/cost_model.h"
#include "core/pipeline/memory_plan.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule.h"
#include "core/project/llama_config.h"
#include "tests/synthetic_llama.h"
#include "tests/test_paths.h"

using namespace lorapipe;

namespace {

struct model_fixture {
  llama_weights w;
  std::string name;
};
const model_fixture& stories() {
  static model_fixture f{load_llama(test_data_dir() / "models/stories260K/hf", {at::kFloat}).value(), "stories260K"};
  return f;
}
const model_fixture& synthetic() {
  static model_fixture f{random_llama(synthetic_llama_config(512, 1408, 6, 4096)),
                         "synthetic-24M"};
  return f;
}

struct config {
  const model_fixture* model;
  std::string schedule;
  int32_t devices, micro_batches;
  std::vector<int32_t> sizes;  // stage sizes (empty: the generator's default partition)
  bool stream, recompute, offload, layer_recompute;
  int64_t rows, seq_len;  // the batch: rows sequences of seq_len tokens
  // How close the expected peak must come. 5% everywhere but one case: layer recompute with
  // offload on stories260K, where whether a forward's three offloads are still in flight when the
  // next backward starts (a millisecond apart) decides two activations of a 1.4 MiB peak; the
  // plan expects them in flight (+6.9% measured), the bound covers both.
  double tolerance = 0.05;
  std::vector<int32_t> backward = {};  // round-robin: backward stage sizes (empty: one layer each)
};

std::string describe(const config& c) {
  std::string sizes;
  for (int32_t s : c.sizes) sizes += (sizes.empty() ? "" : ",") + std::to_string(s);
  std::string backward;
  for (int32_t s : c.backward) backward += (backward.empty() ? " backward [" : ",") + std::to_string(s);
  return fmt::format("{} {} x{} devices {} micro-batches [{}]{} stream={} recompute={}{} offload={} T={}", c.model->name, c.schedule,
                     c.devices, c.micro_batches, sizes.empty() ? "even" : sizes, backward.empty() ? "" : backward + "]", c.stream,
                     c.recompute, c.layer_recompute ? "(layer)" : "", c.offload, c.seq_len);
}

program make_program(const config& c) {
  schedule_options o;
  o.devices = c.devices;
  o.micro_batches = c.micro_batches;
  o.recompute = c.recompute;
  o.offload_activations = c.offload;
  o.stream_weights = c.stream;
  const auto layers = static_cast<int32_t>(c.model->w.cfg.num_layers);
  if (c.sizes.empty()) return make_schedule(c.schedule, layers, o).value();
  const auto stages = partition_from_sizes(layers, c.sizes).value();
  if (c.schedule == "gpipe") return make_gpipe(stages, o).value();
  if (c.schedule == "1f1b") return make_1f1b(stages, o).value();
  if (c.schedule == "interleaved") return make_interleaved(stages, o).value();
  const int32_t tail = stages.back().first_layer;  // the last forward stage is fused with its backward
  return make_round_robin(stages, c.backward.empty() ? even_partition(tail, tail) : partition_from_sizes(tail, c.backward).value(), o).value();
}

lora_adapters adapters(const llama_weights& w) {
  lora_config lc;
  lc.r = 8;
  lc.targets = {lora_target::q, lora_target::k, lora_target::v, lora_target::o, lora_target::gate, lora_target::up, lora_target::down};
  return init_lora(w, lc, 5);
}

std::vector<micro_batch> batch(const config& c) {
  torch::manual_seed(3);
  auto t = torch::randint(3, c.model->w.cfg.vocab_size, {c.rows, c.seq_len + 1}, torch::kLong);  // i64 [rows, T+1]
  std::vector<micro_batch> out;
  auto xs = t.slice(1, 0, c.seq_len).chunk(c.micro_batches), ys = t.slice(1, 1).chunk(c.micro_batches);
  for (int32_t i = 0; i < c.micro_batches; ++i) out.push_back({xs[i].contiguous(), ys[i].contiguous()});
  return out;
}

// The CPU devices' copy engines, and what the plan assumes of them.
constexpr double copy_bps = 2e9, copy_latency_s = 1e-4;

struct run_result {
  bool ok = false;
  std::string message;
  std::vector<size_t> peak, used_after;
  std::vector<sim_interval> trace;  // compute instructions of the last step
};

// The plan as `plan` makes it for a project (config-derived LoRA and RoPE bytes, copies at the
// devices' bandwidth and latency), with compute times from `profile` (a step's trace) when given,
// else FLOPs at the assumed throughput.
memory_plan predicted(const config& c, const program& p, const run_result* profile) {
  const auto& mc = c.model->w.cfg;
  sim_costs costs = flop_costs(p, mc, c.rows / c.micro_batches, c.seq_len, 4, auto_schedule_gflops, copy_bps);
  costs.copy_latency_s = copy_latency_s;
  costs.per_layer_recompute = c.layer_recompute;
  if (profile != nullptr) costs = with_measured_compute(p, costs, profile->trace);
  const sim_result sim = simulate(p, costs);
  EXPECT_TRUE(sim.ok) << sim.error;
  return make_memory_plan(p, costs, sim, memory_inputs_of(p, mc, 4, 8, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
}

run_result run(const config& c, const program& p, const std::vector<size_t>& capacity, int steps,
               std::shared_ptr<const memory_plan> plan = nullptr) {
  std::vector<std::unique_ptr<cpu_device>> devs;
  std::vector<compute_device*> ptrs;
  for (int32_t d = 0; d < c.devices; ++d) {
    cpu_device_options o;
    o.capacity_bytes = capacity.at(static_cast<size_t>(d));
    o.copy_bytes_per_s = copy_bps;
    o.copy_latency_s = copy_latency_s;
    devs.push_back(std::make_unique<cpu_device>(d, o));
    ptrs.push_back(devs.back().get());
  }
  auto lora = adapters(c.model->w);
  pipeline_options po;
  po.layer_recompute = c.layer_recompute;
  po.memory = std::move(plan);
  run_result out;
  {
    pipeline_executor ex(c.model->w, lora, p, ptrs, {}, po);
    const auto mbs = batch(c);
    out.ok = true;
    for (int i = 0; i < steps && out.ok; ++i) {
      auto r = ex.step(mbs, 1e-3, 1.0);
      out.ok = r.ok();
      if (!r.ok()) out.message = r.message();
      else {
        out.peak = r->peak_bytes;
        out.trace.clear();
        for (const auto& t : r->trace) out.trace.push_back({t.device, 0, t.in, t.start_s, t.end_s});
      }
    }
    for (auto* d : ptrs) out.used_after.push_back(d->arena().used());
  }
  return out;
}

std::vector<config> configs() {
  const auto* s = &stories();
  const auto* z = &synthetic();
  return {
      {s, "gpipe", 2, 4, {}, false, false, false, false, 8, 32},
      {s, "gpipe", 2, 4, {4, 1}, true, true, false, false, 8, 64},
      {s, "1f1b", 2, 4, {}, false, true, true, false, 8, 32},
      {s, "1f1b", 3, 8, {1, 2, 2}, true, false, false, false, 8, 64},
      {s, "1f1b", 2, 4, {}, true, true, false, true, 8, 64},
      {s, "1f1b", 2, 4, {}, true, true, true, true, 8, 64, 0.10},
      {s, "interleaved", 2, 4, {2, 1, 1, 1}, false, false, false, false, 8, 32},
      {s, "interleaved", 2, 4, {}, true, true, true, false, 8, 64},
      {s, "round-robin", 2, 4, {}, true, true, true, false, 8, 32},
      {s, "round-robin", 3, 6, {2, 2, 1}, true, true, false, false, 6, 64},
      {z, "1f1b", 2, 4, {}, true, true, true, false, 4, 64},
      {z, "gpipe", 2, 2, {2, 4}, false, false, false, false, 4, 128},
      {z, "round-robin", 2, 4, {}, true, true, true, false, 4, 64},
      {z, "round-robin", 2, 4, {2, 3, 1}, true, true, true, false, 4, 64, 0.05, {3, 2}},
      {z, "interleaved", 2, 4, {}, true, false, false, false, 4, 128},
      {z, "1f1b", 2, 2, {}, false, true, false, true, 4, 128},
  };
}

}  // namespace

TEST(MemoryPlan, PredictsEveryDevicePeakWithinFivePercent) {
  at::set_num_threads(1);
  double worst = 0;
  for (const auto& c : configs()) {
    SCOPED_TRACE(describe(c));
    const program p = make_program(c);
    // Two steps (the second in steady state, weights prefetched across the step boundary); the
    // first one's trace is the profile the plan's timing comes from.
    const std::vector<size_t> unlimited(static_cast<size_t>(c.devices), size_t{1} << 40);
    const auto profile = run(c, p, unlimited, 1);
    ASSERT_TRUE(profile.ok) << profile.message;
    const memory_plan plan = predicted(c, p, &profile);
    const auto r = run(c, p, unlimited, 2);
    ASSERT_TRUE(r.ok) << r.message;
    std::string line;
    for (size_t d = 0; d < r.peak.size(); ++d) {
      const double pred = plan.devices[d].expected_peak_bytes, bound = plan.devices[d].peak_bytes, meas = static_cast<double>(r.peak[d]);
      const double err = (pred - meas) / meas;
      worst = std::max(worst, std::abs(err));
      line += fmt::format("  cpu:{} {:.3f}/{:.3f} MiB ({:+.2f}%, bound {:+.2f}%)", d, pred / 1048576, meas / 1048576, 100 * err,
                          100 * (bound - meas) / meas);
      EXPECT_LE(std::abs(err), c.tolerance) << "device " << d << ": predicted " << pred << " measured " << meas << "\n"
                                     << memory_plan_text(plan, {}) << program_grid(p);
      EXPECT_GE(bound, meas) << "device " << d << ": the bound the executor checks is below what it held";
    }
    std::printf("%s\n%s\n", describe(c).c_str(), line.c_str());
  }
  std::printf("largest error of the predicted peak: %.2f%%\n", 100 * worst);
}

TEST(MemoryPlan, FitsAtItsPeakAndIsRefusedThreePercentBelow) {
  at::set_num_threads(1);
  for (const auto& c : configs()) {
    SCOPED_TRACE(describe(c));
    const program p = make_program(c);
    const auto profile = run(c, p, std::vector<size_t>(static_cast<size_t>(c.devices), size_t{1} << 40), 1);
    ASSERT_TRUE(profile.ok) << profile.message;
    const auto plan = std::make_shared<const memory_plan>(predicted(c, p, &profile));
    std::vector<size_t> at_peak, below;
    for (const auto& dp : plan->devices) {
      at_peak.push_back(static_cast<size_t>(std::ceil(dp.peak_bytes)));
      below.push_back(static_cast<size_t>(dp.peak_bytes * 0.97));
    }
    const auto fits = run(c, p, at_peak, 2, plan);
    EXPECT_TRUE(fits.ok) << fits.message;
    const auto refused = run(c, p, below, 1, plan);
    ASSERT_FALSE(refused.ok);
    EXPECT_NE(refused.message.find("cpu:"), std::string::npos) << refused.message;
    EXPECT_NE(refused.message.find("the memory plan needs"), std::string::npos) << refused.message;
    EXPECT_NE(refused.message.find("does not fit"), std::string::npos) << refused.message;
    EXPECT_NE(refused.message.find("3.1%"), std::string::npos) << refused.message;  // 1/0.97 - 1
    for (size_t u : refused.used_after) EXPECT_EQ(u, 0u) << "refused before anything was allocated";
  }
}
