// Discrete-event simulation of schedule programs: see schedule_sim.h.
#include "core/pipeline/schedule_sim.h"

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
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

sim_result sim_failure(const program& p, int32_t d, int32_t idx, std::string msg) {
  sim_result r;
  r.error = std::move(msg);
  r.fail_device = d;
  r.fail_index = idx;
  r.grid = program_grid(p, d, idx);
  return r;
}

// Checks every instruction's stage and peer and that each SEND (kind, boundary, micro, from -> to)
// has exactly one matching RECV; returns the first problem as a failed result.
std::optional<sim_result> check_pairing(const program& p) {
  const int32_t D = p.num_devices();
  std::map<std::tuple<char, int32_t, int32_t, int32_t, int32_t>, std::pair<int, int>> pairs;  // -> (sends, recvs)
  std::map<std::tuple<char, int32_t, int32_t, int32_t, int32_t>, std::pair<int32_t, int32_t>> where;
  for (int32_t d = 0; d < D; ++d)
    for (size_t i = 0; i < p.devices[d].size(); ++i) {
      const auto& in = p.devices[d][i];
      const auto idx = static_cast<int32_t>(i);
      if (in.stage < 0 || in.stage >= static_cast<int32_t>(p.stages.size()))
        return sim_failure(p, d, idx, fmt::format("d{} step {}: unknown stage {}", d, i, in.stage));
      const bool is_send = in.kind == op::send_act || in.kind == op::send_grad;
      const bool is_recv = in.kind == op::recv_act || in.kind == op::recv_grad;
      if (!is_send && !is_recv) continue;
      if (in.peer < 0 || in.peer >= D || in.peer == d)
        return sim_failure(p, d, idx, fmt::format("d{} step {}: {} has no valid peer device", d, i, instr_to_text(in)));
      const auto msg = message_of(p, in);
      auto k = is_send ? std::make_tuple(msg.kind, msg.boundary, in.micro, d, in.peer)
                       : std::make_tuple(msg.kind, msg.boundary, in.micro, in.peer, d);
      (is_send ? pairs[k].first : pairs[k].second)++;
      where[k] = {d, idx};
    }
  for (const auto& [k, n] : pairs)
    if (n.first != 1 || n.second != 1) {
      auto [d, i] = where[k];
      return sim_failure(p, d, i,
                         fmt::format("d{} step {}: {} is not paired ({} sends, {} receives for {} {} of micro-batch {} from d{} to d{})", d,
                                     i, instr_to_text(p.devices[d][i]), n.first, n.second,
                                     std::get<0>(k) == 'A' ? "activation" : "gradient", std::get<1>(k), std::get<2>(k),
                                     std::get<3>(k), std::get<4>(k)));
    }
  return std::nullopt;
}

// The discrete-event replay: devices advance in turn as far as their inputs allow; each instruction
// kind has one method that books compute, copies and memory and returns false when it must wait.
class sim_run {
 public:
  sim_run(const program& p, const sim_costs& c)
      : p_(p), c_(c), D_(p.num_devices()), dev_(D_), carried_(D_), act_(c.act_bytes) {
    for (const auto& list : p.devices)
      for (const auto& in : list) {
        if (in.kind == op::recompute) has_recompute_.insert(in.stage);
        if (in.kind == op::backward) ++total_backward_;
      }
    if (c.steady_state)
      for (int32_t d = 0; d < D_; ++d) {  // stages prefetched after a device's last compute are resident from the previous iteration
        const auto& list = p.devices[d];
        size_t last_compute = 0;
        for (size_t i = 0; i < list.size(); ++i)
          if (list[i].kind == op::forward || list[i].kind == op::recompute || list[i].kind == op::backward) last_compute = i;
        for (size_t i = last_compute; i < list.size(); ++i)
          if (list[i].kind == op::prefetch_weights) carried_[d].insert(list[i].stage);
      }
  }

  sim_result run() {
    size_t remaining = 0;
    for (const auto& d : p_.devices) remaining += d.size();
    while (remaining > 0) {
      bool progress = false;
      for (int32_t d = 0; d < D_; ++d)
        while (dev_[d].pc < p_.devices[d].size() && execute(d, p_.devices[d][dev_[d].pc])) {
          ++dev_[d].pc;
          --remaining;
          progress = true;
        }
      if (!progress && resolve_nccl()) continue;
      if (!progress)
        for (int32_t d = 0; d < D_; ++d)
          if (dev_[d].pc < p_.devices[d].size())
            return sim_failure(p_, d, static_cast<int32_t>(dev_[d].pc),
                               fmt::format("deadlock: d{} step {} ({}) waits for data no device will produce", d, dev_[d].pc,
                                           instr_to_text(p_.devices[d][dev_[d].pc])));
    }
    for (const auto& [end, queue] : posted_)  // every NCCL operation moved (the pairing check says it must)
      if (!queue.empty())
        return sim_failure(p_, end.second, -1, fmt::format("d{}: {} NCCL operation(s) never matched on link {}->{}", end.second, queue.size(),
                                                           end.first.first, end.first.second));
    return finish();
  }

