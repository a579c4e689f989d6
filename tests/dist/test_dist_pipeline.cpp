// One pipeline over 2 and 4 processes (c10d Gloo on 127.0.0.1) against the same pipeline in one
// process: the loss and gradient norm of every step and the LoRA parameters after the last are the
// same, for GPipe, 1F1B and round-robin (pipeline_case.h; ranks other than 0 are
// lorapipe_dist_pipeline_peer processes writing what they trained to a file). And a rank killed
// mid-run: rank 0's step fails within the timeout naming it.
#include <gtest/gtest.h>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>
#include <torch/serialize.h>

#include "core/base/child_process.h"
#include "tests/dist/pipeline_case.h"
#include "tests/test_paths.h"

using namespace lorapipe;
using clk = std::chrono::steady_clock;

namespace {

std::string out_file(int rank) {
  return (std::filesystem::temp_directory_path() / fmt::format("lp_dist_{}_{}.pt", ::getpid(), rank)).string();
}

struct multi_run {
  result<dist_case::outcome> rank0 = make_error("not run");
  std::vector<std::unique_ptr<child_process>> peers;
};

// peer_dies_before: "N" (SIGKILL before step N) or "fail:N" (an error before step N) for the last rank.
multi_run run_ranks(const std::string& schedule, int devices, int world, int steps, int timeout_ms, const std::string& peer_dies_before = "") {
  multi_run m;
  rendezvous_options o;
  o.world = world;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.config_hash = schedule + "/" + std::to_string(devices);
  o.on_listening = [&](uint16_t port) {
    for (int r = 1; r < world; ++r) {
      std::vector<std::string> args{LORAPIPE_DIST_PIPELINE_PEER, test_data_dir().string(), schedule, std::to_string(devices),
                                    std::to_string(steps), std::to_string(r), std::to_string(world), std::to_string(port),
                                    std::to_string(timeout_ms), out_file(r)};
      if (!peer_dies_before.empty() && r == world - 1) args.push_back(peer_dies_before);
      m.peers.push_back(std::make_unique<child_process>(args, out_file(r) + ".err"));
    }
  };
  auto g = process_group::join(o);
  if (!g.ok()) {
    m.rank0 = g.err();
    return m;
  }
  m.rank0 = dist_case::run(test_data_dir().string(), schedule, devices, steps, g->get());
  return m;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

// Every rank's losses and norms equal the one-process run's; each layer's LoRA parameters equal
// the reference's on the rank that trained it, and every layer was trained by exactly one rank.
void expect_same_as_one_process(const std::string& schedule, int devices, int world) {
  SCOPED_TRACE(fmt::format("{} on cpu:{} over {} processes", schedule, devices, world));
  at::set_num_threads(1);
  const int steps = 3;
  auto ref = dist_case::run(test_data_dir().string(), schedule, devices, steps, nullptr);
  ASSERT_TRUE(ref.ok()) << ref.message();
  auto m = run_ranks(schedule, devices, world, steps, 30000);
  ASSERT_TRUE(m.rank0.ok()) << m.rank0.message();
  std::vector<int> trained_by(5, -1);
  auto take = [&](int rank, const std::vector<double>& losses, const std::vector<double>& norms, const std::vector<int32_t>& layers,
                  const std::vector<at::Tensor>& lora) {
    ASSERT_EQ(losses.size(), static_cast<size_t>(steps));
    for (int s = 0; s < steps; ++s) {
      EXPECT_NEAR(losses[s], ref->losses[s], 1e-6 * std::abs(ref->losses[s])) << "rank " << rank << " step " << s;
      EXPECT_NEAR(norms[s], ref->norms[s], 1e-5 * std::abs(ref->norms[s])) << "rank " << rank << " step " << s;
    }
    for (int32_t l : layers) {
      EXPECT_EQ(trained_by[l], -1) << "layer " << l << " trained twice";
      trained_by[l] = rank;
    }
    ASSERT_EQ(lora.size(), ref->lora.size());
    for (size_t i = 0; i < lora.size(); ++i)
      if (trained_by[ref->param_layer[i]] == rank) EXPECT_LT(rel(lora[i], ref->lora[i]), 1e-5) << "rank " << rank << " parameter " << i;
  };
  take(0, m.rank0->losses, m.rank0->norms, m.rank0->layers, m.rank0->lora);
  for (int r = 1; r < world; ++r) {
    auto& p = *m.peers[static_cast<size_t>(r - 1)];
    ASSERT_EQ(p.wait(std::chrono::seconds(60)).value_or(-1000), 0) << p.stderr_text();
    std::vector<at::Tensor> saved;
    torch::load(saved, out_file(r));
    std::filesystem::remove(out_file(r));
    ASSERT_GE(saved.size(), 3u);
    auto vec = [](const at::Tensor& t) { return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel()); };
    std::vector<int32_t> layers;
    for (int64_t i = 0; i < saved[2].numel(); ++i) layers.push_back(static_cast<int32_t>(saved[2][i].item<int64_t>()));
    take(r, vec(saved[0]), vec(saved[1]), layers, std::vector<at::Tensor>(saved.begin() + 3, saved.end()));
  }
  for (int l = 0; l < 5; ++l) EXPECT_GE(trained_by[l], 0) << "layer " << l << " trained by no rank";
  // The steps changed the parameters (the comparison above is not of untouched initial values).
  auto init = dist_case::run(test_data_dir().string(), schedule, devices, 0, nullptr);
  EXPECT_GT(rel(ref->lora[0], init->lora[0]), 1e-3);
}

}  // namespace

