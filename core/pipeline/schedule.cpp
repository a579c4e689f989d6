// Schedule generators, text form and grid printer: see schedule.h.
#include "core/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <sstream>

namespace lorapipe {

namespace {
constexpr const char* mnemonics[num_ops] = {"LOAD", "F",  "B",  "R",  "SEND_F", "RECV_F", "SEND_B",
                                            "RECV_B", "PW", "RW", "OFF", "ON",   "STEP"};

// Appends instructions to per-device lists; knows where each stage runs.
struct builder {
  program p;
  std::vector<int32_t> device_of;  // stage -> device
  const schedule_options& o;
  builder(std::string name, std::vector<stage_def> stages, const schedule_options& opt) : o(opt) {
    p.schedule = std::move(name);
    p.micro_batches = opt.micro_batches;
    p.stages = std::move(stages);
    p.devices.resize(opt.devices);
    device_of.assign(p.stages.size(), 0);
  }
  void emit(int32_t d, op k, int32_t s, int32_t m = -1, int32_t peer = -1) { p.devices[d].push_back({k, s, m, peer}); }
  // The stage whose input boundary is `layer` (forward successor) / whose output boundary is `layer`.
  int32_t stage_starting_at(int32_t layer) const {
    for (size_t i = 0; i < p.stages.size(); ++i)
      if (p.stages[i].first_layer == layer) return static_cast<int32_t>(i);
    return -1;
  }
  int32_t stage_ending_at(int32_t layer) const {
    for (size_t i = 0; i < p.stages.size(); ++i)
      if (p.stages[i].last_layer == layer && !p.stages[i].has_head) return static_cast<int32_t>(i);
    return -1;
  }
  void forward_unit(int32_t s, int32_t m) {
    const int32_t d = device_of[s];
    const auto& st = p.stages[s];
    if (st.has_embed || st.has_head) emit(d, op::load_micro_batch, s, m);
    if (!st.has_embed) {
      int32_t prev = stage_ending_at(st.first_layer);
      if (prev >= 0 && device_of[prev] != d) emit(d, op::recv_act, s, m, device_of[prev]);
    }
    emit(d, op::forward, s, m);
    if (o.recompute && o.offload_activations) emit(d, op::offload_act, s, m);
    if (!st.has_head) {
      int32_t next = stage_starting_at(st.last_layer);
      if (next >= 0 && device_of[next] != d) emit(d, op::send_act, s, m, device_of[next]);
    }
  }
  void backward_unit(int32_t s, int32_t m) {
    const int32_t d = device_of[s];
    const auto& st = p.stages[s];
    if (!st.has_head) {
      int32_t next = stage_starting_at(st.last_layer);
      if (next >= 0 && device_of[next] != d) emit(d, op::recv_grad, s, m, device_of[next]);
    }
    if (o.recompute) {
      if (o.offload_activations) emit(d, op::reload_act, s, m);
      emit(d, op::recompute, s, m);
    }
    emit(d, op::backward, s, m);
    if (!st.has_embed) {
      int32_t prev = stage_ending_at(st.first_layer);
      if (prev >= 0 && device_of[prev] != d) emit(d, op::send_grad, s, m, device_of[prev]);
    }
  }
  // Bound schedules: weights of every stage of a device are prefetched before its first instruction
  // that computes with them and released after its last; the optimizer steps at the end.
  void add_weights_and_steps() {
    for (int32_t d = 0; d < p.num_devices(); ++d) {
      auto& list = p.devices[d];
      std::vector<instr> out;
      std::map<int32_t, size_t> last_use;
      for (size_t i = 0; i < list.size(); ++i)
        if (list[i].kind == op::forward || list[i].kind == op::recompute || list[i].kind == op::backward)
          last_use[list[i].stage] = i;
      std::set<int32_t> fetched;
      for (size_t i = 0; i < list.size(); ++i) {
        const auto& in = list[i];
        bool computes = in.kind == op::forward || in.kind == op::recompute || in.kind == op::backward;
        if (computes && !fetched.count(in.stage)) {
          out.push_back({op::prefetch_weights, in.stage, -1, -1});
          fetched.insert(in.stage);
        }
        out.push_back(in);
        if (o.stream_weights && computes && last_use[in.stage] == i) out.push_back({op::release_weights, in.stage, -1, -1});
      }
      // Prefetch hoisting for bound schedules: all PWs up front (stages stay bound to the device).
      std::stable_partition(out.begin(), out.end(), [](const instr& x) { return x.kind == op::prefetch_weights; });
      for (const auto& [s, _] : last_use) out.push_back({op::optimizer_step, s, -1, -1});
      list = std::move(out);
    }
  }
};

status check_common(const std::vector<stage_def>& stages, const schedule_options& o) {
  if (o.devices < 1) return make_error("parallel.devices: need at least one device");
  if (o.micro_batches < 1) return make_error("parallel.micro_batches: need at least one micro-batch");
  if (stages.empty()) return make_error("schedule: no stages");
  if (!stages.front().has_embed || !stages.back().has_head) return make_error("schedule: first stage must embed, last must have the head");
  for (size_t i = 1; i < stages.size(); ++i)
    if (stages[i].first_layer != stages[i - 1].last_layer) return make_error("schedule: stages must be contiguous");
  return ok_status();
}
}  // namespace

const char* op_mnemonic(op k) { return mnemonics[static_cast<int>(k)]; }

std::vector<stage_def> even_partition(int32_t n_layers, int32_t n_stages) {
  std::vector<stage_def> out;
  int32_t first = 0;
  for (int32_t s = 0; s < n_stages; ++s) {
    int32_t size = n_layers / n_stages + (s < n_layers % n_stages ? 1 : 0);
    out.push_back({first, first + size, s == 0, s == n_stages - 1});
    first += size;
  }
  return out;
}

result<std::vector<stage_def>> partition_from_sizes(int32_t n_layers, const std::vector<int32_t>& sizes) {
  std::vector<stage_def> out;
  int32_t first = 0;
  for (size_t s = 0; s < sizes.size(); ++s) {
    if (sizes[s] < 0) return make_error("partition: stage {} has a negative size", s);
    out.push_back({first, first + sizes[s], s == 0, s + 1 == sizes.size()});
    first += sizes[s];
  }
  if (first != n_layers) return make_error("partition: sizes add up to {} layers, the model has {}", first, n_layers);
  if (out.empty()) return make_error("partition: no stages");
  return out;
}

result<program> make_gpipe(const std::vector<stage_def>& stages, const schedule_options& o) {
  LP_TRY(check_common(stages, o));
  builder b("gpipe", stages, o);
  for (size_t s = 0; s < stages.size(); ++s) b.device_of[s] = static_cast<int32_t>(s) % o.devices;
  for (int32_t s = 0; s < static_cast<int32_t>(stages.size()); ++s)
    for (int32_t m = 0; m < o.micro_batches; ++m) b.forward_unit(s, m);
  for (int32_t s = static_cast<int32_t>(stages.size()) - 1; s >= 0; --s)
    for (int32_t m = 0; m < o.micro_batches; ++m) b.backward_unit(s, m);
  b.add_weights_and_steps();
  return b.p;
}

result<program> make_1f1b(const std::vector<stage_def>& stages, const schedule_options& o) {
  LP_TRY(check_common(stages, o));
  if (static_cast<int32_t>(stages.size()) != o.devices)
    return make_error("1f1b: needs one stage per device ({} stages, {} devices)", stages.size(), o.devices);
  builder b("1f1b", stages, o);
  const int32_t p = o.devices, M = o.micro_batches;
  for (int32_t s = 0; s < p; ++s) b.device_of[s] = s;
  for (int32_t d = 0; d < p; ++d) {
    const int32_t warm = std::min(p - d - 1, M);
    for (int32_t m = 0; m < warm; ++m) b.forward_unit(d, m);
    for (int32_t i = 0; i < M - warm; ++i) {
      b.forward_unit(d, warm + i);
      b.backward_unit(d, i);
    }
    for (int32_t m = M - warm; m < M; ++m) b.backward_unit(d, m);
  }
  b.add_weights_and_steps();
  return b.p;
}

result<program> make_interleaved(const std::vector<stage_def>& stages, const schedule_options& o) {
  LP_TRY(check_common(stages, o));
  const int32_t p = o.devices, v = o.virtual_stages, M = o.micro_batches;
  if (v < 1 || static_cast<int32_t>(stages.size()) != p * v)
    return make_error("interleaved: needs devices x virtual_stages = {} stages, got {}", p * v, stages.size());
  if (M % p != 0) return make_error("interleaved: micro_batches ({}) must be a multiple of devices ({})", M, p);
  builder b("interleaved", stages, o);
  for (int32_t s = 0; s < p * v; ++s) b.device_of[s] = s % p;
  const int32_t total = M * v;
  auto unit = [&](int32_t k, bool fwd, int32_t& stage_chunk, int32_t& micro) {  // Megatron's ordering
    int32_t chunk = (k / p) % v;
    if (!fwd) chunk = v - 1 - chunk;
    micro = (k / (p * v)) * p + k % p;
    stage_chunk = chunk;
  };
  for (int32_t d = 0; d < p; ++d) {
    const int32_t warm = std::min((p - d - 1) * 2 + (v - 1) * p, total);
    int32_t c, m;
    for (int32_t k = 0; k < warm; ++k) {
      unit(k, true, c, m);
      b.forward_unit(c * p + d, m);
    }
    for (int32_t k = 0; k < total - warm; ++k) {
      unit(warm + k, true, c, m);
      b.forward_unit(c * p + d, m);
      unit(k, false, c, m);
      b.backward_unit(c * p + d, m);
    }
    for (int32_t k = total - warm; k < total; ++k) {
      unit(k, false, c, m);
      b.backward_unit(c * p + d, m);
    }
  }
  b.add_weights_and_steps();
  return b.p;
}

result<program> make_round_robin(const std::vector<stage_def>& fwd, const std::vector<stage_def>& bwd,
                                 const schedule_options& o) {
  LP_TRY(check_common(fwd, o));
  const auto& tail = fwd.back();
  int32_t expect = 0;
  for (const auto& s : bwd) {
    if (s.first_layer != expect || s.last_layer <= s.first_layer)
      return make_error("round-robin: backward stages must tile layers [0, {}) in order", tail.first_layer);
    expect = s.last_layer;
  }
  if (expect != tail.first_layer)
    return make_error("round-robin: backward stages cover [0, {}), the fused tail starts at layer {}", expect, tail.first_layer);
  // Stage table: forward stages first, then backward stages (flags: embed only on layer 0, head only on the tail).
  std::vector<stage_def> all = fwd;
  for (size_t i = 0; i < bwd.size(); ++i) all.push_back({bwd[i].first_layer, bwd[i].last_layer, bwd[i].first_layer == 0, false});
  builder b("round-robin", all, o);
  const int32_t p = o.devices, M = o.micro_batches, Kf = static_cast<int32_t>(fwd.size()), Kb = static_cast<int32_t>(bwd.size());
  // Job order: forward stages, then backward stages from the last layers down; job j -> device j % p.
  std::vector<int32_t> jobs;
  for (int32_t s = 0; s < Kf; ++s) jobs.push_back(s);
  for (int32_t i = Kb - 1; i >= 0; --i) jobs.push_back(Kf + i);
  for (size_t j = 0; j < jobs.size(); ++j) b.device_of[jobs[j]] = static_cast<int32_t>(j) % p;
  auto bwd_stage_at = [&](int32_t boundary_last) {  // backward stage whose range ends at this layer
    for (int32_t i = 0; i < Kb; ++i)
      if (all[Kf + i].last_layer == boundary_last) return Kf + i;
    return -1;
  };
  auto bwd_stage_starting = [&](int32_t first) {
    for (int32_t i = 0; i < Kb; ++i)
      if (all[Kf + i].first_layer == first) return Kf + i;
    return -1;
  };
  std::vector<std::vector<int32_t>> jobs_of(p);
  for (size_t j = 0; j < jobs.size(); ++j) jobs_of[j % p].push_back(jobs[j]);
  for (int32_t d = 0; d < p; ++d) {
    const auto& mine = jobs_of[d];
    auto weights_for = [&](size_t k) {
      if (k < mine.size()) b.emit(d, op::prefetch_weights, mine[k]);
    };
    if (o.stream_weights) {
      weights_for(0);
      weights_for(1);  // double buffering: the next job's weights upload during this job
    } else {
      for (size_t k = 0; k < mine.size(); ++k) weights_for(k);
    }
    for (size_t k = 0; k < mine.size(); ++k) {
      const int32_t s = mine[k];
      const auto& st = all[s];
      for (int32_t m = 0; m < M; ++m) {
        if (s < Kf) {  // forward job
          if (st.has_embed || st.has_head) b.emit(d, op::load_micro_batch, s, m);
          if (!st.has_embed && b.device_of[s - 1] != d) b.emit(d, op::recv_act, s, m, b.device_of[s - 1]);
          b.emit(d, op::forward, s, m);
          // Checkpoints for the backward stages that start inside this forward stage go to host.
          for (int32_t i = 0; i < Kb; ++i)
            if (!st.has_head && all[Kf + i].first_layer >= st.first_layer && all[Kf + i].first_layer < st.last_layer)
              b.emit(d, op::offload_act, Kf + i, m);
          if (st.has_head) {  // fused tail: head + loss + backward of the tail layers, no recompute
            b.emit(d, op::backward, s, m);
            int32_t to = bwd_stage_at(st.first_layer);
            if (to >= 0 && b.device_of[to] != d) b.emit(d, op::send_grad, s, m, b.device_of[to]);
          } else if (s + 1 < Kf && b.device_of[s + 1] != d) {
            b.emit(d, op::send_act, s, m, b.device_of[s + 1]);
          }
        } else {  // backward job
          int32_t from = st.last_layer == tail.first_layer ? Kf - 1 : bwd_stage_starting(st.last_layer);
          if (b.device_of[from] != d) b.emit(d, op::recv_grad, s, m, b.device_of[from]);
          b.emit(d, op::reload_act, s, m);
          b.emit(d, op::recompute, s, m);
          b.emit(d, op::backward, s, m);
          int32_t to = bwd_stage_at(st.first_layer);
          if (to >= 0 && b.device_of[to] != d) b.emit(d, op::send_grad, s, m, b.device_of[to]);
        }
      }
      if (o.stream_weights) {
        b.emit(d, op::release_weights, s);
        weights_for(k + 2);
      }
    }
    // Cross-iteration prefetch: the next step's first two jobs upload while the others finish (the
    // PREFETCH at the top of the next step then finds them resident).
    if (o.stream_weights) {
      weights_for(0);
      weights_for(1);
    }
    for (int32_t s : mine)
      if (s >= Kf - 1) b.emit(d, op::optimizer_step, s);  // stages that own LoRA grads
  }
  return b.p;
}

namespace {
bool forward_kind(op k) {
  switch (k) {
    case op::load_micro_batch:
    case op::prefetch_weights:
    case op::release_weights:
    case op::forward:
    case op::send_act:
    case op::recv_act: return true;
    case op::recompute:
    case op::backward:
    case op::send_grad:
    case op::recv_grad:
    case op::offload_act:
    case op::reload_act:
    case op::optimizer_step: return false;
  }
  return false;
}

// A PREFETCH whose stage runs no FORWARD before that stage's next RELEASE (or the end) loads weights
// only the backward used: it goes, with that RELEASE.
std::vector<instr> drop_unused_prefetches(const std::vector<instr>& list) {
  std::vector<bool> drop(list.size(), false);
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].kind != op::prefetch_weights) continue;
    bool used = false;
    size_t j = i + 1;
    for (; j < list.size() && !(list[j].stage == list[i].stage && list[j].kind == op::release_weights); ++j)
      used = used || (list[j].stage == list[i].stage && list[j].kind == op::forward);
    if (used) continue;
    drop[i] = true;
    if (j < list.size()) drop[j] = true;
  }
  std::vector<instr> out;
  for (size_t i = 0; i < list.size(); ++i)
    if (!drop[i]) out.push_back(list[i]);
  return out;
}
}  // namespace

