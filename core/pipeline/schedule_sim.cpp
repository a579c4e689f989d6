// Discrete-event simulation of schedule programs: see schedule_sim.h.
#include "core/pipeline/schedule_sim.h"

#include <algorithm>
#include <deque>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "core/pipeline/sim_sharing.h"
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

const char* mem_kind_name(mem_kind k) {
  switch (k) {
    case mem_kind::weights: return "weights";
    case mem_kind::inputs: return "inputs";
    case mem_kind::activations: return "activations";
    case mem_kind::checkpoints: return "checkpoints";
    case mem_kind::graphs: return "graphs";
    case mem_kind::head: return "head";
  }
  return "?";
}

namespace {

// Data item identity: kind letter, boundary layer or stage, micro-batch, device (-1 = host).
using key = std::tuple<char, int32_t, int32_t, int32_t>;

// A copy engine's busy intervals. Devices are simulated one after another, so a request may come in
// "earlier" than intervals already booked: it takes the first gap that fits (a FIFO engine would
// have served it then).
struct engine {
  std::map<double, double> busy;  // start -> end
  double fit(double t, double dur) const {  // the first gap from t that fits dur
    auto it = busy.upper_bound(t);  // intervals do not overlap: those before the one holding t end by t
    if (it != busy.begin()) --it;
    for (; it != busy.end(); ++it) {
      if (it->second <= t) continue;
      if (it->first >= t + dur) break;
      t = std::max(t, it->second);
    }
    return t;
  }
  double reserve(double t, double dur) {
    t = fit(t, dur);
    if (dur > 0) busy[t] = t + dur;
    return t;
  }
  double last() const { return busy.empty() ? 0 : busy.rbegin()->second; }
};

struct device_state {
  size_t pc = 0;
  double clock = 0, busy = 0;
  engine wh2d, h2d, d2h;  // weight upload, activation upload, download (as on the devices)
  std::vector<mem_event> mem;
  std::set<int32_t> inputs;  // micro-batches whose tokens and labels are on the device
  // What outgoing copies (SEND, OFFLOAD) free when they finish: booked no earlier than the end of
  // the device's next compute, so the plan holds a copy's source until the compute it overlaps is
  // done (engines on a busy host, or a driver's queue, can finish later than the bandwidth says).
  std::vector<mem_event> pending_free;
  double last_start = 0;  // when its last compute began
  int64_t computes = 0;   // computes begun
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

// Device d's relative compute speed (1 when not given), and whether it computes on the host's cores.
double speed_of(const sim_costs& c, int32_t d) {
  return static_cast<size_t>(d) < c.device_speed.size() && c.device_speed[d] > 0 ? c.device_speed[d] : 1.0;
}
bool on_host_cores(const sim_costs& c, int32_t d) { return static_cast<size_t>(d) < c.on_host_cores.size() && c.on_host_cores[d]; }

// The discrete-event replay: devices advance in turn as far as their inputs allow; each instruction
// kind has one method that books compute, copies and memory and returns false when it must wait.
class sim_run {
 public:
  sim_run(const program& p, const sim_costs& c, sim_sharing::resources last_pass = {})
      : p_(p), c_(c), D_(p.num_devices()), dev_(D_), shared_(std::move(last_pass)), carried_(D_), act_(c.act_bytes),
        ckpt_(checkpoint_boundaries(p, c.per_layer_recompute)) {
    for (const auto& list : p.devices)
      for (const auto& in : list) {
        if (in.kind == op::recompute) has_recompute_.insert(in.stage);
        if (in.kind == op::backward) {
          ++total_backward_;
          has_backward_.insert(in.stage);
        }
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
      if (!progress && cores_.advance()) continue;  // a compute on the host's cores starts or ends
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

  // The copies on shared links with their intervals in this pass (the next pass starts from it).
  sim_sharing::resources take_shared() { return std::move(shared_); }

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
  // Memory accounting mirrors the executor's arena charges (pipeline_worker.cpp).
  void charge(int32_t d, double t, double bytes, mem_kind k, int32_t s, int32_t m) { dev_[d].mem.push_back({t, bytes, k, s, m}); }
  double recompute_cost(int32_t s) const { return c_.recompute_s[s] > 0 ? c_.recompute_s[s] : c_.forward_s[s]; }
  double graph_bytes(int32_t s) const { return std::max(1, layers(s)) * c_.stash_bytes_per_layer; }
  double checkpoint_bytes(int32_t boundary) const { return boundary == 0 ? c_.token_bytes : act_; }
  // The boundaries a recomputed stage checkpoints (OFFLOAD, RELOAD and its recompute use them).
  std::vector<int32_t> bounds(int32_t s) const {
    std::vector<int32_t> out{p_.stages[s].first_layer};
    if (c_.per_layer_recompute)
      for (int32_t l = p_.stages[s].first_layer + 1; l < p_.stages[s].last_layer; ++l) out.push_back(l);
    return out;
  }
  double bounds_bytes(int32_t s) const {
    double b = 0;
    for (int32_t x : bounds(s)) b += checkpoint_bytes(x);
    return b;
  }
  void use_inputs(int32_t d, int32_t m, double t) {
    if (dev_[d].inputs.insert(m).second) charge(d, t, c_.input_bytes, mem_kind::inputs, -1, m);
  }
  void head_during(int32_t d, int32_t s, double t0, double t1) {
    if (!p_.stages[s].has_head) return;
    charge(d, t0, c_.head_bytes, mem_kind::head, s, -1);
    charge(d, t1, -c_.head_bytes, mem_kind::head, s, -1);
  }
  key weights(int32_t d, int32_t s) const { return key{'w', s, -1, d}; }

  // Compute after every input is there; records the interval in the timeline.
  bool compute(int32_t d, const instr& in, double cost, const std::vector<key>& needs) {
    auto& ds = dev_[d];
    double start = ds.clock;
    for (const auto& k : needs) {
      if (!has(k)) return false;
      start = std::max(start, ready_[k]);
    }
    const auto end = compute_end(d, start, cost);
    if (!end) return false;  // on the host's cores, until the pool gets to its end
    started_ = ds.last_start = start;
    ++ds.computes;
    ds.clock = ended_ = *end;
    ds.busy += ended_ - start;
    // The executor waits, when a compute ends (after its results are kept), for the outgoing
    // copies issued before it began: their sources are freed just after the compute's allocations.
    if (!ds.pending_free.empty()) {
      double t = std::nextafter(ended_, std::numeric_limits<double>::infinity());
      for (const auto& e : ds.pending_free) t = std::max(t, e.t);
      for (auto e : ds.pending_free) {
        e.t = t;
        ds.mem.push_back(e);
      }
      ds.pending_free.clear();
      ds.clock = t;
    }
    timeline_.push_back({d, static_cast<int32_t>(ds.pc), in, start, ds.clock});
    return true;
  }

  // When a compute of `cost` seconds (at speed 1, alone) begun at `start` ends on device d: slower by
  // its speed; a CPU virtual device also shares the host's cores with the others computing at once
  // (sim_costs::host_compute_slots) and, slower than the fastest, idles in proportion after (as
  // cpu_device does), holding no core meanwhile. nullopt: it has joined the host's cores and its end
  // is known once the replay has advanced the pool that far (run()).
  std::optional<double> compute_end(int32_t d, double start, double cost) {
    const double speed = speed_of(c_, d);
    if (!(c_.host_compute_slots > 0 && on_host_cores(c_, d)) || !(cost > 0) || !std::isfinite(start + cost)) return start + cost / speed;
    const double fastest = std::max(speed, fastest_speed_);
    const sim_sharing::work_id id{d, static_cast<int32_t>(dev_[d].pc)};
    if (const auto busy_end = cores_.end_of(id)) return start + (*busy_end - start) * fastest / speed;
    cores_.join(id, start, cost / fastest);
    return std::nullopt;
  }

  bool forward(int32_t d, const instr& in) {
    const auto& st = p_.stages[in.stage];
    const int32_t m = in.micro, s = in.stage;
    std::vector<key> needs{weights(d, s), st.has_embed ? key{'L', 0, m, d} : key{'a', st.first_layer, m, d}};
    if (st.has_head) needs.push_back({'L', 0, m, d});
    if (!compute(d, in, c_.forward_s[s], needs)) return false;
    const double t0 = started_, t1 = ended_;
    for (int32_t b = st.first_layer; b < st.last_layer; ++b) ready_[{'c', b, m, d}] = t1;
    if (st.first_layer == st.last_layer) ready_[{'c', st.first_layer, m, d}] = t1;
    use_inputs(d, m, t0);
    if (!st.has_embed) charge(d, t0, -act_, mem_kind::activations, s, m);  // the input is taken
    head_during(d, s, t0, t1);
    if (auto it = ckpt_.find(s); it != ckpt_.end())
      for (int32_t b : it->second) charge(d, t1, checkpoint_bytes(b), mem_kind::checkpoints, s, m);
    if (!has_recompute_.count(s)) ready_[{'s', s, m, d}] = t1;
    if (has_backward_.count(s) && !has_recompute_.count(s)) charge(d, t1, graph_bytes(s), mem_kind::graphs, s, m);  // kept for B
    if (!st.has_head) {
      ready_[{'a', st.last_layer, m, d}] = t1;
      charge(d, t1, act_, mem_kind::activations, s, m);
    }
    return true;
  }

  bool recompute(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const int32_t m = in.micro, s = in.stage;
    std::vector<key> needs{weights(d, s), {'c', st.first_layer, m, d}};
    if (st.has_head) needs.push_back({'L', 0, m, d});
    if (c_.per_layer_recompute) {  // the executor's RECOMPUTE returns at once; BACKWARD recomputes layer by layer
      for (const auto& k : needs)
        if (!has(k)) return false;
      ready_[{'s', s, m, d}] = ds.clock;
      return true;
    }
    if (!compute(d, in, recompute_cost(s), needs)) return false;
    const double t0 = started_, t1 = ended_;
    ready_[{'s', s, m, d}] = t1;
    use_inputs(d, m, t0);
    charge(d, t0, -checkpoint_bytes(st.first_layer), mem_kind::checkpoints, s, m);
    head_during(d, s, t0, t1);
    charge(d, t1, graph_bytes(s), mem_kind::graphs, s, m);
    return true;
  }

  bool backward(int32_t d, const instr& in) {
    const auto& st = p_.stages[in.stage];
    const int32_t m = in.micro, s = in.stage;
    std::vector<key> needs{weights(d, s), {'s', s, m, d}};
    if (!st.has_head) needs.push_back({'g', st.last_layer, m, d});
    const bool adds_recompute = c_.per_layer_recompute && has_recompute_.count(s) && !c_.backward_includes_recompute;
    const double cost = c_.backward_s[s] + (adds_recompute ? recompute_cost(s) : 0.0);
    if (!compute(d, in, cost, needs)) return false;
    const double t0 = started_, t1 = ended_;
    if (!st.has_head) charge(d, t0, -act_, mem_kind::activations, s, m);  // the gradient is taken
    head_during(d, s, t0, t1);
    if (c_.per_layer_recompute && has_recompute_.count(s)) {
      // One layer's graph at a time; each checkpoint is taken as its layer starts, from the last one.
      const auto b = bounds(s);
      const double per = c_.stash_bytes_per_layer;
      charge(d, t0, per, mem_kind::graphs, s, m);
      charge(d, t1, -per, mem_kind::graphs, s, m);
      for (size_t k = 0; k < b.size(); ++k) {
        const double t = t0 + (t1 - t0) * static_cast<double>(b.size() - 1 - k) / static_cast<double>(b.size());
        charge(d, t, -checkpoint_bytes(b[k]), mem_kind::checkpoints, s, m);
      }
    } else {
      charge(d, t1, -graph_bytes(s), mem_kind::graphs, s, m);
    }
    if (!st.has_embed) {
      ready_[{'g', st.first_layer, m, d}] = t1;
      charge(d, t1, act_, mem_kind::activations, s, m);
    }
    ++backward_done_;
    last_backward_end_ = std::max(last_backward_end_, t1);
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
        charge(from, t, -act_, mem_kind::activations, -1, micro);
        charge(to, start, act_, mem_kind::activations, -1, micro);
        ready_[{kind == 'A' ? 'a' : 'g', boundary, micro, to}] = t;
        queue.pop_front();
        peer_queue.pop_front();
        any = again = true;
      }
    }
    return any;
  }

