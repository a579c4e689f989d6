// lorapipe-cli plan: the schedule program for the project, checked and simulated with the engine's
// cost model (core/engine/plan_report.h), the what-if answers and the largest fit
// (core/engine/plan_questions.h); printed here as text or JSON, and --write.
#include "app/cli_plan.h"

#include <algorithm>
#include <iostream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/cli_runs.h"
#include "core/engine/compute_profile.h"
#include "core/engine/device_inventory.h"
#include "core/engine/plan_questions.h"
#include "core/engine/plan_report.h"
#include "core/project/project.h"

namespace lorapipe {
namespace {

std::string prog_label(const project_config& c) {
  if (c.parallel.schedule == "single") return "single";
  return fmt::format("{}, micro_batches {}, partition {}", c.parallel.schedule, c.parallel.micro_batches, c.parallel.partition);
}

struct plan_inputs {
  const plan_args& args;
  const project_config& cfg;
  const plan_report& rep;
  const std::optional<probe_outcome>& probed;
  const std::optional<profile_outcome>& profiled;
  const result<fit_limits>& fit;
  const std::vector<what_if_answer>& answers;
  const std::vector<what_if_answer>& faster;  // offload settings that would make the step faster and fit
  const std::optional<device_order_answer>& order;  // cross mapping of the probed devices
};

nlohmann::json summary_json(const plan_summary& s) {
  return {{"schedule", s.schedule}, {"micro_batches", s.micro_batches}, {"partition", s.partition}, {"devices", s.devices},
          {"step_seconds", s.step_s}, {"tokens_per_second", s.tokens_per_s}, {"bubble_ratio", s.bubble_ratio},
          {"peak_bytes", s.peak_bytes}, {"host_bytes", s.host_bytes}, {"fits", s.refusal.empty()}, {"refusal", s.refusal}};
}

nlohmann::json answers_json(const std::vector<what_if_answer>& answers) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& a : answers) {
    nlohmann::json changes = nlohmann::json::array();
    for (const auto& c : a.changes) changes.push_back({{"field", c.field}, {"before", c.before}, {"after", c.after}});
    nlohmann::json q = {{"question", a.question}, {"changes", changes}, {"notes", a.notes}, {"error", a.error}, {"before", summary_json(a.before)}};
    if (a.error.empty()) q["after"] = summary_json(a.after);
    out.push_back(q);
  }
  return out;
}

nlohmann::json questions_json(const plan_inputs& in) {
  nlohmann::json out = {{"what_if", answers_json(in.answers)}, {"faster_offload_settings", answers_json(in.faster)}};
  if (in.fit) {
    const auto& f = *in.fit;
    out["largest_fit"] = {{"bounded", f.bounded}, {"note", f.note}, {"max_seq_len", f.max_seq_len},
                          {"seq_len_at_model_limit", f.seq_len_at_model_limit},
                          {"max_rows_per_micro_batch", f.max_rows_per_micro_batch}, {"rows_per_micro_batch", f.rows_per_micro_batch}};
  } else {
    out["largest_fit"] = {{"bounded", false}, {"note", in.fit.message()}};
  }
  return out;
}