TEST(DistPipeline, TwoProcessesTrainLikeOne) {
  for (const char* s : {"gpipe", "1f1b", "round-robin"}) expect_same_as_one_process(s, 2, 2);
}

TEST(DistPipeline, FourProcessesTrainLikeOne) {
  for (const char* s : {"1f1b", "round-robin"}) expect_same_as_one_process(s, 4, 4);
}

TEST(DistPipeline, TwoDevicesPerProcess) { expect_same_as_one_process("1f1b", 4, 2); }

TEST(DistPipeline, ARankKilledMidRunFailsTheStepNamingIt) {
  at::set_num_threads(1);
  const auto t0 = clk::now();
  auto m = run_ranks("1f1b", 2, 2, 3, 5000, /*peer dies before step*/ "1");
  const double took = std::chrono::duration<double>(clk::now() - t0).count();
  ASSERT_FALSE(m.rank0.ok());
  EXPECT_NE(m.rank0.message().find("rank 1"), std::string::npos) << m.rank0.message();
  // The dead rank's last report: an instruction of its device completed in step 0.
  EXPECT_NE(m.rank0.message().find("rank 1 last reported: cpu:1 completed "), std::string::npos) << m.rank0.message();
  std::printf("rank 1 killed before step 1: rank 0 after %.2f s: %s\n", took, m.rank0.message().c_str());
  EXPECT_LT(took, 5.0 + 15.0);
  EXPECT_EQ(m.peers[0]->wait(std::chrono::seconds(10)).value_or(-1000), -SIGKILL);
}

// A rank that fails without dying leaves its error in the store: rank 0's error quotes it.
TEST(DistPipeline, ARankThatFailsPassesItsErrorOn) {
  at::set_num_threads(1);
  const auto t0 = clk::now();
  auto m = run_ranks("1f1b", 2, 2, 3, 5000, "fail:1");
  const double took = std::chrono::duration<double>(clk::now() - t0).count();
  ASSERT_FALSE(m.rank0.ok());
  EXPECT_NE(m.rank0.message().find("rank 1 last reported: failed: injected failure before step 1"), std::string::npos)
      << m.rank0.message();
  std::printf("rank 1 failed before step 1: rank 0 after %.2f s: %s\n", took, m.rank0.message().c_str());
  EXPECT_EQ(m.peers[0]->wait(std::chrono::seconds(10)).value_or(-1000), 4);
}
