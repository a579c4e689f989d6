// Torch-free offload planning and memory: the exact-size staging pool, block layouts, the weight
// arena memory plan (double buffering, fixed slots against fragmentation, resident stages), the
// per-link transport choice, shared host links' turns, and the cuBLAS workspaces a GPU plan charges.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "core/pipeline/cost_model.h"
#include "core/pipeline/partition_search.h"
#include "core/pipeline/schedule.h"
#include "core/pipeline/schedule_sim.h"
#include "core/pipeline/transport.h"
#include "offload/device_facts.h"
#include "offload/copy_engine.h"
#include "offload/memory_arena.h"
#include "offload/pinned_registry.h"
#include "offload/staging_pool.h"
#include "tests/test_paths.h"

using namespace lorapipe;

TEST(StagingPool, ExactSizesAreReusedNeverRounded) {
  std::vector<size_t> allocated;
  int freed = 0;
  auto pool = staging_pool::create(
      "t", [&](size_t n) { allocated.push_back(n); return std::malloc(n); }, [&](void* p) { ++freed; std::free(p); });
  {
    auto a = pool->acquire(1000), b = pool->acquire(1000), c = pool->acquire(3001);
    EXPECT_NE(a.get(), b.get());
    EXPECT_EQ(pool->stats().in_use_bytes, 5001u);
  }
  EXPECT_EQ(allocated, (std::vector<size_t>{1000, 1000, 3001}));  // exactly what was asked
  auto st = pool->stats();
  EXPECT_EQ(st.in_use_bytes, 0u);
  EXPECT_EQ(st.reserved_bytes, 5001u);
  EXPECT_EQ(st.peak_in_use_bytes, 5001u);
  EXPECT_EQ(st.misses, 3u);
  // The next "step" asks for the same shapes: all hits, nothing new from the system.
  for (int step = 0; step < 3; ++step) {
    auto a = pool->acquire(1000), b = pool->acquire(3001), c = pool->acquire(1000);
  }
  EXPECT_EQ(allocated.size(), 3u);
  EXPECT_EQ(pool->stats().hits, 9u);
  auto odd = pool->acquire(1001);  // a size never seen: a new exact block
  EXPECT_EQ(allocated.back(), 1001u);
  odd.reset();
  pool->trim();
  EXPECT_EQ(freed, 4);
  EXPECT_EQ(pool->stats().reserved_bytes, 0u);
}

TEST(StagingPool, CacheCapAndBlocksOutlivingThePool) {
  int freed = 0;
  auto pool = staging_pool::create("t", [](size_t n) { return std::malloc(n); }, [&](void* p) { ++freed; std::free(p); }, 1500);
  auto a = pool->acquire(1000), b = pool->acquire(1000);
  a.reset();  // cached (1000 <= 1500)
  b.reset();  // over the cap: back to the system
  EXPECT_EQ(freed, 1);
  EXPECT_EQ(pool->stats().reserved_bytes, 1000u);
  auto c = pool->acquire(10);
  std::weak_ptr<staging_pool> w = pool;
  pool.reset();
  EXPECT_FALSE(w.expired());  // the live block keeps its pool
  c.reset();
  EXPECT_TRUE(w.expired());
  EXPECT_EQ(freed, 3);
  // Many threads acquiring and releasing the same sizes (the copy engines do this).
  auto shared = staging_pool::create("mt", [](size_t n) { return std::malloc(n); }, [](void* p) { std::free(p); });
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 500; ++i) auto blk = shared->acquire(64 + (i % 3));
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(shared->stats().in_use_bytes, 0u);
  EXPECT_LE(shared->stats().misses, 12u);  // at most one block per size per thread
}

TEST(WeightArenaPlan, LayoutAndHighWater) {
  auto l = layout_block({400, 28, 0, 256}, 256);
  EXPECT_EQ(l.offsets, (std::vector<size_t>{0, 512, 768, 768}));
  EXPECT_EQ(l.bytes, 1024u);
  memory_arena a("t", 10000, 100);
  auto x = a.allocate(300), y = a.allocate(300);
  a.release(*x);
  auto z = a.allocate(200);  // best fit: the 300-byte hole, not the tail
  EXPECT_EQ(*z, 0u);
  EXPECT_EQ(a.high_water(), 600u);
  (void)y;
}

