// The memory plan: see memory_plan.h.
#include "core/pipeline/memory_plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>

namespace lorapipe {

namespace {

std::string human(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024 * 1024));
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", bytes / (1024.0 * 1024));
  return fmt::format("{:.1f} KiB", bytes / 1024.0);
}

const char* buffer_name(mem_kind k) {
  switch (k) {
    case mem_kind::weights: return "stage weights";
    case mem_kind::inputs: return "micro-batch token ids and labels";
    case mem_kind::activations: return "boundary activations and gradients";
    case mem_kind::checkpoints: return "checkpointed stage inputs";
    case mem_kind::graphs: return "autograd graphs";
    case mem_kind::head: return "head loss working set";
  }
  return "?";
}

const char* lifetime_of(mem_kind k) {
  switch (k) {
    case mem_kind::weights: return "PREFETCH to RELEASE";
    case mem_kind::inputs: return "first F or R of the micro-batch to the end of the step";
    case mem_kind::activations: return "F or B (or arrival) to the SEND's copy (or use)";
    case mem_kind::checkpoints: return "F (or RELOAD) to OFFLOAD (or RECOMPUTE)";
    case mem_kind::graphs: return "F or RECOMPUTE to BACKWARD";
    case mem_kind::head: return "while the head computes";
  }
  return "?";
}

std::string event_what(const mem_event& e) {
  std::string s = buffer_name(e.kind);
  if (e.stage >= 0) s += fmt::format(" of stage {}", e.stage);
  if (e.micro >= 0) s += fmt::format("{} micro-batch {}", e.stage >= 0 ? "," : " of", e.micro);
  return s;
}

// The layers a device computes (F, R or B of a stage): the LoRA weights it holds.
std::set<int32_t> device_layers(const program& p, int32_t d) {
  std::set<int32_t> out;
  for (const auto& in : p.devices[d])
    if (in.kind == op::forward || in.kind == op::recompute || in.kind == op::backward)
      for (int32_t l = p.stages[in.stage].first_layer; l < p.stages[in.stage].last_layer; ++l) out.insert(l);
  return out;
}

// Replays one device: resident buffers first, then the events; calls at(total, held-by-name)
// after each change.
template <class F>
void replay(const std::vector<std::pair<std::string, double>>& resident, const std::vector<mem_event>& events, F&& at) {
  std::vector<std::pair<std::string, double>> held;
  double cur = 0;
  for (const auto& [name, bytes] : resident) {
    held.emplace_back(name, bytes);
    cur += bytes;
    if (!at(cur, held, name, bytes, -1.0)) return;
  }
  std::array<double, num_mem_kinds> by_kind{};
  const size_t first_kind = held.size();
  for (int k = 0; k < num_mem_kinds; ++k)
    if (static_cast<mem_kind>(k) != mem_kind::weights) held.emplace_back(mem_kind_name(static_cast<mem_kind>(k)), 0.0);
  for (const auto& e : events) {
    cur += e.bytes;
    by_kind[static_cast<size_t>(e.kind)] += e.bytes;
    size_t i = first_kind;
    for (int k = 0; k < num_mem_kinds; ++k)
      if (static_cast<mem_kind>(k) != mem_kind::weights) held[i++].second = by_kind[static_cast<size_t>(k)];
    if (!at(cur, held, event_what(e), e.bytes, e.t)) return;
  }
}

}  // namespace