 private:
  bool execute(int32_t d, const instr& in) {
    switch (in.kind) {
      case op::load_micro_batch:
        ready_[{'L', 0, in.micro, d}] = dev_[d].clock;
        return true;
      case op::forward: return forward(d, in);
      case op::recompute: return recompute(d, in);
      case op::backward: return backward(d, in);
      case op::send_act:
      case op::send_grad: return send(d, in);
      case op::recv_act:
      case op::recv_grad: return recv(d, in);
      case op::prefetch_weights: return prefetch(d, in);
      case op::release_weights: return release(d, in);
      case op::offload_act: return offload(d, in);
      case op::reload_act: return reload(d, in);
      case op::optimizer_step:
        if (backward_done_ != total_backward_) return false;
        dev_[d].clock = std::max(dev_[d].clock, last_backward_end_);
        return true;
    }
    return false;
  }

  bool has(const key& k) const { return ready_.count(k) > 0; }
  int32_t layers(int32_t s) const { return p_.stages[s].last_layer - p_.stages[s].first_layer; }
  key weights(int32_t d, int32_t s) const { return key{'w', s, -1, d}; }

  // Compute after every input is there; records the interval in the timeline.
  bool compute(int32_t d, const instr& in, double cost, const std::vector<key>& needs) {
    auto& ds = dev_[d];
    double start = ds.clock;
    for (const auto& k : needs) {
      if (!has(k)) return false;
      start = std::max(start, ready_[k]);
    }
    ds.clock = start + cost;
    ds.busy += cost;
    timeline_.push_back({d, static_cast<int32_t>(ds.pc), in, start, ds.clock});
    return true;
  }

  bool forward(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const int32_t m = in.micro, s = in.stage;
    std::vector<key> needs{weights(d, s), st.has_embed ? key{'L', 0, m, d} : key{'a', st.first_layer, m, d}};
    if (st.has_head) needs.push_back({'L', 0, m, d});
    const double t0 = ds.clock;
    if (!compute(d, in, c_.forward_s[s], needs)) return false;
    for (int32_t b = st.first_layer; b < st.last_layer; ++b) ready_[{'c', b, m, d}] = ds.clock;
    if (st.first_layer == st.last_layer) ready_[{'c', st.first_layer, m, d}] = ds.clock;
    if (!st.has_head) {
      ready_[{'a', st.last_layer, m, d}] = ds.clock;
      ds.mem.push_back({ds.clock, act_});
    } else {  // the chunked head loss while the head runs
      ds.mem.push_back({ds.clock - c_.forward_s[s], c_.head_bytes});
      ds.mem.push_back({ds.clock, -c_.head_bytes});
    }
    if (!has_recompute_.count(s)) {
      ready_[{'s', s, m, d}] = ds.clock;
      ds.mem.push_back({t0, layers(s) * c_.stash_bytes_per_layer});
    }
    ds.mem.push_back({ds.clock, -act_});  // the input is consumed (checkpoints are counted on OFF/R)
    ds.mem.push_back({t0, act_});
    return true;
  }

  bool recompute(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const int32_t m = in.micro, s = in.stage;
    const double t0 = ds.clock;
    std::vector<key> needs{weights(d, s), {'c', st.first_layer, m, d}};
    if (st.has_head) needs.push_back({'L', 0, m, d});
    if (!compute(d, in, c_.recompute_s[s] > 0 ? c_.recompute_s[s] : c_.forward_s[s], needs)) return false;
    ready_[{'s', s, m, d}] = ds.clock;
    ds.mem.push_back({t0, layers(s) * c_.stash_bytes_per_layer});
    return true;
  }

  bool backward(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const int32_t m = in.micro, s = in.stage;
    std::vector<key> needs{weights(d, s), {'s', s, m, d}};
    if (!st.has_head) needs.push_back({'g', st.last_layer, m, d});
    if (!compute(d, in, c_.backward_s[s], needs)) return false;
    if (st.has_head) {  // the head's chunks recomputed for the gradient
      ds.mem.push_back({ds.clock - c_.backward_s[s], c_.head_bytes});
      ds.mem.push_back({ds.clock, -c_.head_bytes});
    }
    ds.mem.push_back({ds.clock, -layers(s) * c_.stash_bytes_per_layer});
    if (!st.has_head) ds.mem.push_back({ds.clock, -act_});
    if (!st.has_embed) {
      ready_[{'g', st.first_layer, m, d}] = ds.clock;
      ds.mem.push_back({ds.clock, act_});
    }
    ++backward_done_;
    last_backward_end_ = std::max(last_backward_end_, ds.clock);
    return true;
  }

