// The CUDA pipeline device on a real GPU: the preallocated weight arena (placement, upload, reuse
// after the release fence), exact-size pinned staging, the peer transport between two pipeline
// devices on one GPU, and whole pipeline steps on cuda:0,0 (and cuda:0,1 with peer and NCCL
// transports when two GPUs exist) against the single-device CPU run of stories260K.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/errors.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule.h"
#include "core/pipeline/transport.h"
#include "offload/cuda/cuda_resources.h"
#include "offload/device.h"
#include "offload/device_probe.h"
#include "tests/test_paths.h"

using namespace lorapipe;

namespace {
size_t pinned_budget = 0;  // 0: the default (half of RAM); set by the bounce-buffer test
std::vector<std::unique_ptr<compute_device>> cuda_devices(const std::string& spec) {
  cpu_device_options o;
  o.capacity_bytes = size_t{2} << 30;
  o.pinned_budget_bytes = pinned_budget;
  auto d = make_devices(spec, o);
  EXPECT_TRUE(d.ok()) << (d.ok() ? "" : d.message());
  return d.ok() ? std::move(*d) : std::vector<std::unique_ptr<compute_device>>{};
}
}  // namespace

TEST(CudaPipelineDevice, WeightArenaUploadsAndReusesBlocksAfterTheFence) {
  auto devs = cuda_devices("cuda:0");
  ASSERT_EQ(devs.size(), 1u);
  auto& dev = *devs[0];
  ASSERT_TRUE(dev.reserve_weight_arena(8 << 20).ok());
  dev.enter_compute_thread();
  auto a = torch::randn({1024, 1024});  // f32 [1024,1024]: 4 MiB
  auto b = torch::randn({1024, 1024});
  at::Tensor sum_a;
  {
    auto p = dev.place_weights({a});
    ASSERT_TRUE(p.ok()) << p.message();
    auto up = dev.upload_weights(*p, {a});
    EXPECT_EQ(up[0].device().type(), c10::DeviceType::CUDA);
    EXPECT_EQ(static_cast<char*>(up[0].data_ptr()), p->base);
    // Queue work that reads the block, then drop it: the next upload into the same range must wait.
    auto y = up[0];
    for (int i = 0; i < 20; ++i) y = torch::matmul(y, up[0]) * 1e-3;
    sum_a = y.sum();
  }
  auto p2 = dev.place_weights({b});
  ASSERT_TRUE(p2.ok()) << p2.message();
  auto up2 = dev.upload_weights(*p2, {b});
  EXPECT_TRUE(torch::equal(up2[0].cpu(), b));
  // Recompute the same chain on the CPU: had b overwritten a early, this would differ.
  auto y = a;
  for (int i = 0; i < 20; ++i) y = torch::matmul(y, a) * 1e-3;
  EXPECT_NEAR(sum_a.item<double>(), y.sum().item<double>(), 1e-3 * std::abs(y.sum().item<double>()) + 1e-6);
}

TEST(CudaPipelineDevice, PinnedStagingIsExactAndPeerCopyOnOneGpu) {
  auto devs = cuda_devices("cuda:0,0");
  ASSERT_EQ(devs.size(), 2u);
  devs[0]->enter_compute_thread();
  auto x = torch::randn({3, 7, 11}).cuda();
  auto host = devs[0]->copy_out(x);
  EXPECT_TRUE(host.is_pinned());
  EXPECT_TRUE(torch::equal(host, x.cpu()));
  EXPECT_EQ(devs[0]->staging().reserved_bytes, 3u * 7 * 11 * 4);  // exact, no rounding
  host.reset();
  auto again = devs[0]->copy_out(x);
  EXPECT_EQ(devs[0]->staging().hits, 1u);
  auto moved = devs[1]->copy_from_peer(*devs[0], x);
  EXPECT_TRUE(torch::equal(moved.cpu(), x.cpu()));
}

