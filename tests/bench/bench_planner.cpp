// lorapipe_bench_planner: the planner against measurement on CPU virtual devices with throttled copy
// engines, on a synthetic Llama (random weights in memory). Everything is measured side by side in one
// run: configurations take turns step by step, so slow drifts of the shared machine hit all alike.
//
// 1. Devices of different speed: cpu:1 at half speed (parallel.device_speeds 1,0.5), 1F1B; the even
//    partition against the one choose_partition balances (measured step medians and their ratio).
// 2. Step time and choice: a grid of configurations (every schedule x micro-batch counts x weights
//    streamed or resident) on two devices, predicted by the simulator from the layer profile
//    (profile_layers: each layer, the embedding and the head timed alone on one device before anything
//    runs; what `plan --profile` and a cached profile give `auto`), and from a two-step trace (after
//    three warm-up steps, two profiling steps' stage compute medians, with_measured_compute; warm-up
//    and profiling steps also take turns); then all are measured. Prints predicted vs measured per
//    configuration, the worst errors, and the picks (the planner's: the smallest prediction from the
//    layer profile; the two-step trace's; the FLOP-only model's, `auto` before any profile) against
//    the fastest measured. This shared machine's speed drifts by 10-30% over seconds
//    (--profiles N takes the layer profile N times in a row), so two more columns separate the
//    simulator's error from that noise: the layer profile taken in turns with the measured steps (a
//    short one of each micro-batch shape before each round, medians over them), and the simulator fed with the compute the
//    measured steps themselves traced (its own error: copies, waits, shared cores).
// 3. Cross mapping (--cross): four devices whose copies share two host links (offload.copy_links
//    0,0,1,1: two GPUs behind each of two PCIe switches), round-robin with weights streamed; the probe
//    measures the links, cross_mapping reorders them (Mobius), and the given order and the mapped one
//    are predicted (the simulator divides shared links among the copies in flight) and measured side by side: the planner takes
//    the mapped order only when the prediction is at least 1% faster (plan_device_order).
// 4. Round-robin's backward stages (--backward): the even forward stages with every way of cutting
//    the layers before the fused tail into backward stages of equal size (one layer each, as before
//    parallel.backward_partition, up to one stage), and the planner's choice (forward and backward
//    partitions auto, from the layer profile), predicted and measured side by side: the pick against
//    the fastest measured.
// 5. Shared host link (--links): two devices on one link (offload.copy_links 0,0) against a link each,
//    every schedule with weights streamed: the simulator's prediction against the measured step.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <functional>
#include <map>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/engine/device_inventory.h"
#include "core/pipeline/cost_model.h"
#include "core/pipeline/partition_search.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule_sim.h"
#include "core/pipeline/transport.h"
#include "core/train/layer_profile.h"
#include "core/train/pipeline_setup.h"
#include "tests/synthetic_llama.h"

using namespace lorapipe;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One configuration: its project settings, program, devices and executor, stepped on demand.
struct rig {
  std::string label;
  project_config cfg;
  llama_config mc;
  program prog;
  std::vector<std::unique_ptr<compute_device>> devs;
  lora_adapters lora;
  std::unique_ptr<pipeline_executor> ex;
  std::vector<micro_batch> mbs;
  std::vector<double> times;
  std::vector<sim_interval> profile;  // compute instructions of the profiling steps
  std::vector<sim_interval> traced;   // ... and of the measured steps
  double flop_predicted_s = 0, profiled_predicted_s = 0, layer_predicted_s = 0;