void print_plan_json(const plan_inputs& in) {
  const auto* rep = &in.rep;
  const auto& prog = rep->prog;
  const auto& r = rep->sim;
  const auto& probed = in.probed;
  nlohmann::json j = {{"schedule", rep->schedule}, {"devices", prog.num_devices()}, {"micro_batches", prog.micro_batches},
                      {"stages", prog.stages.size()}, {"step_seconds", r.makespan_s}, {"bubble_ratio", r.bubble_ratio},
                      {"peak_bytes", r.peak_bytes}, {"busy_seconds", r.busy_s}, {"program", program_to_text(prog)},
                      {"stage_weight_bytes", rep->stage_bytes},
                      {"head", {{"chunk_rows", rep->head_chunk_rows}, {"working_bytes", rep->head_working_bytes},
                                {"full_logits_bytes", rep->full_logits_bytes}}},
                      {"requested_schedule", rep->requested_schedule}, {"candidates", nlohmann::json::array()},
                      {"partition", {{"layers", rep->partition.sizes}, {"how", rep->partition.how},
                                     {"backward_layers", rep->partition.backward_sizes}, {"backward_how", rep->partition.backward_how},
                                     {"step_seconds", rep->partition.step_s}, {"even_step_seconds", rep->partition.even_step_s}}},
                      {"device_speeds", rep->device_speeds},
                      {"offload", {{"auto", rep->offload_auto.weighed}, {"changes", rep->offload_auto.changes},
                                   {"given_step_seconds", rep->offload_auto.given_step_s}, {"step_seconds", rep->offload_auto.step_s},
                                   {"stream_weights", rep->stream_weights},
                                   {"activations", rep->activations}, {"recompute", rep->recompute},
                                   {"recompute_granularity", rep->recompute_granularity}}}};
  for (const auto& c : rep->schedule_candidates)
    j["candidates"].push_back({{"schedule", c.schedule}, {"micro_batches", c.micro_batches}, {"ok", c.ok}, {"note", c.note},
                               {"step_seconds", c.step_s}, {"bubble_ratio", c.bubble_ratio}, {"peak_bytes", c.peak_bytes},
                               {"partition", c.partition}, {"partition_how", c.partition_how},
                               {"backward_partition", c.backward_partition}});
  for (const auto& a : rep->arenas)
    j["weight_arenas"].push_back({{"bytes", a.bytes}, {"stages_at_once", a.max_stages}, {"slot_bytes", a.slot_bytes}});
  for (const auto& l : rep->links)
    j["transports"].push_back({{"from", l.from}, {"to", l.to}, {"kind", transport_name(l.kind)}, {"reason", l.reason}});
  j["peak_bytes"] = nlohmann::json::array();  // the memory plan's bound per device (what the executor checks)
  auto& mem = j["memory"];
  mem = {{"devices", nlohmann::json::array()}, {"buffers", nlohmann::json::array()}, {"host_bytes", rep->memory.host_bytes},
         {"refusal", rep->memory_refusal}};
  for (size_t d = 0; d < rep->memory.devices.size(); ++d) {
    const auto& dp = rep->memory.devices[d];
    j["peak_bytes"].push_back(dp.peak_bytes);
    nlohmann::json held = nlohmann::json::object();
    for (const auto& [name, bytes] : dp.held) held[name] = bytes;
    mem["devices"].push_back({{"device", d < rep->devices.size() ? rep->devices[d].name : std::to_string(d)},
                              {"peak_bytes", dp.peak_bytes}, {"expected_peak_bytes", dp.expected_peak_bytes},
                              {"peak_at_seconds", dp.at_s}, {"held_at_peak", held}});
  }
  for (const auto& b : rep->memory.buffers)
    mem["buffers"].push_back({{"name", b.name}, {"home", b.home < 0 ? std::string("host") : rep->devices.at(static_cast<size_t>(b.home)).name},
                              {"bytes", b.bytes}, {"count", b.count}, {"lifetime", b.lifetime}});
  if (probed) {
    j["probe"] = nlohmann::json::parse(inventory_to_json(probed->inventory));
    j["probe"]["from_cache"] = probed->from_cache;
    j["probe"]["cache_file"] = probed->cache_file.string();
  }
  if (in.order) {
    const auto& o = in.order->order;
    j["device_order"] = {{"order", o.order}, {"score", o.score}, {"given_score", o.given_score}, {"groups", o.groups},
                         {"setting", o.setting}, {"why", o.why}, {"given_step_seconds", in.order->given_step_s},
                         {"mapped_step_seconds", in.order->mapped_step_s}};
  }
  j["compute"] = rep->compute;
  j["copy_rates"] = rep->copy_rates;
  j["tokens_per_second"] = summarize_plan(in.cfg, *rep).tokens_per_s;
  if (in.profiled) {
    j["layer_profile"] = nlohmann::json::parse(layer_profile_to_json(in.profiled->profile, in.profiled->key));
    j["layer_profile"]["from_cache"] = in.profiled->from_cache;
    j["layer_profile"]["cache_file"] = in.profiled->cache_file.string();
  }
  j.update(questions_json(in));
  std::cout << j.dump(2) << "\n";
}