TEST(WeightArenaPlan, StreamingIsDoubleBufferedAndResidentHoldsEveryStage) {
  schedule_options o;
  o.devices = 2;
  o.micro_batches = 4;
  // Round-robin streaming: every device holds two stages at once (the one computing, the next).
  auto rr = make_round_robin(partition_from_sizes(6, {1, 1, 1, 1, 1, 1}).value(), partition_from_sizes(5, {2, 2, 1}).value(), o).value();  // backward: the head stage fuses the last layer
  std::vector<size_t> bytes;
  for (const auto& st : rr.stages) bytes.push_back(1000 * static_cast<size_t>(st.last_layer - st.first_layer) + (st.has_embed ? 500 : 0));
  auto plan = plan_weight_arenas(rr, bytes, 256);
  ASSERT_EQ(plan.size(), 2u);
  for (const auto& p : plan) {
    EXPECT_EQ(p.max_stages, 2);
    EXPECT_LE(p.bytes, 2 * 2560u);  // two slots of the largest stage (2 layers + embedding, aligned)
    EXPECT_GE(p.bytes, 2000u);
  }
  // Resident 1F1B: a device keeps its stage for good; the arena is exactly that stage.
  auto f = make_1f1b(partition_from_sizes(6, {2, 4}).value(), o).value();
  std::vector<size_t> fb;
  for (const auto& st : f.stages) fb.push_back(1000 * static_cast<size_t>(st.last_layer - st.first_layer));
  auto fp = plan_weight_arenas(f, fb, 256);
  EXPECT_EQ(fp[0].bytes, 2048u);  // 2000 at the 256-byte alignment
  EXPECT_EQ(fp[1].bytes, 4096u);
  EXPECT_EQ(fp[0].max_stages, 1);
  // Alternating sizes that fragment a first-fit arena get fixed slots (2 x largest) instead.
  program p;
  p.micro_batches = 1;
  p.stages = {{0, 1, true, false}, {1, 2, false, false}, {2, 3, false, true}};
  p.devices = {{{op::prefetch_weights, 0}, {op::prefetch_weights, 1}, {op::release_weights, 0}, {op::prefetch_weights, 2},
                {op::release_weights, 1}, {op::release_weights, 2}}};
  auto frag = plan_weight_arenas(p, {3000, 1800, 3100}, 256);
  EXPECT_EQ(frag[0].slot_bytes, 3100u);
  EXPECT_EQ(frag[0].bytes, 2 * 3328u);  // 3100 rounded to the 256-byte alignment, twice
  auto fits = plan_weight_arenas(p, {3100, 1800, 3000}, 256);  // the third fits the first's hole
  EXPECT_EQ(fits[0].slot_bytes, 0u);
  EXPECT_EQ(fits[0].bytes, 3328u + 2048u);  // 1800 takes 2048 at this alignment
}

