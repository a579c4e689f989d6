// Layer partitions balanced by device speed: see partition_search.h.
#include "core/pipeline/partition_search.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "core/pipeline/cost_model.h"
#include "core/pipeline/memory_plan.h"
#include "core/pipeline/schedule_sim.h"

namespace lorapipe {

std::vector<int32_t> min_max_partition(const std::vector<double>& layer_s, double embed_s, double head_s,
                                       const std::vector<double>& stage_speed, const std::vector<double>& last_layer_s) {
  const int32_t L = static_cast<int32_t>(layer_s.size()), S = static_cast<int32_t>(stage_speed.size());
  // Costs in units of the cheapest layer, so that sums of equal stages compare equal whatever their
  // magnitude (FLOPs are ~1e12); a candidate must then beat the best by more than rounding.
  double unit = 0;
  for (double x : layer_s)
    if (x > 0 && (unit == 0 || x < unit)) unit = x;
  if (unit == 0) unit = 1;
  const std::vector<double>& tail = last_layer_s.size() == layer_s.size() ? last_layer_s : layer_s;
  std::vector<double> prefix(static_cast<size_t>(L) + 1, 0.0), tail_prefix = prefix;
  for (int32_t l = 0; l < L; ++l) {
    prefix[static_cast<size_t>(l) + 1] = prefix[static_cast<size_t>(l)] + layer_s[static_cast<size_t>(l)] / unit;
    tail_prefix[static_cast<size_t>(l) + 1] = tail_prefix[static_cast<size_t>(l)] + tail[static_cast<size_t>(l)] / unit;
  }
  const auto stage_time = [&](int32_t s, int32_t first, int32_t last) {  // layers [first, last) on stage s
    const auto& pre = s == S - 1 ? tail_prefix : prefix;
    double t = pre[last] - pre[first] + ((s == 0 ? embed_s : 0.0) + (s == S - 1 ? head_s : 0.0)) / unit;
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
          if (v < best[s][l] * (1 - 1e-12)) best[s][l] = v, cut[s][l] = k;
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

// Simulated steps of the project's schedule by partition, each simulated once.
class step_oracle {
 public:
  step_oracle(const project_config& cfg, const llama_config& mc, const compute_rates& rates) : cfg_(cfg), mc_(mc), rates_(rates) {}
  // inf when the program cannot be generated or its memory plan does not fit offload.device_memory_mb.
  // `backward`: round-robin's backward stages (empty = one layer each).
  double operator()(const std::vector<int32_t>& sizes, const std::vector<int32_t>& backward = {}) {
    auto [it, fresh] = seen_.try_emplace({sizes, backward}, inf);
    if (fresh) it->second = simulate_step(sizes, backward);
    return it->second;
  }

 private:
  double simulate_step(const std::vector<int32_t>& sizes, const std::vector<int32_t>& backward) const {
    schedule_options so = schedule_options_of(cfg_);
    so.stage_layers = sizes;
    so.backward_layers = backward;
    auto prog = make_schedule(cfg_.parallel.schedule, static_cast<int32_t>(mc_.num_layers), so);
    if (!prog) return inf;
    const sim_costs costs = estimate_costs(*prog, mc_, cfg_, rates_);
    const sim_result sim = simulate(*prog, costs);
    if (!sim.ok) return inf;
    if (cfg_.offload.device_memory_mb > 0) {  // the plan the executor checks (FLOP timing), whatever ranks the partitions
      const memory_plan mem = checked_memory_plan(*prog, mc_, cfg_, rates_, costs, sim);
      for (const auto& d : mem.devices)
        if (d.peak_bytes > cfg_.offload.device_memory_mb * 1048576.0) return inf;
    }
    return sim.makespan_s;
  }
  const project_config& cfg_;
  const llama_config& mc_;
  const compute_rates rates_;  // a copy: a double and a shared pointer
  std::map<std::pair<std::vector<int32_t>, std::vector<int32_t>>, double> seen_;
};

// The speed of the device that runs each stage (bound schedules: stage s on device s % D; round-robin
// runs every stage on every device in turn, so its stages are balanced for a speed-1 device).
std::vector<double> stage_speeds(const project_config& cfg, int32_t n_stages, const std::vector<double>& speeds) {
  std::vector<double> out(static_cast<size_t>(n_stages), 1.0);
  if (cfg.parallel.schedule == "round-robin") return out;
  for (int32_t s = 0; s < n_stages; ++s) out[static_cast<size_t>(s)] = speeds[static_cast<size_t>(s) % speeds.size()];
  return out;
}

// Hill climbing from `sizes`: move one layer across the boundary that gains most while the simulated
// step improves (at most 4 x layers moves). With `resize`, a move may also merge two neighbouring
// stages or split one in halves (round-robin, whose stage count is free).
template <typename StepOf>
std::vector<int32_t> refine(StepOf&& step_of, std::vector<int32_t> sizes, int64_t layers, double& step, bool resize = false) {
  step = step_of(sizes);
  for (int64_t round = 0; round < 4 * layers; ++round) {
    std::vector<int32_t> best_sizes;
    double best = step;
    const auto consider = [&](std::vector<int32_t> t) {
      const double s = step_of(t);
      if (s < best * (1 - 1e-9)) best = s, best_sizes = std::move(t);
    };
    for (size_t b = 0; b + 1 < sizes.size(); ++b)
      for (int dir : {-1, 1}) {
        std::vector<int32_t> t = sizes;
        t[b] += dir;
        t[b + 1] -= dir;
        if (t[b] >= 1 && t[b + 1] >= 1) consider(std::move(t));
      }
    for (size_t b = 0; resize && b < sizes.size(); ++b) {
      std::vector<int32_t> t = sizes;
      if (b + 1 < sizes.size()) {  // merge b and b + 1
        t[b] += t[b + 1];
        t.erase(t.begin() + static_cast<std::ptrdiff_t>(b) + 1);
        consider(std::move(t));
        t = sizes;
      }
      if (sizes[b] >= 2) {  // split b in halves
        t[b] = sizes[b] / 2;
        t.insert(t.begin() + static_cast<std::ptrdiff_t>(b) + 1, sizes[b] - sizes[b] / 2);
        consider(std::move(t));
      }
    }
    if (best_sizes.empty()) break;
    sizes = std::move(best_sizes);
    step = best;
  }
  return sizes;
}

double finite_or_zero(double x) { return std::isfinite(x) ? x : 0.0; }

int32_t layer_sum(const std::vector<int32_t>& sizes) {
  int32_t n = 0;
  for (int32_t x : sizes) n += x;
  return n;
}

// Round-robin: the forward stages (`out.sizes`, given or even) and the backward ones (given or one
// layer each), then what auto searches. With the forward stages held: the backward stage count (a
// min-max partition of the per-layer costs for each), then that partition refined on the simulator.
// With the forward stages auto too, also: both counts in turn (two rounds), the forward partition
// refined, then the backward one; the faster of the two results. Every device must get a job
// (forward plus backward stages at least devices). At most search_budget simulations.
constexpr int search_budget = 3000;

result<partition_choice> choose_round_robin(const project_config& cfg, const llama_config& mc, const compute_rates& rates,
                                            step_oracle& step_of, partition_choice out) {
  LP_TRY_ASSIGN(given_bwd, backward_partition_sizes(cfg));
  const int32_t L = static_cast<int32_t>(mc.num_layers), devices = schedule_options_of(cfg).devices;
  const auto tail_first = [&](const std::vector<int32_t>& fwd) { return L - fwd.back(); };
  out.backward_how = "per-layer";
  if (!given_bwd.empty()) {
    if (layer_sum(given_bwd) != tail_first(out.sizes))
      return make_error("parallel.backward_partition: '{}' adds up to {} layers; the layers before the fused tail (forward stages {}) are {}",
                        cfg.parallel.backward_partition, layer_sum(given_bwd), partition_text(out.sizes), tail_first(out.sizes));
    if (std::any_of(given_bwd.begin(), given_bwd.end(), [](int32_t n) { return n != 1; })) out.backward_sizes = given_bwd;
    out.backward_how = "given";
  }
  const auto jobs = [&](const std::vector<int32_t>& fwd, const std::vector<int32_t>& bwd) {
    return static_cast<int32_t>(fwd.size()) + (bwd.empty() ? tail_first(fwd) : static_cast<int32_t>(bwd.size()));
  };
  int simulations = 0;
  const auto step = [&](const std::vector<int32_t>& fwd, const std::vector<int32_t>& bwd) {
    return jobs(fwd, bwd) < devices || ++simulations > search_budget ? inf : step_of(fwd, bwd);
  };
  const double start = step(out.sizes, out.backward_sizes);
  out.step_s = finite_or_zero(start);
  if (out.how == "even" && out.backward_how == "per-layer") out.even_step_s = out.step_s;
  const bool fwd_auto = cfg.parallel.partition == "auto", bwd_auto = cfg.parallel.backward_partition == "auto";
  if (fwd_auto || bwd_auto) {
    const int64_t rows = cfg.run.batch_size / std::max<int64_t>(1, cfg.parallel.micro_batches);
    std::vector<double> fwd_l, bwd_l;  // per layer: forward without autograd (recomputed later); forward with it + backward
    for (int64_t l = 0; l < L; ++l) {
      fwd_l.push_back(rates.layer_forward(mc, l, rows, cfg.data.seq_len, false));
      bwd_l.push_back(rates.layer_forward(mc, l, rows, cfg.data.seq_len) + rates.layer_backward(mc, l, rows, cfg.data.seq_len));
    }
    const double head_s = rates.head_forward(mc, rows, cfg.data.seq_len) + rates.head_backward(mc, rows, cfg.data.seq_len);
    const auto ones = [](int32_t n) { return std::vector<double>(static_cast<size_t>(std::max(1, n)), 1.0); };
    // The fused tail runs its layers forward and backward (bwd_l), plus the head.
    const auto forward_of = [&](int32_t kf) { return min_max_partition(fwd_l, 0.0, head_s, ones(kf), bwd_l); };
    std::map<std::pair<int32_t, int32_t>, std::vector<int32_t>> cut;  // (tail's first layer, count) -> backward sizes
    const auto backward_of = [&](const std::vector<int32_t>& fwd, int32_t kb) {
      const int32_t T = tail_first(fwd);
      if (!bwd_auto || T <= 0 || kb >= T) return bwd_auto ? std::vector<int32_t>{} : out.backward_sizes;
      auto [it, fresh] = cut.try_emplace({T, kb});
      if (fresh) it->second = min_max_partition(std::vector<double>(bwd_l.begin(), bwd_l.begin() + T), 0.0, 0.0, ones(kb));
      return it->second;
    };
    const auto best_count = [&](const std::vector<int32_t>& fwd, int32_t& kb, double& best) {
      for (int32_t k = 1; bwd_auto && k <= tail_first(fwd); ++k)
        if (const double t = step(fwd, backward_of(fwd, k)); t < best * (1 - 1e-9)) best = t, kb = k;
    };
    // The backward partition of count kb for `fwd`, refined; `t` its step.
    const auto refined_backward = [&](const std::vector<int32_t>& fwd, int32_t kb, double& t) {
      std::vector<int32_t> b = backward_of(fwd, kb);
      t = step(fwd, b);
      if (!bwd_auto || tail_first(fwd) <= 0) return b;
      if (b.empty()) b.assign(static_cast<size_t>(tail_first(fwd)), 1);
      b = refine([&](const std::vector<int32_t>& x) { return step(fwd, x); }, b, L, t, true);
      if (std::all_of(b.begin(), b.end(), [](int32_t n) { return n == 1; })) b.clear();
      return b;
    };
    // The forward stages held.
    std::vector<int32_t> fwd = out.sizes;
    int32_t kb = out.backward_sizes.empty() ? tail_first(fwd) : static_cast<int32_t>(out.backward_sizes.size());
    double best = start;
    best_count(fwd, kb, best);
    const int32_t held_kb = kb;
    std::vector<int32_t> bwd = refined_backward(fwd, kb, best);
    if (fwd_auto) {  // both counts in turn from there, then both partitions refined
      std::vector<int32_t> f = fwd;
      int32_t k = held_kb;
      double t = step(f, backward_of(f, k));
      for (int round = 0; round < 2; ++round) {
        best_count(f, k, t);
        for (int32_t kf = 1; kf <= L; ++kf) {
          auto g = forward_of(kf);
          if (const double x = step(g, backward_of(g, k)); x < t * (1 - 1e-9)) t = x, f = std::move(g);
        }
      }
      f = refine([&](const std::vector<int32_t>& g) { return step(g, backward_of(g, k)); }, f, L, t, true);
      std::vector<int32_t> b = refined_backward(f, k, t);
      if (t < best) best = t, fwd = std::move(f), bwd = std::move(b);
    }
    if (best < start * 0.98) {  // a start over the memory limit (inf) loses to anything that fits
      if (fwd != out.sizes) out.how = "balanced";
      if (bwd != out.backward_sizes) out.backward_how = "balanced";
      out.sizes = std::move(fwd);
      out.backward_sizes = std::move(bwd);
      out.step_s = finite_or_zero(best);
    }
  }
  if (jobs(out.sizes, out.backward_sizes) < devices)
    return make_error("parallel.partition: round-robin with forward stages {} and backward stages {} has {} jobs for {} devices; "
                      "every device needs one (more stages, or parallel.backward_partition auto)",
                      partition_text(out.sizes), backward_partition_text(out), jobs(out.sizes, out.backward_sizes), devices);
  return out;
}

}  // namespace

std::string backward_partition_text(const partition_choice& c) {
  if (c.backward_how.empty()) return "";
  return c.backward_sizes.empty() ? "per-layer" : partition_text(c.backward_sizes);
}

result<partition_choice> choose_partition(const project_config& cfg, const llama_config& mc, const compute_rates& rates) {
  LP_TRY_ASSIGN(given, partition_sizes(cfg));
  LP_TRY_ASSIGN(speeds, device_speeds(cfg));
  const schedule_options so = schedule_options_of(cfg);
  const bool rr = cfg.parallel.schedule == "round-robin";
  const int32_t L = static_cast<int32_t>(mc.num_layers);
  const int32_t S = schedule_stage_count(cfg.parallel.schedule, L, so);
  step_oracle step_of(cfg, mc, rates);
  partition_choice out;
  if (!given.empty()) {
    if (static_cast<int32_t>(given.size()) != S && !rr)
      return make_error("parallel.partition: '{}' has {} stages; {} on {} device(s) needs {}", cfg.parallel.partition, given.size(),
                        cfg.parallel.schedule, so.devices, S);
    if (layer_sum(given) != L)
      return make_error("parallel.partition: '{}' adds up to {} layers; the model has {}", cfg.parallel.partition, layer_sum(given), L);
    out.sizes = given;
    out.how = "given";
    if (rr) return choose_round_robin(cfg, mc, rates, step_of, std::move(out));
    out.step_s = finite_or_zero(step_of(given));
    return out;
  }
  if (S > L) return make_error("parallel.schedule: {}: {} layers cannot fill its {} stages", cfg.parallel.schedule, L, S);
  std::vector<int32_t> even;
  for (const auto& st : even_partition(L, S)) even.push_back(st.last_layer - st.first_layer);
  out.sizes = even;
  out.how = "even";
  if (rr) return choose_round_robin(cfg, mc, rates, step_of, std::move(out));
  const double even_step = step_of(even);
  out.step_s = out.even_step_s = finite_or_zero(even_step);
  if (cfg.parallel.partition == "even" || S == 1) return out;
  const int64_t rows = cfg.run.batch_size / std::max<int64_t>(1, so.micro_batches);
  std::vector<double> layer_s;  // forward + backward of each layer, the head's likewise
  for (int64_t l = 0; l < L; ++l)
    layer_s.push_back(rates.layer_forward(mc, l, rows, cfg.data.seq_len) + rates.layer_backward(mc, l, rows, cfg.data.seq_len));
  const double head_s = rates.head_forward(mc, rows, cfg.data.seq_len) + rates.head_backward(mc, rows, cfg.data.seq_len);
  const auto start = min_max_partition(layer_s, 0.0, head_s, stage_speeds(cfg, S, speeds));
  double step = inf;
  auto balanced = refine(step_of, start, L, step);
  if (step < even_step * 0.98) {  // an even partition over the memory limit loses to any that fits
    out.sizes = std::move(balanced);
    out.how = "balanced";
    out.step_s = finite_or_zero(step);
  }
  return out;
}

result<program> partitioned_program(const project_config& cfg, const llama_config& mc, const std::vector<int32_t>& sizes,
                                    const std::vector<int32_t>& backward) {
  const bool pipelined = cfg.parallel.schedule != "single" && cfg.parallel.schedule != "auto";
  schedule_options so = schedule_options_of(cfg);
  if (pipelined) so.stage_layers = sizes, so.backward_layers = backward;
  auto prog = make_schedule(pipelined ? cfg.parallel.schedule : "gpipe", static_cast<int32_t>(mc.num_layers), so);
  if (!prog) return make_error("parallel.schedule: {}", prog.message());
  return prog;
}

result<program> project_program(const project_config& cfg, const llama_config& mc, const compute_rates& rates) {
  const bool pipelined = cfg.parallel.schedule != "single" && cfg.parallel.schedule != "auto";
  if (!pipelined) return partitioned_program(cfg, mc, {}, {});
  LP_TRY_ASSIGN(choice, choose_partition(cfg, mc, rates));
  return partitioned_program(cfg, mc, choice.sizes, choice.backward_sizes);
}

}  // namespace lorapipe