namespace {
void pipeline_matches_cpu(const std::string& spec, const std::string& schedule, const std::string& transport) {
  auto w_cpu = load_llama(test_data_dir() / "models/stories260K/hf", {at::kFloat}).value();
  lora_config lc;
  lc.r = 4;
  lc.alpha = 8;
  lc.targets = {lora_target::q, lora_target::v, lora_target::gate};
  auto ref = init_lora(w_cpu, lc, 5);
  auto pipe_lora = init_lora(w_cpu, lc, 5);
  {
    torch::NoGradGuard ng;
    auto g1 = at::make_generator<at::CPUGeneratorImpl>(17), g2 = at::make_generator<at::CPUGeneratorImpl>(17);
    for (auto& p : ref.parameters()) p.uniform_(-0.2, 0.2, g1);
    for (auto& p : pipe_lora.parameters()) p.uniform_(-0.2, 0.2, g2);
  }
  torch::manual_seed(3);
  auto t = torch::randint(3, 512, {8, 33}, torch::kLong);
  auto x = t.slice(1, 0, 32).contiguous(), y = t.slice(1, 1).contiguous();
  causal_lm_loss(forward(w_cpu, &ref, x, 0, nullptr, true), y).backward();

  auto devs = cuda_devices(spec);
  ASSERT_FALSE(devs.empty());
  std::vector<compute_device*> raw;
  for (auto& d : devs) raw.push_back(d.get());
  schedule_options o;
  o.devices = static_cast<int32_t>(raw.size());
  o.micro_batches = 4;
  auto prog = make_schedule(schedule, 5, o).value();
  pipeline_options po;
  po.transports = choose_transports(prog, facts_of(raw), transport, gpu_peer_access, nccl_available()).value();
  if (transport == "nccl") {
    ASSERT_TRUE(enable_nccl(raw, nccl_links(po.transports)).ok());
  }
  pipeline_executor ex(w_cpu, pipe_lora, prog, raw, {}, po);
  std::vector<micro_batch> mbs;
  auto xs = x.chunk(4), ys = y.chunk(4);
  for (int i = 0; i < 4; ++i) mbs.push_back({xs[i].contiguous(), ys[i].contiguous()});
  auto r = ex.step(mbs, 0.0, 0.0, false);
  ASSERT_TRUE(r.ok()) << r.message();
  double worst = 0;
  auto a = pipe_lora.parameters(), b = ref.parameters();
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, ((a[i].grad().cpu() - b[i].grad()).abs().max() / b[i].grad().abs().max().clamp_min(1e-30)).item<double>());
  std::printf("%s %s %s: LoRA grads max rel diff vs CPU single device %.2e\n", spec.c_str(), schedule.c_str(), transport.c_str(), worst);
  EXPECT_LE(worst, 1e-4);  // TF32 is off by default in LibTorch matmuls; cuBLAS vs MKL summation order
}
}  // namespace

TEST(CudaPipeline, TwoPipelineDevicesOnOneGpuMatchTheCpuRun) {
  for (const auto& s : {"gpipe", "1f1b", "round-robin"}) {
    pipeline_matches_cpu("cuda:0,0", s, "auto");
    pipeline_matches_cpu("cuda:0,0", s, "host");
  }
}

// A pinned budget of one byte: no weight can be page-locked, every PREFETCH goes through the pinned
// bounce buffers, and the step still matches the CPU run.
TEST(CudaPipeline, WeightsBeyondThePinnedBudgetGoThroughTheBounceBuffer) {
  pinned_budget = 1;
  pipeline_matches_cpu("cuda:0,0", "round-robin", "host");
  pinned_budget = 0;
}

TEST(CudaPipeline, TwoGpusWithPeerAndNcclTransports) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  pipeline_matches_cpu("cuda:0,1", "1f1b", "host");
  if (gpu_peer_access(0, 1) && gpu_peer_access(1, 0)) pipeline_matches_cpu("cuda:0,1", "1f1b", "peer");
  if (nccl_available()) pipeline_matches_cpu("cuda:0,1", "round-robin", "nccl");
}