  rig(std::string name, const project_config& c, program p, const llama_weights& w, const compute_rates& layers)
      : label(std::move(name)), cfg(c), mc(w.cfg), prog(std::move(p)) {
    // Throttle, threads, speeds and shared links as a run makes them.
    devs = make_devices(cfg.parallel.devices, device_options_of(cfg).value()).value();
    std::vector<compute_device*> raw;
    for (const auto& d : devs) raw.push_back(d.get());
    lora_config lc;
    lc.r = cfg.lora.r;
    lora = init_lora(w, lc, 1);
    pipeline_options po;
    po.transports = choose_transports(prog, facts_of(raw), "host", nullptr).value();
    po.watchdog_s = 0;
    ex = std::make_unique<pipeline_executor>(w, lora, prog, raw, adamw_config{}, po);
    torch::manual_seed(1);
    const int64_t rows = cfg.run.batch_size / prog.micro_batches;
    for (int m = 0; m < prog.micro_batches; ++m) {
      auto t = torch::randint(0, w.cfg.vocab_size, {rows, cfg.data.seq_len + 1}, torch::kLong);  // i64 [rows, T+1]
      mbs.push_back({t.slice(1, 0, cfg.data.seq_len).contiguous(), t.slice(1, 1).contiguous()});
    }
    flop_predicted_s = simulate(prog, estimate_costs(prog, w.cfg, cfg, auto_schedule_gflops)).makespan_s;
    layer_predicted_s = simulate(prog, estimate_costs(prog, w.cfg, cfg, layers)).makespan_s;
    step(false);  // warm-up: resident weights get uploaded here, allocators and caches settle
  }
  // One profiling step: its compute instructions join the profile, and the prediction is redone.
  void profile_step() {
    for (const auto& t : step(false).trace) profile.push_back({t.device, 0, t.in, t.start_s, t.end_s});
    const sim_costs flop = estimate_costs(prog, mc, cfg, auto_schedule_gflops);
    profiled_predicted_s = simulate(prog, with_measured_compute(prog, flop, profile)).makespan_s;
  }
  // Compute seconds per step summed over devices: measured (the profiling steps' compute intervals),
  // predicted from the layer profile with the host's cores shared, and alone (no sharing).
  std::array<double, 3> compute_per_step(const compute_rates& layers) const {
    const auto sum = [](const std::vector<sim_interval>& v) {
      double s = 0;
      for (const auto& i : v) s += i.end_s - i.start_s;
      return s;
    };
    sim_costs c = estimate_costs(prog, mc, cfg, layers);
    const double shared = sum(simulate(prog, c).timeline);
    c.host_compute_slots = 0;
    return {sum(profile) / 2, shared, sum(simulate(prog, c).timeline)};
  }
  // The simulator given the compute the measured steps themselves traced: its error is the model's
  // alone (copies, waits, shared cores), without the noise of a profile taken at another time.
  double predicted_from_own_compute() const {
    return simulate(prog, with_measured_compute(prog, estimate_costs(prog, mc, cfg, auto_schedule_gflops), traced)).makespan_s;
  }
  pipeline_step_result step(bool record = true) {
    auto r = ex->step(mbs, 1e-4, 1.0);
    if (!r) {
      fmt::print(stderr, "error: {}: {}\n", label, r.message());
      std::exit(1);
    }
    if (record) {
      times.push_back(r->seconds);
      for (const auto& t : r->trace) traced.push_back({t.device, 0, t.in, t.start_s, t.end_s});
    }
    return std::move(*r);
  }
};

// Two more warm-up steps, two profiling steps, then `steps` measured ones, each round over every
// configuration in turn; `between` runs before each measured round.
void step_all(std::vector<std::unique_ptr<rig>>& rigs, int steps, const std::function<void()>& between = {}) {
  for (int i = 0; i < 2; ++i)
    for (auto& r : rigs) r->step(false);
  for (int i = 0; i < 2; ++i)
    for (auto& r : rigs) r->profile_step();
  for (int i = 0; i < steps; ++i) {
    if (between) between();
    for (auto& r : rigs) r->step();
  }
}

