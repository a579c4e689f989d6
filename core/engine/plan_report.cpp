// The plan of a project: see plan_report.h.
#include "core/engine/plan_report.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/engine/compute_profile.h"
#include "core/engine/device_inventory.h"
#include "core/engine/plan_questions.h"

#include "core/model/llama_model.h"
#include "core/pipeline/cost_model.h"
#include "offload/device.h"
#include "offload/memory_arena.h"

namespace lorapipe {
namespace fs = std::filesystem;

result<llama_config> project_model_config(const project_config& cfg) {
  try {
    const fs::path model = cfg.resolve(cfg.model.path);
    if (fs::is_directory(model)) return load_llama_config(model / "config.json");
    LP_TRY_ASSIGN(w, load_llama(model, {at::kFloat}));  // llama2.c: the header is inside the checkpoint
    return w.cfg;
  } catch (const std::exception& e) {
    return make_error("{}", e.what());
  }
}

namespace {

// The memory bound the planner's choices must fit, in MiB: offload.device_memory_mb when set; else
// on GPUs what each pipeline device will reserve (the probe's capacities), the smallest of them;
// 0 = unbounded (CPU virtual devices without a limit, GPUs without a probe).
double choice_bound_mb(const project_config& cfg, const device_inventory* probe) {
  if (cfg.offload.device_memory_mb > 0 || device_count(cfg.parallel.devices) <= 1 || probe == nullptr) return cfg.offload.device_memory_mb;
  return static_cast<double>(smallest_capacity(project_capacity(cfg, probe))) / 1048576.0;
}

project_config with_bound(const project_config& cfg, double mb) {
  project_config c = cfg;
  c.offload.device_memory_mb = mb;
  return c;
}

// The planner words a bound as offload.device_memory_mb; one the GPUs gave is named as such.
std::string bound_named(std::string text, const project_config& cfg, double bound_mb) {
  if (cfg.offload.device_memory_mb > 0 || bound_mb <= 0) return text;
  const std::string from = "offload.device_memory_mb is", to = "the GPU devices' memory (90% of what was free) is";
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) text.replace(at, from.size(), to);
  return text;
}

}  // namespace

result<project_config> resolve_project_schedule(const project_config& cfg, const device_inventory* gpus) {
  LP_TRY_ASSIGN(mc, project_model_config(cfg));
  // Chosen to fit the GPUs' memory even when the project sets no limit; recorded as set.
  const double bound_mb = choice_bound_mb(cfg, gpus);
  auto out = resolve_auto_schedule(with_bound(with_planning_copy_rates(cfg, gpus), bound_mb), mc, project_compute_rates(cfg, mc));
  if (!out) return make_error("{}", bound_named(out.message(), cfg, bound_mb));
  out->offload.device_memory_mb = cfg.offload.device_memory_mb;
  return out;  // (with the copy rate the choices were costed at: the executor's memory plan is theirs)
}

result<project_config> resolve_project_schedule(const project_config& cfg) {
  // The GPUs are read only when there is a choice to make.
  const auto& par = cfg.parallel;
  const bool rr = par.schedule == "auto" || par.schedule == "round-robin";
  const bool chooses = par.schedule == "auto" || par.partition == "auto" || (rr && par.backward_partition == "auto") || cfg.offload.automatic;
  const auto gpus = chooses ? gpu_planning_inventory(cfg) : std::nullopt;
  return resolve_project_schedule(cfg, gpus ? &*gpus : nullptr);
}

