// Building a project's pipeline and its trace: see pipeline_setup.h.
#include "core/train/pipeline_setup.h"

#include <algorithm>
#include <map>
#include <set>

#include <unistd.h>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/errors.h"
#include "core/pipeline/cost_model.h"
#include "core/pipeline/partition_search.h"
#include "core/pipeline/transport.h"
#include "offload/process_group.h"

namespace lorapipe {

namespace {

plan_event describe_plan(const program& prog, const std::vector<device_facts>& devs, const std::vector<weight_arena_plan>& arenas,
                         const std::vector<size_t>& stage_bytes, const std::vector<link_transport>& links, const sim_result& sim) {
  plan_event pe;
  pe.schedule = prog.schedule;
  pe.micro_batches = prog.micro_batches;
  pe.program = program_to_text(prog);
  std::map<int32_t, int32_t> device_of;  // stage -> device computing it
  for (size_t d = 0; d < prog.devices.size(); ++d)
    for (const auto& in : prog.devices[d])
      if (in.kind == op::forward && !device_of.count(in.stage)) device_of[in.stage] = static_cast<int32_t>(d);
  for (size_t s = 0; s < prog.stages.size(); ++s) {
    const auto& st = prog.stages[s];
    pe.stages.push_back({device_of[static_cast<int32_t>(s)], st.first_layer, st.last_layer, st.has_embed, st.has_head,
                         static_cast<int64_t>(stage_bytes[s])});
  }
  for (size_t d = 0; d < devs.size(); ++d)
    pe.arenas.push_back({devs[d].name, static_cast<int64_t>(arenas[d].bytes), arenas[d].max_stages,
                         static_cast<int64_t>(arenas[d].slot_bytes)});
  for (const auto& l : links) pe.links.push_back({l.from, l.to, transport_name(l.kind), l.reason});
  pe.simulated_step_s = sim.makespan_s;
  pe.bubble_ratio = sim.bubble_ratio;
  return pe;
}

// "3,2" (round-robin, whose backward stages follow the forward ones: "3,2 forward + 3 backward").
std::string stage_layer_text(const program& p) {
  std::vector<int32_t> sizes, backward;
  bool past_head = false;
  for (const auto& st : p.stages) {
    (past_head ? backward : sizes).push_back(st.last_layer - st.first_layer);
    past_head = past_head || st.has_head;
  }
  if (p.schedule != "round-robin") sizes.insert(sizes.end(), backward.begin(), backward.end());
  else return fmt::format("{} forward + {} backward", partition_text(sizes), backward.empty() ? "no" : partition_text(backward));
  return partition_text(sizes);
}

}  // namespace

result<cpu_device_options> device_options_of(const project_config& cfg) {
  cpu_device_options o;
  if (cfg.offload.device_memory_mb > 0) o.capacity_bytes = static_cast<size_t>(cfg.offload.device_memory_mb * 1048576.0);
  o.pinned_budget_bytes = static_cast<size_t>(cfg.offload.pinned_memory_gb * 1e9);
  o.copy_bytes_per_s = cfg.offload.copy_gbps * 1e9;
  o.compute_threads = static_cast<int>(cfg.parallel.threads_per_device);
  LP_TRY_ASSIGN(speeds, device_speeds(cfg));
  o.speed = std::move(speeds);
  LP_TRY_ASSIGN(links, copy_links(cfg));
  o.copy_link = std::move(links);
  return o;
}

result<weight_selection> rank_weight_selection(const project_config& cfg_in, const llama_config& mc, int rank, int world) {
  LP_TRY_ASSIGN(cfg, resolve_auto_schedule(cfg_in, mc, auto_schedule_gflops));
  LP_TRY_ASSIGN(prog, project_program(cfg, mc, auto_schedule_gflops));
  return rank_weight_selection(prog, mc.num_layers, rank_of_positions(static_cast<int64_t>(prog.devices.size()), world), rank);
}

std::string describe_weight_selection(const weight_selection& sel) {
  std::vector<std::string> parts;
  for (size_t l = 0; l < sel.layers.size();) {
    if (!sel.layers[l]) {
      ++l;
      continue;
    }
    size_t e = l;
    while (e < sel.layers.size() && sel.layers[e]) ++e;
    parts.push_back(e - l == 1 ? fmt::format("{}", l) : fmt::format("{}-{}", l, e - 1));
    l = e;
  }
  return fmt::format("layers {}{}{}", parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, ",")), sel.embed ? ", embedding" : "",
                     sel.head ? ", head" : "");
}

