// The layer profiler on a real GPU: stories260K in bfloat16 on cuda:0 (each layer's forward with and
// without autograd and its backward, the embedding and the head, timed between synchronisations),
// cached under its key (the GPU's name, compute capability, SMs and memory; not its free memory),
// and a plan that charges it.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "core/engine/compute_profile.h"
#include "core/engine/device_inventory.h"
#include "core/engine/plan_report.h"
#include "tests/test_paths.h"

using namespace lorapipe;

TEST(CudaProfile, ProfilesTheLayersOnTheGpuAndPlansWithThem) {
  const auto cache = std::filesystem::temp_directory_path() / fmt::format("lp_cuda_profile_{}", ::getpid());
  std::filesystem::remove_all(cache);
  project_config c;
  c.model.path = (test_data_dir() / "models/stories260K/hf").string();
  c.model.dtype = "bfloat16";
  c.data.train = (test_data_dir() / "text/tinyshakespeare.txt").string();
  c.parallel.devices = "cuda:0,0";
  c.parallel.schedule = "1f1b";
  c.parallel.micro_batches = 4;
  c.run.batch_size = 8;
  c.data.seq_len = 128;
  const llama_config mc = project_model_config(c).value();
  profile_request req;
  req.cache_dir = cache;
  req.options.min_seconds = 0.2;
  auto out = profile_project(c, mc, req);
  ASSERT_TRUE(out.ok()) << out.message();
  EXPECT_FALSE(out->from_cache);
  EXPECT_EQ(out->profile.device, "cuda:0");
  const auto& m = out->profile.compute;
  ASSERT_EQ(m.layer_forward_s.size(), 5u);
  for (size_t l = 0; l < 5; ++l) {
    EXPECT_GT(m.layer_forward_s[l], 0);
    EXPECT_GT(m.layer_backward_s[l], 0);
  }
  EXPECT_GT(m.head_forward_s, 0);
  EXPECT_GT(m.head_backward_s, 0);
  std::printf("%s", layer_profile_text(out->profile).c_str());
  auto again = profile_project(c, mc, req);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->from_cache);
  project_config on_cpu = c;
  on_cpu.parallel.devices = "cpu:2";
  EXPECT_NE(layer_profile_key(on_cpu, mc).value(), out->key);
  auto rep = make_plan(c, 100, nullptr, std::make_shared<const measured_compute>(m));
  ASSERT_TRUE(rep.ok()) << rep.message();
  EXPECT_NE(rep->compute.find("layer profile"), std::string::npos);
  EXPECT_GT(rep->sim.makespan_s, 0);
  std::printf("1f1b x4 on cuda:0,0 from the layer profile: step %.3f ms\n", rep->sim.makespan_s * 1e3);
  std::filesystem::remove_all(cache);
}

// Without offload.device_memory_mb the GPUs' free memory bounds what auto chooses: the inventory
// splits 90% of cuda:0's free memory between its two devices, the trainer's resolution plans within
// it, and a plan over it is refused before a run is recorded (check_project_memory); the choices
// cost copies at the GPU's PCIe estimate (or a cached probe).
TEST(CudaPlan, TheGpusFreeMemoryBoundsTheChoiceWithoutALimit) {
  project_config c;
  c.model.path = (test_data_dir() / "models/stories260K/hf").string();
  c.data.train = (test_data_dir() / "text/tinyshakespeare.txt").string();
  c.parallel.devices = "cuda:0,0";
  c.run.batch_size = 8;
  c.data.seq_len = 128;
  const auto inv = gpu_planning_inventory(c);
  ASSERT_TRUE(inv.has_value());
  ASSERT_EQ(inv->devices.size(), 2u);
  EXPECT_EQ(inv->devices[0].capacity_bytes, inv->devices[1].capacity_bytes);
  EXPECT_GT(inv->devices[0].capacity_bytes, size_t{64} << 20);
  // Its copy rates: a cached probe of this GPU, else its PCIe link's estimate (where sysfs tells it);
  // the choices cost copies at them.
  std::printf("cuda:0 PCIe gen %d x%d (up to gen %d x%d), planned at %.2f GB/s: %s\n", inv->devices[0].pcie_gen, inv->devices[0].pcie_width,
              inv->devices[0].pcie_max_gen, inv->devices[0].pcie_max_width, inv->devices[0].h2d_bytes_per_s / 1e9, inv->rates_from.c_str());
  if (inv->devices[0].pcie_max_gen > 0 || inv->devices[0].pcie_gen > 0) {
    EXPECT_GT(inv->devices[0].h2d_bytes_per_s, 1e9);
    EXPECT_NE(inv->rates_from, "");
    auto planned = make_plan(c, 100, &*inv);
    ASSERT_TRUE(planned.ok()) << planned.message();
    EXPECT_NE(planned->copy_rates, "");
  }
  auto resolved = resolve_project_schedule(c);
  ASSERT_TRUE(resolved.ok()) << resolved.message();
  EXPECT_NE(resolved->parallel.schedule, "auto");
  EXPECT_EQ(resolved->offload.device_memory_mb, 0);  // recorded as set
  auto rep = make_plan(*resolved, 100, &*inv);
  ASSERT_TRUE(rep.ok()) << rep.message();
  EXPECT_NEAR(rep->memory_bound_mb, inv->devices[0].capacity_bytes / 1048576.0, 1e-6);
  EXPECT_EQ(rep->memory_refusal, "");
  EXPECT_TRUE(check_project_memory(*resolved).ok());
  project_config huge = *resolved;  // a sequence no GPU holds the activations of
  huge.data.seq_len = 512;
  huge.run.batch_size = 8 << 14;
  huge.parallel.micro_batches = 2;
  const auto refused = check_project_memory(huge);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("GPU memory ("), std::string::npos) << refused.message();
}