// The layer profile taken in turns with the measured steps: a short one before each round, each field
// the median over them. This shared machine's speed drifts by 10-30% over seconds (--profiles shows
// the spread of profiles taken in a row), so one profile taken before everything can be off by that.
// Taken for each micro-batch count of the rigs (its own shape, as plan --profile caches a profile
// per shape), and predicted from the profile of the rig's shape.
struct profile_in_turns {
  project_config cfg;
  llama_config mc;
  std::vector<int64_t> counts;                         // micro-batch counts profiled
  std::map<int64_t, std::vector<measured_compute>> takes;  // by micro-batch count
  void take() {
    profile_options o;
    o.warmup = 1, o.warmup_seconds = 0.1, o.repeats = 3, o.min_seconds = 0.2;
    for (int64_t m : counts) {
      project_config c = cfg;
      c.parallel.micro_batches = m;
      takes[m].push_back(profile_layers(c, mc, o).value().compute);
    }
  }
  size_t rounds() const { return takes.empty() ? 0 : takes.begin()->second.size(); }
  compute_rates rates(int64_t count) const {
    const auto& mine = takes.at(count);
    auto m = std::make_shared<measured_compute>(mine.at(0));
    m->second = {};  // each rig is charged at its own shape's profile
    const auto mid = [&](auto field) {
      std::vector<double> v;
      for (const auto& t : mine) v.push_back(field(t));
      return median(v);
    };
    for (size_t l = 0; l < m->layer_forward_s.size(); ++l) {
      m->layer_forward_s[l] = mid([&](const measured_compute& t) { return t.layer_forward_s[l]; });
      m->layer_forward_nograd_s[l] = mid([&](const measured_compute& t) { return t.layer_forward_nograd_s[l]; });
      m->layer_backward_s[l] = mid([&](const measured_compute& t) { return t.layer_backward_s[l]; });
    }
    m->embed_s = mid([](const measured_compute& t) { return t.embed_s; });
    m->head_forward_s = mid([](const measured_compute& t) { return t.head_forward_s; });
    m->head_backward_s = mid([](const measured_compute& t) { return t.head_backward_s; });
    return compute_rates(std::shared_ptr<const measured_compute>(std::move(m)));
  }
  double predicted_s(const rig& r) const {
    return simulate(r.prog, estimate_costs(r.prog, mc, r.cfg, rates(r.cfg.parallel.micro_batches))).makespan_s;
  }
};

std::string sizes_of(const program& p) {
  std::vector<int32_t> s;
  for (const auto& st : p.stages) s.push_back(st.last_layer - st.first_layer);
  return partition_text(s);
}

// 3. Four devices on two shared links: the given order against the cross-mapped one.
int cross_mapping_part(const project_config& base, const llama_config& mc, const llama_weights& w, const compute_rates& by_layer,
                       int steps, double gbps, bool even) {
  project_config given = base;
  if (even) given.parallel.partition = "even", given.parallel.backward_partition = "per-layer";  // the order alone, not the partition chosen with it
  given.parallel.devices = "cpu:4";
  given.parallel.schedule = "round-robin";
  given.offload.stream_weights = true;
  given.offload.copy_gbps = gbps;
  given.offload.copy_links = "0,0,1,1";
  char dir[] = "/tmp/lorapipe-bench-probe-XXXXXX";
  if (::mkdtemp(dir) == nullptr) return 1;
  probe_request req;
  req.cache_dir = dir;
  req.options.bytes = size_t{8} << 20;
  req.options.peers = false;
  const auto probed = probe_project_devices(given, req).value();
  std::filesystem::remove_all(dir);
  const device_order order = cross_mapping(probed.inventory, given);
  fmt::print("\n3. cross mapping: cpu:4, copies through two shared links of {} GB/s each way (offload.copy_links {}), round-robin, "
             "weights streamed\n{}  device order: {}\n",
             gbps, given.offload.copy_links, inventory_text(probed.inventory), order.why);
  if (order.setting.empty()) return 0;
  const project_config mapped = with_device_order(given, order.order);
  std::vector<std::unique_ptr<rig>> rigs;
  for (const project_config* c : std::initializer_list<const project_config*>{&given, &mapped})
    rigs.push_back(std::make_unique<rig>("links " + c->offload.copy_links, *c, project_program(*c, mc, auto_schedule_gflops).value(), w, by_layer));
  step_all(rigs, steps);
  for (const auto& r : rigs)
    fmt::print("  {:<16} layers {:<20} measured {:.3f} s/step, predicted {:.3f} s from the layer profile (links costed)\n", r->label,
               sizes_of(r->prog), median(r->times), r->layer_predicted_s);
  std::vector<double> ratios;
  for (size_t i = 0; i < rigs[0]->times.size(); ++i) ratios.push_back(rigs[0]->times[i] / rigs[1]->times[i]);
  fmt::print("  measured: cross-mapped {:+.1f}% (median {:.3f} vs {:.3f} s; per-step ratios given/mapped {:.2f}); predicted {:+.1f}%: "
             "the planner {} it\n",
             100 * (median(rigs[1]->times) / median(rigs[0]->times) - 1), median(rigs[1]->times), median(rigs[0]->times),
             fmt::join(ratios, " "), 100 * (rigs[1]->layer_predicted_s / rigs[0]->layer_predicted_s - 1),
             rigs[1]->layer_predicted_s <= 0.99 * rigs[0]->layer_predicted_s ? "takes" : "keeps the given order over");
  return 0;
}

