// The pipeline cost model: see cost_model.h.
#include "core/pipeline/cost_model.h"

#include <algorithm>
#include <tuple>

#include <fmt/format.h>

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

double stash_bytes_per_layer(const llama_config& c, int64_t tokens, size_t elem_bytes) {
  const double kv = static_cast<double>(c.num_kv_heads * c.head_dim), q = static_cast<double>(c.num_heads * c.head_dim);
  return static_cast<double>(tokens) * elem_bytes * (7.0 * c.hidden_size + 2 * q + 2 * kv + 3.0 * c.intermediate_size);
}

sim_costs estimate_costs(const program& p, const llama_config& mc, const project_config& cfg, double gflops) {
  const size_t elem = compute_element_bytes(cfg);
  const int64_t tokens = cfg.run.batch_size / std::max<int32_t>(1, p.micro_batches) * cfg.data.seq_len;
  const double layer_params =
      static_cast<double>(mc.num_parameters() - mc.vocab_size * mc.hidden_size * (mc.tie_word_embeddings ? 1 : 2) - mc.hidden_size) /
      static_cast<double>(mc.num_layers);
  const double attn_flops = 4.0 * cfg.data.seq_len * mc.num_heads * mc.head_dim * tokens;
  const double f_layer = (2.0 * layer_params * tokens + attn_flops) / (gflops * 1e9);
  sim_costs c;
  for (const auto& s : p.stages) {
    double fwd = (s.last_layer - s.first_layer) * f_layer;
    if (s.has_head) fwd += 2.0 * mc.vocab_size * mc.hidden_size * tokens / (gflops * 1e9);
    c.forward_s.push_back(fwd);
    c.backward_s.push_back(2 * fwd);
    c.recompute_s.push_back(fwd);
  }
  for (size_t b : stage_weight_bytes(p, mc, elem)) c.weight_bytes.push_back(static_cast<double>(b));
  c.act_bytes = static_cast<double>(tokens) * mc.hidden_size * elem;
  c.stash_bytes_per_layer = stash_bytes_per_layer(mc, tokens, elem);
  c.head_bytes = static_cast<double>(head_working_bytes(mc, tokens));
  c.h2d_bytes_per_s = c.d2h_bytes_per_s = cfg.offload.copy_gbps > 0 ? cfg.offload.copy_gbps * 1e9 : 0;
  c.steady_state = true;
  return c;
}

namespace {

schedule_candidate weigh(const project_config& cfg, const llama_config& mc, double gflops) {
  schedule_candidate c{cfg.parallel.schedule, static_cast<int32_t>(cfg.parallel.micro_batches)};
  auto prog = make_schedule(cfg.parallel.schedule, static_cast<int32_t>(mc.num_layers), schedule_options_of(cfg));
  if (!prog) {
    c.note = prog.message();
    return c;
  }
  const sim_result sim = simulate(*prog, estimate_costs(*prog, mc, cfg, gflops));
  if (!sim.ok) {
    c.note = sim.error;
    return c;
  }
  c.step_s = sim.makespan_s;
  c.bubble_ratio = sim.bubble_ratio;
  for (double b : sim.peak_bytes) c.peak_bytes = std::max(c.peak_bytes, b);
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

result<schedule_choice> choose_schedule(const project_config& cfg, const llama_config& mc, double gflops) {
  schedule_choice out;
  const int64_t n_dev = device_count(cfg.parallel.devices);
  if (n_dev <= 1) {
    out.schedule = "single";
    return out;
  }
  const auto& names = schedule_names();
  for (const auto& name : names)
    for (int64_t m : {n_dev, 2 * n_dev}) {
      if (cfg.run.batch_size % m != 0) continue;
      project_config c = cfg;
      c.parallel.schedule = name;
      c.parallel.micro_batches = m;
      out.candidates.push_back(weigh(c, mc, gflops));
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
    if (out.candidates.empty())
      why = fmt::format(" (run.batch_size {} is divisible by neither {} nor {} micro-batches)", cfg.run.batch_size, n_dev, 2 * n_dev);
    return make_error("parallel.schedule: auto found no pipeline for {} devices that fits{}", n_dev, why);
  }
  out.schedule = out.candidates.front().schedule;
  out.micro_batches = out.candidates.front().micro_batches;
  return out;
}

result<project_config> resolve_auto_schedule(const project_config& cfg, const llama_config& mc, double gflops) {
  if (cfg.parallel.schedule != "auto") return cfg;
  LP_TRY_ASSIGN(choice, choose_schedule(cfg, mc, gflops));
  project_config out = cfg;
  out.parallel.schedule = choice.schedule;
  if (choice.schedule != "single") out.parallel.micro_batches = choice.micro_batches;
  return out;
}

}  // namespace lorapipe
