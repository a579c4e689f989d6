// Layer partitions balanced by device speed: see partition_search.h.
#include "core/pipeline/partition_search.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "core/pipeline/cost_model.h"
#include "core/pipeline/memory_plan.h"
#include "core/pipeline/schedule_sim.h"

namespace lorapipe {

std::vector<int32_t> min_max_partition(const std::vector<double>& layer_s, double embed_s, double head_s,
                                       const std::vector<double>& stage_speed) {
  const int32_t L = static_cast<int32_t>(layer_s.size()), S = static_cast<int32_t>(stage_speed.size());
  std::vector<double> prefix(static_cast<size_t>(L) + 1, 0.0);
  std::partial_sum(layer_s.begin(), layer_s.end(), prefix.begin() + 1);
  const auto stage_time = [&](int32_t s, int32_t first, int32_t last) {  // layers [first, last) on stage s
    double t = prefix[last] - prefix[first] + (s == 0 ? embed_s : 0.0) + (s == S - 1 ? head_s : 0.0);
    return t / stage_speed[static_cast<size_t>(s)];
  };
  constexpr double inf = std::numeric_limits<double>::infinity();
  // Over stages 0..s-1 on layers [0, l): cost(s-1 stage, k, l) combined with best[s-1][k]; cut[s][l] is
  // where stage s-1 starts. Pass 1 minimises the largest stage time; pass 2, among partitions whose
  // stages all stay within it, the sum of squared stage times (no stage needlessly heavy).
  const auto solve = [&](const std::function<double(double, double)>& combine, double limit) {
    std::vector<std::vector<double>> best(static_cast<size_t>(S) + 1, std::vector<double>(static_cast<size_t>(L) + 1, inf));
    std::vector<std::vector<int32_t>> cut(static_cast<size_t>(S) + 1, std::vector<int32_t>(static_cast<size_t>(L) + 1, -1));
    best[0][0] = 0;
    for (int32_t s = 1; s <= S; ++s)
      for (int32_t l = s; l <= L - (S - s); ++l)
        for (int32_t k = l - 1; k >= s - 1; --k) {  // larger k first: among equals, earlier stages larger
          const double t = stage_time(s - 1, k, l);
          if (best[s - 1][k] == inf || t > limit) continue;
          const double v = combine(best[s - 1][k], t);
          if (v < best[s][l]) best[s][l] = v, cut[s][l] = k;
        }
    return std::make_pair(best[S][L], cut);
  };
  const double worst = solve([](double a, double t) { return std::max(a, t); }, inf).first;
  const auto cut = solve([](double a, double t) { return a + t * t; }, worst * (1 + 1e-12)).second;
  std::vector<int32_t> sizes(static_cast<size_t>(S));
  for (int32_t s = S, l = L; s >= 1; --s) {
    const int32_t k = cut[s][l];
    sizes[static_cast<size_t>(s - 1)] = l - k;
    l = k;
  }
  return sizes;
}

std::string partition_text(const std::vector<int32_t>& sizes) { return fmt::format("{}", fmt::join(sizes, ",")); }

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

// The simulated step of the project's schedule with `sizes` (inf when it cannot be generated or its
// memory plan does not fit offload.device_memory_mb).
double simulated_step(const project_config& cfg, const llama_config& mc, double gflops, const std::vector<int32_t>& sizes) {
  schedule_options so = schedule_options_of(cfg);
  so.stage_layers = sizes;
  auto prog = make_schedule(cfg.parallel.schedule, static_cast<int32_t>(mc.num_layers), so);
  if (!prog) return inf;
  const sim_costs costs = estimate_costs(*prog, mc, cfg, gflops);
  const sim_result sim = simulate(*prog, costs);
  if (!sim.ok) return inf;
  if (cfg.offload.device_memory_mb > 0) {
    const memory_plan mem =
        make_memory_plan(*prog, costs, sim, memory_inputs_of(*prog, mc, compute_element_bytes(cfg), cfg.lora.r, cfg.lora.targets));
    for (const auto& d : mem.devices)
      if (d.peak_bytes > cfg.offload.device_memory_mb * 1048576.0) return inf;
  }
  return sim.makespan_s;
}

// The speed of the device that runs each stage (bound schedules: stage s on device s % D; round-robin
// runs every stage on every device in turn, so its stages are balanced for a speed-1 device).
std::vector<double> stage_speeds(const project_config& cfg, int32_t n_stages, const std::vector<double>& speeds) {
  std::vector<double> out(static_cast<size_t>(n_stages), 1.0);
  if (cfg.parallel.schedule == "round-robin") return out;
  for (int32_t s = 0; s < n_stages; ++s) out[static_cast<size_t>(s)] = speeds[static_cast<size_t>(s) % speeds.size()];
  return out;
}

// Hill climbing from `start`: move one layer across one boundary while the simulated step improves.
std::vector<int32_t> refine(const project_config& cfg, const llama_config& mc, double gflops, std::vector<int32_t> sizes, double& step) {
  step = simulated_step(cfg, mc, gflops, sizes);
  for (int round = 0; round < 4 * static_cast<int>(mc.num_layers); ++round) {
    std::vector<int32_t> best_sizes;
    double best = step;
    for (size_t b = 0; b + 1 < sizes.size(); ++b)
      for (int dir : {-1, 1}) {
        std::vector<int32_t> t = sizes;
        t[b] += dir;
        t[b + 1] -= dir;
        if (t[b] < 1 || t[b + 1] < 1) continue;
        const double s = simulated_step(cfg, mc, gflops, t);
        if (s < best * (1 - 1e-9)) best = s, best_sizes = std::move(t);
      }
    if (best_sizes.empty()) break;
    sizes = std::move(best_sizes);
    step = best;
  }
  return sizes;
}

}  // namespace