  bool direct(int32_t from, int32_t to) const {
    return std::find(c_.direct.begin(), c_.direct.end(), std::make_pair(from, to)) != c_.direct.end();
  }

  // Host-staged: download on this device's engine, upload on the peer's. Direct: the download
  // engine's one copy lands on the peer.
  bool send(int32_t d, const instr& in) {
    if (over_rendezvous(d, in)) return exchange(d, in);
    auto& ds = dev_[d];
    const auto msg = message_of(p_, in);
    const key local{msg.kind == 'A' ? 'a' : 'g', msg.boundary, in.micro, d};
    if (!has(local)) return false;
    const double down = transfer(act_, c_.d2h_bytes_per_s, c_.copy_latency_s);
    const auto [t0, t1] = copy(d, ds.d2h, false, std::max(ds.clock, ready_[local]), down);
    ds.pending_free.push_back({t1, -act_, mem_kind::activations, -1, in.micro, t1});
    ready_[{msg.kind, msg.boundary, in.micro, in.peer}] = t1;  // in host staging (the RECV uploads it), or on the peer
    if (direct(d, in.peer)) copy_start_[{msg.kind, msg.boundary, in.micro, in.peer}] = t0;
    return true;
  }

  bool recv(int32_t d, const instr& in) {
    if (over_rendezvous(d, in)) return exchange(d, in);
    const auto msg = message_of(p_, in);
    const key mail{msg.kind, msg.boundary, in.micro, d};
    if (!has(mail)) return false;
    if (direct(in.peer, d)) {  // already here: held from the copy's start
      auto& ds = dev_[d];
      ds.mem.push_back({copy_start_[mail], act_, mem_kind::activations, -1, in.micro, copy_start_[mail]});
      ds.clock = std::max(ds.clock, ready_[mail]);
      ready_[{msg.kind == 'A' ? 'a' : 'g', msg.boundary, in.micro, d}] = ds.clock;
      return true;
    }
    // The executor uploads a host-staged message once this device has begun the compute before
    // the RECV (from the start when there is none); the buffer is charged from that gate on.
    auto& ds = dev_[d];
    const double gate = ds.computes > 0 ? ds.last_start : 0.0;
    const double up = transfer(act_, c_.h2d_bytes_per_s, c_.copy_latency_s);
    const auto [t2, arrived] = copy(d, ds.h2d, true, std::max(ready_[mail], gate), up);
    ds.mem.push_back({gate, act_, mem_kind::activations, -1, in.micro, t2});
    ds.clock = std::max(ds.clock, arrived);  // the device thread blocks until it arrives
    ready_[{msg.kind == 'A' ? 'a' : 'g', msg.boundary, in.micro, d}] = dev_[d].clock;
    return true;
  }