  bool rendezvous(int32_t from, int32_t to) const {
    return std::find(c_.rendezvous.begin(), c_.rendezvous.end(), std::make_pair(from, to)) != c_.rendezvous.end();
  }
  static bool is_send(const instr& in) { return in.kind == op::send_act || in.kind == op::send_grad; }
  static bool is_recv(const instr& in) { return in.kind == op::recv_act || in.kind == op::recv_grad; }
  bool over_rendezvous(int32_t d, const instr& in) const {
    return (is_send(in) && rendezvous(d, in.peer)) || (is_recv(in) && rendezvous(in.peer, d));
  }
  using message_id = std::tuple<char, int32_t, int32_t, int32_t, int32_t>;  // kind, boundary, micro, from, to
  message_id id_of(int32_t d, const instr& in) const {
    const auto msg = message_of(p_, in);
    return is_send(in) ? message_id{msg.kind, msg.boundary, in.micro, d, in.peer} : message_id{msg.kind, msg.boundary, in.micro, in.peer, d};
  }

  // NCCL as the simulator sees it: each communicator is a FIFO of the operations both ends posted;
  // posting never blocks the device (sends and receives are stream-ordered). An operation moves when
  // it and its counterpart are the oldest unmoved operations of their ends on that communicator; a
  // receive's data is ready then. Compute waiting for data that never moves is the deadlock.
  struct nccl_op {
    message_id id;
    bool send = false;
    double posted = 0;
  };
  using comm_key = std::pair<int32_t, int32_t>;  // (from, to), or (low, high) with a shared communicator
  comm_key comm_of(int32_t from, int32_t to) const {
    return c_.shared_pair_communicator ? comm_key{std::min(from, to), std::max(from, to)} : comm_key{from, to};
  }
  bool exchange(int32_t d, const instr& in) {
    double at = dev_[d].clock;
    const bool send = is_send(in);
    if (send) {  // stream-ordered after the compute that produced the data
      const auto msg = message_of(p_, in);
      const key local{msg.kind == 'A' ? 'a' : 'g', msg.boundary, in.micro, d};
      if (!has(local)) return false;
      at = std::max(at, ready_[local]);
    }
    const comm_key comm = send ? comm_of(d, in.peer) : comm_of(in.peer, d);
    posted_[{comm, d}].push_back({id_of(d, in), send, at});
    return true;
  }

  // Moves every operation that can move; true when something moved.
  bool resolve_nccl() {
    bool any = false;
    for (bool again = true; again;) {
      again = false;
      for (auto& [end, queue] : posted_) {
        const auto [comm, d] = end;
        if (queue.empty() || !queue.front().send) continue;
        const auto [kind, boundary, micro, from, to] = queue.front().id;
        auto& peer_queue = posted_[{comm, to}];
        if (peer_queue.empty() || peer_queue.front().send || peer_queue.front().id != queue.front().id) continue;
        const double start = std::max({queue.front().posted, peer_queue.front().posted, free_at_[{comm, d}], free_at_[{comm, to}]});
        const double t = start + transfer(act_, c_.d2h_bytes_per_s, c_.copy_latency_s);
        free_at_[{comm, d}] = free_at_[{comm, to}] = t;
        dev_[from].mem.push_back({t, -act_});
        dev_[to].mem.push_back({start, act_});
        ready_[{kind == 'A' ? 'a' : 'g', boundary, micro, to}] = t;
        queue.pop_front();
        peer_queue.pop_front();
        any = again = true;
      }
    }
    return any;
  }

  // Host-staged: download on this device's engine, upload on the peer's.
  bool send(int32_t d, const instr& in) {
    if (over_rendezvous(d, in)) return exchange(d, in);
    auto& ds = dev_[d];
    const auto msg = message_of(p_, in);
    const key local{msg.kind == 'A' ? 'a' : 'g', msg.boundary, in.micro, d};
    if (!has(local)) return false;
    const double down = transfer(act_, c_.d2h_bytes_per_s, c_.copy_latency_s);
    const double t1 = ds.d2h.reserve(std::max(ds.clock, ready_[local]), down) + down;
    ds.mem.push_back({t1, -act_});
    auto& peer = dev_[in.peer];
    const double up = transfer(act_, c_.h2d_bytes_per_s, c_.copy_latency_s);
    const double t2 = peer.h2d.reserve(t1, up);
    peer.mem.push_back({t2, act_});
    ready_[{msg.kind, msg.boundary, in.micro, in.peer}] = t2 + up;
    return true;
  }

