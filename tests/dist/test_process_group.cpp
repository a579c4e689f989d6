// Process groups over c10d on 127.0.0.1: the other ranks are lorapipe_dist_peer processes (every
// child is killed and reaped by the test, whatever happens). Checks the bytes that cross (f32, bf16,
// i64: Debian's Gloo headers against LibTorch's Gloo would garble or crash here), collectives over 2
// and 4 processes, the refusal of a rank with another project, and that a killed, hung or missing
// rank becomes an error naming it within the timeout.
#include <gtest/gtest.h>


#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "offload/process_group.h"
#include "core/base/child_process.h"

using namespace lorapipe;
using clk = std::chrono::steady_clock;

namespace {

std::filesystem::path err_file(int rank) {
  return std::filesystem::temp_directory_path() / ("lp_peer_" + std::to_string(::getpid()) + "_" + std::to_string(rank));
}

struct world_of {
  std::vector<std::unique_ptr<child_process>> peers;
  result<std::unique_ptr<process_group>> rank0 = make_error("not joined");
  // Rank 0 here; ranks 1..world-1 run `mode` (hashes[r] if given, else "same").
  world_of(const std::string& mode, int world, int timeout_ms, std::vector<std::string> hashes = {}) {
    rendezvous_options o;
    o.world = world;
    o.config_hash = "same";
    o.timeout = std::chrono::milliseconds(timeout_ms);
    o.on_listening = [&](uint16_t port) {
      for (int r = 1; r < world; ++r)
        peers.push_back(std::make_unique<child_process>(
            std::vector<std::string>{LORAPIPE_DIST_PEER, mode, std::to_string(r), std::to_string(world), std::to_string(port),
                                     hashes.empty() ? "same" : hashes[static_cast<size_t>(r)], std::to_string(timeout_ms)},
            err_file(r)));
    };
    rank0 = process_group::join(o);
  }
};

}  // namespace

TEST(ProcessGroup, TwoProcessesMoveTensorsExactlyAndReduce) {
  world_of w("exchange", 2, 20000);
  ASSERT_TRUE(w.rank0.ok()) << w.rank0.message();
  auto& g = **w.rank0;
  EXPECT_EQ(g.rank(), 0);
  EXPECT_EQ(g.world(), 2);
  EXPECT_GT(g.port(), 0);
  const auto x = torch::randn({4, 1024});  // f32 [4,1024]
  ASSERT_TRUE(g.send(x, 1, 1).ok());
  auto y = torch::empty({4, 1024});
  auto s = g.recv(y, 1, 2);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(torch::equal(y, x * 2 + 1));
  const auto h = torch::randn({3, 5}).to(torch::kBFloat16);  // bf16 [3,5]
  ASSERT_TRUE(g.send(h, 1, 3).ok());
  auto h2 = torch::empty({3, 5}, torch::kBFloat16);
  ASSERT_TRUE(g.recv(h2, 1, 4).ok());
  EXPECT_TRUE(torch::equal(h2, h));
  auto sum = torch::full({2}, 1.0f);  // f32 [2]: rank 0 adds 1, rank 1 adds 2
  ASSERT_TRUE(g.all_reduce_sum(sum).ok());
  EXPECT_EQ(sum[0].item<float>(), 3.0f);
  auto b = torch::arange(6, torch::kInt64) * 7;  // i64 [6]
  ASSERT_TRUE(g.broadcast(b, 0).ok());
  auto back = torch::empty({6}, torch::kInt64);
  ASSERT_TRUE(g.recv(back, 1, 5).ok());
  EXPECT_TRUE(torch::equal(back, torch::arange(6, torch::kInt64) * 7));
  ASSERT_TRUE(g.barrier().ok());
  EXPECT_EQ(w.peers[0]->wait(std::chrono::seconds(20)).value_or(-1000), 0) << w.peers[0]->stderr_text();
}