void print_plan_text(const plan_inputs& in) {
  const auto* rep = &in.rep;
  const auto* p = &in.cfg;
  const auto& prog = rep->prog;
  const auto& r = rep->sim;
  const auto& probed = in.probed;
  const std::string& path = in.args.project;
  if (in.profiled) {
    const auto& pr = *in.profiled;
    std::cout << (pr.from_cache ? fmt::format("layer profile reused from {}\n", pr.cache_file.string())
                                : fmt::format("layer profile measured now{}\n", pr.cache_note.empty() ? "" : " (" + pr.cache_note + ")"))
              << layer_profile_text(pr.profile);
  }
  if (probed) {
    const auto& inv = probed->inventory;
    std::cout << (probed->from_cache ? fmt::format("devices (probe of {} reused from {}):\n", inv.when, probed->cache_file.string())
                                     : fmt::format("devices (probed in {:.2f} s with {} MiB copies{}):\n", inv.probe_seconds,
                                                   inv.probe_bytes >> 20, probed->cache_note.empty() ? "" : "; " + probed->cache_note))
              << inventory_text(inv)
              << fmt::format("  the prediction costs copies at {:.2f} GB/s (the slowest measured with every device copying)\n",
                             with_probed_bandwidth(*p, inv).offload.copy_gbps);
  }
  if (in.order) std::cout << "device order: " << (in.order->order.setting.empty() ? "keep, " : "") << in.order->order.why << "\n";
  std::cout << fmt::format("plan for {}: {} on {} device(s), {} stages, {} micro-batches of {} tokens\n", path, rep->schedule,
                           prog.num_devices(), prog.stages.size(), prog.micro_batches, rep->tokens_per_micro_batch);
  std::cout << fmt::format("estimated step {:.3f} s, {} tokens/s (compute: {}), bubble ratio {:.3f}\n", r.makespan_s,
                           tokens_per_s_text(summarize_plan(*p, *rep).tokens_per_s), rep->compute, r.bubble_ratio);
  if (!rep->copy_rates.empty()) std::cout << "the choices cost copies at " << rep->copy_rates << "\n";
  if (rep->offload_auto.weighed) std::cout << offload_choice_text(*rep) << "\n";
  if (!rep->schedule_candidates.empty()) {
    std::cout << fmt::format("schedule auto chose {} with {} micro-batches; weighed (fastest first):\n", prog.schedule, prog.micro_batches);
    for (const auto& c : rep->schedule_candidates)
      std::cout << (c.ok ? fmt::format("  {:<12} x{:<3} step {:.3f} s, bubble {:.3f}, peak {:.1f} MiB, layers {} ({}){}{}\n", c.schedule,
                                       c.micro_batches, c.step_s, c.bubble_ratio, c.peak_bytes / 1048576.0, c.partition, c.partition_how,
                                       c.backward_partition.empty() ? std::string() : ", backward " + c.backward_partition,
                                       candidate_loss_text(c, rep->schedule_candidates.front()))
                         : fmt::format("  {:<12} x{:<3} not possible: {}\n", c.schedule, c.micro_batches, c.note));
  }
  if (!rep->partition.sizes.empty()) {
    const auto& pc = rep->partition;
    std::string speeds;
    for (size_t d = 0; d < rep->device_speeds.size() && d < rep->devices.size(); ++d)
      speeds += fmt::format("{}{} x{:g}", speeds.empty() ? "" : ", ", rep->devices[d].name, rep->device_speeds[d]);
    const bool searched = pc.how == "balanced" || pc.backward_how == "balanced";
    const std::string even = pc.backward_how.empty() ? "even" : "even forward stages and one layer per backward stage";
    std::cout << fmt::format("layers per stage: {} ({}){}{}; device speeds: {}\n", partition_text(pc.sizes), pc.how,
                             pc.backward_how.empty() ? std::string()
                                                     : fmt::format("; backward stages: {} ({})", backward_partition_text(pc), pc.backward_how),
                             searched && pc.even_step_s > 0
                                 ? fmt::format("; {:.1f}% faster than {} ({:.3f} s)", 100 * (1 - pc.step_s / pc.even_step_s), even, pc.even_step_s)
                                 : std::string(),
                             speeds);
  }
  std::vector<std::string> names;
  for (const auto& f : rep->devices) names.push_back(f.name);
  std::cout << "memory plan (peak: the bound checked before anything is allocated; expected: with copies on time):\n"
            << memory_plan_text(rep->memory, names);
  for (size_t d = 0; d < r.busy_s.size(); ++d)
    std::cout << fmt::format("  device {}: weight arena {:.1f} MiB ({} stage(s) at once), busy {:.3f} s\n", d,
                             rep->arenas[d].bytes / 1048576.0, rep->arenas[d].max_stages, r.busy_s[d]);
  if (!rep->memory_refusal.empty()) std::cout << "does not fit: " << rep->memory_refusal << "\n";
  std::cout << fmt::format("  LM head: loss on labelled positions only, {} rows per chunk, working set {:.1f} MiB "
                           "(full logits, softmax and gradient would take {:.1f} MiB per micro-batch)\n",
                           rep->head_chunk_rows, rep->head_working_bytes / 1048576.0, rep->full_logits_bytes / 1048576.0);
  for (const auto& l : rep->links)
    std::cout << fmt::format("  link {} -> {}: {} ({})\n", rep->devices[l.from].name, rep->devices[l.to].name, transport_name(l.kind), l.reason);
  std::cout << (in.fit ? fit_limits_text(*in.fit, in.cfg) : "largest fit: " + in.fit.message() + "\n");
  for (const auto& a : in.faster)
    std::cout << fmt::format("faster and fits: {} (step {:.4f} s, {:+.1f}%; largest device peak {:.1f} MiB)\n", a.question, a.after.step_s,
                             100 * (a.after.step_s / a.before.step_s - 1),
                             *std::max_element(a.after.peak_bytes.begin(), a.after.peak_bytes.end()) / 1048576.0);
  for (const auto& a : in.answers) std::cout << what_if_text(a);
  if (in.args.grid) std::cout << program_grid(prog);
}

}  // namespace