  // A copy on one of device d's engines: [start, end). With a shared link it also shares the link's
  // bandwidth with the copies in flight there (uploads or downloads of every device on it): it ends
  // when its bytes are through at its share, or after its own time alone (latency), whichever is later.
  std::pair<double, double> copy(int32_t d, engine& own, bool up, double t, double dur) {
    const auto l = static_cast<size_t>(d) < c_.copy_link.size() ? c_.copy_link[static_cast<size_t>(d)] : -1;
    if (l < 0 || !(dur > 0) || !std::isfinite(t + dur)) {
      const double s = own.reserve(t, dur);
      return {s, s + dur};
    }
    auto& on_link = shared_.try_emplace({l, up}, 1.0).first->second;
    const sim_sharing::work_id id{d, static_cast<int32_t>(dev_[d].pc)};
    const double lat = std::min(dur, c_.copy_latency_s), work = dur - lat;  // the bytes move after the latency
    double s = own.fit(t, dur), through = s + dur;
    for (;;) {  // its engine must be free for as long as it takes; s only moves on to the end of a busy interval
      through = on_link.end_of(id, s + lat, work);
      const double again = own.fit(s, through - s);
      if (again == s) break;
      s = again;
    }
    own.reserve(s, through - s);
    on_link.set(id, s + lat, through);
    return {s, through};
  }