// 4. Round-robin's backward partition: fixed cuts against the planner's choice.
int backward_part(const project_config& base, const llama_config& mc, const llama_weights& w, const compute_rates& by_layer, int steps,
                  const std::string& devices) {
  project_config rr = base;
  rr.parallel.devices = devices;
  rr.parallel.schedule = "round-robin";
  rr.offload.stream_weights = true;
  const int32_t L = static_cast<int32_t>(mc.num_layers);
  rr.parallel.partition = "auto";
  rr.parallel.backward_partition = "auto";
  const partition_choice pick = choose_partition(rr, mc, by_layer).value();
  std::vector<int32_t> even_sizes;
  for (const auto& st : even_partition(L, schedule_stage_count("round-robin", L, schedule_options_of(rr)))) even_sizes.push_back(st.last_layer - st.first_layer);
  project_config even = rr;
  even.parallel.partition = partition_text(even_sizes);
  const int32_t tail_first = L - even_sizes.back();
  std::vector<std::unique_ptr<rig>> rigs;
  for (int32_t k = tail_first; k >= 1; --k) {
    if (tail_first % k != 0 && k != tail_first) continue;  // stages of equal size
    project_config c = even;
    c.parallel.backward_partition = k == tail_first ? "per-layer" : partition_text(std::vector<int32_t>(static_cast<size_t>(k), tail_first / k));
    rigs.push_back(std::make_unique<rig>(fmt::format("F {} B {}", c.parallel.partition, c.parallel.backward_partition), c,
                                         project_program(c, mc, by_layer).value(), w, by_layer));
  }
  project_config chosen = rr;
  chosen.parallel.partition = partition_text(pick.sizes);
  chosen.parallel.backward_partition = backward_partition_text(pick);
  rigs.push_back(std::make_unique<rig>(fmt::format("planner: F {} B {}", chosen.parallel.partition, chosen.parallel.backward_partition),
                                       chosen, project_program(chosen, mc, by_layer).value(), w, by_layer));
  step_all(rigs, steps);
  fmt::print("\n4. round-robin on {}, weights streamed, copies {} GB/s: backward partitions with the even forward stages, and the "
             "planner's choice (both partitions auto, layer profile)\n",
             devices, base.offload.copy_gbps);
  const rig* fastest = nullptr;
  for (const auto& r : rigs) {
    const double m = median(r->times);
    const auto busy = r->compute_per_step(by_layer);
    fmt::print("  {:<40} measured {:.3f} s/step, predicted {:.3f} s ({:+.1f}%); compute {:.3f} s, predicted {:.3f} s ({:.3f} alone)\n",
               r->label, m, r->layer_predicted_s, 100 * (r->layer_predicted_s / m - 1), busy[0], busy[1], busy[2]);
    if (!fastest || m < median(fastest->times)) fastest = r.get();
  }
  const rig& planned = *rigs.back();
  const rig& per_layer = *rigs.front();
  fmt::print("  planner's pick {:+.1f}% from the fastest measured ({}); {:+.1f}% against one layer per backward stage (predicted {:+.1f}%)\n",
             100 * (median(planned.times) / median(fastest->times) - 1), fastest->label,
             100 * (median(planned.times) / median(per_layer.times) - 1),
             100 * (planned.layer_predicted_s / per_layer.layer_predicted_s - 1));
  return 0;
}