result<pipeline_rig> build_pipeline(const project_config& cfg, const llama_weights& w, lora_adapters& lora, observer& obs,
                                    const pipeline_options& base) {
  obs.on_event(phase_event{phase::building_pipeline, 0, 0, 0, cfg.parallel.devices});
  pipeline_rig rig;
  rig.group = base.processes.group;
  LP_TRY_ASSIGN(dopts, device_options_of(cfg));
  LP_TRY_ASSIGN(all_facts, describe_devices(cfg.parallel.devices));
  std::vector<bool> here(all_facts.size(), true);  // several processes: this rank's positions only
  std::vector<bool> on_this_host(all_facts.size(), true);  // ... and those of every process on this machine
  if (rig.group != nullptr) {
    std::set<int> local_ranks;
    for (size_t d = 0; d < here.size(); ++d) {
      const int r = base.processes.rank_of.at(d);
      here[d] = r == rig.group->rank();
      on_this_host[d] = rig.group->same_host(r);
      if (on_this_host[d]) local_ranks.insert(r);
    }
    // The processes of one machine share its pinned-memory default (half the RAM), as its GPUs.
    const bool gpu_spec = std::any_of(all_facts.begin(), all_facts.end(), [](const device_facts& f) { return f.gpu >= 0; });
    if (gpu_spec && dopts.pinned_budget_bytes == 0 && local_ranks.size() > 1) {
      const size_t ram = static_cast<size_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
      dopts.pinned_budget_bytes = ram / 2 / local_ranks.size();
    }
  }
  LP_TRY_ASSIGN(devs, make_devices(cfg.parallel.devices, dopts, here, on_this_host));
  rig.devices = std::move(devs);
  const schedule_options so = schedule_options_of(cfg);
  auto prog = project_program(cfg, w.cfg, auto_schedule_gflops);
  if (!prog) return prog.err();
  const auto check = simulate(*prog, uniform_costs(*prog, 1.0, 2.0));
  if (!check.ok) return make_error("parallel.schedule: generated program is invalid: {}\n{}", check.error, check.grid);
  std::vector<compute_device*> raw;  // null: a device of another process
  for (auto& d : rig.devices) raw.push_back(d.get());
  std::vector<device_facts> facts = all_facts;
  for (size_t d = 0; d < raw.size(); ++d)
    if (raw[d] != nullptr) facts[d] = {raw[d]->name(), raw[d]->gpu()};
  LP_TRY_ASSIGN(links, choose_transports(*prog, facts, cfg.parallel.transport, gpu_peer_access, nccl_available(),
                                         rig.group != nullptr ? base.processes.rank_of : std::vector<int>{}));
  if (cfg.parallel.transport == "nccl") {
    // NCCL moves data only when both ends have posted, in each communicator's order: check that the
    // program cannot deadlock under those semantics before anything runs.
    sim_costs nc = uniform_costs(*prog, 1.0, 2.0);
    nc.rendezvous = nccl_links(links);
    const auto rendezvous = simulate(*prog, nc);
    if (!rendezvous.ok)
      return make_error("parallel.transport: nccl: the program would deadlock: {}\n{}", rendezvous.error, rendezvous.grid);
    LP_TRY(enable_nccl(raw, nc.rendezvous, base.processes.group, base.processes.rank_of));
  }
  obs.on_event(log_event{log_event::level::info,
                         fmt::format("pipeline: {} on {} ({} stages of {} layers, {} micro-batches; weights {}, activations {})",
                                     prog->schedule, cfg.parallel.devices, prog->stages.size(), stage_layer_text(*prog), prog->micro_batches,
                                     so.stream_weights ? "streamed" : "resident", so.offload_activations ? "offloaded" : "on device")});
  obs.on_event(log_event{log_event::level::info, "transports: " + describe_transports(links, facts)});
  pipeline_options po = base;
  po.layer_recompute = cfg.offload.recompute_granularity == "layer";
  po.async_optimizer = cfg.optimizer.asynchronous;
  po.transports = links;
  // The executor checks the very plan `plan` shows and begin_run checked (same program and costs).
  po.memory = std::make_shared<const memory_plan>(project_memory_plan(*prog, w.cfg, cfg, auto_schedule_gflops));
  // The watchdog guards GPU waits (a peer that never posts, a hung driver); on CPU virtual devices an
  // instruction of a large model may legitimately take longer than any fixed bound.
  const bool gpus = std::any_of(facts.begin(), facts.end(), [](const device_facts& f) { return f.gpu >= 0; });
  if (!gpus) po.watchdog_s = 0;
  // An NCCL operation with a peer in another process that died waits on its stream without end (Gloo
  // calls time out by themselves): the watchdog fails the step, aborting the communicators, within
  // distributed.timeout_s.
  const bool nccl_across = rig.group != nullptr && std::any_of(links.begin(), links.end(), [&](const link_transport& l) {
    return l.kind == transport_kind::nccl && base.processes.rank_of.at(static_cast<size_t>(l.from)) != base.processes.rank_of.at(static_cast<size_t>(l.to));
  });
  if (nccl_across && cfg.distributed.timeout_s > 0) po.watchdog_s = po.watchdog_s > 0 ? std::min(po.watchdog_s, cfg.distributed.timeout_s) : cfg.distributed.timeout_s;
  po.on_watchdog = [&obs](const std::string& m) { obs.on_event(log_event{log_event::level::error, m}); };
  if (po.async_optimizer)
    obs.on_event(log_event{log_event::level::warning, "asynchronous optimizer: each step computes with weights one update stale"});
  const auto stage_bytes = stage_weight_bytes(*prog, w.cfg, static_cast<size_t>(w.embed.element_size()));
  const program kept = *prog;
  // Several processes: both executors get this rank's device positions only (null elsewhere).
  rig.executor = std::make_unique<pipeline_executor>(
      w, lora, std::move(*prog), raw,
      adamw_config{cfg.optimizer.lr, cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.eps, cfg.optimizer.weight_decay}, po);
  pipeline_options eval_po;
  eval_po.transports = links;
  eval_po.watchdog_s = po.watchdog_s;
  eval_po.processes = po.processes;
  rig.evaluator = std::make_unique<pipeline_executor>(w, lora, forward_only(kept), raw, adamw_config{}, eval_po);
  rig.bubble_ratio = check.bubble_ratio;
  rig.plan = describe_plan(kept, facts, rig.executor->weight_plan(), stage_bytes, links, check);
  std::string arenas;
  for (const auto& a : rig.plan.arenas)
    arenas += fmt::format("{}{} {:.2f} MiB ({} stage(s) at once{})", arenas.empty() ? "" : "; ", a.device, a.bytes / 1048576.0,
                          a.stages_at_once, a.slot_bytes ? fmt::format(", slots of {:.2f} MiB", a.slot_bytes / 1048576.0) : "");
  obs.on_event(log_event{log_event::level::info, "memory plan: weight arenas " + arenas});
  {
    const memory_plan& mem = *po.memory;
    std::string peaks;
    for (size_t d = 0; d < mem.devices.size() && d < raw.size(); ++d)
      peaks += fmt::format("{}{} {:.2f} MiB", peaks.empty() ? "" : "; ", facts[d].name, mem.devices[d].peak_bytes / 1048576.0);
    obs.on_event(log_event{log_event::level::info, "memory plan: device peaks " + peaks + " (checked before the first step allocates)"});
  }
  obs.on_event(rig.plan);
  return rig;
}