  bool prefetch(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const int32_t s = in.stage;
    if (carried_[d].count(s)) {  // resident from the previous iteration (first PW) ...
      carried_[d].erase(s);
      ready_[weights(d, s)] = ds.clock;
      charge(d, ds.clock, c_.weight_bytes[s], mem_kind::weights, s, -1);
      return true;
    }
    const double up = transfer(c_.weight_bytes[s], c_.h2d_bytes_per_s, c_.weight_bytes[s] > 0 ? c_.copy_latency_s : 0);
    const auto [t, through] = copy(d, ds.wh2d, true, ds.clock, up);
    ready_[weights(d, s)] = through;
    charge(d, t, c_.weight_bytes[s], mem_kind::weights, s, -1);
    return true;
  }

  bool release(int32_t d, const instr& in) {
    if (!has(weights(d, in.stage))) return false;
    charge(d, dev_[d].clock, -c_.weight_bytes[in.stage], mem_kind::weights, in.stage, -1);
    ready_.erase(weights(d, in.stage));
    return true;
  }

  bool offload(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const key ck{'c', st.first_layer, in.micro, d};
    if (!has(ck)) return false;
    const double down = transfer(bounds_bytes(in.stage), c_.d2h_bytes_per_s, c_.copy_latency_s);
    const double t1 = copy(d, ds.d2h, false, std::max(ds.clock, ready_[ck]), down).second;
    for (int32_t b : bounds(in.stage)) ds.pending_free.push_back({t1, -checkpoint_bytes(b), mem_kind::checkpoints, in.stage, in.micro, t1});
    ready_[{'H', st.first_layer, in.micro, -1}] = t1;
    return true;
  }