TEST(Transport, ChosenPerLinkWithAReason) {
  schedule_options o;
  o.devices = 3;
  auto g = make_schedule("1f1b", 6, o).value();  // links 0->1, 1->2 (activations), 2->1, 1->0 (gradients)
  std::vector<device_facts> cpus{{"cpu:0", -1}, {"cpu:1", -1}, {"cpu:2", -1}};
  auto host = choose_transports(g, cpus, "auto", nullptr).value();
  ASSERT_EQ(host.size(), 4u);
  for (const auto& l : host) EXPECT_EQ(l.kind, transport_kind::host_staged);
  auto peer = choose_transports(g, cpus, "peer", nullptr).value();
  for (const auto& l : peer) EXPECT_EQ(l.kind, transport_kind::peer);
  EXPECT_NE(describe_transports(peer, cpus).find("cpu:0 -> cpu:1 peer"), std::string::npos) << describe_transports(peer, cpus);
  // GPUs: 0 and 1 are P2P-capable, 2 is not; devices 1 and 2 of the pipeline share GPU... none here.
  std::vector<device_facts> gpus{{"cuda:0#0", 0}, {"cuda:1#1", 1}, {"cuda:2#2", 2}};
  auto access = [](int a, int b) { return (a == 0 && b == 1) || (a == 1 && b == 0); };
  auto mixed = choose_transports(g, gpus, "auto", access).value();
  for (const auto& l : mixed) {
    const bool p2p = (l.from == 0 && l.to == 1) || (l.from == 1 && l.to == 0);
    EXPECT_EQ(l.kind, p2p ? transport_kind::peer : transport_kind::host_staged) << l.from << "->" << l.to << ": " << l.reason;
  }
  auto forced = choose_transports(g, gpus, "peer", access);
  ASSERT_FALSE(forced.ok());
  EXPECT_NE(forced.message().find("cuda:1#1 -> cuda:2#2"), std::string::npos) << forced.message();
  auto all_host = choose_transports(g, gpus, "host", access).value();
  for (const auto& l : all_host) EXPECT_EQ(l.kind, transport_kind::host_staged);
  // Two pipeline devices on one GPU: a device-to-device copy even without P2P.
  std::vector<device_facts> shared{{"cuda:0#0", 0}, {"cuda:0#1", 0}, {"cuda:1#2", 1}};
  auto same = choose_transports(g, shared, "auto", nullptr).value();
  for (const auto& l : same) EXPECT_EQ(l.kind, (l.from < 2 && l.to < 2) ? transport_kind::peer : transport_kind::host_staged);
  EXPECT_FALSE(choose_transports(g, cpus, "nvlink", nullptr).ok());
  // NCCL: only with NCCL, GPUs, one rank per GPU.
  EXPECT_FALSE(choose_transports(g, gpus, "nccl", access, /*nccl=*/false).ok());
  EXPECT_FALSE(choose_transports(g, cpus, "nccl", nullptr, true).ok());
  EXPECT_FALSE(choose_transports(g, shared, "nccl", nullptr, true).ok());
  auto nccl = choose_transports(g, gpus, "nccl", access, true).value();
  for (const auto& l : nccl) EXPECT_EQ(l.kind, transport_kind::nccl);
  // Several processes (two machines, each its GPU 0): one rank per GPU within each process.
  std::vector<device_facts> zeros{{"cuda:0#0", 0}, {"cuda:0#1", 0}, {"cuda:0#2", 0}};
  EXPECT_EQ(rank_of_positions(3, 3), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(rank_of_positions(4, 2), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_TRUE(choose_transports(g, zeros, "nccl", nullptr, true, rank_of_positions(3, 3)).ok());
  auto twice = choose_transports(g, zeros, "nccl", nullptr, true, {0, 0, 1});
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.message().find("GPU 0 appears twice in process 0"), std::string::npos) << twice.message();
  // Between processes a link is host-staged (Gloo) unless it is NCCL; peer copies cannot cross.
  const auto across = choose_transports(g, zeros, "auto", nullptr, true, {0, 0, 1}).value();
  for (const auto& l : across)
    EXPECT_EQ(l.kind, (l.from < 2 && l.to < 2) ? transport_kind::peer : transport_kind::host_staged) << l.from << "->" << l.to;
  EXPECT_FALSE(choose_transports(g, zeros, "peer", nullptr, true, {0, 0, 1}).ok());
  EXPECT_FALSE(choose_transports(g, {cpus[0], gpus[1], cpus[2]}, "auto", nullptr).ok());  // mixed device kinds
}

// NCCL runs a communicator's operations in order, and past its buffer sizes a send waits for its
// receive. With one communicator carrying both directions between two devices (ncclCommInitAll's),
// 1F1B on two GPUs deadlocks: each device sends before it receives from the other. With one
// communicator per direction (what the executor makes) every generator runs under these semantics.
TEST(Transport, NcclCommunicatorPerDirectionCannotDeadlock) {
  int shared_deadlocks = 0, programs = 0;
  for (int devices : {2, 3, 4})
    for (const auto& name : schedule_names())
      for (bool offload : {false, true}) {
        schedule_options o;
        o.devices = devices;
        o.micro_batches = 2 * devices;
        o.offload_activations = offload;
        auto made = make_schedule(name, 8, o);
        ASSERT_TRUE(made.ok()) << name << " x" << devices << ": " << made.message();
        SCOPED_TRACE(name + " x" + std::to_string(devices));
        std::vector<device_facts> gpus;
        for (int i = 0; i < devices; ++i) gpus.push_back({"cuda:" + std::to_string(i), i});
        auto links = choose_transports(*made, gpus, "nccl", nullptr, true).value();
        sim_costs c = uniform_costs(*made, 1, 2);
        c.act_bytes = 1 << 20;
        c.d2h_bytes_per_s = c.h2d_bytes_per_s = 1e9;
        c.rendezvous = nccl_links(links);
        EXPECT_EQ(c.rendezvous.size(), links.size());
        const auto per_direction = simulate(*made, c);
        EXPECT_TRUE(per_direction.ok) << per_direction.error << "\n" << per_direction.grid;
        c.shared_pair_communicator = true;
        const auto shared = simulate(*made, c);
        ++programs;
        if (!shared.ok) {
          ++shared_deadlocks;
          EXPECT_NE(shared.error.find("deadlock"), std::string::npos) << shared.error;
        }
        if (name == "1f1b" && devices == 2) {
          EXPECT_FALSE(shared.ok);
        }
      }
  std::printf("nccl: %d of %d programs deadlock with one communicator per device pair, none with one per direction\n",
              shared_deadlocks, programs);
}

// Direct (P2P) links: one copy, on the sender's engine, straight into the receiver; host-staged ones
// download and then upload. With copies on the critical path the direct program is faster, never
// slower, and every program still completes.
TEST(Transport, DirectLinksAreOneCopyInTheSimulator) {
  for (int devices : {2, 4})
    for (const auto& name : schedule_names()) {
      schedule_options o;
      o.devices = devices;
      o.micro_batches = 2 * devices;
      auto made = make_schedule(name, 8, o);
      ASSERT_TRUE(made.ok()) << name << " x" << devices << ": " << made.message();
      SCOPED_TRACE(name + " x" + std::to_string(devices));
      std::vector<device_facts> gpus;
      for (int i = 0; i < devices; ++i) gpus.push_back({"cuda:" + std::to_string(i), i});
      const auto always = [](int, int) { return true; };
      const auto links = choose_transports(*made, gpus, "peer", always, false).value();
      sim_costs c = uniform_costs(*made, 1e-3, 2e-3);
      c.act_bytes = 4 << 20;
      c.d2h_bytes_per_s = c.h2d_bytes_per_s = 1e9;  // 4 ms a copy: more than a compute
      const auto staged = simulate(*made, c);
      c.direct = peer_links(links);
      ASSERT_EQ(c.direct.size(), links.size());
      const auto direct = simulate(*made, c);
      ASSERT_TRUE(staged.ok && direct.ok) << staged.error << direct.error << "\n" << direct.grid;
      EXPECT_LT(direct.makespan_s, staged.makespan_s);
      std::printf("%s x%d: host-staged %.1f ms, direct %.1f ms\n", name.c_str(), devices, 1e3 * staged.makespan_s, 1e3 * direct.makespan_s);
    }
}

// cuda:0,0 used to give each of its two pipeline devices 90% of GPU 0's free memory (180% in all):
// the pipeline devices on one GPU share its budget.
TEST(DeviceMemory, PipelineDevicesOnOneGpuShareItsBudget) {
  const std::map<int, size_t> free_b{{0, 20'000}, {1, 10'000}};
  auto of = [&](int g) { return free_b.at(g); };
  EXPECT_EQ(split_gpu_memory({0, 0}, of, 0.9), (std::vector<size_t>{9'000, 9'000}));
  EXPECT_EQ(split_gpu_memory({0, 1}, of, 0.9), (std::vector<size_t>{18'000, 9'000}));
  EXPECT_EQ(split_gpu_memory({0, 1, 0, 0}, of, 0.9), (std::vector<size_t>{6'000, 9'000, 6'000, 6'000}));
  size_t on_gpu0 = 0;
  for (size_t b : split_gpu_memory({0, 0, 0}, of, 0.9)) on_gpu0 += b;
  EXPECT_LE(on_gpu0, 18'000u);
}

// A shared link divides its bandwidth equally among the transfers in flight: one alone runs at the
// link's rate; two at once end together at twice the time, however unevenly their threads look at
// the link (the turns it used to hand out went to whichever thread asked first, so one woken late by
// a busy host lost its share); one that joins later slows the others only while both are in flight;
// one that leaves (a failed copy) gives its share back.
TEST(SharedLink, DividesItsBandwidthAmongTheTransfersInFlight) {
  fluid_link link(1e6);  // 1 MB/s: 1000 bytes take 1 ms
  const uint64_t alone = link.join(1000, 0.010);
  EXPECT_DOUBLE_EQ(link.end_of(alone), 0.011);
  link.advance(0.0112);
  EXPECT_TRUE(link.through(alone));
  // Two at once, the link looked at unevenly: both through at 2 ms, not before.
  const uint64_t a = link.join(1000, 0.040), b = link.join(1000, 0.040);
  EXPECT_NEAR(link.end_of(a), 0.042, 1e-12);
  for (double t : {0.0401, 0.0413, 0.04131, 0.0419}) {
    link.advance(t);
    EXPECT_FALSE(link.through(a)) << t;
    EXPECT_FALSE(link.through(b)) << t;
  }
  link.advance(0.042 + 1e-9);
  EXPECT_TRUE(link.through(a));
  EXPECT_TRUE(link.through(b));
  // 1000 bytes at 50 ms, 3000 joining at 50.5 ms: the first has 500 left, passed at half the rate
  // (through at 51.5 ms); the second passed 500 by then and the rest alone (through at 54 ms).
  const uint64_t first = link.join(1000, 0.050);
  link.advance(0.0505);
  const uint64_t second = link.join(3000, 0.0505);
  EXPECT_NEAR(link.end_of(first), 0.0515, 1e-12);
  EXPECT_NEAR(link.end_of(second), 0.054, 1e-12);
  link.advance(0.0516);
  EXPECT_TRUE(link.through(first));
  EXPECT_FALSE(link.through(second));
  EXPECT_NEAR(link.end_of(second), 0.054, 1e-12);
  EXPECT_EQ(link.in_flight(), 1u);
  link.advance(0.054 + 1e-9);
  EXPECT_EQ(link.in_flight(), 0u);
  // 2000 bytes each from 60 ms; one leaves at 61 ms (500 passed): the other is alone from then.
  const uint64_t stays = link.join(2000, 0.060), fails = link.join(2000, 0.060);
  link.advance(0.061);
  link.leave(fails);
  EXPECT_NEAR(link.end_of(stays), 0.0625, 1e-12);
  EXPECT_EQ(link.in_flight(), 1u);
}

// On real threads: two engines on one link, the second given its copy 20 ms late (a thread a busy
// host woke late). Neither is through before the link could carry it: the early one passes alone
// until the late one joins, then at half the rate; both together take 1 MB at 10 MB/s. A copy is on
// the link while its engine runs the job (a 30 ms job on the late one delays nothing).
TEST(SharedLink, EnginesOnOneLinkShareItFromWhenBothAreOnIt) {
  using clock = std::chrono::steady_clock;
  auto link = std::make_shared<shared_link>(10e6);  // 10 MB/s: 500 KB take 50 ms
  copy_engine early("early", 0, 0, link), late("late", 0, 0, link);
  const auto t0 = clock::now();
  auto joined = std::make_shared<clock::time_point>();
  auto fe = early.submit(500'000, [] {});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto fl = late.submit(500'000, [joined] {
    *joined = clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  });
  fe.wait();
  const auto end_early = clock::now();
  fl.wait();
  const auto end_late = clock::now();
  const auto ms = [&](clock::time_point t) { return std::chrono::duration<double, std::milli>(t - t0).count(); };
  // The early one passed 10 KB/ms alone until the late one joined, the rest at 5 KB/ms.
  const double j = ms(*joined), early_model = j < 50 ? j + 2 * (500 - 10 * j) / 10 : 50;
  std::printf("two 500 KB copies on a 10 MB/s link, one joining at %.1f ms: through at %.1f (model %.1f) and %.1f ms\n", j,
              ms(end_early), early_model, ms(end_late));
  EXPECT_GE(ms(end_early), early_model - 0.5);
  EXPECT_GE(ms(end_late), 99.5);
  EXPECT_GE(ms(end_late), ms(end_early));
}

// cuBLAS workspaces as LibTorch sizes them: its default by compute capability, CUBLAS_WORKSPACE_CONFIG
// summed over its :SIZE:COUNT pairs (KiB), the default again when the variable cannot be parsed.
TEST(DeviceMemory, CublasWorkspaceFollowsLibTorchsRule) {
  constexpr size_t mib = size_t{1} << 20;
  EXPECT_EQ(cublas_workspace_bytes(9, std::nullopt), 32 * mib);   // Hopper
  EXPECT_EQ(cublas_workspace_bytes(12, std::nullopt), 32 * mib);  // Blackwell (consumer)
  EXPECT_EQ(cublas_workspace_bytes(8, std::nullopt), 8 * mib + 128 * 1024);  // Ampere, Ada: :4096:2:16:8
  EXPECT_EQ(cublas_workspace_bytes(0, std::nullopt), 32 * mib);   // unknown: the larger
  EXPECT_EQ(cublas_workspace_bytes(8, ":4096:8"), 32 * mib);
  EXPECT_EQ(cublas_workspace_bytes(9, ":4096:2:16:8"), 8 * mib + 128 * 1024);
  EXPECT_EQ(cublas_workspace_bytes(9, ":16:8"), 128u * 1024);
  EXPECT_EQ(cublas_workspace_bytes(8, "garbage"), 8 * mib + 128 * 1024);
  EXPECT_EQ(compute_workspaces(-1, 9).count, 0);  // CPU virtual devices hold none
  EXPECT_EQ(compute_workspaces(0, 8).count, cublas_workspaces_per_device);
}

// Page-locked weights under a budget, shared by a pipeline's devices: each buffer registered once,
// nothing beyond the budget (the device copies those through its bounce buffer), buffers someone
// else pinned counted but never unregistered here, everything released with the registry.
TEST(DeviceMemory, PinnedRegistryKeepsToItsBudget) {
  using pin_result = pinned_registry::pin_result;
  std::vector<const void*> registered, unregistered;
  std::vector<char> a(100), b(100), c(50), other(10);
  {
    pinned_registry r(
        160,
        [&](void* p, size_t) {
          if (p == other.data()) return pin_result::pinned_elsewhere;
          registered.push_back(p);
          return pin_result::pinned;
        },
        [&](void* p) { unregistered.push_back(p); });
    EXPECT_TRUE(r.acquire(a.data(), a.size()));
    EXPECT_TRUE(r.acquire(a.data(), a.size()));   // a second device: the same registration
    EXPECT_FALSE(r.acquire(b.data(), b.size()));  // 200 > 160: over the budget
    EXPECT_TRUE(r.acquire(c.data(), c.size()));
    EXPECT_TRUE(r.acquire(other.data(), other.size()));
    EXPECT_EQ(r.pinned_bytes(), 160u);
    EXPECT_EQ(r.refused(), 1u);
    EXPECT_EQ(registered, (std::vector<const void*>{a.data(), c.data()}));
    EXPECT_TRUE(unregistered.empty());
  }
  std::sort(unregistered.begin(), unregistered.end());
  std::sort(registered.begin(), registered.end());
  EXPECT_EQ(unregistered, registered);  // not `other`
}

TEST(Transport, NcclNeedsSendsInTheOrderTheyAreReceived) {
  // Every generator sends in receive order on every link.
  for (int devices : {2, 3, 4})
    for (const auto& name : schedule_names()) {
      schedule_options o;
      o.devices = devices;
      o.micro_batches = 4;
      auto p = make_schedule(name, 8, o);
      if (!p.ok()) {  // only interleaved may refuse: its micro-batches must divide by the devices (4 on 3)
        EXPECT_TRUE(name == "interleaved" && devices == 3) << name << " x" << devices << ": " << p.message();
        continue;
      }
      std::vector<device_facts> gpus;
      for (int i = 0; i < devices; ++i) gpus.push_back({"cuda:" + std::to_string(i), i});
      auto r = choose_transports(*p, gpus, "nccl", nullptr, true);
      EXPECT_TRUE(r.ok()) << name << " x" << devices << ": " << r.message();
    }
  // Swap two receives on device 1: NCCL would hand micro-batch 0's activation to micro-batch 1.
  schedule_options o;
  o.devices = 2;
  auto p = make_schedule("gpipe", 4, o).value();
  auto& list = p.devices[1];
  std::vector<size_t> recvs;
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i].kind == op::recv_act) recvs.push_back(i);
  ASSERT_GE(recvs.size(), 2u);
  std::swap(list[recvs[0]], list[recvs[1]]);
  std::vector<device_facts> gpus{{"cuda:0", 0}, {"cuda:1", 1}};
  auto r = choose_transports(p, gpus, "nccl", nullptr, true);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("cuda:0 -> cuda:1: send 1 is the activation at layer 2 of micro-batch 0"), std::string::npos) << r.message();
  EXPECT_TRUE(choose_transports(p, gpus, "host", nullptr, true).ok());  // the mailbox matches by key: order does not matter
}