// 5. Copies through one shared host link (--links): two devices on offload.copy_links 0,0 against a
// link each, every schedule with weights streamed and checkpoints offloaded, predicted from the layer
// profile (the simulator divides a shared link among the copies in flight) and measured side by side.
int links_part(const project_config& base, const llama_config& mc, const llama_weights& w, const compute_rates& by_layer, int steps) {
  std::vector<std::unique_ptr<rig>> rigs;
  for (const auto& name : schedule_names())
    for (const char* links : {"0,0", ""}) {
      project_config c = base;
      c.parallel.schedule = name;
      c.offload.stream_weights = true;
      c.offload.copy_links = links;
      auto p = project_program(c, mc, by_layer);
      if (!p) continue;
      rigs.push_back(std::make_unique<rig>(fmt::format("{} {}", name, *links ? "one link" : "a link each"), c, std::move(*p), w, by_layer));
    }
  step_all(rigs, steps);
  fmt::print("\n5. cpu:2, weights streamed, copies {} GB/s: one shared host link (offload.copy_links 0,0) against a link each\n",
             base.offload.copy_gbps);
  double worst = 0;
  for (const auto& r : rigs) {
    const double m = median(r->times), err = r->layer_predicted_s / m - 1;
    if (!r->cfg.offload.copy_links.empty()) worst = std::max(worst, std::abs(err));
    fmt::print("  {:<28} layers {:<10} measured {:.3f} s/step, predicted {:.3f} s from the layer profile ({:+.1f}%)\n", r->label,
               sizes_of(r->prog), m, r->layer_predicted_s, 100 * err);
  }
  fmt::print("  worst error on the shared link: {:.1f}%\n", 100 * worst);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"planner against measurement on CPU virtual devices"};
  int steps = 9, layers = 8;
  int64_t dim = 256, seq = 128, batch = 8;
  double gbps = 1.0;
  bool skip_grid = false, cross = false, cross_even = false, backward = false, links = false;
  int profiles = 0;
  std::string backward_devices = "cpu:2";
  double cross_gbps = 0.1;
  app.add_option("--steps", steps, "Measured steps per configuration (after a warm-up and two profiling steps)")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers);
  app.add_option("--dim", dim);
  app.add_option("--seq-len", seq);
  app.add_option("--batch", batch);
  app.add_option("--copy-gbps", gbps, "Copy engine throttle of every device");
  app.add_flag("--no-grid", skip_grid, "Only the devices-of-different-speed part");
  app.add_flag("--cross", cross, "Only the cross-mapping part (4 devices on two shared links)");
  app.add_option("--cross-gbps", cross_gbps, "Bandwidth of each shared link in the cross-mapping part");
  app.add_flag("--cross-even", cross_even, "Cross-mapping part with the even partition in both orders");
  app.add_flag("--backward", backward, "Only the round-robin backward partition part");
  app.add_option("--backward-devices", backward_devices, "Devices of the backward partition part");
  app.add_flag("--links", links, "Only the shared-link part (2 devices on one host link against a link each)");
  app.add_option("--profiles", profiles, "Only the layer profile, taken this many times in a row (its spread)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  const llama_config mc = synthetic_llama_config(dim, dim * 8 / 3 / 64 * 64, layers, 4096);
  const llama_weights w = random_llama(mc);

  project_config base;
  base.model.dtype = "float32";
  base.parallel.devices = "cpu:2";
  base.parallel.micro_batches = 4;
  base.run.batch_size = batch;
  base.data.seq_len = seq;
  base.offload.copy_gbps = gbps;
  // The layer profile, before anything else runs (as plan --profile takes it).
  const auto prof = profile_layers(base, mc, {}).value();
  const compute_rates by_layer(std::make_shared<const measured_compute>(prof.compute));
  fmt::print("Planner bench: synthetic Llama dim {} x {} layers ({:.1f}M params), batch {} x {} tokens, 2 CPU virtual devices "
             "(1 thread each), copies throttled to {} GB/s\n",
             dim, layers, mc.num_parameters() / 1e6, batch, seq, gbps);
  fmt::print("layer profile ({:.2f} s, {} rounds at {} x {} tokens): layer forward {:.2f} ms (no autograd {:.2f}), backward {:.2f} ms; "
             "head forward {:.2f} ms, backward {:.2f} ms; at {} x {}: layer forward {:.2f} ms, backward {:.2f} ms, head forward {:.2f} ms, "
             "backward {:.2f} ms\n",
             prof.seconds, prof.repeats, prof.compute.rows, prof.compute.seq_len, prof.compute.layer_forward_s[0] * 1e3,
             prof.compute.layer_forward_nograd_s[0] * 1e3, prof.compute.layer_backward_s[0] * 1e3, prof.compute.head_forward_s * 1e3,
             prof.compute.head_backward_s * 1e3, prof.compute.second.rows, prof.compute.second.seq_len,
             prof.compute.second.layer_forward_s.empty() ? 0.0 : prof.compute.second.layer_forward_s[0] * 1e3,
             prof.compute.second.layer_backward_s.empty() ? 0.0 : prof.compute.second.layer_backward_s[0] * 1e3,
             prof.compute.second.head_forward_s * 1e3, prof.compute.second.head_backward_s * 1e3);

  for (int i = 1; i < profiles; ++i) {
    const auto again = profile_layers(base, mc, {}).value();
    fmt::print("layer profile again ({:.2f} s, {} rounds): layer forward {:.2f} ms (no autograd {:.2f}), backward {:.2f} ms; head forward "
               "{:.2f} ms, backward {:.2f} ms\n",
               again.seconds, again.repeats, again.compute.layer_forward_s[0] * 1e3, again.compute.layer_forward_nograd_s[0] * 1e3,
               again.compute.layer_backward_s[0] * 1e3, again.compute.head_forward_s * 1e3, again.compute.head_backward_s * 1e3);
  }
  if (profiles > 0) return 0;
  if (cross) return cross_mapping_part(base, mc, w, by_layer, steps, cross_gbps, cross_even);
  if (backward) return backward_part(base, mc, w, by_layer, steps, backward_devices);
  if (links) return links_part(base, mc, w, by_layer, steps);

  // 1. A device at half speed: even against balanced.
  {
    project_config het = base;
    het.parallel.schedule = "1f1b";
    het.parallel.device_speeds = "1,0.5";
    const auto choice = choose_partition(het, mc, auto_schedule_gflops).value();
    project_config even = het;
    even.parallel.partition = "even";
    std::vector<std::unique_ptr<rig>> rigs;
    rigs.push_back(std::make_unique<rig>("even", even, project_program(even, mc, auto_schedule_gflops).value(), w, by_layer));
    rigs.push_back(std::make_unique<rig>(choice.how, het, project_program(het, mc, auto_schedule_gflops).value(), w, by_layer));
    profile_in_turns turns{base, mc, {base.parallel.micro_batches}, {}};
    step_all(rigs, steps, [&] { turns.take(); });
    fmt::print("\n1. cpu:1 at half speed (parallel.device_speeds 1,0.5), 1f1b x4, {} measured steps each (alternating)\n", steps);
    for (const auto& r : rigs) {
      const double m = median(r->times), turn = turns.predicted_s(*r), own = r->predicted_from_own_compute();
      fmt::print("  layers {:<5} ({:<8}): measured {:.3f} s/step; predicted {:.3f} s from FLOPs, {:.3f} s profiled ({:+.1f}%), "
                 "{:.3f} s from the layer profile ({:+.1f}%), {:.3f} s from it in turns ({:+.1f}%), {:.3f} s from the steps' own "
                 "compute ({:+.1f}%)\n",
                 sizes_of(r->prog), r->label, m, r->flop_predicted_s, r->profiled_predicted_s, 100 * (r->profiled_predicted_s / m - 1),
                 r->layer_predicted_s, 100 * (r->layer_predicted_s / m - 1), turn, 100 * (turn / m - 1), own, 100 * (own / m - 1));
    }
    // Per stage: the compute the layer profile charges against the medians traced in the pipeline.
    for (const auto& r : rigs) {
      const sim_costs traced = with_measured_compute(r->prog, estimate_costs(r->prog, mc, r->cfg, auto_schedule_gflops), r->profile);
      const sim_costs charged = estimate_costs(r->prog, mc, r->cfg, by_layer);
      for (size_t st = 0; st < r->prog.stages.size(); ++st)
        fmt::print("    {} stage {}: F {:.1f} / {:.1f} ms, R {:.1f} / {:.1f} ms, B {:.1f} / {:.1f} ms (layer profile / traced, speed 1)\n",
                   r->label, st, charged.forward_s[st] * 1e3, traced.forward_s[st] * 1e3, charged.recompute_s[st] * 1e3,
                   traced.recompute_s[st] * 1e3, charged.backward_s[st] * 1e3, traced.backward_s[st] * 1e3);
    }
    std::vector<double> ratios;
    for (size_t i = 0; i < rigs[0]->times.size(); ++i) ratios.push_back(rigs[0]->times[i] / rigs[1]->times[i]);
    fmt::print("  balanced is {:.1f}% faster than even (median step {:.3f} vs {:.3f} s; per-step ratios even/balanced {:.2f})\n",
               100 * (1 - median(rigs[1]->times) / median(rigs[0]->times)), median(rigs[1]->times), median(rigs[0]->times),
               fmt::join(ratios, " "));
  }
  if (skip_grid) return 0;

  // 2. The grid: every schedule x {2, 4} micro-batches x weights streamed / resident.
  std::vector<std::unique_ptr<rig>> rigs;
  for (const auto& name : schedule_names())
    for (int64_t m : {2, 4})
      for (bool stream : {true, false}) {
        project_config c = base;
        c.parallel.schedule = name;
        c.parallel.micro_batches = m;
        c.offload.stream_weights = stream;
        auto p = project_program(c, mc, auto_schedule_gflops);
        if (!p) {
          fmt::print("  {} x{} {}: not possible: {}\n", name, m, stream ? "streamed" : "resident", p.message());
          continue;
        }
        rigs.push_back(std::make_unique<rig>(fmt::format("{} x{} {}", name, m, stream ? "streamed" : "resident"), c, std::move(*p), w, by_layer));
      }
  profile_in_turns turns{base, mc, {2, 4}, {}};
  step_all(rigs, steps, [&] { turns.take(); });
  fmt::print("\n2. {} configurations on 2 devices at equal speed, {} measured steps each (round-robin over configurations)\n", rigs.size(), steps);
  fmt::print("  {:<40} {:>9} {:>17} {:>19} {:>19} {:>19} {:>10}\n", "configuration", "measured", "profiled", "layer profile",
             "... in turns", "own compute", "FLOP model");
  double worst = 0, worst_layers = 0, worst_turns = 0, worst_own = 0;
  const rig *fastest = nullptr, *pick = nullptr, *flop_pick = nullptr, *layer_pick = nullptr, *turns_pick = nullptr;
  double turns_best = 0;
  for (const auto& r : rigs) {
    const double m = median(r->times), turn = turns.predicted_s(*r), own = r->predicted_from_own_compute();
    const double err = r->profiled_predicted_s / m - 1, lerr = r->layer_predicted_s / m - 1, terr = turn / m - 1, oerr = own / m - 1;
    worst = std::max(worst, std::abs(err));
    worst_layers = std::max(worst_layers, std::abs(lerr));
    worst_turns = std::max(worst_turns, std::abs(terr));
    worst_own = std::max(worst_own, std::abs(oerr));
    fmt::print("  {:<40} {:>7.3f} s {:>7.3f} s {:>+6.1f}% {:>9.3f} s {:>+6.1f}% {:>9.3f} s {:>+6.1f}% {:>9.3f} s {:>+6.1f}% {:>8.3f} s\n",
               r->label + " [" + sizes_of(r->prog) + "]", m, r->profiled_predicted_s, 100 * err, r->layer_predicted_s, 100 * lerr, turn,
               100 * terr, own, 100 * oerr, r->flop_predicted_s);
    if (!fastest || m < median(fastest->times)) fastest = r.get();
    if (!pick || r->profiled_predicted_s < pick->profiled_predicted_s) pick = r.get();
    if (!flop_pick || r->flop_predicted_s < flop_pick->flop_predicted_s) flop_pick = r.get();
    if (!layer_pick || r->layer_predicted_s < layer_pick->layer_predicted_s) layer_pick = r.get();
    if (!turns_pick || turn < turns_best) turns_pick = r.get(), turns_best = turn;
  }
  if (!fastest) return 0;
  fmt::print("  step-time prediction: worst error {:.1f}% from the two-step profile, {:.1f}% from the layer profile, {:.1f}% from the "
             "layer profile taken in turns ({} takes of each micro-batch shape), {:.1f}% from the steps' own compute (the simulator's own error), over {} "
             "configurations\n",
             100 * worst, 100 * worst_layers, 100 * worst_turns, turns.rounds(), 100 * worst_own, rigs.size());
  const auto off = [&](const rig* r) { return 100 * (median(r->times) / median(fastest->times) - 1); };
  int close = 0;
  for (const auto& r : rigs) close += off(r.get()) < 5;
  fmt::print("  fastest measured: {} ({:.3f} s; {} configurations measured within 5% of it)\n", fastest->label, median(fastest->times), close);
  fmt::print("  planner's pick (the layer profile, what plan --profile gives schedule auto): {} ({:.3f} s measured, {:+.1f}% from the "
             "fastest); from the profile in turns: {} ({:+.1f}%); from the two-step trace: {} ({:+.1f}%); FLOP-only: {} ({:+.1f}%)\n",
             layer_pick->label, median(layer_pick->times), off(layer_pick), turns_pick->label, off(turns_pick), pick->label, off(pick),
             flop_pick->label, off(flop_pick));
  return 0;
}