int cmd_plan(const plan_args& a) {
  auto p = load_project(a.project);
  if (!p) return cli_fail(p.message());
  if (!a.devices.empty()) p->parallel.devices = a.devices;
  if (!a.schedule.empty()) p->parallel.schedule = a.schedule;
  if (auto st = validate_project(*p); !st) return cli_fail(fmt::format("{} is not valid:\n{}", a.project, st.message()));
  std::optional<probe_outcome> probed;
  if (a.probe > 0) {
    probe_request req;
    req.refresh = a.probe > 1;
    auto out = probe_project_devices(*p, req);
    if (!out) return cli_fail(out.message());
    probed = std::move(*out);
  }
  // Without a probe, GPUs are bounded by what they have free now and their copies costed (a cached
  // probe, else the PCIe estimate), as `train` will choose.
  const auto gpus = probed ? std::nullopt : gpu_planning_inventory(*p);
  const device_inventory* inv = probed ? &probed->inventory : gpus ? &*gpus : nullptr;
  std::optional<profile_outcome> profiled;
  if (a.profile > 0) {
    auto mc = project_model_config(*p);
    if (!mc) return cli_fail(mc.message());
    profile_request req;
    req.refresh = a.profile > 1;
    auto out = profile_project(*p, *mc, req);
    if (!out) return cli_fail(out.message());
    profiled = std::move(*out);
    if (!profiled->from_cache && !profiled->cache_note.empty())
      std::fputs(fmt::format("warning: layer profile {}\n", profiled->cache_note).c_str(), stderr);
  }
  auto rep = make_plan(*p, a.gflops, inv, profiled ? std::make_shared<const measured_compute>(profiled->profile.compute) : nullptr);
  if (!rep) return cli_fail(rep.message());
  const auto fit = largest_fit(with_plan_choices(*p, *rep), project_capacity(*p, inv));
  std::vector<what_if_answer> answers;
  const plan_summary base = summarize_plan(*p, *rep);
  for (const auto& q : a.what_if) answers.push_back(what_if(*p, base, q, a.gflops, inv, rep->measured));
  // With the schedule and partition the plan chose held: each flip is one simulation, not a search.
  // (offload.auto weighed them already, with the trainer's rates)
  const auto faster = rep->offload_auto.weighed ? std::vector<what_if_answer>{}
                                                : faster_offload_settings(with_plan_choices(*p, *rep), base, a.gflops, inv, rep->measured);
  std::optional<device_order_answer> order;
  if (probed) order = plan_device_order(*p, *rep, a.gflops, *inv);
  const plan_inputs in{a, *p, *rep, probed, profiled, fit, answers, faster, order};
  if (a.json) print_plan_json(in);
  else print_plan_text(in);
  if (a.write) {
    if (!rep->memory_refusal.empty()) return cli_fail(fmt::format("the plan does not fit ({}); {} left as it was", rep->memory_refusal, a.project));
    // The devices in the cross-mapped order with the plan made in it (speeds and capacities move with
    // their devices, so the partition may differ).
    const bool mapped = order && order->mapped_plan;
    const project_config& chosen = mapped ? *order->mapped_cfg : *p;
    const plan_report& written = mapped ? *order->mapped_plan : *rep;
    if (auto st = write_plan_choices(a.project, chosen, written); !st) return cli_fail(st.message());
    std::fputs(fmt::format("wrote the plan's choices to {}: parallel.devices {}{}, schedule {}\n", a.project, chosen.parallel.devices,
                           chosen.offload.copy_links.empty() ? "" : ", offload.copy_links " + chosen.offload.copy_links,
                           prog_label(with_plan_choices(chosen, written))).c_str(), stderr);
  }
  return 0;
}

}  // namespace lorapipe