TEST(ProcessGroup, FourProcessesPassARingAndReduce) {
  world_of w("ring", 4, 20000);
  ASSERT_TRUE(w.rank0.ok()) << w.rank0.message();
  auto& g = **w.rank0;
  auto mine = torch::zeros({1000}), theirs = torch::empty({1000});  // f32 [1000]
  auto sent = g.isend(mine, 1, 7);
  ASSERT_TRUE(sent.ok()) << sent.message();
  ASSERT_TRUE(g.recv(theirs, 3, 7).ok());
  ASSERT_TRUE(sent->wait().ok());
  EXPECT_TRUE(torch::equal(theirs, torch::full({1000}, 3.0f)));
  auto sum = torch::full({2}, 1.0f);
  ASSERT_TRUE(g.all_reduce_sum(sum).ok());
  EXPECT_EQ(sum[1].item<float>(), 10.0f);  // 1+2+3+4
  auto b = torch::arange(6, torch::kInt64);
  ASSERT_TRUE(g.broadcast(b, 0).ok());
  ASSERT_TRUE(g.barrier().ok());
  for (auto& p : w.peers) EXPECT_EQ(p->wait(std::chrono::seconds(20)).value_or(-1000), 0) << p->stderr_text();
}

TEST(ProcessGroup, ARankWithAnotherProjectIsRefusedOnEveryRank) {
  world_of w("exchange", 3, 20000, {"same", "same", "other"});
  ASSERT_FALSE(w.rank0.ok());
  EXPECT_NE(w.rank0.message().find("rank 2 runs another project than rank 0"), std::string::npos) << w.rank0.message();
  std::printf("refused: %s\n", w.rank0.message().c_str());
  EXPECT_EQ(w.peers[1]->wait(std::chrono::seconds(20)).value_or(-1000), 2);
  EXPECT_NE(w.peers[1]->stderr_text().find("rank 2 runs another project"), std::string::npos) << w.peers[1]->stderr_text();
  EXPECT_EQ(w.peers[0]->wait(std::chrono::seconds(20)).value_or(-1000), 2);  // the matching rank refuses too
  EXPECT_NE(w.peers[0]->stderr_text().find("rank 2 runs another project"), std::string::npos) << w.peers[0]->stderr_text();
}

namespace {
// Rank 0 receives from rank 1 (nothing will come): the error and how long it took.
std::pair<status, double> timed_recv_from_1(process_group& g) {
  const auto t0 = clk::now();
  auto y = torch::empty({16});
  auto s = g.recv(y, 1, 1);
  return {std::move(s), std::chrono::duration<double>(clk::now() - t0).count()};
}
}  // namespace

namespace {
// Until rank r's progress report has reached the store (a hanging peer reports, then sleeps).
std::string await_report(process_group& g, int r) {
  const auto end = clk::now() + std::chrono::seconds(10);
  std::string t;
  while ((t = g.last_report(r)).empty() && clk::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return t;
}
}  // namespace

TEST(ProcessGroup, AKilledRankIsNamedWithinTheTimeout) {
  world_of w("hang", 2, 5000);
  ASSERT_TRUE(w.rank0.ok()) << w.rank0.message();
  EXPECT_EQ(await_report(**w.rank0, 1), "hanging as asked (rank 1): cpu:1 completed F s0 m1");
  w.peers[0]->kill();
  auto [s, took] = timed_recv_from_1(**w.rank0);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("receive from rank 1"), std::string::npos) << s.message();
  // What the dead rank did last, from its report in the store.
  EXPECT_NE(s.message().find("(rank 1 last reported: hanging as asked (rank 1): cpu:1 completed F s0 m1)"), std::string::npos)
      << s.message();
  std::printf("killed rank, after %.2f s: %s\n", took, s.message().c_str());
  EXPECT_LT(took, 5.0 + 5.0) << s.message();  // the timeout, with a wide margin for a loaded machine
  EXPECT_EQ(w.peers[0]->wait(std::chrono::seconds(5)).value_or(-1000), -SIGKILL);
}