memory_plan make_memory_plan(const program& p, const sim_costs& costs, const sim_result& sim, const memory_inputs& in) {
  memory_plan plan;
  const double align = static_cast<double>(std::max<size_t>(1, in.alignment));
  const auto rounded = [&](double b) { return std::copysign(std::ceil(std::abs(b) / align) * align, b); };
  const int32_t D = p.num_devices();
  for (int32_t d = 0; d < D; ++d) {
    std::vector<std::pair<std::string, double>> resident;
    const auto& arena = in.arenas.at(static_cast<size_t>(d));
    resident.emplace_back("weight arena", rounded(static_cast<double>(arena.bytes)));
    plan.buffers.push_back({"weight arena", d, static_cast<double>(arena.bytes), 1,
                            arena.slot_bytes > 0 ? fmt::format("whole run ({} slots of {})", arena.max_stages, human(static_cast<double>(arena.slot_bytes)))
                                                 : fmt::format("whole run ({} stages at once)", arena.max_stages)});
    double lora = 0;
    for (int32_t l : device_layers(p, d))
      if (static_cast<size_t>(l) < in.lora_layer_bytes.size()) lora += static_cast<double>(in.lora_layer_bytes[static_cast<size_t>(l)]);
    resident.emplace_back("LoRA weights", rounded(lora));
    resident.emplace_back("RoPE tables", rounded(static_cast<double>(in.rope_bytes)));
    plan.buffers.push_back({"LoRA weights", d, lora, 1, "step"});
    plan.buffers.push_back({"RoPE tables", d, static_cast<double>(in.rope_bytes), 1, "step"});
    if (static_cast<size_t>(d) < in.workspaces.size() && in.workspaces[static_cast<size_t>(d)].count > 0) {
      const auto& ws = in.workspaces[static_cast<size_t>(d)];
      resident.emplace_back("cuBLAS workspaces", static_cast<double>(ws.bytes) * ws.count);
      plan.buffers.push_back({"cuBLAS workspaces", d, static_cast<double>(ws.bytes), ws.count, "whole run (outside the arenas)"});
    }
    std::vector<mem_event> events;
    std::map<mem_kind, std::pair<double, int32_t>> allocs;  // kind -> (largest, count)
    for (const auto& e : sim.memory.at(static_cast<size_t>(d))) {
      if (e.kind == mem_kind::weights) continue;
      events.push_back(e);
      events.back().bytes = rounded(e.bytes);
      if (e.bytes > 0) {
        auto& a = allocs[e.kind];
        a.first = std::max(a.first, e.bytes);
        ++a.second;
      }
    }
    for (const auto& [k, a] : allocs) plan.buffers.push_back({buffer_name(k), d, a.first, a.second, lifetime_of(k)});
    device_peak peak;
    replay(resident, events, [&](double cur, const auto& held, const std::string&, double, double t) {
      if (cur > peak.peak_bytes) {
        peak.peak_bytes = cur;
        peak.at_s = std::max(0.0, t);
        peak.held = held;
      }
      return true;
    });
    auto expected = events;
    for (auto& e : expected)
      if (e.t_expected >= 0) e.t = e.t_expected;
    std::stable_sort(expected.begin(), expected.end(), [](const mem_event& a, const mem_event& b) {
      return a.t < b.t || (a.t == b.t && a.bytes < b.bytes);
    });
    replay(resident, expected, [&](double cur, const auto&, const std::string&, double, double) {
      peak.expected_peak_bytes = std::max(peak.expected_peak_bytes, cur);
      return true;
    });
    // The bound keeps room for one more message per sending peer: a host-staged upload may land
    // just before the gate the replay charges it at (measured: up to one activation).
    std::set<int32_t> senders;
    for (int32_t s = 0; s < D; ++s)
      for (const auto& i : p.devices[s])
        if ((i.kind == op::send_act || i.kind == op::send_grad) && i.peer == d) senders.insert(s);
    if (!senders.empty()) {
      const double room = rounded(costs.act_bytes) * static_cast<double>(senders.size());
      peak.peak_bytes += room;
      peak.held.emplace_back("arrival headroom", room);
      plan.buffers.push_back({"arrival headroom", d, rounded(costs.act_bytes), static_cast<int32_t>(senders.size()), "bound only"});
    }
    plan.devices.push_back(std::move(peak));
    plan.resident.push_back(std::move(resident));
    plan.replay.push_back(std::move(events));
  }
  // Host.
  const double master = static_cast<double>(in.lora_master_bytes);
  plan.buffers.push_back({"frozen weights (pinned)", -1, static_cast<double>(in.host_weight_bytes), 1, "whole run"});
  plan.buffers.push_back({"LoRA master weights (f32)", -1, master, 1, "whole run"});
  plan.buffers.push_back({"LoRA gradients (f32)", -1, master, 1, "whole run"});
  plan.buffers.push_back({"AdamW moments (f32)", -1, 2 * master, 1, "whole run"});
  int32_t offloads = 0, sends = 0;
  double offload_bytes = 0;
  for (const auto& list : p.devices)
    for (const auto& i : list) {
      if (i.kind == op::offload_act) {
        ++offloads;
        offload_bytes = std::max(offload_bytes, p.stages[i.stage].first_layer == 0 ? costs.token_bytes : costs.act_bytes);
      }
      if (i.kind == op::send_act || i.kind == op::send_grad) ++sends;
    }
  if (offloads > 0) plan.buffers.push_back({"offloaded checkpoints", -1, offload_bytes, offloads, "OFFLOAD to RELOAD"});
  if (sends > 0) plan.buffers.push_back({"staging of host-staged sends (at most)", -1, costs.act_bytes, sends, "download to upload"});
  for (const auto& b : plan.buffers)
    if (b.home < 0) plan.host_bytes += b.bytes * b.count;
  return plan;
}