program forward_only(const program& training) {
  program p{training.schedule + "/forward", training.micro_batches, training.stages, {}};
  for (const auto& list : training.devices) {
    std::vector<instr> kept;
    for (const auto& in : list)
      if (forward_kind(in.kind)) kept.push_back(in);
    p.devices.push_back(drop_unused_prefetches(kept));
  }
  return p;
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "interleaved", "round-robin"};
  return names;
}

int32_t schedule_stage_count(const std::string& name, int32_t n_layers, const schedule_options& o) {
  if (name == "gpipe") return std::min(n_layers, o.devices);
  if (name == "interleaved") return o.devices * o.virtual_stages;
  // Round-robin: forward stages ~3x the layers of backward stages (backward with recompute costs ~3x forward).
  if (name == "round-robin") return std::max(1, std::min(n_layers, (n_layers + 2) / 3));
  return o.devices;
}

result<program> make_schedule(const std::string& name, int32_t n_layers, const schedule_options& o) {
  const bool known = name == "gpipe" || name == "1f1b" || name == "interleaved" || name == "round-robin";
  if (!known) return make_error("parallel.schedule: unknown schedule '{}' (gpipe, 1f1b, interleaved, round-robin)", name);
  const int32_t n_stages = schedule_stage_count(name, n_layers, o);
  std::vector<stage_def> stages;
  if (o.stage_layers.empty()) {
    if (name == "1f1b" && n_layers < o.devices) return make_error("1f1b: {} layers cannot fill {} devices", n_layers, o.devices);
    if (name == "interleaved" && n_layers < n_stages)
      return make_error("interleaved: {} layers cannot fill {} x {} stages", n_layers, o.devices, o.virtual_stages);
    stages = even_partition(n_layers, n_stages);
  } else {
    if (static_cast<int32_t>(o.stage_layers.size()) != n_stages && name != "round-robin")
      return make_error("{}: the partition has {} stages, the schedule needs {}", name, o.stage_layers.size(), n_stages);
    LP_TRY_ASSIGN(p, partition_from_sizes(n_layers, o.stage_layers));
    stages = std::move(p);
  }
  if (name == "gpipe") return make_gpipe(stages, o);
  if (name == "1f1b") return make_1f1b(stages, o);
  if (name == "interleaved") return make_interleaved(stages, o);
  const int32_t tail_first = stages.back().first_layer;
  std::vector<stage_def> bwd;
  if (o.backward_layers.empty()) {
    for (int32_t l = 0; l < tail_first; ++l) bwd.push_back({l, l + 1, l == 0, false});
  } else {
    int32_t total = 0;
    for (int32_t n : o.backward_layers) total += n;
    if (total != tail_first)
      return make_error("round-robin: the backward stages hold {} layers; the layers before the fused tail are {}", total, tail_first);
    LP_TRY_ASSIGN(b, partition_from_sizes(tail_first, o.backward_layers));
    bwd = std::move(b);
  }
  return make_round_robin(stages, bwd, o);
}