result<partition_choice> choose_partition(const project_config& cfg, const llama_config& mc, double gflops) {
  const auto fail = [](const std::string& m) { return make_error("parallel.partition: {}", m); };
  LP_TRY_ASSIGN(given, partition_sizes(cfg));
  LP_TRY_ASSIGN(speeds, device_speeds(cfg));
  const schedule_options so = schedule_options_of(cfg);
  const int32_t L = static_cast<int32_t>(mc.num_layers);
  const int32_t S = schedule_stage_count(cfg.parallel.schedule, L, so);
  partition_choice out;
  if (!given.empty()) {
    if (static_cast<int32_t>(given.size()) != S)
      return fail(fmt::format("'{}' has {} stages; {} on {} device(s) needs {}", cfg.parallel.partition, given.size(),
                              cfg.parallel.schedule, so.devices, S));
    out.sizes = given;
    out.how = "given";
    out.step_s = simulated_step(cfg, mc, gflops, given);
    return out;
  }
  if (S > L) return fail(fmt::format("{} layers cannot fill the {} stages of {}", L, S, cfg.parallel.schedule));
  std::vector<int32_t> even;
  for (const auto& st : even_partition(L, S)) even.push_back(st.last_layer - st.first_layer);
  out.even_step_s = simulated_step(cfg, mc, gflops, even);
  out.sizes = even;
  out.how = "even";
  out.step_s = out.even_step_s;
  if (cfg.parallel.partition == "even" || S == 1) return out;
  const int64_t rows = cfg.run.batch_size / std::max<int64_t>(1, so.micro_batches);
  const std::vector<double> layer_s(static_cast<size_t>(L), layer_forward_flops(mc, rows, cfg.data.seq_len));
  const auto start = min_max_partition(layer_s, 0.0, head_forward_flops(mc, rows, cfg.data.seq_len), stage_speeds(cfg, S, speeds));
  double step = inf;
  auto balanced = refine(cfg, mc, gflops, start, step);
  if (step < out.even_step_s * 0.98) {
    out.sizes = std::move(balanced);
    out.how = "balanced";
    out.step_s = step;
  }
  return out;
}

result<program> project_program(const project_config& cfg, const llama_config& mc, double gflops) {
  const bool pipelined = cfg.parallel.schedule != "single" && cfg.parallel.schedule != "auto";
  schedule_options so = schedule_options_of(cfg);
  if (pipelined) {
    LP_TRY_ASSIGN(choice, choose_partition(cfg, mc, gflops));
    so.stage_layers = std::move(choice.sizes);
  }
  auto prog = make_schedule(pipelined ? cfg.parallel.schedule : "gpipe", static_cast<int32_t>(mc.num_layers), so);
  if (!prog) return make_error("parallel.schedule: {}", prog.message());
  return prog;
}

}  // namespace lorapipe