namespace {
lorapipe::llama_config synthetic_llama() {
  auto mc = lorapipe::parse_llama_config(
      nlohmann::json{{"model_type", "llama"}, {"hidden_size", 512}, {"intermediate_size", 1536}, {"num_hidden_layers", 8},
                     {"num_attention_heads", 8}, {"num_key_value_heads", 8}, {"vocab_size", 32000},
                     {"max_position_embeddings", 2048}, {"rms_norm_eps", 1e-5}},
      "synthetic");
  EXPECT_TRUE(mc.ok()) << mc.message();
  return *mc;
}
// 1F1B on two CPU virtual devices with `batch` sequences of `seq_len` tokens.
lorapipe::project_config two_cpu_1f1b(int64_t batch, int64_t seq_len) {
  lorapipe::project_config c;
  c.parallel.devices = "cpu:2";
  c.parallel.schedule = "1f1b";
  c.run.batch_size = batch;
  c.data.seq_len = seq_len;
  return c;
}
}  // namespace

// parallel.schedule "auto" (the default): on several devices every pipeline schedule with `devices`
// and 2 x `devices` micro-batches is simulated with the cost model and the fastest that fits wins; a
// device memory limit removes the candidates that do not fit; one device runs single.
TEST(AutoSchedule, ChoosesTheFastestSimulatedPipelineThatFits) {
  using namespace lorapipe;
  const llama_config mc = synthetic_llama();
  project_config cfg;
  EXPECT_EQ(cfg.parallel.schedule, "auto");
  cfg.parallel.devices = "cpu:2";
  cfg.run.batch_size = 8;
  cfg.data.seq_len = 256;
  cfg.offload.copy_gbps = 4;
  auto ch = choose_schedule(cfg, mc, 100);
  ASSERT_TRUE(ch.ok()) << ch.message();
  std::set<std::pair<std::string, int32_t>> weighed;
  double best = std::numeric_limits<double>::infinity(), lo = best, hi = 0;
  for (const auto& c : ch->candidates) {
    weighed.insert({c.schedule, c.micro_batches});
    EXPECT_TRUE(c.micro_batches == 2 || c.micro_batches == 4) << c.micro_batches;
    if (!c.ok) continue;
    best = std::min(best, c.step_s);
    lo = std::min(lo, c.peak_bytes);
    hi = std::max(hi, c.peak_bytes);
  }
  EXPECT_EQ(weighed.size(), 2 * schedule_names().size());
  // Every divisor of the batch from the device count to 2 x devices; below it only when nothing else divides.
  EXPECT_EQ(micro_batch_counts(8, 2), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(micro_batch_counts(8, 3), (std::vector<int64_t>{4}));
  EXPECT_EQ(micro_batch_counts(48, 4), (std::vector<int64_t>{4, 6, 8}));
  EXPECT_EQ(micro_batch_counts(3, 4), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(micro_batch_counts(7, 2), (std::vector<int64_t>{1}));
  EXPECT_EQ(micro_batch_counts(720, 8), (std::vector<int64_t>{8, 9, 10, 12, 15, 16}));
  ASSERT_TRUE(ch->candidates.front().ok);
  EXPECT_EQ(ch->candidates.front().step_s, best);
  EXPECT_EQ(ch->schedule, ch->candidates.front().schedule);
  EXPECT_EQ(ch->micro_batches, ch->candidates.front().micro_batches);
  for (size_t i = 0; i + 1 < ch->candidates.size(); ++i)
    if (ch->candidates[i].ok && ch->candidates[i + 1].ok) EXPECT_LE(ch->candidates[i].step_s, ch->candidates[i + 1].step_s) << i;
  // The choice is what a run trains: resolve_auto_schedule writes it into the project.
  auto resolved = resolve_auto_schedule(cfg, mc, 100);
  ASSERT_TRUE(resolved.ok()) << resolved.message();
  EXPECT_EQ(resolved->parallel.schedule, ch->schedule);
  EXPECT_EQ(resolved->parallel.micro_batches, ch->micro_batches);

  // A device memory limit between the smallest and the largest simulated peak, the partitions held
  // (auto would move layers until a candidate fits): what is chosen fits, every candidate above the
  // limit is refused with the field named.
  project_config held = cfg;
  held.parallel.partition = "even";
  held.parallel.backward_partition = "per-layer";
  lo = std::numeric_limits<double>::infinity(), hi = 0;
  const auto held_choice = choose_schedule(held, mc, 100);
  ASSERT_TRUE(held_choice.ok()) << held_choice.message();
  for (const auto& c : held_choice->candidates)
    if (c.ok) lo = std::min(lo, c.peak_bytes), hi = std::max(hi, c.peak_bytes);
  ASSERT_GT(hi - lo, 4.0 * 1048576) << "the candidates' peaks should differ by megabytes";
  project_config tight = held;
  tight.offload.device_memory_mb = static_cast<int64_t>((lo + hi) / 2 / 1048576);
  const double cap = static_cast<double>(tight.offload.device_memory_mb) * 1048576;
  auto fit = choose_schedule(tight, mc, 100);
  ASSERT_TRUE(fit.ok()) << fit.message();
  EXPECT_LE(fit->candidates.front().peak_bytes, cap);
  int refused = 0;
  for (const auto& c : fit->candidates)
    if (c.peak_bytes > cap) {
      EXPECT_FALSE(c.ok) << c.schedule << " x" << c.micro_batches;
      EXPECT_NE(c.note.find("offload.device_memory_mb"), std::string::npos) << c.note;
      ++refused;
    }
  EXPECT_GT(refused, 0);
  // Nothing fits: refused before anything runs, naming the field and every candidate's need.
  tight.offload.device_memory_mb = 1;
  auto none = choose_schedule(tight, mc, 100);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.message().find("parallel.schedule: auto found no pipeline for 2 devices that fits"), std::string::npos) << none.message();
  EXPECT_NE(none.message().find("offload.device_memory_mb is 1"), std::string::npos) << none.message();
  project_config searched = tight;  // the partitions searched too: still nothing fits, and it says so
  searched.parallel.partition = searched.parallel.backward_partition = "auto";
  auto none_searched = choose_schedule(searched, mc, 100);
  ASSERT_FALSE(none_searched.ok());
  EXPECT_NE(none_searched.message().find("round-robin with 4 micro-batches: needs"), std::string::npos) << none_searched.message();
  // Batches that neither the device count nor twice it divides still get a pipeline that trains: 3
  // sequences on 2 devices (3 micro-batches), 1 on 2 devices (1 micro-batch), 8 on 3 devices (4).
  for (auto [batch, devices, expect_m] : {std::tuple{3, "cpu:2", 3}, std::tuple{1, "cpu:2", 1}, std::tuple{8, "cpu:3", 4}}) {
    project_config odd = cfg;
    odd.run.batch_size = batch;
    odd.parallel.devices = devices;
    auto odd_choice = choose_schedule(odd, mc, 100);
    ASSERT_TRUE(odd_choice.ok()) << batch << " on " << devices << ": " << odd_choice.message();
    EXPECT_EQ(odd.run.batch_size % odd_choice->micro_batches, 0);
    bool weighed_expected = false;
    for (const auto& c : odd_choice->candidates) weighed_expected |= c.micro_batches == expect_m && c.ok;
    EXPECT_TRUE(weighed_expected) << batch << " on " << devices << ": " << expect_m << " micro-batches not weighed or not feasible";
    auto trained = resolve_auto_schedule(odd, mc, 100);
    ASSERT_TRUE(trained.ok()) << trained.message();
    trained->model.path = (test_data_dir() / "models/stories260K/hf").string();  // what validation asks besides the pipeline
    trained->data.train = (test_data_dir() / "text/tinyshakespeare.txt").string();
    const auto valid = validate_project(*trained);
    EXPECT_TRUE(valid.ok()) << batch << " on " << devices << ": " << valid.message();
  }
  // One device: single, nothing to weigh; explicit schedules pass through unchanged.
  project_config one = cfg;
  one.parallel.devices = "cpu";
  auto single = choose_schedule(one, mc, 100);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->schedule, "single");
  EXPECT_TRUE(single->candidates.empty());
  project_config fixed = cfg;
  fixed.parallel.schedule = "gpipe";
  fixed.parallel.micro_batches = 8;
  auto same = resolve_auto_schedule(fixed, mc, 100);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->parallel.schedule, "gpipe");
  EXPECT_EQ(same->parallel.micro_batches, 8);
}