std::string instr_to_text(const instr& i) {
  std::string s = std::to_string(i.stage) + op_mnemonic(i.kind);
  if (i.micro >= 0) s += std::to_string(i.micro);
  if (i.peer >= 0) s += "@" + std::to_string(i.peer);
  return s;
}

result<instr> parse_instr(const std::string& s) {
  size_t pos = 0;
  auto digits = [&]() -> int32_t {
    size_t start = pos;
    while (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) ++pos;
    if (start == pos || pos - start > 9) return -1;
    return std::stoi(s.substr(start, pos - start));
  };
  instr in;
  in.stage = digits();
  if (in.stage < 0) return make_error("instruction '{}': expected a stage number first", s);
  size_t start = pos;
  while (pos < s.size() && (std::isupper(static_cast<unsigned char>(s[pos])) || s[pos] == '_')) ++pos;
  std::string mn = s.substr(start, pos - start);
  int k = -1;
  for (int i = 0; i < num_ops; ++i)
    if (mn == mnemonics[i]) k = i;
  if (k < 0) return make_error("instruction '{}': unknown operation '{}'", s, mn);
  in.kind = static_cast<op>(k);
  if (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) in.micro = digits();
  if (pos < s.size() && s[pos] == '@') {
    ++pos;
    in.peer = digits();
    if (in.peer < 0) return make_error("instruction '{}': expected a device after '@'", s);
  }
  if (pos != s.size()) return make_error("instruction '{}': unexpected '{}'", s, s.substr(pos));
  return in;
}