  bool reload(int32_t d, const instr& in) {
    auto& ds = dev_[d];
    const auto& st = p_.stages[in.stage];
    const key hk{'H', st.first_layer, in.micro, -1};
    if (!has(hk)) return false;
    const double up = transfer(bounds_bytes(in.stage), c_.h2d_bytes_per_s, c_.copy_latency_s);
    const double through = copy(d, ds.h2d, true, std::max(ds.clock, ready_[hk]), up).second;
    for (int32_t b : bounds(in.stage))  // charged when the upload is queued
      charge(d, std::max(ds.clock, ready_[hk]), checkpoint_bytes(b), mem_kind::checkpoints, in.stage, in.micro);
    ready_[{'c', st.first_layer, in.micro, d}] = through;
    return true;
  }

  sim_result finish() {
    sim_result r;
    r.ok = true;
    for (const auto& ds : dev_)
      r.makespan_s = std::max({r.makespan_s, ds.clock, ds.h2d.last(), ds.d2h.last(), c_.steady_state ? 0.0 : ds.wh2d.last()});
    double busy = 0;
    for (auto& ds : dev_) {
      ds.mem.insert(ds.mem.end(), ds.pending_free.begin(), ds.pending_free.end());
      r.busy_s.push_back(ds.busy);
      busy += ds.busy;
      std::stable_sort(ds.mem.begin(), ds.mem.end(),
                       [](auto& a, auto& b) { return a.t < b.t || (a.t == b.t && a.bytes < b.bytes); });
      double cur = 0, peak = 0;
      for (const auto& e : ds.mem) {
        cur += e.bytes;
        peak = std::max(peak, cur);
      }
      r.peak_bytes.push_back(peak);
      r.memory.push_back(ds.mem);
    }
    r.bubble_ratio = r.makespan_s > 0 ? 1.0 - busy / (D_ * r.makespan_s) : 0.0;
    r.timeline = std::move(timeline_);
    return r;
  }