TEST(AutoSchedule, ValidationTreatsAutoAsAPipelineOnSeveralDevices) {
  using namespace lorapipe;
  project_config c;
  c.model.path.clear();
  c.data.train.clear();
  c.parallel.devices = "cpu:2";
  c.parallel.micro_batches = 3;  // auto chooses its own micro-batch count: not refused
  auto st = validate_project(c);
  EXPECT_EQ(st.message().find("parallel.micro_batches"), std::string::npos) << st.message();
  EXPECT_EQ(st.message().find("parallel.schedule"), std::string::npos) << st.message();
  c.run.grad_accum = 2;  // a pipeline takes micro-batches instead
  st = validate_project(c);
  EXPECT_NE(st.message().find("run.grad_accum: must be 1 with a pipeline schedule"), std::string::npos) << st.message();
  c.parallel.devices = "cpu";
  st = validate_project(c);
  EXPECT_EQ(st.message().find("run.grad_accum"), std::string::npos) << st.message();
}

// The memory plan of a project on GPUs charges each pipeline device its cuBLAS workspaces (resident
// for the whole run, so its peak rises by exactly that); CPU virtual devices are charged nothing.
TEST(DeviceMemory, PlanChargesCublasWorkspacesOnCudaDevices) {
  const llama_config mc = synthetic_llama();
  project_config cpu = two_cpu_1f1b(4, 128);
  project_config gpu = cpu;
  gpu.parallel.devices = "cuda:0,1";
  auto p = project_program(cpu, mc, 100);
  ASSERT_TRUE(p.ok()) << p.message();
  const memory_plan on_cpu = project_memory_plan(*p, mc, cpu, 100), on_gpu = project_memory_plan(*p, mc, gpu, 100);
  const double ws = static_cast<double>(cublas_workspace_bytes(0, cublas_workspace_config()) * cublas_workspaces_per_device);
  ASSERT_EQ(on_cpu.devices.size(), 2u);
  ASSERT_EQ(on_gpu.devices.size(), 2u);
  for (size_t d = 0; d < 2; ++d) {
    EXPECT_NEAR(on_gpu.devices[d].peak_bytes - on_cpu.devices[d].peak_bytes, ws, 1.0) << d;
    int charged = 0;
    for (const auto& b : on_gpu.buffers)
      if (b.home == static_cast<int32_t>(d) && b.name == "cuBLAS workspaces") charged += b.count;
    EXPECT_EQ(charged, cublas_workspaces_per_device) << d;
    for (const auto& b : on_cpu.buffers) EXPECT_NE(b.name, "cuBLAS workspaces");
  }
  // Capacities between the CPU plan's peaks and the GPU plan's: the GPU plan is refused.
  std::vector<size_t> cap;
  for (const auto& d : on_cpu.devices) cap.push_back(static_cast<size_t>(d.peak_bytes + ws / 2));
  const status st = check_memory_plan(on_gpu, cap, {"cuda:0#0", "cuda:1#1"});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cuda:"), std::string::npos) << st.message();
  EXPECT_TRUE(check_memory_plan(on_cpu, cap, {"cpu:0", "cpu:1"}).ok());
}

