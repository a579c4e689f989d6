// lorapipe_bench_pipeline: weight streaming vs resident weights on CPU virtual devices with throttled
// copy engines, side by side in one run, plus the simulator's predicted step time next to the
// measured one. Writes a synthetic Llama (random weights, HF layout) to a temp folder first.
//
// Resident: every stage's weights stay on its device across steps (uploaded once, before timing).
// Streamed: RoundPipe round-robin, one layer per stage, weights uploaded before each stage job and
// freed after it (double buffered), with the copy bandwidth set so one stage's upload takes half of
// its measured compute time. Overlap efficiency = resident step time / streamed step time. Also the
// streamed configuration with the peer transport between stages (one copy instead of two).
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule_sim.h"
#include "core/model/tensor_io.h"
#include "core/train/trainer.h"
#include "core/pipeline/transport.h"

namespace fs = std::filesystem;
using namespace lorapipe;

namespace {
fs::path write_model(const fs::path& dir, const llama_config& c) {
  fs::create_directories(dir);
  torch::manual_seed(0);
  auto rnd = [](std::vector<int64_t> s) { return torch::randn(s) * 0.02; };
  std::vector<std::pair<std::string, at::Tensor>> t{{"model.embed_tokens.weight", rnd({c.vocab_size, c.hidden_size})},
                                                    {"model.norm.weight", torch::ones({c.hidden_size})}};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const auto p = fmt::format("model.layers.{}.", l);
    const int64_t D = c.hidden_size, H = c.intermediate_size, kv = c.num_kv_heads * c.head_dim;
    t.emplace_back(p + "self_attn.q_proj.weight", rnd({D, D}));
    t.emplace_back(p + "self_attn.k_proj.weight", rnd({kv, D}));
    t.emplace_back(p + "self_attn.v_proj.weight", rnd({kv, D}));
    t.emplace_back(p + "self_attn.o_proj.weight", rnd({D, D}));
    t.emplace_back(p + "mlp.gate_proj.weight", rnd({H, D}));
    t.emplace_back(p + "mlp.up_proj.weight", rnd({H, D}));
    t.emplace_back(p + "mlp.down_proj.weight", rnd({D, H}));
    t.emplace_back(p + "input_layernorm.weight", torch::ones({D}));
    t.emplace_back(p + "post_attention_layernorm.weight", torch::ones({D}));
  }
  (void)write_tensors(dir / "model.safetensors", t);
  std::ofstream(dir / "config.json") << llama_config_to_hf_json(c).dump(2);
  return dir;
}

// One configuration: its own devices, adapters and executor, stepped on demand.
struct setup {
  std::vector<std::unique_ptr<compute_device>> devs;
  lora_adapters lora;
  std::unique_ptr<pipeline_executor> ex;
  std::vector<micro_batch> mbs;
  pipeline_step_result last;
  setup(const llama_weights& w, const program& p, double bw, int threads, const std::string& transport = "host") {
    cpu_device_options o;
    o.copy_bytes_per_s = bw;
    o.compute_threads = threads;
    std::vector<compute_device*> raw;
    for (int i = 0; i < p.num_devices(); ++i) {
      devs.push_back(std::make_unique<cpu_device>(i, o));
      raw.push_back(devs.back().get());
    }
    lora_config lc;
    lc.r = 8;
    lora = init_lora(w, lc, 1);
    pipeline_options po;
    po.transports = choose_transports(p, facts_of(raw), transport, nullptr).value();
    ex = std::make_unique<pipeline_executor>(w, lora, p, raw, adamw_config{}, po);
    torch::manual_seed(1);
    for (int m = 0; m < p.micro_batches; ++m) {
      auto t = torch::randint(0, w.cfg.vocab_size, {2, 129}, torch::kLong);
      mbs.push_back({t.slice(1, 0, 128).contiguous(), t.slice(1, 1).contiguous()});
    }
    step();  // warm-up; resident weights get uploaded here
  }
  double step() {
    auto r = ex->step(mbs, 1e-4, 1.0);
    if (!r) {
      fmt::print(stderr, "error: {}\n", r.message());
      std::exit(1);
    }
    last = *r;
    return r->seconds;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"weight streaming overlap benchmark on CPU virtual devices"};
  int devices = 2, layers = 6, steps = 9, threads = 1, micro = 4;
  int64_t dim = 512;
  app.add_option("--devices", devices);
  app.add_option("--layers", layers);
  app.add_option("--dim", dim);
  app.add_option("--steps", steps);
  app.add_option("--micro-batches", micro);
  app.add_option("--threads-per-device", threads);
  CLI11_PARSE(app, argc, argv);
  llama_config c;
  c.vocab_size = 4096;
  c.hidden_size = dim;
  c.intermediate_size = dim * 8 / 3;
  c.num_layers = layers;
  c.num_heads = static_cast<int>(dim / 64);
  c.num_kv_heads = c.num_heads;
  c.head_dim = 64;
  c.max_position_embeddings = 512;
  c.tie_word_embeddings = true;
  auto dir = write_model(fs::temp_directory_path() / fmt::format("lorapipe_bench_pipe_{}", ::getpid()), c);
  auto w = load_llama(dir, {at::kFloat}).value();
  fs::remove_all(dir);

  schedule_options o;
  o.devices = devices;
  o.micro_batches = micro;
  auto fwd = even_partition(layers, layers), bwd = even_partition(layers - 1, layers - 1);
  o.stream_weights = false;
  auto resident_prog = make_round_robin(fwd, bwd, o).value();
  o.stream_weights = true;
  auto streamed_prog = make_round_robin(fwd, bwd, o).value();