trace_event make_trace_event(const program& p, const pipeline_step_result& r, const plan_event& plan, int64_t step) {
  trace_event te;
  te.step = step;
  te.measured_step_s = r.seconds;
  const size_t S = p.stages.size();
  std::vector<double> sum_f(S), sum_r(S), sum_b(S);
  std::vector<int> n_f(S), n_r(S), n_b(S);
  for (const auto& t : r.trace) {
    const double dt = t.end_s - t.start_s;
    const auto s = static_cast<size_t>(t.in.stage);
    if (t.in.kind == op::forward) sum_f[s] += dt, ++n_f[s];
    if (t.in.kind == op::recompute) sum_r[s] += dt, ++n_r[s];
    if (t.in.kind == op::backward) sum_b[s] += dt, ++n_b[s];
    te.measured.push_back({t.device, instr_to_text(t.in), t.start_s, t.end_s, plan.stages[s].weight_bytes});
  }
  sim_costs c = uniform_costs(p, 0, 0);
  for (size_t s = 0; s < S; ++s) {
    c.forward_s[s] = n_f[s] ? sum_f[s] / n_f[s] : 0;
    c.recompute_s[s] = n_r[s] ? sum_r[s] / n_r[s] : 0;
    c.backward_s[s] = n_b[s] ? sum_b[s] / n_b[s] : 0;
  }
  const auto sim = simulate(p, c);
  te.predicted_step_s = sim.makespan_s;
  for (const auto& iv : sim.timeline)
    te.predicted.push_back({iv.device, instr_to_text(iv.in), iv.start_s, iv.end_s, plan.stages[iv.in.stage].weight_bytes});
  return te;
}