TEST(ProcessGroup, ARankKilledBeforeACollectiveIsNamed) {
  world_of w("hang", 3, 5000);
  ASSERT_TRUE(w.rank0.ok()) << w.rank0.message();
  EXPECT_FALSE(await_report(**w.rank0, 1).empty());
  EXPECT_FALSE(await_report(**w.rank0, 2).empty());
  w.peers[1]->kill();  // rank 2
  (void)w.peers[1]->wait(std::chrono::seconds(5));
  w.peers[0]->kill();  // rank 1 as well: rank 0 is the only survivor
  (void)w.peers[0]->wait(std::chrono::seconds(5));
  auto sum = torch::ones({4});
  const auto t0 = clk::now();
  auto s = (*w.rank0)->all_reduce_sum(sum);
  const double took = std::chrono::duration<double>(clk::now() - t0).count();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("ranks 1, 2 are gone (no word from them after the failure; rank 1 last reported: hanging as asked (rank 1): "
                             "cpu:1 completed F s0 m1; rank 2 last reported: hanging as asked (rank 2): cpu:2 completed F s0 m1)"),
            std::string::npos)
      << s.message();
  std::printf("collective after two ranks were killed, after %.2f s: %s\n", took, s.message().c_str());
  EXPECT_LT(took, 5.0 + 8.0);
}

TEST(ProcessGroup, AHungRankTimesOutNamingIt) {
  world_of w("hang", 2, 1500);
  ASSERT_TRUE(w.rank0.ok()) << w.rank0.message();
  auto [s, took] = timed_recv_from_1(**w.rank0);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("receive from rank 1"), std::string::npos) << s.message();
  std::printf("hung rank, after %.2f s: %s\n", took, s.message().c_str());
  EXPECT_GT(took, 1.0);
  EXPECT_LT(took, 1.5 + 8.0) << s.message();
}

// Rank 0 stopped (SIGSTOP: its rendezvous store answers nobody): rank 1's collective fails after the
// timeout, then names rank 0 within seconds, and the group can be destroyed. (A TCPStore client's
// check() then blocks in recv for ever: the failure bookkeeping goes through store_agent, which gives
// up after its deadline.)
TEST(ProcessGroup, AStoppedRankZeroIsNamedWithinTheTimeoutAndSeconds) {
  const int timeout_ms = 6000;
  int port = 0;
  {  // a free port for the child's store
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port = ntohs(a.sin_port);
    ::close(fd);
  }
  child_process zero({LORAPIPE_DIST_PEER, "hang", "0", "2", std::to_string(port), "same", std::to_string(timeout_ms)}, err_file(20));
  rendezvous_options o;
  o.rank = 1;
  o.world = 2;
  o.port = static_cast<uint16_t>(port);
  o.config_hash = "same";
  o.timeout = std::chrono::milliseconds(timeout_ms);
  auto g = process_group::join(o);
  ASSERT_TRUE(g.ok()) << g.message() << zero.stderr_text();
  ASSERT_FALSE(await_report(**g, 0).empty());  // rank 0 is past its join, hanging
  ASSERT_EQ(::kill(zero.pid(), SIGSTOP), 0);
  const auto t0 = clk::now();
  at::Tensor x = torch::ones({4});  // f32 [4]
  auto st = (*g)->all_reduce_sum(x);
  const double took = std::chrono::duration<double>(clk::now() - t0).count();
  (*g)->report_failure(st.message());  // as a failing rank does before it exits: seconds too
  const double took_all = std::chrono::duration<double>(clk::now() - t0).count();
  const auto t1 = clk::now();
  g->reset();  // rank 0 still stopped: the group goes without waiting on it (the agent's thread is let go)
  const double took_down = std::chrono::duration<double>(clk::now() - t1).count();
  ::kill(zero.pid(), SIGCONT);
  zero.kill();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rank 0 is gone"), std::string::npos) << st.message();
  std::printf("rank 0 stopped: failed after %.2f s, reported after %.2f s, group gone %.2f s later (timeout %.1f s): %s\n", took,
              took_all, took_down, timeout_ms / 1000.0, st.message().c_str());
  EXPECT_GT(took, timeout_ms / 1000.0 - 0.5);
  EXPECT_LT(took_all, timeout_ms / 1000.0 + 7.0);  // the timeout and one agent deadline (5 s); before: forever
  EXPECT_LT(took_down, 3.0);
}

