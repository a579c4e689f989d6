// Discrete-event simulation of schedule programs: see schedule_sim.h.
#include "core/schedule_sim.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "offload/memory_arena.h"

namespace lorapipe {

sim_costs uniform_costs(const program& p, double t_f, double t_b) {
  sim_costs c;
  c.forward_s.assign(p.stages.size(), t_f);
  c.backward_s.assign(p.stages.size(), t_b);
  c.recompute_s.assign(p.stages.size(), 0.0);
  c.weight_bytes.assign(p.stages.size(), 0.0);
  return c;
}

namespace {

// Data item identity: kind letter, boundary layer or stage, micro-batch, device (-1 = host).
using key = std::tuple<char, int32_t, int32_t, int32_t>;

// A copy engine's busy intervals. Devices are simulated one after another, so a request may come in
// "earlier" than intervals already booked: it takes the first gap that fits (a FIFO engine would
// have served it then).
struct engine {
  std::map<double, double> busy;  // start -> end
  double reserve(double t, double dur) {
    for (auto it = busy.begin(); it != busy.end(); ++it) {
      if (it->second <= t) continue;
      if (it->first >= t + dur) break;
      t = std::max(t, it->second);
    }
    if (dur > 0) busy[t] = t + dur;
    return t;
  }
  double last() const { return busy.empty() ? 0 : busy.rbegin()->second; }
};

struct device_state {
  size_t pc = 0;
  double clock = 0, busy = 0;
  engine wh2d, h2d, d2h;  // weight upload, activation upload, download (as on the devices)
  std::vector<std::pair<double, double>> mem;  // (time, +/- bytes)
};

double transfer(double bytes, double bw, double lat) { return bw > 0 ? bytes / bw + lat : lat; }

}  // namespace

sim_result simulate(const program& p, const sim_costs& c) {
  sim_result r;
  const int32_t D = p.num_devices();
  const auto fail = [&](int32_t d, int32_t idx, std::string msg) {
    r.ok = false;
    r.error = std::move(msg);
    r.fail_device = d;
    r.fail_index = idx;
    r.grid = program_grid(p, d, idx);
    return r;
  };
  // Pairing: each SEND (kind, boundary, micro, from -> to) has exactly one matching RECV and vice versa.
  std::map<std::tuple<char, int32_t, int32_t, int32_t, int32_t>, std::pair<int, int>> pairs;  // -> (sends, recvs)
  std::map<std::tuple<char, int32_t, int32_t, int32_t, int32_t>, std::pair<int32_t, int32_t>> where;
  std::map<int32_t, bool> has_recompute;
  int total_backward = 0;
  for (int32_t d = 0; d < D; ++d)
    for (size_t i = 0; i < p.devices[d].size(); ++i) {
      const auto& in = p.devices[d][i];
      if (in.stage < 0 || in.stage >= static_cast<int32_t>(p.stages.size()))
        return fail(d, static_cast<int32_t>(i), fmt::format("d{} step {}: unknown stage {}", d, i, in.stage));
      const auto& st = p.stages[in.stage];
      if (in.kind == op::recompute) has_recompute[in.stage] = true;
      if (in.kind == op::backward) ++total_backward;
      bool is_send = in.kind == op::send_act || in.kind == op::send_grad;
      bool is_recv = in.kind == op::recv_act || in.kind == op::recv_grad;
      if (!is_send && !is_recv) continue;
      if (in.peer < 0 || in.peer >= D || in.peer == d)
        return fail(d, static_cast<int32_t>(i), fmt::format("d{} step {}: {} has no valid peer device", d, i, instr_to_text(in)));
      char kind = (in.kind == op::send_act || in.kind == op::recv_act) ? 'A' : 'G';
      int32_t boundary = in.kind == op::send_act ? st.last_layer
                         : in.kind == op::recv_act ? st.first_layer
                         : in.kind == op::send_grad ? st.first_layer
                                                    : st.last_layer;
      auto k = is_send ? std::make_tuple(kind, boundary, in.micro, d, in.peer) : std::make_tuple(kind, boundary, in.micro, in.peer, d);
      (is_send ? pairs[k].first : pairs[k].second)++;
      where[k] = {d, static_cast<int32_t>(i)};
    }
  for (const auto& [k, n] : pairs)
    if (n.first != 1 || n.second != 1) {
      auto [d, i] = where[k];
      return fail(d, i, fmt::format("d{} step {}: {} is not paired ({} sends, {} receives for {} {} of micro-batch {} from d{} to d{})", d, i,
                                    instr_to_text(p.devices[d][i]), n.first, n.second, std::get<0>(k) == 'A' ? "activation" : "gradient",
                                    std::get<1>(k), std::get<2>(k), std::get<3>(k), std::get<4>(k)));
    }

  std::vector<std::set<int32_t>> carried(D);  // stages resident from the previous iteration
  if (c.steady_state)
    for (int32_t d = 0; d < D; ++d) {
      const auto& list = p.devices[d];
      size_t last_compute = 0;
      for (size_t i = 0; i < list.size(); ++i)
        if (list[i].kind == op::forward || list[i].kind == op::recompute || list[i].kind == op::backward) last_compute = i;
      for (size_t i = last_compute; i < list.size(); ++i)
        if (list[i].kind == op::prefetch_weights) carried[d].insert(list[i].stage);
    }
  std::vector<device_state> dev(D);
  std::map<key, double> ready;  // when an item becomes available
  int backward_done = 0;
  double last_backward_end = 0;
  auto has = [&](const key& k) { return ready.count(k) > 0; };
  auto layers = [&](int32_t s) { return p.stages[s].last_layer - p.stages[s].first_layer; };
  const double act = c.act_bytes;
  size_t remaining = 0;
  for (const auto& d : p.devices) remaining += d.size();
  while (remaining > 0) {
    bool progress = false;
    for (int32_t d = 0; d < D; ++d) {
      auto& ds = dev[d];
      while (ds.pc < p.devices[d].size()) {
        const auto& in = p.devices[d][ds.pc];
        const auto& st = p.stages[in.stage];
        const int32_t m = in.micro, s = in.stage;
        const key w{'w', s, -1, d};
        auto compute = [&](double cost, std::vector<key> needs) -> bool {
          double start = ds.clock;
          for (const auto& k : needs) {
            if (!has(k)) return false;
            start = std::max(start, ready[k]);
          }
          ds.clock = start + cost;
          ds.busy += cost;
          return true;
        };
        bool done = true;
        switch (in.kind) {
          case op::load_micro_batch:
            ready[{'L', 0, m, d}] = ds.clock;
            break;
          case op::forward: {
            std::vector<key> needs{w, st.has_embed ? key{'L', 0, m, d} : key{'a', st.first_layer, m, d}};
            if (st.has_head) needs.push_back({'L', 0, m, d});
            double t0 = ds.clock;
            if (!(done = compute(c.forward_s[s], needs))) break;
            for (int32_t b = st.first_layer; b < st.last_layer; ++b) ready[{'c', b, m, d}] = ds.clock;
            if (st.first_layer == st.last_layer) ready[{'c', st.first_layer, m, d}] = ds.clock;
            if (!st.has_head) {
              ready[{'a', st.last_layer, m, d}] = ds.clock;
              ds.mem.push_back({ds.clock, act});
            }
            if (!has_recompute[s]) {
              ready[{'s', s, m, d}] = ds.clock;
              ds.mem.push_back({t0, layers(s) * c.stash_bytes_per_layer});
            }
            ds.mem.push_back({ds.clock, -act});  // the input is consumed (checkpoints are counted on OFF/R)
            ds.mem.push_back({t0, act});
            break;
          }
          case op::recompute: {
            double t0 = ds.clock;
            std::vector<key> needs{w, {'c', st.first_layer, m, d}};
            if (st.has_head) needs.push_back({'L', 0, m, d});
            if (!(done = compute(c.recompute_s[s] > 0 ? c.recompute_s[s] : c.forward_s[s], needs))) break;
            ready[{'s', s, m, d}] = ds.clock;
            ds.mem.push_back({t0, layers(s) * c.stash_bytes_per_layer});
            break;
          }
          case op::backward: {
            std::vector<key> needs{w, {'s', s, m, d}};
            if (!st.has_head) needs.push_back({'g', st.last_layer, m, d});
            if (!(done = compute(c.backward_s[s], needs))) break;
            ds.mem.push_back({ds.clock, -layers(s) * c.stash_bytes_per_layer});
            if (!st.has_head) ds.mem.push_back({ds.clock, -act});
            if (!st.has_embed) {
              ready[{'g', st.first_layer, m, d}] = ds.clock;
              ds.mem.push_back({ds.clock, act});
            }
            ++backward_done;
            last_backward_end = std::max(last_backward_end, ds.clock);
            break;
          }
          case op::send_act:
          case op::send_grad: {
            const bool a = in.kind == op::send_act;
            const int32_t b = a ? st.last_layer : st.first_layer;
            const key local{a ? 'a' : 'g', b, m, d};
            if (!(done = has(local))) break;
            const double down = transfer(act, c.d2h_bytes_per_s, c.copy_latency_s);
            double t1 = ds.d2h.reserve(std::max(ds.clock, ready[local]), down) + down;
            ds.mem.push_back({t1, -act});
            auto& peer = dev[in.peer];
            const double up = transfer(act, c.h2d_bytes_per_s, c.copy_latency_s);
            double t2 = peer.h2d.reserve(t1, up);
            double t3 = t2 + up;
            peer.mem.push_back({t2, act});
            ready[{a ? 'A' : 'G', b, m, in.peer}] = t3;
            break;
          }
          case op::recv_act:
          case op::recv_grad: {
            const bool a = in.kind == op::recv_act;
            const int32_t b = a ? st.first_layer : st.last_layer;
            const key mail{a ? 'A' : 'G', b, m, d};
            if (!(done = has(mail))) break;
            ds.clock = std::max(ds.clock, ready[mail]);  // the device thread blocks until it arrives
            ready[{a ? 'a' : 'g', b, m, d}] = ds.clock;
            break;
          }
          case op::prefetch_weights: {
            if (carried[d].count(s)) {  // resident from the previous iteration (first PW) ...
              carried[d].erase(s);
              ready[w] = ds.clock;
              ds.mem.push_back({ds.clock, c.weight_bytes[s]});
              break;
            }
            const double up = transfer(c.weight_bytes[s], c.h2d_bytes_per_s, c.weight_bytes[s] > 0 ? c.copy_latency_s : 0);
            double t = ds.wh2d.reserve(ds.clock, up);
            double t1 = t + up;
            ready[w] = t1;
            ds.mem.push_back({t, c.weight_bytes[s]});
            break;
          }
          case op::release_weights:
            if (!(done = has(w))) break;
            ds.mem.push_back({ds.clock, -c.weight_bytes[s]});
            ready.erase(w);
            break;
          case op::offload_act: {
            const key ck{'c', st.first_layer, m, d};
            if (!(done = has(ck))) break;
            const double down = transfer(act, c.d2h_bytes_per_s, c.copy_latency_s);
            double t1 = ds.d2h.reserve(std::max(ds.clock, ready[ck]), down) + down;
            ds.mem.push_back({ready[ck], act});
            ds.mem.push_back({t1, -act});
            ready[{'H', st.first_layer, m, -1}] = t1;
            break;
          }
          case op::reload_act: {
            const key hk{'H', st.first_layer, m, -1};
            if (!(done = has(hk))) break;
            const double up = transfer(act, c.h2d_bytes_per_s, c.copy_latency_s);
            double t = ds.h2d.reserve(std::max(ds.clock, ready[hk]), up);
            double t1 = t + up;
            ds.mem.push_back({t, act});
            ready[{'c', st.first_layer, m, d}] = t1;
            break;
          }
          case op::optimizer_step:
            if (!(done = backward_done == total_backward)) break;
            ds.clock = std::max(ds.clock, last_backward_end);
            break;
        }
        if (!done) break;
        ++ds.pc;
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      for (int32_t d = 0; d < D; ++d)
        if (dev[d].pc < p.devices[d].size()) {
          const auto& in = p.devices[d][dev[d].pc];
          return fail(d, static_cast<int32_t>(dev[d].pc),
                      fmt::format("deadlock: d{} step {} ({}) waits for data no device will produce", d, dev[d].pc, instr_to_text(in)));
        }
    }
  }
  r.ok = true;
  for (const auto& ds : dev) r.makespan_s = std::max({r.makespan_s, ds.clock, ds.h2d.last(), ds.d2h.last(), c.steady_state ? 0.0 : ds.wh2d.last()});
  double busy = 0;
  for (auto& ds : dev) {
    r.busy_s.push_back(ds.busy);
    busy += ds.busy;
    std::stable_sort(ds.mem.begin(), ds.mem.end(), [](auto& a, auto& b) { return a.first < b.first || (a.first == b.first && a.second < b.second); });
    double cur = 0, peak = 0;
    for (const auto& [t, b] : ds.mem) {
      cur += b;
      peak = std::max(peak, cur);
    }
    r.peak_bytes.push_back(peak);
  }
  r.bubble_ratio = r.makespan_s > 0 ? 1.0 - busy / (D * r.makespan_s) : 0.0;
  r.grid = program_grid(p);
  return r;
}

namespace {
// High-water offset and stages held at once of a device's PREFETCH/RELEASE sequence (two iterations).
weight_arena_plan place_sequence(const std::vector<instr>& list, const std::vector<size_t>& stage_bytes, size_t alignment,
                                 size_t slot) {
  memory_arena arena("plan", size_t{1} << 62, alignment, /*contiguous=*/true);
  std::map<int32_t, size_t> resident;  // stage -> offset
  weight_arena_plan w;
  w.slot_bytes = slot;
  for (int iteration = 0; iteration < 2; ++iteration)
    for (const auto& in : list) {
      if (in.kind == op::prefetch_weights && !resident.count(in.stage)) {
        resident[in.stage] = arena.allocate(std::max(slot, stage_bytes.at(static_cast<size_t>(in.stage)))).value();
        w.max_stages = std::max(w.max_stages, static_cast<int32_t>(resident.size()));
      } else if (in.kind == op::release_weights) {
        if (auto it = resident.find(in.stage); it != resident.end()) {
          arena.release(it->second);
          resident.erase(it);
        }
      }
    }
  w.bytes = arena.high_water();
  return w;
}
}  // namespace

std::vector<weight_arena_plan> plan_weight_arenas(const program& p, const std::vector<size_t>& stage_bytes, size_t alignment) {
  std::vector<weight_arena_plan> out;
  for (const auto& list : p.devices) {
    size_t largest = 0;
    for (const auto& in : list)
      if (in.kind == op::prefetch_weights) largest = std::max(largest, stage_bytes.at(static_cast<size_t>(in.stage)));
    const auto exact = place_sequence(list, stage_bytes, alignment, 0);
    const auto slots = place_sequence(list, stage_bytes, alignment, largest);
    out.push_back(slots.bytes < exact.bytes ? slots : exact);
  }
  return out;
}

}  // namespace lorapipe