  // 1. Resident, unthrottled copies: calibrate per-stage compute times.
  setup calib(w, resident_prog, 0, threads);
  std::vector<double> f(resident_prog.stages.size(), 0), r(resident_prog.stages.size(), 0), b(resident_prog.stages.size(), 0);
  std::vector<int> nf(f.size(), 0), nr(f.size(), 0), nb(f.size(), 0);
  for (int i = 0; i < 3; ++i) {  // per-stage compute times, averaged over three steps
    calib.step();
    for (const auto& t : calib.last.trace) {
      const double dt = t.end_s - t.start_s;
      if (t.in.kind == op::forward) f[t.in.stage] += dt, nf[t.in.stage]++;
      if (t.in.kind == op::recompute) r[t.in.stage] += dt, nr[t.in.stage]++;
      if (t.in.kind == op::backward) b[t.in.stage] += dt, nb[t.in.stage]++;
    }
  }
  double layer_bytes = 0;
  for (const auto& p : w.layers[0].t)
    if (p.defined()) layer_bytes += p.numel() * 4.0;
  double mean_f = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    f[i] = nf[i] ? f[i] / nf[i] : 0;
    r[i] = nr[i] ? r[i] / nr[i] : 0;
    b[i] = nb[i] ? b[i] / nb[i] : 0;
    if (i > 0 && i + 1 < static_cast<size_t>(layers)) mean_f += f[i];
  }
  mean_f /= std::max(1, layers - 2);
  // Bandwidth so that a one-layer stage's upload takes half of its forward job (all micro-batches).
  const double bw = layer_bytes / (0.5 * mean_f * micro);

  // Both configurations live side by side and take turns step by step, so slow drifts of the shared
  // machine hit both alike; medians of the per-step times and of the per-pair ratios are reported.
  setup resident(w, resident_prog, bw, threads), streamed(w, streamed_prog, bw, threads), unthrottled(w, streamed_prog, 0, threads),
      peer(w, streamed_prog, bw, threads, "peer");
  std::vector<double> res_t, str_t, unt_t, peer_t, ratios;
  for (int i = 0; i < steps; ++i) {
    res_t.push_back(resident.step());
    str_t.push_back(streamed.step());
    unt_t.push_back(unthrottled.step());
    peer_t.push_back(peer.step());
    ratios.push_back(res_t.back() / str_t.back());
  }
  sim_costs sc;
  sc.forward_s = f;
  sc.recompute_s = r;
  sc.backward_s = b;
  sc.weight_bytes.assign(streamed_prog.stages.size(), layer_bytes);
  sc.weight_bytes[0] += w.embed.numel() * 4.0;
  sc.weight_bytes[layers - 1] += w.embed.numel() * 4.0;  // head (tied) copied with the tail stage
  sc.act_bytes = 2.0 * 128 * dim * 4;
  sc.h2d_bytes_per_s = sc.d2h_bytes_per_s = bw;
  sc.steady_state = true;
  auto predicted = simulate(streamed_prog, sc);
  sim_costs sr = sc;
  std::fill(sr.weight_bytes.begin(), sr.weight_bytes.end(), 0.0);  // resident: no weight traffic
  auto predicted_res = simulate(resident_prog, sr);

  fmt::print("Pipeline weight streaming on {} CPU virtual devices ({} compute thread each), synthetic Llama dim {} x {} layers "
             "({:.1f}M params), round-robin 1-layer stages, {} micro-batches x 2 x 128 tokens\n",
             devices, threads, dim, layers, c.num_parameters() / 1e6, micro);
  fmt::print("  copy engines throttled to {:.1f} MB/s: one layer's weights ({:.1f} MB) upload in {:.3f} s vs {:.3f} s of forward compute per stage job\n",
             bw / 1e6, layer_bytes / 1e6, layer_bytes / bw, mean_f * micro);
  fmt::print("  resident weights : {:.3f} s/step   (simulator predicts {:.3f} s)\n", median(res_t), predicted_res.makespan_s);
  fmt::print("  streamed weights : {:.3f} s/step   (simulator predicts {:.3f} s, bubble {:.3f})\n", median(str_t),
             predicted.makespan_s, predicted.bubble_ratio);
  fmt::print("  streamed, copies unthrottled: {:.3f} s/step (the cost of streaming itself)\n", median(unt_t));
  fmt::print("  overlap efficiency (resident / streamed, medians of {} alternating steps) = {:.3f}; median per-step ratio {:.3f} "
             "(per step {:.2f})\n",
             steps, median(res_t) / median(str_t), median(ratios), fmt::join(ratios, " "));
  fmt::print("  streamed, peer transport between stages: {:.3f} s/step (one copy per activation/gradient instead of download + upload)\n",
             median(peer_t));
  for (size_t i = 0; i < streamed.last.peak_bytes.size(); ++i)
    fmt::print("  device {} peak arena use: streamed {:.1f} MB (weight arena {:.1f} MB, {} stages at once), resident {:.1f} MB "
               "(weight arena {:.1f} MB)\n",
               i, streamed.last.peak_bytes[i] / 1e6, streamed.ex->weight_plan()[i].bytes / 1e6, streamed.ex->weight_plan()[i].max_stages,
               resident.last.peak_bytes[i] / 1e6, resident.ex->weight_plan()[i].bytes / 1e6);
  return 0;
}