// Three ranks in a chain: rank 0 receives from rank 1, which receives from rank 2. Rank 0's call
// times out on rank 1, but the cause is rank 2: the error leads with it, found by following the
// ranks each one waits on, whether rank 2 was stopped (no heartbeat) or is alive and stuck.
namespace {
enum class chain_end { stopped, stuck, left };
std::string chain_error(chain_end end) {
  world_of w(end == chain_end::left ? "relay-leave" : "relay", 3, 3000);
  if (!w.rank0.ok()) return "join: " + w.rank0.message();
  if (end != chain_end::left && await_report(**w.rank0, 2).empty()) return "rank 2 never reported";
  if (end == chain_end::stopped && ::kill(w.peers[1]->pid(), SIGSTOP) != 0) return "SIGSTOP failed";
  auto [s, took] = timed_recv_from_1(**w.rank0);
  std::printf("chain, rank 2 %s, after %.2f s: %s\n", end == chain_end::stopped ? "stopped" : end == chain_end::stuck ? "stuck" : "left", took,
              s.message().c_str());
  if (end == chain_end::stopped) ::kill(w.peers[1]->pid(), SIGCONT);
  EXPECT_LT(took, 3.0 + 2.0 + 8.0);  // the timeout, the heartbeat grace, a wide margin
  EXPECT_EQ(w.peers[0]->wait(std::chrono::seconds(20)).value_or(-1000), 4) << w.peers[0]->stderr_text();  // rank 1 failed too
  if (end == chain_end::left) {
    EXPECT_EQ(w.peers[1]->wait(std::chrono::seconds(20)).value_or(-1000), 0) << w.peers[1]->stderr_text();
  }
  return s.ok() ? "no error" : s.message();
}
}  // namespace

TEST(ProcessGroup, AStoppedRankFurtherAlongIsNamedNotTheNeighbour) {
  const std::string e = chain_error(chain_end::stopped);
  EXPECT_EQ(e.rfind("distributed: rank 2 does not respond (no heartbeat for 2.0 s", 0), 0) << e;
  // Rank 0's own call timed out, or failed when rank 1 gave up first (it waited longer): either way.
  EXPECT_NE(e.find("rank 0: receive from rank 1 (tag 1) "), std::string::npos) << e;
  EXPECT_NE(e.find("rank 2 last reported: hanging as asked (rank 2): cpu:2 completed F s0 m1"), std::string::npos) << e;
  EXPECT_EQ(e.find("rank 1 does not"), std::string::npos) << e;
}

TEST(ProcessGroup, AStuckRankFurtherAlongIsNamedNotTheNeighbour) {
  const std::string e = chain_error(chain_end::stuck);
  EXPECT_EQ(e.rfind("distributed: rank 2 is alive and not waiting on another rank's send or receive", 0), 0) << e;
  // What rank 1 was doing: still waiting on rank 2, or its own failure doing so (a race either way).
  const auto r1 = e.find("rank 1 last reported: ");
  ASSERT_NE(r1, std::string::npos) << e;
  EXPECT_NE(e.find("receive from rank 2 (tag 1)", r1), std::string::npos) << e;
  EXPECT_NE(e.find("rank 2 last reported: hanging as asked (rank 2)"), std::string::npos) << e;
}

// The end of the chain closes its process group without a failure (as a rank whose program ended
// does): it is named as having left, with what it did last, not as unresponsive.
TEST(ProcessGroup, ARankThatLeftFurtherAlongIsNamedAsLeft) {
  const std::string e = chain_error(chain_end::left);
  EXPECT_EQ(e.rfind("distributed: rank 2 left the group without reporting a failure", 0), 0) << e;
  EXPECT_NE(e.find("rank 2 last reported: left the group after: leaving as asked (rank 2): cpu:2 completed F s0 m1"), std::string::npos) << e;
  // What rank 1 was doing: waiting on rank 2, or its own failure doing so (whichever came first).
  const auto r1 = e.find("rank 1 last reported: ");
  ASSERT_NE(r1, std::string::npos) << e;
  EXPECT_NE(e.find("receive from rank 2 (tag 1)", r1), std::string::npos) << e;
  EXPECT_EQ(e.find("does not respond"), std::string::npos) << e;
}