status check_memory_plan(const memory_plan& plan, const std::vector<size_t>& capacity, const std::vector<std::string>& names) {
  for (size_t d = 0; d < plan.devices.size() && d < capacity.size(); ++d) {
    const double cap = static_cast<double>(capacity[d]), peak = plan.devices[d].peak_bytes;
    if (peak <= cap) continue;
    std::string what, held_text;
    double what_bytes = 0, when = -1;
    replay(plan.resident[d], plan.replay[d], [&](double cur, const auto& held, const std::string& name, double bytes, double t) {
      if (bytes <= 0 || cur <= cap) return true;
      what = name;
      what_bytes = bytes;
      when = t;
      for (const auto& [n, b] : held)
        if (b > 0) held_text += fmt::format("{}{} {}", held_text.empty() ? "" : ", ", n, human(b));
      return false;
    });
    if (what.empty()) {  // only the bound's headroom crosses the capacity
      what = "arrival headroom";
      for (const auto& [n, b] : plan.devices[d].held)
        if (n == what) what_bytes = b;
      for (const auto& [n, b] : plan.devices[d].held)
        if (b > 0) held_text += fmt::format("{}{} {}", held_text.empty() ? "" : ", ", n, human(b));
    }
    const std::string name = d < names.size() ? names[d] : fmt::format("device {}", d);
    return make_error("{}: the memory plan needs {} at its peak, {} ({:.1f}%) more than the device's {}: {} ({}) does not fit{} (held then: {})",
                      name, human(peak), human(peak - cap), 100.0 * (peak - cap) / std::max(cap, 1.0), human(cap), what, human(what_bytes),
                      when >= 0 ? fmt::format(" at {:.4g} s into the step", when) : std::string(" before the step"), held_text);
  }
  return ok_status();
}

std::string memory_plan_text(const memory_plan& plan, const std::vector<std::string>& names) {
  std::string out;
  for (size_t d = 0; d < plan.devices.size(); ++d) {
    const auto& dp = plan.devices[d];
    out += fmt::format("  {}: peak {} (expected {})", d < names.size() ? names[d] : fmt::format("device {}", d), human(dp.peak_bytes),
                       human(dp.expected_peak_bytes));
    std::string parts;
    for (const auto& [n, b] : dp.held)
      if (b > 0) parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", n, human(b));
    out += fmt::format(" = {}\n", parts);
  }
  out += fmt::format("  host: {} =", human(plan.host_bytes));
  bool first = true;
  for (const auto& b : plan.buffers)
    if (b.home < 0) {
      out += fmt::format("{} {} {}", first ? "" : ",", b.name, b.count > 1 ? fmt::format("{} x {}", b.count, human(b.bytes)) : human(b.bytes));
      first = false;
    }
  return out + "\n";
}

}  // namespace lorapipe