result<plan_report> make_plan(const project_config& cfg_in, double gflops, const device_inventory* probe,
                              std::shared_ptr<const measured_compute> profile) {
  try {
    LP_TRY(validate_project(cfg_in));
    LP_TRY_ASSIGN(mc, project_model_config(cfg_in));
    plan_report r;
    r.requested_schedule = cfg_in.parallel.schedule;
    // The choices are made as the trainer makes them (its compute rates; the project's copy rate, or
    // on GPUs without one the inventory's), so the plan shows what will run; without a profile
    // gflops only changes the prediction.
    const compute_rates rates = profile ? compute_rates(profile) : project_compute_rates(cfg_in, mc);
    r.measured = rates.measured;
    const compute_rates predict = r.measured ? rates : compute_rates(gflops);
    r.compute = predict.describe();
    // Without offload.device_memory_mb, the GPUs' memory bounds the choices (a probe's capacities:
    // the trainer reads gpu_planning_inventory).
    const double bound_mb = choice_bound_mb(cfg_in, probe);
    // On GPUs without offload.copy_gbps the choices cost copies at the inventory's rates, as the
    // trainer's do (and record them).
    const project_config costed = with_planning_copy_rates(cfg_in, probe);
    if (costed.offload.copy_gbps != cfg_in.offload.copy_gbps)
      r.copy_rates = fmt::format("{:.2f} GB/s{}, {}", costed.offload.copy_gbps,
                                 costed.offload.copy_links.empty() ? "" : " on shared links (offload.copy_links " + costed.offload.copy_links + ")",
                                 probe->measured ? "measured by the probe" : probe->rates_from);
    auto offloaded = resolve_auto_offload(with_bound(costed, bound_mb), mc, rates, &r.offload_auto);
    if (!offloaded) return make_error("{}", bound_named(offloaded.message(), cfg_in, bound_mb));
    project_config cfg = std::move(*offloaded);
    r.stream_weights = cfg.offload.stream_weights;
    r.activations = cfg.offload.activations;
    r.recompute = cfg.offload.recompute;
    r.recompute_granularity = cfg.offload.recompute_granularity;
    if (cfg.parallel.schedule == "auto") {
      auto chosen = choose_schedule(cfg, mc, rates);
      if (!chosen) return make_error("{}", bound_named(chosen.message(), cfg_in, bound_mb));
      auto& choice = *chosen;
      for (auto& c : choice.candidates) c.note = bound_named(c.note, cfg_in, bound_mb);
      cfg.parallel.schedule = choice.schedule;
      if (choice.schedule != "single") cfg.parallel.micro_batches = choice.micro_batches;
      r.schedule_candidates = std::move(choice.candidates);
    }
    const bool pipelined = cfg.parallel.schedule != "single";
    r.schedule = cfg.parallel.schedule;
    r.gflops = gflops;
    if (!r.schedule_candidates.empty()) {
      r.partition = r.schedule_candidates.front().part;  // chosen with the schedule
    } else if (pipelined) {
      LP_TRY_ASSIGN(part, choose_partition(cfg, mc, rates));
      r.partition = std::move(part);
    }
    LP_TRY_ASSIGN(speeds, device_speeds(cfg));
    r.device_speeds = pipelined ? speeds : std::vector<double>{1.0};
    LP_TRY_ASSIGN(prog, partitioned_program(cfg, mc, r.partition.sizes, r.partition.backward_sizes));
    r.prog = std::move(prog);
    // The memory plan is the one the executor checks: the trainer's inputs (with the copy rate the
    // choices were costed at, which the run records), not gflops or a probe's other rates.
    r.memory = project_memory_plan(r.prog, mc, cfg, auto_schedule_gflops);
    if (probe != nullptr && probe->measured) cfg = with_probed_bandwidth(cfg, *probe);
    r.tokens_per_micro_batch = cfg.run.batch_size / r.prog.micro_batches * cfg.data.seq_len;
    LP_TRY_ASSIGN(facts, describe_devices(pipelined ? cfg.parallel.devices : std::string("cpu")));
    r.devices = std::move(facts);
    LP_TRY_ASSIGN(links, choose_transports(r.prog, r.devices, cfg.parallel.transport, gpu_peer_access, nccl_available(),
                                           cfg.distributed.processes > 1
                                               ? rank_of_positions(static_cast<int64_t>(r.devices.size()), static_cast<int>(cfg.distributed.processes))
                                               : std::vector<int>{}));
    r.links = std::move(links);
    sim_costs costs = estimate_costs(r.prog, mc, cfg, predict);
    costs.direct = peer_links(r.links);  // the links the run will use: device to device, or paired (NCCL)
    costs.rendezvous = nccl_links(r.links);
    r.sim = simulate(r.prog, costs);
    if (costs.host_compute_slots > 0)
      r.compute += fmt::format("; {} CPU virtual devices of {} thread(s) share the host's {} cores, {:g} computing at full speed at once",
                               std::count(costs.on_host_cores.begin(), costs.on_host_cores.end(), true), cfg.parallel.threads_per_device,
                               host_core_count(), costs.host_compute_slots);
    if (!r.sim.ok) return make_error("the generated program is invalid: {}\n{}", r.sim.error, r.sim.grid);
    r.stage_bytes = stage_weight_bytes(r.prog, mc, compute_element_bytes(cfg));
    r.arenas = plan_weight_arenas(r.prog, r.stage_bytes, weight_alignment);
    r.head_chunk_rows = head_chunk_rows(mc);
    r.head_working_bytes = head_working_bytes(mc, r.tokens_per_micro_batch);
    r.full_logits_bytes = 3 * r.tokens_per_micro_batch * mc.vocab_size * 4;  // the same three f32 tensors, for every position
    if (bound_mb > 0 && pipelined) {  // the limit is for pipeline devices (as check_project_memory)
      std::vector<std::string> names;
      for (const auto& f : r.devices) names.push_back(f.name);
      const std::vector<size_t> cap(names.size(), static_cast<size_t>(bound_mb * 1048576.0));
      if (auto st = check_memory_plan(r.memory, cap, names); !st)
        r.memory_refusal = (cfg_in.offload.device_memory_mb > 0 ? "offload.device_memory_mb: "
                                                                  : fmt::format("GPU memory ({:.0f} MiB a device, 90% of what was free): ", bound_mb)) +
                           st.message();
    }
    r.memory_bound_mb = pipelined ? bound_mb : 0;
    return r;
  } catch (const std::exception& e) {
    return make_error("{}", e.what());
  }
}