double pipeline_batch_loss(pipeline_rig& rig, const at::Tensor& x, const at::Tensor& y, int64_t batch) {
  at::Tensor xs = x, ys = y;  // i64 [batch,T]
  if (x.size(0) < batch) {
    const int64_t pad = batch - x.size(0);
    xs = torch::cat({x, x.slice(0, 0, 1).expand({pad, x.size(1)})});
    ys = torch::cat({y, torch::full({pad, y.size(1)}, -100, y.options())});
  }
  const int32_t m = rig.evaluator->prog().micro_batches;
  auto xc = xs.chunk(m), yc = ys.chunk(m);
  std::vector<micro_batch> mbs;
  for (size_t i = 0; i < xc.size(); ++i) mbs.push_back({xc[i].contiguous(), yc[i].contiguous(), /*loss_scale=*/1.0, 0});
  auto r = rig.evaluator->step(mbs, 0.0, 0.0, false);
  if (!r) throw lorapipe_error("validation on the pipeline: " + r.message());
  return r->loss;  // loss_scale 1: the summed cross-entropy
}

std::vector<int32_t> pipeline_greedy(pipeline_rig& rig, const std::vector<int32_t>& prompt, int64_t max_new, int32_t stop_id,
                                     int64_t context_length, const std::function<bool(int32_t)>& on_token) {
  std::vector<int64_t> seq(prompt.begin(), prompt.end());
  std::vector<int32_t> out;
  const int32_t m = rig.evaluator->prog().micro_batches;
  while (static_cast<int64_t>(out.size()) < max_new && static_cast<int64_t>(seq.size()) < context_length) {
    auto tokens = torch::tensor(seq, torch::kLong).unsqueeze(0);  // i64 [1,T]
    std::vector<micro_batch> mbs(static_cast<size_t>(m), micro_batch{tokens, at::Tensor(), 0.0, 0, /*last_logits=*/true});
    auto r = rig.evaluator->step(mbs, 0.0, 0.0, false);
    if (!r) throw lorapipe_error("sampling on the pipeline: " + r.message());
    int32_t id = -1;
    if (!r->last_logits.empty()) id = static_cast<int32_t>(r->last_logits.front().argmax(-1).item<int64_t>());  // f32 [1,V] -> id
    if (rig.group != nullptr) {  // the head's rank has the logits: its token, to every rank (the others add 0)
      at::Tensor shared = torch::full({1}, static_cast<double>(id + 1), torch::kDouble);  // f64 [1]
      if (auto st = rig.group->all_reduce_sum(shared); !st.ok()) throw lorapipe_error("sampling on the pipeline: " + st.message());
      id = static_cast<int32_t>(shared.item<double>()) - 1;
    }
    if (id < 0) throw lorapipe_error("sampling on the pipeline: the head returned no logits");
    out.push_back(id);
    seq.push_back(id);
    if (id == stop_id || (on_token && !on_token(id))) break;
  }
  return out;
}

}  // namespace lorapipe