std::string program_to_text(const program& p) {
  std::string out = fmt::format("schedule {} micro_batches {}\n", p.schedule, p.micro_batches);
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const auto& s = p.stages[i];
    out += fmt::format("stage {} {} {}{}{}\n", i, s.first_layer, s.last_layer, s.has_embed ? " embed" : "", s.has_head ? " head" : "");
  }
  for (int32_t d = 0; d < p.num_devices(); ++d) {
    out += fmt::format("d{}:", d);
    for (const auto& in : p.devices[d]) out += " " + instr_to_text(in);
    out += "\n";
  }
  return out;
}

result<program> parse_program(const std::string& text) {
  program p;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    std::istringstream ls(line);
    std::string word;
    if (!(ls >> word)) continue;
    if (word == "schedule") {
      std::string mb;
      if (!(ls >> p.schedule >> mb >> p.micro_batches) || mb != "micro_batches")
        return make_error("line {}: expected 'schedule NAME micro_batches M'", lineno);
    } else if (word == "stage") {
      size_t idx;
      stage_def s;
      if (!(ls >> idx >> s.first_layer >> s.last_layer) || idx != p.stages.size())
        return make_error("line {}: expected 'stage {} FIRST LAST [embed] [head]'", lineno, p.stages.size());
      for (std::string flag; ls >> flag;) {
        if (flag == "embed") s.has_embed = true;
        else if (flag == "head") s.has_head = true;
        else return make_error("line {}: unknown stage flag '{}'", lineno, flag);
      }
      p.stages.push_back(s);
    } else if (word.size() >= 3 && word[0] == 'd' && word.back() == ':') {
      p.devices.emplace_back();
      for (std::string tok; ls >> tok;) {
        auto i = parse_instr(tok);
        if (!i) return make_error("line {}: {}", lineno, i.message());
        if (i->stage >= static_cast<int32_t>(p.stages.size()))
          return make_error("line {}: instruction '{}' names stage {} of {}", lineno, tok, i->stage, p.stages.size());
        p.devices.back().push_back(*i);
      }
    } else {
      return make_error("line {}: unexpected '{}'", lineno, word);
    }
  }
  return p;
}

