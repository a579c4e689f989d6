// The pipeline cost model: see cost_model.h.
#include "core/pipeline/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "core/base/device_spec.h"
#include "core/pipeline/partition_search.h"
#include "core/project/lora_target.h"
#include "offload/memory_arena.h"

namespace lorapipe {

schedule_options schedule_options_of(const project_config& cfg) {
  const bool pipelined = cfg.parallel.schedule != "single" && cfg.parallel.schedule != "auto";
  schedule_options so;
  so.devices = pipelined ? static_cast<int32_t>(device_count(cfg.parallel.devices)) : 1;
  so.micro_batches = pipelined ? static_cast<int32_t>(cfg.parallel.micro_batches) : 1;
  so.virtual_stages = static_cast<int32_t>(cfg.parallel.virtual_stages);
  so.recompute = cfg.offload.recompute;
  so.offload_activations = cfg.offload.activations && cfg.offload.recompute;
  so.stream_weights = cfg.offload.stream_weights;
  if (cfg.parallel.schedule == "round-robin")
    if (auto b = backward_partition_sizes(cfg)) so.backward_layers = std::move(*b);
  return so;
}

size_t compute_element_bytes(const project_config& cfg) { return cfg.model.dtype == "float32" ? 4 : 2; }

std::vector<size_t> stage_tensor_bytes(const stage_def& st, const llama_config& c, size_t elem) {
  const size_t D = static_cast<size_t>(c.hidden_size), V = static_cast<size_t>(c.vocab_size);
  std::vector<size_t> layer;
  for (const auto& spec : layer_tensor_specs(c)) {
    size_t n = 1;
    for (auto d : spec.shape) n *= static_cast<size_t>(d);
    layer.push_back(n * elem);
  }
  std::vector<size_t> out;
  for (int32_t l = st.first_layer; l < st.last_layer; ++l) out.insert(out.end(), layer.begin(), layer.end());
  if (st.has_embed) out.push_back(V * D * elem);
  if (st.has_head) {
    out.push_back(D * elem);
    if (!(st.has_embed && c.tie_word_embeddings)) out.push_back(V * D * elem);
  }
  return out;
}

std::vector<size_t> stage_weight_bytes(const program& p, const llama_config& c, size_t elem) {
  std::vector<size_t> out;
  for (const auto& st : p.stages) out.push_back(layout_block(stage_tensor_bytes(st, c, elem), weight_alignment).bytes);
  return out;
}

graph_targets graph_targets_of(const std::vector<lora_target>& lora_targets) {
  graph_targets t{false, false};
  for (const lora_target k : lora_targets) {
    t.mlp_in |= k == lora_target::gate || k == lora_target::up || k == lora_target::gate_up;
    t.mlp_down |= k == lora_target::down;
  }
  return t;
}

graph_targets graph_targets_of(const std::vector<std::string>& lora_targets) {
  std::vector<lora_target> known;
  for (const auto& name : lora_targets)
    if (const auto k = lora_target_from_name(name)) known.push_back(*k);
  return graph_targets_of(known);
}

double stash_bytes_per_layer(const llama_config& c, int64_t tokens, int64_t seq_len, size_t elem_bytes, graph_targets t) {
  const double kv = static_cast<double>(c.num_kv_heads * c.head_dim), q = static_cast<double>(c.num_heads * c.head_dim);
  double per_token = 7.0 * c.hidden_size + 2 * q + 2 * kv + 3.0 * c.intermediate_size;
  // Adapted feed-forward projections keep their inputs (measured: +h +I with all seven targets at
  // Llama-7B proportions, where the rest alone would fall 4% short).
  if (t.mlp_in) per_token += c.hidden_size;
  if (t.mlp_down) per_token += c.intermediate_size;
  // What the family adds (the layer profiler measures the graph; rounded up from its figures for the
  // family fixtures, f32, 4 heads, 32-128 tokens): norms over q and k (measured 1.3 x (q + kv)), the
  // sandwich norms (2.4 x hidden), and eager attention's rows of scores and probabilities (Gemma 2:
  // 2.0 x heads x keys, from the growth between 32, 64 and 128 tokens).
  if (c.qk_norm) per_token += 1.5 * (q + kv);
  if (c.sandwich_norm) per_token += 3.0 * c.hidden_size;
  if (c.eager_attention()) per_token += 2.5 * static_cast<double>(c.num_heads * seq_len);
  return static_cast<double>(tokens) * static_cast<double>(elem_bytes) * per_token;
}

double layer_forward_flops(const llama_config& mc, int64_t rows, int64_t seq_len) {
  const int64_t tokens = rows * seq_len;
  const double layer_params =
      static_cast<double>(mc.num_parameters() - mc.vocab_size * mc.hidden_size * (mc.tie_word_embeddings ? 1 : 2) - mc.hidden_size) /
      static_cast<double>(mc.num_layers);
  const double attn_flops = 4.0 * seq_len * mc.num_heads * mc.head_dim * tokens;
  return 2.0 * layer_params * tokens + attn_flops;
}

double head_forward_flops(const llama_config& mc, int64_t rows, int64_t seq_len) {
  return 2.0 * mc.vocab_size * mc.hidden_size * rows * seq_len;
}

sim_costs flop_costs(const program& p, const llama_config& mc, int64_t rows, int64_t seq_len, size_t elem, double gflops,
                     double copy_bytes_per_s, graph_targets targets) {
  const int64_t tokens = rows * seq_len;
  const double f_layer = layer_forward_flops(mc, rows, seq_len) / (gflops * 1e9);
  const double f_head = head_forward_flops(mc, rows, seq_len) / (gflops * 1e9);
  sim_costs c;
  for (const auto& s : p.stages) {
    double fwd = (s.last_layer - s.first_layer) * f_layer;
    if (s.has_head) fwd += f_head;
    c.forward_s.push_back(fwd);
    c.backward_s.push_back(2 * fwd);
    c.recompute_s.push_back(fwd);
  }
  for (size_t b : stage_weight_bytes(p, mc, elem)) c.weight_bytes.push_back(static_cast<double>(b));
  c.act_bytes = static_cast<double>(tokens) * mc.hidden_size * elem;
  c.stash_bytes_per_layer = stash_bytes_per_layer(mc, tokens, seq_len, elem, targets);
  c.head_bytes = static_cast<double>(head_working_bytes(mc, tokens));
  c.token_bytes = static_cast<double>(tokens) * 8;   // i64 ids
  c.input_bytes = 2 * c.token_bytes;                 // ids and labels
  c.h2d_bytes_per_s = c.d2h_bytes_per_s = copy_bytes_per_s;
  c.steady_state = true;
  return c;
}

namespace {

// Seconds at `flops` from `a` seconds measured at `fa` FLOPs and `b` at `fb` (the second, smaller
// shape; fb 0 when not measured): along the line through both (a part per call plus a part per
// FLOP), else in proportion to the first. A line that does not rise with FLOPs, or rises faster than
// in proportion (a part per call below 0: noise, or a shape past a cache's size), is not used. Past
// twice the first shape the line is not extended (two small shapes on a GPU can look almost all
// per-call time, which a large one is not): from there on in proportion to its value at twice.
double charged(double flops, double a, double fa, double b, double fb) {
  if (fa <= 0) return a;
  const double proportional = a * flops / fa;
  if (fb <= 0 || fb == fa || b <= 0) return proportional;
  const double slope = (a - b) / (fa - fb);
  const double per_call = a - slope * fa;
  if (slope <= 0 || per_call < 0) return proportional;
  const double reach = 2 * fa;
  return flops <= reach ? per_call + slope * flops : (per_call + slope * reach) * flops / reach;
}

// Tokens per micro-batch of a shape: what the embedding's gather scales with.
double tokens_of(int64_t rows, int64_t seq_len) { return static_cast<double>(rows) * static_cast<double>(seq_len); }

bool has_second(const measured_compute& m, size_t layers) {
  return m.second.rows > 0 && m.second.seq_len > 0 && m.second.layer_forward_s.size() == layers &&
         m.second.layer_forward_nograd_s.size() == layers && m.second.layer_backward_s.size() == layers;
}

double embed_seconds(const measured_compute& m, int64_t rows, int64_t seq_len) {
  const bool two = has_second(m, m.layer_forward_s.size());
  return charged(tokens_of(rows, seq_len), m.embed_s, tokens_of(m.rows, m.seq_len), two ? m.second.embed_s : 0,
                 two ? tokens_of(m.second.rows, m.second.seq_len) : 0);
}

}  // namespace

double compute_rates::layer_forward(const llama_config& c, int64_t l, int64_t rows, int64_t seq_len, bool grad) const {
  if (!measured) return layer_forward_flops(c, rows, seq_len) / (gflops * 1e9);
  const auto& m = *measured;
  const auto i = static_cast<size_t>(l);
  const bool two = has_second(m, m.layer_forward_s.size());
  const auto& v = grad ? m.layer_forward_s : m.layer_forward_nograd_s;
  const auto& v2 = grad ? m.second.layer_forward_s : m.second.layer_forward_nograd_s;
  return charged(layer_forward_flops(c, rows, seq_len), v.at(i), layer_forward_flops(c, m.rows, m.seq_len), two ? v2.at(i) : 0,
                 two ? layer_forward_flops(c, m.second.rows, m.second.seq_len) : 0);
}

double compute_rates::layer_backward(const llama_config& c, int64_t l, int64_t rows, int64_t seq_len) const {
  if (!measured) return 2 * layer_forward_flops(c, rows, seq_len) / (gflops * 1e9);
  const auto& m = *measured;
  const auto i = static_cast<size_t>(l);
  const bool two = has_second(m, m.layer_forward_s.size());
  return charged(layer_forward_flops(c, rows, seq_len), m.layer_backward_s.at(i), layer_forward_flops(c, m.rows, m.seq_len),
                 two ? m.second.layer_backward_s.at(i) : 0, two ? layer_forward_flops(c, m.second.rows, m.second.seq_len) : 0);
}

double compute_rates::head_forward(const llama_config& c, int64_t rows, int64_t seq_len) const {
  if (!measured) return head_forward_flops(c, rows, seq_len) / (gflops * 1e9);
  const auto& m = *measured;
  const bool two = has_second(m, m.layer_forward_s.size());
  return charged(head_forward_flops(c, rows, seq_len), m.head_forward_s, head_forward_flops(c, m.rows, m.seq_len),
                 two ? m.second.head_forward_s : 0, two ? head_forward_flops(c, m.second.rows, m.second.seq_len) : 0);
}

double compute_rates::head_backward(const llama_config& c, int64_t rows, int64_t seq_len) const {
  if (!measured) return 2 * head_forward_flops(c, rows, seq_len) / (gflops * 1e9);
  const auto& m = *measured;
  const bool two = has_second(m, m.layer_forward_s.size());
  return charged(head_forward_flops(c, rows, seq_len), m.head_backward_s, head_forward_flops(c, m.rows, m.seq_len),
                 two ? m.second.head_backward_s : 0, two ? head_forward_flops(c, m.second.rows, m.second.seq_len) : 0);
}

std::string compute_rates::describe() const {
  if (!measured) return fmt::format("FLOPs at {:g} GFLOP/s per device", gflops);
  if (has_second(*measured, measured->layer_forward_s.size()))
    return fmt::format("the layer profile ({} x {} and {} x {} tokens per micro-batch, other shapes along the line between them in FLOPs)",
                       measured->rows, measured->seq_len, measured->second.rows, measured->second.seq_len);
  return fmt::format("the layer profile ({} x {} tokens per micro-batch, scaled by FLOPs to other shapes)", measured->rows, measured->seq_len);
}

int host_core_count() {  // read once: the planner costs thousands of programs, and each read is a file read in glibc
  static const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return cores;
}

void share_host_cores(sim_costs& c, const program& p, const project_config& cfg, int cores) {
  c.host_compute_slots = 0;
  c.on_host_cores.clear();
  const auto spec = parse_device_spec(cfg.parallel.devices);
  const int64_t threads = std::max<int64_t>(1, cfg.parallel.threads_per_device);
  if (!spec || spec->count() != p.num_devices() || spec->cpus < 2 || spec->cpus * threads <= cores) return;
  c.host_compute_slots = std::max(1.0, static_cast<double>(cores) / static_cast<double>(threads));
  c.on_host_cores.assign(static_cast<size_t>(p.num_devices()), false);
  for (int d = 0; d < spec->cpus; ++d) c.on_host_cores[static_cast<size_t>(d)] = true;  // CPU devices come first
}

sim_costs estimate_costs(const program& p, const llama_config& mc, const project_config& cfg, const compute_rates& rates) {
  const int64_t rows = cfg.run.batch_size / std::max<int32_t>(1, p.micro_batches);
  const int64_t T = cfg.data.seq_len;
  sim_costs c = flop_costs(p, mc, rows, T, compute_element_bytes(cfg), rates.gflops,
                           cfg.offload.copy_gbps > 0 ? cfg.offload.copy_gbps * 1e9 : 0, graph_targets_of(cfg.lora.targets));
  if (rates.measured) {
    // The executor's instructions: a FORWARD keeps its graph only when the stage has a BACKWARD and
    // no RECOMPUTE (which is the forward with autograd); the head's loss runs in both.
    std::vector<bool> graph(p.stages.size(), false), recomputed(p.stages.size(), false);
    for (const auto& list : p.devices)
      for (const auto& in : list) {
        if (in.kind == op::backward) graph[static_cast<size_t>(in.stage)] = true;
        if (in.kind == op::recompute) recomputed[static_cast<size_t>(in.stage)] = true;
      }
    for (size_t s = 0; s < p.stages.size(); ++s) {
      const auto& st = p.stages[s];
      const bool keeps_graph = graph[s] && !recomputed[s];
      double fwd = st.has_embed ? embed_seconds(*rates.measured, rows, T) : 0.0, fwd_grad = fwd, bwd = 0;
      for (int32_t l = st.first_layer; l < st.last_layer; ++l) {
        fwd += rates.layer_forward(mc, l, rows, T, keeps_graph);
        fwd_grad += rates.layer_forward(mc, l, rows, T, true);
        bwd += rates.layer_backward(mc, l, rows, T);
      }
      if (st.has_head) {
        fwd += rates.head_forward(mc, rows, T);
        fwd_grad += rates.head_forward(mc, rows, T);
        bwd += rates.head_backward(mc, rows, T);
      }
      c.forward_s[s] = fwd;
      c.recompute_s[s] = fwd_grad;
      c.backward_s[s] = bwd;
    }
  }
  c.per_layer_recompute = cfg.offload.recompute && cfg.offload.recompute_granularity == "layer";
  // Speeds matter between pipeline devices (a single-device run is not paced).
  if (auto speeds = device_speeds(cfg); speeds && p.num_devices() > 1 && static_cast<int32_t>(speeds->size()) == p.num_devices())
    c.device_speed = *speeds;
  if (auto links = copy_links(cfg); links && p.num_devices() > 1 && static_cast<int32_t>(links->size()) == p.num_devices())
    c.copy_link.assign(links->begin(), links->end());
  share_host_cores(c, p, cfg, host_core_count());
  return c;
}

memory_inputs memory_inputs_of(const program& p, const llama_config& c, size_t elem, int64_t lora_r,
                               const std::vector<std::string>& lora_targets) {
  memory_inputs in;
  const auto stage_bytes = stage_weight_bytes(p, c, elem);
  in.arenas = plan_weight_arenas(p, stage_bytes, weight_alignment);
  // LoRA: r x (in + out) per adapted projection of a layer.
  size_t per_layer_params = 0;
  const auto specs = layer_tensor_specs(c);
  for (const auto& name : fit_lora_targets(c, lora_targets)) {
    const auto t = lora_target_from_name(name);
    if (!t) continue;
    const std::string weight = std::string(lora_target_module(*t)) + ".weight";
    for (const auto& spec : specs)
      if (spec.name == weight && spec.shape.size() == 2)
        per_layer_params += static_cast<size_t>(lora_r * (spec.shape[0] + spec.shape[1]));
  }
  in.lora_layer_bytes.assign(static_cast<size_t>(c.num_layers), per_layer_params * elem);
  in.lora_master_bytes = per_layer_params * 4 * static_cast<size_t>(c.num_layers);
  // RoPE: f32 cos and sin [min(P, 8192), head_dim] and inv_freq [head_dim/2]; a second table for
  // sliding layers whose RoPE differs (Gemma 3), as make_rope_tables does.
  const size_t P = static_cast<size_t>(std::min<int64_t>(c.max_position_embeddings, 8192)), hd = static_cast<size_t>(c.head_dim);
  const size_t table = (2 * P * hd + hd / 2) * 4;
  bool sliding = false;
  for (int64_t l = 0; l < c.num_layers; ++l) sliding = sliding || c.is_sliding(l);
  const bool local = sliding && (c.rope_local.type != c.rope.type || c.rope_local.theta != c.rope.theta || c.rope_local.factor != c.rope.factor);
  in.rope_bytes = table * (local ? 2 : 1);
  // The host keeps every frozen tensor once (a tied head shares the embedding).
  stage_def all{0, static_cast<int32_t>(c.num_layers), true, true};
  for (size_t b : stage_tensor_bytes(all, c, elem)) in.host_weight_bytes += b;
  return in;
}

std::vector<workspace_charge> device_workspaces(const project_config& cfg, int32_t devices) {
  std::vector<workspace_charge> out(static_cast<size_t>(std::max(0, devices)));
  const auto spec = parse_device_spec(cfg.parallel.devices);
  if (!spec || spec->count() != devices) return out;
  for (size_t d = 0; d < spec->gpus.size(); ++d) out[static_cast<size_t>(spec->cpus) + d] = compute_workspaces(spec->gpus[d], 0);
  return out;
}

namespace {

memory_inputs project_memory_inputs(const program& p, const llama_config& c, const project_config& cfg) {
  memory_inputs in = memory_inputs_of(p, c, compute_element_bytes(cfg), cfg.lora.r, cfg.lora.targets);
  in.workspaces = device_workspaces(cfg, p.num_devices());
  return in;
}

}  // namespace

memory_plan project_memory_plan(const program& p, const llama_config& c, const project_config& cfg, const compute_rates& rates) {
  const sim_costs costs = estimate_costs(p, c, cfg, rates);
  const sim_result sim = simulate(p, costs);
  return make_memory_plan(p, costs, sim, project_memory_inputs(p, c, cfg));
}

memory_plan checked_memory_plan(const program& p, const llama_config& c, const project_config& cfg, const compute_rates& rates,
                                const sim_costs& costs, const sim_result& sim) {
  if (rates.measured || rates.gflops != auto_schedule_gflops) return project_memory_plan(p, c, cfg, auto_schedule_gflops);
  return make_memory_plan(p, costs, sim, project_memory_inputs(p, c, cfg));
}

std::vector<int64_t> micro_batch_counts(int64_t batch_size, int64_t devices) {
  std::vector<int64_t> out, fewer;  // fewer: counts below the device count, weighed only when nothing else divides
  for (int64_t m = 1; m <= std::min(batch_size, 2 * devices); ++m)
    if (batch_size % m == 0) (m >= devices ? out : fewer).push_back(m);
  if (out.empty()) return fewer;
  // At most 6 (each is a partition search): the multiples of the device count first (every schedule
  // takes them), then the smallest others.
  constexpr size_t most = 6;
  if (out.size() <= most) return out;
  std::vector<int64_t> kept;
  for (int64_t m : out)
    if (m % devices == 0 && kept.size() < most) kept.push_back(m);
  for (int64_t m : out)
    if (m % devices != 0 && kept.size() < most) kept.push_back(m);
  std::sort(kept.begin(), kept.end());
  return kept;
}

namespace {

schedule_candidate weigh(const project_config& cfg, const llama_config& mc, const compute_rates& rates) {
  schedule_candidate c{cfg.parallel.schedule, static_cast<int32_t>(cfg.parallel.micro_batches)};
  auto part = choose_partition(cfg, mc, rates);
  if (!part) {
    c.note = part.message();
    return c;
  }
  c.part = *part;
  c.partition = partition_text(part->sizes);
  c.partition_how = part->how;
  c.backward_partition = backward_partition_text(*part);
  schedule_options so = schedule_options_of(cfg);
  so.stage_layers = part->sizes;
  so.backward_layers = part->backward_sizes;
  auto prog = make_schedule(cfg.parallel.schedule, static_cast<int32_t>(mc.num_layers), so);
  if (!prog) {
    c.note = prog.message();
    return c;
  }
  const sim_costs costs = estimate_costs(*prog, mc, cfg, rates);
  const sim_result sim = simulate(*prog, costs);
  if (!sim.ok) {
    c.note = sim.error;
    return c;
  }
  c.step_s = sim.makespan_s;
  c.bubble_ratio = sim.bubble_ratio;
  // Fit is judged by the plan the executor checks (its timing: FLOPs at auto_schedule_gflops), whatever
  // the compute rates that rank the candidates.
  const memory_plan mem = checked_memory_plan(*prog, mc, cfg, rates, costs, sim);
  for (const auto& d : mem.devices) c.peak_bytes = std::max(c.peak_bytes, d.peak_bytes);
  const double cap = static_cast<double>(cfg.offload.device_memory_mb) * 1024 * 1024;
  if (cap > 0 && c.peak_bytes > cap) {
    c.note = fmt::format("needs {:.1f} MiB on a device, offload.device_memory_mb is {}", c.peak_bytes / 1048576.0,
                         cfg.offload.device_memory_mb);
    return c;
  }
  c.ok = true;
  return c;
}

}  // namespace

result<schedule_choice> choose_schedule(const project_config& cfg, const llama_config& mc, const compute_rates& rates) {
  schedule_choice out;
  const int64_t n_dev = device_count(cfg.parallel.devices);
  if (n_dev <= 1) {
    out.schedule = "single";
    return out;
  }
  const auto& names = schedule_names();
  for (const auto& name : names)
    for (int64_t m : micro_batch_counts(cfg.run.batch_size, n_dev)) {
      project_config c = cfg;
      c.parallel.schedule = name;
      c.parallel.micro_batches = m;
      out.candidates.push_back(weigh(c, mc, rates));
    }
  const auto rank = [&](const schedule_candidate& c) {
    const auto order = std::find(names.begin(), names.end(), c.schedule) - names.begin();
    return std::make_tuple(!c.ok, c.ok ? c.step_s : 0.0, c.micro_batches, order);
  };
  std::stable_sort(out.candidates.begin(), out.candidates.end(),
                   [&](const schedule_candidate& a, const schedule_candidate& b) { return rank(a) < rank(b); });
  if (out.candidates.empty() || !out.candidates.front().ok) {
    std::string why;
    for (const auto& c : out.candidates) why += fmt::format("\n  {} with {} micro-batches: {}", c.schedule, c.micro_batches, c.note);
    return make_error("parallel.schedule: auto found no pipeline for {} devices that fits{}", n_dev, why);
  }
  out.schedule = out.candidates.front().schedule;
  out.micro_batches = out.candidates.front().micro_batches;
  return out;
}

result<project_config> resolve_auto_schedule(const project_config& cfg_in, const llama_config& mc, const compute_rates& rates) {
  LP_TRY_ASSIGN(cfg, resolve_auto_offload(cfg_in, mc, rates));
  project_config out = cfg;
  std::optional<partition_choice> chosen;  // weighed with the schedule chosen
  if (cfg.parallel.schedule == "auto") {
    LP_TRY_ASSIGN(choice, choose_schedule(cfg, mc, rates));
    out.parallel.schedule = choice.schedule;
    if (choice.schedule != "single") out.parallel.micro_batches = choice.micro_batches;
    if (choice.schedule != "single") chosen = std::move(choice.candidates.front().part);
  }
  // The layers per stage are recorded too: a resume (or another version of the planner) trains the
  // same partition.
  const bool rr_auto = out.parallel.schedule == "round-robin" && out.parallel.backward_partition == "auto";
  if (out.parallel.schedule != "single" && (out.parallel.partition == "auto" || rr_auto)) {
    if (!chosen) {
      LP_TRY_ASSIGN(part, choose_partition(out, mc, rates));
      chosen = std::move(part);
    }
    const partition_choice& part = *chosen;
    // Backward counts need the forward ones (validate_project): "even" is written out then.
    if (out.parallel.partition == "auto" || (rr_auto && !part.backward_sizes.empty())) out.parallel.partition = partition_text(part.sizes);
    if (rr_auto) out.parallel.backward_partition = backward_partition_text(part);
  }
  return out;
}

namespace {

// Every combination of the four settings offload.auto chooses (activations and granularity only
// while recomputing: without recompute there are no checkpoints to offload or recompute): 10.
std::vector<project_config> offload_settings(const project_config& c) {
  std::vector<project_config> out;
  for (bool stream : {true, false})
    for (int r = 0; r < 5; ++r) {
      project_config v = c;
      v.offload.stream_weights = stream;
      v.offload.recompute = r < 4;
      if (r < 4) {
        v.offload.activations = (r & 1) != 0;
        v.offload.recompute_granularity = (r & 2) != 0 ? "layer" : "stage";
      }
      out.push_back(std::move(v));
    }
  return out;
}

constexpr const char* offload_fields[] = {"offload.stream_weights", "offload.activations", "offload.recompute", "offload.recompute_granularity"};

// "field: before -> after" for each of the four that differs (activations and granularity only
// when both recompute).
std::vector<std::string> offload_changes(const project_config& a, const project_config& b) {
  std::vector<std::string> out;
  for (const char* f : offload_fields) {
    const std::string x = project_field_text(a, f), y = project_field_text(b, f);
    const bool matters = std::string(f) == "offload.stream_weights" || std::string(f) == "offload.recompute" ||
                         (a.offload.recompute && b.offload.recompute);
    if (matters && x != y) out.push_back(fmt::format("{}: {} -> {}", f, x, y));
  }
  return out;
}

// The predicted step of a project with its schedule and partition resolved; inf when it cannot be
// planned or does not fit.
double resolved_step(const project_config& c, const llama_config& mc, const compute_rates& rates) {
  auto r = resolve_auto_schedule(c, mc, rates);
  if (!r) return std::numeric_limits<double>::infinity();
  const schedule_candidate w = weigh(*r, mc, rates);
  return w.ok ? w.step_s : std::numeric_limits<double>::infinity();
}

}  // namespace

result<project_config> resolve_auto_offload(const project_config& cfg, const llama_config& mc, const compute_rates& rates,
                                            offload_choice* why) {
  project_config cur = cfg;
  cur.offload.automatic = false;
  if (!cfg.offload.automatic || device_count(cfg.parallel.devices) <= 1) return cur;
  const double given = resolved_step(cur, mc, rates);
  // The fastest that fits, taken over the settings as set only when at least 1% faster; among
  // steps within 1e-9, the fewest changes.
  double best = given;
  size_t best_changes = 0;
  project_config pick = cur;
  for (const auto& v : offload_settings(cur)) {
    const double t = resolved_step(v, mc, rates);
    const size_t n = offload_changes(cur, v).size();
    if (n == 0 || !std::isfinite(t)) continue;
    const bool beats_given = !std::isfinite(given) || t < 0.99 * given;
    const bool better = t < best * (1 - 1e-9) || (t <= best * (1 + 1e-9) && n < best_changes);
    if (beats_given && better) best = t, best_changes = n, pick = v;
  }
  if (why != nullptr) {
    why->weighed = true;
    why->changes = offload_changes(cur, pick);
    why->given_step_s = std::isfinite(given) ? given : 0;
    why->step_s = std::isfinite(best) ? best : 0;
  }
  return pick;
}

}  // namespace lorapipe
