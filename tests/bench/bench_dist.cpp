// lorapipe_bench_dist: the same pipeline program (1F1B, 4 micro-batches, two device positions) in one
// process with two CPU virtual devices against two processes with one device each (c10d Gloo over
// 127.0.0.1), on a synthetic Llama (random weights, the same in both processes). Prints the median
// step time of each, their ratio, and the bytes each process sent the other per step (activations,
// gradients). Order: one process, two processes, one process again (brackets slow drifts of a shared
// machine). Rank 1 is this program started again with --rank1 PORT.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/child_process.h"
#include "core/model/lora.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule.h"
#include "offload/device.h"
#include "offload/process_group.h"
#include "tests/synthetic_llama.h"

using namespace lorapipe;
using clk = std::chrono::steady_clock;

namespace {

struct setup {
  int64_t dim = 512, layers = 8, batch = 8, seq = 128;
  int warmup = 2, steps = 8;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Runs warmup + steps steps; group null: both positions here. Returns the measured step times.
std::vector<double> run(const setup& s, process_group* group) {
  const auto mc = synthetic_llama_config(s.dim, s.dim * 8 / 3 / 64 * 64, s.layers, 4096);
  const auto w = random_llama(mc, 11);
  lora_config lc;
  lc.r = 8;
  lc.alpha = 16;
  auto lora = init_lora(w, lc, 5);
  schedule_options so;
  so.devices = 2;
  so.micro_batches = 4;
  auto prog = make_schedule("1f1b", static_cast<int32_t>(s.layers), so).value();
  cpu_device_options dopt;
  dopt.compute_threads = 1;
  auto owned = make_devices("cpu:2", dopt).value();
  pipeline_options po;
  std::vector<compute_device*> devs{owned[0].get(), owned[1].get()};
  if (group != nullptr) {
    po.processes = {group, {0, 1}};
    devs[static_cast<size_t>(1 - group->rank())] = nullptr;
  }
  pipeline_executor ex(w, lora, prog, devs, adamw_config{}, po);
  torch::manual_seed(3);
  const auto t = torch::randint(3, 4096, {s.batch, s.seq + 1}, torch::kLong);  // i64 [B,T+1]
  std::vector<micro_batch> mbs;
  auto xs = t.slice(1, 0, s.seq).chunk(4), ys = t.slice(1, 1).chunk(4);
  for (int i = 0; i < 4; ++i) mbs.push_back({xs[i].contiguous(), ys[i].contiguous()});
  std::vector<double> times;
  for (int i = 0; i < s.warmup + s.steps; ++i) {
    const auto t0 = clk::now();
    auto r = ex.step(mbs, 1e-3, 1.0);
    if (!r.ok()) {
      std::fprintf(stderr, "step failed: %s\n", r.message().c_str());
      std::exit(1);
    }
    if (i >= s.warmup) times.push_back(std::chrono::duration<double>(clk::now() - t0).count());
  }
  return times;
}

rendezvous_options rendezvous(int rank, uint16_t port) {
  rendezvous_options o;
  o.rank = rank;
  o.world = 2;
  o.port = port;
  o.timeout = std::chrono::milliseconds(120000);
  o.config_hash = "bench_dist";
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  setup s;
  int rank1_port = -1;
  CLI::App app{"one pipeline in one process vs two processes"};
  app.add_option("--dim", s.dim);
  app.add_option("--layers", s.layers);
  app.add_option("--steps", s.steps);
  app.add_option("--rank1", rank1_port, "(internal) run as rank 1 of the two-process configuration");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  if (rank1_port >= 0) {
    auto g = process_group::join(rendezvous(1, static_cast<uint16_t>(rank1_port)));
    if (!g.ok()) return std::fprintf(stderr, "rank 1: %s\n", g.message().c_str()), 1;
    run(s, g->get());
    (void)(*g)->store_set("bytes_to_0", std::to_string((*g)->bytes_sent(0)));
    return (*g)->barrier().ok() ? 0 : 1;
  }
  fmt::print("Distributed bench: synthetic Llama dim {} x {} layers, batch {} x {} tokens, 1F1B x4 on 2 device positions (1 thread each), "
             "{} steps after {} warm-up\n", s.dim, s.layers, s.batch, s.seq, s.steps, s.warmup);
  const double one_a = median(run(s, nullptr));
  std::unique_ptr<child_process> peer;
  auto o = rendezvous(0, 0);
  o.on_listening = [&](uint16_t port) {
    peer = std::make_unique<child_process>(std::vector<std::string>{"/proc/self/exe", "--dim", std::to_string(s.dim), "--layers",
                                                                    std::to_string(s.layers), "--steps", std::to_string(s.steps),
                                                                    "--rank1", std::to_string(port)});
  };
  auto g = process_group::join(o);
  if (!g.ok()) return std::fprintf(stderr, "%s\n", g.message().c_str()), 1;
  const double two = median(run(s, g->get()));
  const int n = s.warmup + s.steps;
  const double to1 = static_cast<double>((*g)->bytes_sent(1)) / n;
  auto from1 = (*g)->store_get("bytes_to_0");
  (void)(*g)->barrier();
  g->reset();
  const double one_b = median(run(s, nullptr));
  const double one = 0.5 * (one_a + one_b);
  fmt::print("one process, two devices:   step {:.4f} s (before {:.4f}, after {:.4f})\n", one, one_a, one_b);
  fmt::print("two processes, one each:    step {:.4f} s\n", two);
  fmt::print("ratio two processes / one:  {:.3f}\n", two / one);
  fmt::print("bytes per step, rank 0 -> 1: {:.2f} MiB (activations); rank 1 -> 0: {:.2f} MiB (gradients)\n", to1 / 1048576.0,
             from1.ok() ? std::stod(*from1) / n / 1048576.0 : -1.0);
  return 0;
}