// A device that fails in the middle of an NCCL 1F1B step on two GPUs: its peer waits on the GPU for
// a transfer that never comes; the failure aborts the communicators and the step ends with the error
// within the watchdog's bound instead of hanging (before: only a second Ctrl-C ended the process).
TEST(CudaPipeline, NcclFailureEndsTheStep) {
  if (cuda::device_count() < 2 || !nccl_available()) GTEST_SKIP() << "needs two GPUs and NCCL";
  auto w_cpu = load_llama(test_data_dir() / "models/stories260K/hf", {at::kFloat}).value();
  lora_config lc;
  lc.r = 4;
  lc.alpha = 8;
  lc.targets = {lora_target::q, lora_target::v};
  auto lora = init_lora(w_cpu, lc, 5);
  auto devs = cuda_devices("cuda:0,1");
  std::vector<compute_device*> raw{devs[0].get(), devs[1].get()};
  schedule_options o;
  o.devices = 2;
  o.micro_batches = 4;
  auto prog = make_schedule("1f1b", 5, o).value();
  pipeline_options po;
  po.transports = choose_transports(prog, facts_of(raw), "nccl", gpu_peer_access, true).value();
  po.watchdog_s = 20;
  std::atomic<int> n{0};
  po.probe = [&](const char*) {
    if (++n == 25) throw device_error("injected failure");
  };
  ASSERT_TRUE(enable_nccl(raw, nccl_links(po.transports)).ok());
  pipeline_executor ex(w_cpu, lora, prog, raw, {}, po);
  torch::manual_seed(3);
  auto t = torch::randint(3, 512, {8, 33}, torch::kLong);
  std::vector<micro_batch> mbs;
  auto xs = t.slice(1, 0, 32).chunk(4), ys = t.slice(1, 1).chunk(4);
  for (int i = 0; i < 4; ++i) mbs.push_back({xs[i].contiguous(), ys[i].contiguous()});
  const auto t0 = std::chrono::steady_clock::now();
  auto r = ex.step(mbs, 0.0, 0.0, false);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("injected failure"), std::string::npos) << r.message();
  EXPECT_LT(s, 60.0);
  std::printf("NCCL step with a failing device ended after %.1f s: %s\n", s, r.message().c_str());
  n = -1000;  // no more injected failures: the aborted links say so instead of hanging
  auto again = ex.step(mbs, 0.0, 0.0, false);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.message().find("aborted"), std::string::npos) << again.message();
}

// The probe on a real GPU: the static facts from the driver and sysfs, timed pinned copies alone and
// with a second pipeline device on the same GPU, and a peer copy within the GPU.
TEST(CudaProbe, DescribesAndMeasuresTheGpu) {
  auto devs = cuda_devices("cuda:0,0");
  ASSERT_EQ(devs.size(), 2u);
  std::vector<compute_device*> raw{devs[0].get(), devs[1].get()};
  device_inventory inv = describe_inventory(raw);
  const auto& d = inv.devices[0];
  EXPECT_EQ(d.kind, "cuda");
  EXPECT_FALSE(d.gpu_name.empty());
  EXPECT_GT(d.total_bytes, size_t{1} << 30);
  EXPECT_GT(d.free_bytes, 0u);
  EXPECT_GT(d.sm_count, 0);
  EXPECT_GE(d.cc_major, 7);
  EXPECT_EQ(d.pci_bus_id.size(), 12u) << d.pci_bus_id;  // 0000:01:00.0
  EXPECT_TRUE(inv.links[0].direct);  // the same GPU
  probe_options po;
  po.bytes = size_t{64} << 20;
  po.deadline_s = 60;
  measure_inventory(inv, raw, po);
  ASSERT_TRUE(inv.ok()) << inv.devices[0].error << inv.devices[1].error;
  EXPECT_TRUE(inv.complete);
  std::printf("%s", inventory_text(inv).c_str());
  EXPECT_GT(inv.devices[0].h2d_bytes_per_s, 1e9);  // any PCIe link moves more than 1 GB/s pinned
  EXPECT_GT(inv.devices[0].d2h_bytes_per_s, 1e9);
  EXPECT_GT(inv.devices[0].h2d_concurrent_bytes_per_s, 0);
  EXPECT_GT(inv.links[0].bytes_per_s, 0);
}