status check_project_memory(const project_config& cfg, const device_inventory* gpus) {
  if (cfg.parallel.schedule == "single") return ok_status();  // the limit is for pipeline devices
  if (cfg.offload.device_memory_mb <= 0 && gpus == nullptr) return ok_status();  // unbounded
  LP_TRY_ASSIGN(rep, make_plan(cfg, auto_schedule_gflops, gpus));
  if (!rep.memory_refusal.empty()) return make_error("{}", rep.memory_refusal);
  return ok_status();
}

status check_project_memory(const project_config& cfg) {
  const auto gpus = gpu_planning_inventory(cfg);
  return check_project_memory(cfg, gpus ? &*gpus : nullptr);
}

std::string offload_choice_text(const plan_report& r) {
  const auto& o = r.offload_auto;
  if (!o.weighed) return "";
  const auto on = [](bool b) { return b ? "on" : "off"; };
  const std::string settings =
      fmt::format("weights streamed {}, recompute {}", on(r.stream_weights),
                  r.recompute ? fmt::format("on ({}), activations offloaded {}", r.recompute_granularity, on(r.activations)) : "off");
  if (o.step_s == 0 && o.given_step_s == 0) return "offload auto: no combination of the offload settings gives a plan that fits";
  if (o.changes.empty())
    return fmt::format("offload auto kept the settings as set ({}): no other combination predicts a step 1% faster that fits", settings);
  return fmt::format("offload auto chose {} (changed {}); predicted step {:.4f} s against {} as set", settings, fmt::join(o.changes, ", "),
                     o.step_s, o.given_step_s > 0 ? fmt::format("{:.4f} s", o.given_step_s) : std::string("no plan that fits"));
}

std::string candidate_loss_text(const schedule_candidate& c, const schedule_candidate& winner) {
  if (&c == &winner) return "; chosen";
  if (!c.ok) return "";
  if (c.step_s > winner.step_s * (1 + 1e-9)) return fmt::format("; lost: {:.1f}% slower", 100 * (c.step_s / winner.step_s - 1));
  return c.micro_batches > winner.micro_batches ? "; lost: as fast, more micro-batches" : "; lost: as fast, listed later";
}

}  // namespace lorapipe