  bool recv(int32_t d, const instr& in) {
    if (over_rendezvous(d, in)) return exchange(d, in);
    const auto msg = message_of(p_, in);
    const key mail{msg.kind, msg.boundary, in.micro, d};
    if (!has(mail)) return false;
    dev_[d].clock = std::max(dev_[d].clock, ready_[mail]);  // the device thread blocks until it arrives
    ready_[{msg.kind == 'A' ? 'a' : 'g', msg.boundary, in.micro, d}] = dev_[d].clock;
    return true;
  }

  bool prefetch(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const int32_t s = in.stage;
    if (carried_[d].count(s)) {  // resident from the previous iteration (first PW) ...
      carried_[d].erase(s);
      ready_[weights(d, s)] = ds.clock;
      ds.mem.push_back({ds.clock, c_.weight_bytes[s]});
      return true;
    }
    const double up = transfer(c_.weight_bytes[s], c_.h2d_bytes_per_s, c_.weight_bytes[s] > 0 ? c_.copy_latency_s : 0);
    const double t = ds.wh2d.reserve(ds.clock, up);
    ready_[weights(d, s)] = t + up;
    ds.mem.push_back({t, c_.weight_bytes[s]});
    return true;
  }

  bool release(int32_t d, const instr& in) {
    if (!has(weights(d, in.stage))) return false;
    dev_[d].mem.push_back({dev_[d].clock, -c_.weight_bytes[in.stage]});
    ready_.erase(weights(d, in.stage));
    return true;
  }

  bool offload(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const key ck{'c', st.first_layer, in.micro, d};
    if (!has(ck)) return false;
    const double down = transfer(act_, c_.d2h_bytes_per_s, c_.copy_latency_s);
    const double t1 = ds.d2h.reserve(std::max(ds.clock, ready_[ck]), down) + down;
    ds.mem.push_back({ready_[ck], act_});
    ds.mem.push_back({t1, -act_});
    ready_[{'H', st.first_layer, in.micro, -1}] = t1;
    return true;
  }

  bool reload(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const key hk{'H', st.first_layer, in.micro, -1};
    if (!has(hk)) return false;
    const double up = transfer(act_, c_.h2d_bytes_per_s, c_.copy_latency_s);
    const double t = ds.h2d.reserve(std::max(ds.clock, ready_[hk]), up);
    ds.mem.push_back({t, act_});
    ready_[{'c', st.first_layer, in.micro, d}] = t + up;
    return true;
  }

  sim_result finish() {
    sim_result r;
    r.ok = true;
    for (const auto& ds : dev_)
      r.makespan_s = std::max({r.makespan_s, ds.clock, ds.h2d.last(), ds.d2h.last(), c_.steady_state ? 0.0 : ds.wh2d.last()});
    double busy = 0;
    for (auto& ds : dev_) {
      r.busy_s.push_back(ds.busy);
      busy += ds.busy;
      std::stable_sort(ds.mem.begin(), ds.mem.end(),
                       [](auto& a, auto& b) { return a.first < b.first || (a.first == b.first && a.second < b.second); });
      double cur = 0, peak = 0;
      for (const auto& [t, b] : ds.mem) {
        cur += b;
        peak = std::max(peak, cur);
      }
      r.peak_bytes.push_back(peak);
    }
    r.bubble_ratio = r.makespan_s > 0 ? 1.0 - busy / (D_ * r.makespan_s) : 0.0;
    r.grid = program_grid(p_);
    r.timeline = std::move(timeline_);
    return r;
  }

  const program& p_;
  const sim_costs& c_;
  const int32_t D_;
  std::vector<device_state> dev_;
  std::vector<std::set<int32_t>> carried_;  // stages resident from the previous iteration
  const double act_;
  std::map<key, double> ready_;  // when an item becomes available
  // Per (communicator, device): the NCCL operations it posted there and not yet moved, oldest first,
  // and when its last one moved.
  std::map<std::pair<comm_key, int32_t>, std::deque<nccl_op>> posted_;
  std::map<std::pair<comm_key, int32_t>, double> free_at_;
  std::set<int32_t> has_recompute_;
  int total_backward_ = 0, backward_done_ = 0;
  double last_backward_end_ = 0;
  std::vector<sim_interval> timeline_;
};

}  // namespace

sim_result simulate(const program& p, const sim_costs& c) {
  if (auto bad = check_pairing(p)) return *bad;
  return sim_run(p, c).run();
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