std::string program_grid(const program& p, int32_t mark_device, int32_t mark_index) {
  size_t width = 4, cols = 0;
  for (const auto& d : p.devices) {
    cols = std::max(cols, d.size());
    for (const auto& i : d) width = std::max(width, instr_to_text(i).size() + 4);
  }
  std::string out = "     ";
  for (size_t c = 0; c < cols; ++c) out += fmt::format("{:<{}}", c, width);
  out += "\n";
  for (int32_t d = 0; d < p.num_devices(); ++d) {
    out += fmt::format("d{:<3} ", d);
    for (size_t c = 0; c < p.devices[d].size(); ++c) {
      std::string cell = instr_to_text(p.devices[d][c]);
      if (d == mark_device && static_cast<int32_t>(c) == mark_index) cell = "[>" + cell + "<]";
      out += fmt::format("{:<{}}", cell, width);
    }
    out += "\n";
  }
  return out;
}

message message_of(const program& p, const instr& in) {
  const auto& st = p.stages[in.stage];
  const bool grad = in.kind == op::send_grad || in.kind == op::recv_grad;
  // A sender's activation leaves at its last layer; the receiver's stage starts there (first layer).
  const bool at_last = in.kind == op::send_act || in.kind == op::recv_grad;
  return {grad ? 'G' : 'A', at_last ? st.last_layer : st.first_layer};
}

std::map<int32_t, std::set<int32_t>> checkpoint_boundaries(const program& p, bool per_layer) {
  std::set<int32_t> recomputed;
  for (const auto& list : p.devices)
    for (const auto& in : list)
      if (in.kind == op::recompute) recomputed.insert(in.stage);
  std::map<int32_t, std::set<int32_t>> out;
  for (const auto& list : p.devices)
    for (const auto& in : list)
      if (in.kind == op::forward) {
        const auto& fs = p.stages[in.stage];
        const int32_t end = std::max(fs.last_layer, fs.first_layer + 1);
        for (int32_t x : recomputed) {
          const auto& sx = p.stages[x];
          const int32_t b_end = per_layer ? sx.last_layer : sx.first_layer + 1;
          for (int32_t b = sx.first_layer; b < b_end; ++b)
            if (b >= fs.first_layer && b < end) out[in.stage].insert(b);
        }
      }
  return out;
}

}  // namespace lorapipe