  const program& p_;
  const sim_costs& c_;
  const int32_t D_;
  std::vector<device_state> dev_;
  // Copies on shared host links: this pass's once booked, else the last pass's.
  sim_sharing::resources shared_;
  sim_sharing::core_pool cores_{c_.host_compute_slots};  // computes of CPU virtual devices, in time order
  std::vector<std::set<int32_t>> carried_;  // stages resident from the previous iteration
  const double act_;
  std::map<int32_t, std::set<int32_t>> ckpt_;  // forward stage -> boundaries it checkpoints
  std::map<key, double> ready_;       // when an item becomes available
  std::map<key, double> copy_start_;  // direct links: when the copy into the receiver began
  // Per (communicator, device): the NCCL operations it posted there and not yet moved, oldest first,
  // and when its last one moved.
  std::map<std::pair<comm_key, int32_t>, std::deque<nccl_op>> posted_;
  std::map<std::pair<comm_key, int32_t>, double> free_at_;
  std::set<int32_t> has_recompute_, has_backward_;
  int total_backward_ = 0, backward_done_ = 0;
  double last_backward_end_ = 0;
  std::vector<sim_interval> timeline_;
  // The fastest CPU virtual device computes at the host's speed (a faster GPU in the list does not count).
  const double fastest_speed_ = [this] {
    double f = 0;
    for (int32_t d = 0; d < D_; ++d)
      if (on_host_cores(c_, d)) f = std::max(f, speed_of(c_, d));
    return f > 0 ? f : 1.0;
  }();
  double started_ = 0;  // when the last compute() began (exactly: end - cost need not round back to it)
  double ended_ = 0;    // when it ended (before waiting for outgoing copies)
};

}  // namespace

sim_result simulate(const program& p, const sim_costs& c) {
  if (auto bad = check_pairing(p)) return *bad;
  sim_run first(p, c);
  sim_result r = first.run();
  sim_sharing::resources shared = first.take_shared();
  if (!r.ok || !sim_sharing::any_oversubscribed(shared)) return r;  // nothing was slowed by sharing: settled
  // Mostly the same order of events each pass, with times moving (the host's cores let devices on
  // in the order their computes end, which the links' times can move). Settled: nothing ends more than
  // 0.1% of the step later or earlier than in the pass before. Work that slips in and out of a gap
  // on its engine can make passes alternate instead: then the slower of the last two stands.
  for (int pass = 1; pass < sim_sharing::max_passes; ++pass) {
    sim_run next(p, c, shared);
    sim_result again = next.run();
    sim_sharing::resources now = next.take_shared();
    if (!again.ok) return again;
    const bool settled = sim_sharing::largest_shift(shared, now) <= 1e-3 * std::max(r.makespan_s, again.makespan_s);
    const bool last = pass + 1 == sim_sharing::max_passes;
    if (settled || !last || again.makespan_s >= r.makespan_s) r = std::move(again);
    if (settled) break;
    shared = std::move(now);
  }
  return r;
}

sim_costs with_measured_compute(const program& p, sim_costs c, const std::vector<sim_interval>& measured) {
  c.host_compute_slots = 0;  // the measured times already hold the sharing of the host's cores
  std::map<std::pair<op, int32_t>, std::vector<double>> times;  // (kind, stage) -> seconds
  // Normalised to a speed-1 device: simulate divides by the speed of the device that runs it.
  for (const auto& m : measured) times[{m.in.kind, m.in.stage}].push_back((m.end_s - m.start_s) * speed_of(c, m.device));
  const auto median = [&](op k, int32_t s, double& out) {
    auto it = times.find({k, s});
    if (it == times.end() || it->second.empty()) return;
    auto v = it->second;  // the median; of an even count, the mean of the middle two
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    out = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  c.forward_s.resize(p.stages.size());
  c.backward_s.resize(p.stages.size());
  c.recompute_s.resize(p.stages.size());
  for (int32_t s = 0; s < static_cast<int32_t>(p.stages.size()); ++s) {
    median(op::forward, s, c.forward_s[s]);
    median(op::backward, s, c.backward_s[s]);
    median(op::recompute, s, c.recompute_s[s]);
  }
  c.backward_includes_recompute = c.per_layer_recompute;
  return c;
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