// Two processes started as rank 1: the second is refused at once, naming the rank; a rank started
// for another world size is refused by rank 0, naming both sizes.
TEST(ProcessGroup, ARankTakenTwiceOrAnotherWorldSizeIsRefused) {
  rendezvous_options o;
  o.world = 3;
  o.config_hash = "same";
  o.timeout = std::chrono::milliseconds(1500);
  std::vector<std::unique_ptr<child_process>> ones;
  o.on_listening = [&](uint16_t port) {
    for (int i = 0; i < 2; ++i)
      ones.push_back(std::make_unique<child_process>(
          std::vector<std::string>{LORAPIPE_DIST_PEER, "exchange", "1", "3", std::to_string(port), "same", "1500"}, err_file(10 + i)));
  };
  auto g = process_group::join(o);
  ASSERT_FALSE(g.ok());  // rank 2 never comes
  EXPECT_NE(g.message().find("rank(s) 2 did not arrive"), std::string::npos) << g.message();
  int refused = 0;
  for (auto& p : ones) {
    (void)p->wait(std::chrono::seconds(20));
    refused += p->stderr_text().find("another process already joined the rendezvous") != std::string::npos &&
               p->stderr_text().find("as rank 1") != std::string::npos;
  }
  EXPECT_EQ(refused, 1) << ones[0]->stderr_text() << "\n" << ones[1]->stderr_text();

  rendezvous_options two = o;
  two.world = 2;
  std::unique_ptr<child_process> three;
  two.on_listening = [&](uint16_t port) {
    three = std::make_unique<child_process>(
        std::vector<std::string>{LORAPIPE_DIST_PEER, "exchange", "1", "3", std::to_string(port), "same", "1500"}, err_file(12));
  };
  auto h = process_group::join(two);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.message().find("rank 1 was started for 3 processes, rank 0 for 2"), std::string::npos) << h.message();
  (void)three->wait(std::chrono::seconds(20));
}

TEST(ProcessGroup, AMissingRankIsNamedAtTheRendezvous) {
  rendezvous_options o;
  o.world = 3;
  o.timeout = std::chrono::milliseconds(1500);
  std::unique_ptr<child_process> one;
  o.on_listening = [&](uint16_t port) {
    one = std::make_unique<child_process>(std::vector<std::string>{LORAPIPE_DIST_PEER, "hang", "1", "3", std::to_string(port), "", "1500"},
                                          err_file(1));
  };
  const auto t0 = clk::now();
  auto g = process_group::join(o);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.message().find("rank(s) 2 did not arrive"), std::string::npos) << g.message();
  EXPECT_LT(std::chrono::duration<double>(clk::now() - t0).count(), 1.5 + 8.0);
  auto bad = [] {
    rendezvous_options o;
    o.rank = 2;
    o.world = 2;
    return process_group::join(o);
  }();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("rank 2 is outside a world of 2"), std::string::npos);
}

// Threads that fail at once (a device thread and the trainer) may all report: nothing crashes (the
// publisher is joined once), and the first report stands instead of being overwritten by later ones.
TEST(ProcessGroup, FailuresReportedFromSeveralThreadsAtOnceKeepTheFirst) {
  for (int round = 0; round < 10; ++round) {
    rendezvous_options o;
    o.world = 1;
    o.config_hash = "same";
    o.timeout = std::chrono::milliseconds(3000);
    auto g = process_group::join(o);
    ASSERT_TRUE(g.ok()) << g.message();
    (*g)->report_context("step 1 of 2");
    std::atomic<int> go{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t] {
        ++go;
        while (go.load() < 4) std::this_thread::yield();
        (*g)->report_failure("thread " + std::to_string(t));
      });
    for (auto& t : threads) t.join();
    const std::string report = (*g)->last_report(0);
    EXPECT_EQ(report.rfind("failed: thread ", 0), 0u) << report;
    (*g)->report_failure("after the others");  // a later failure does not replace the first
    EXPECT_EQ((*g)->last_report(0), report);
  }
}