// offload.auto: of the 10 combinations of the four settings, the fastest predicted that fits
// (brute force agrees), at least 1% faster than as set, concrete (offload.auto off) and what
// resolve_auto_schedule trains; under a memory limit below its peak (the partition held even, so
// the same settings cannot fit by moving layers) the choice changes to settings that fit.
TEST(AutoOffload, ChoosesTheFastestSettingsThatFit) {
  using namespace lorapipe;
  const llama_config mc = synthetic_llama();
  project_config cfg = two_cpu_1f1b(8, 256);
  cfg.offload.copy_gbps = 4;
  cfg.parallel.partition = "even";
  cfg.offload.automatic = true;
  const auto step_of = [&](project_config c) {
    c.offload.automatic = false;
    const program p = project_program(c, mc, 100).value();
    return simulate(p, estimate_costs(p, mc, c, 100)).makespan_s;
  };
  const auto off_settings = [](project_config c) {
    c.offload.automatic = false;
    return c;
  };
  const auto peak_of = [&](const project_config& c) {
    double peak = 0;
    for (const auto& d : project_memory_plan(project_program(c, mc, 100).value(), mc, c, 100).devices) peak = std::max(peak, d.peak_bytes);
    return peak;
  };
  offload_choice why;
  const project_config chosen = resolve_auto_offload(cfg, mc, 100, &why).value();
  EXPECT_TRUE(why.weighed);
  EXPECT_FALSE(chosen.offload.automatic);
  ASSERT_FALSE(why.changes.empty()) << "without a memory limit, recomputing each stage's forward only costs time";
  EXPECT_FALSE(chosen.offload.recompute) << fmt::format("{}", fmt::join(why.changes, "; "));
  EXPECT_LT(why.step_s, 0.99 * why.given_step_s);
  EXPECT_NEAR(why.step_s, step_of(chosen), 1e-12);
  EXPECT_NEAR(why.given_step_s, step_of(cfg), 1e-12);
  int combinations = 0;
  for (bool stream : {true, false})
    for (bool recompute : {true, false})
      for (bool activations : {true, false})
        for (const char* granularity : {"stage", "layer"}) {
          if (!recompute && (!activations || std::string(granularity) == "layer")) continue;  // one combination without recompute
          project_config c = cfg;
          c.offload.stream_weights = stream, c.offload.recompute = recompute, c.offload.activations = activations;
          c.offload.recompute_granularity = granularity;
          EXPECT_GE(step_of(c), why.step_s * (1 - 1e-9)) << stream << recompute << activations << granularity;
          ++combinations;
        }
  EXPECT_EQ(combinations, 10);
  const project_config trained = resolve_auto_schedule(cfg, mc, 100).value();
  EXPECT_EQ(trained.offload.stream_weights, chosen.offload.stream_weights);
  EXPECT_EQ(trained.offload.recompute, chosen.offload.recompute);
  EXPECT_FALSE(trained.offload.automatic);
  // A device memory limit just below the choice's peak: the choice fits it.
  project_config tight = cfg;
  tight.offload.device_memory_mb = (peak_of(chosen) - 1) / 1048576.0;
  offload_choice tight_why;
  const project_config fits = resolve_auto_offload(tight, mc, 100, &tight_why).value();
  EXPECT_LE(peak_of(fits), tight.offload.device_memory_mb * 1048576.0);
  const auto settings = [](const project_config& c) {
    return std::make_tuple(c.offload.stream_weights, c.offload.recompute, c.offload.activations, c.offload.recompute_granularity);
  };
  EXPECT_NE(settings(fits), settings(chosen));
  // Nothing fits: the settings as set come back, and the choice says so.
  project_config none = cfg;
  none.offload.device_memory_mb = 1;
  offload_choice none_why;
  EXPECT_EQ(settings(resolve_auto_offload(none, mc, 100, &none_why).value()), settings(off_settings(cfg)));
  EXPECT_EQ(none_why.step_s, 0);
  EXPECT_EQ(none_why.given_step_s, 0);
  // Off, or one device: nothing is weighed.
  offload_choice off_why;
  project_config off = cfg;
  off.offload.automatic = false;
  EXPECT_EQ(project_to_json(resolve_auto_offload(off, mc, 100, &off_why).value()), project_to_json(off));
  EXPECT_FALSE(off_why.weighed);
  // Validation: on GPUs it needs the memory bound; the field is outside the hash while off.
  project_config gpu = cfg;
  gpu.parallel.devices = "cuda:0,1";
  EXPECT_NE(validate_project(gpu).message().find("offload.auto: on GPUs needs offload.device_memory_mb"), std::string::npos);
  EXPECT_NE(config_hash(cfg), config_hash(off));  // (off, it leaves older hashes alone: Partition.FieldsAreValidatedByName)
}
