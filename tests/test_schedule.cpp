// Schedules as data: structure of each generator, text round trip, the grid printer, and the
// simulator (pairing, deadlock, bubble formulas, peak memory). CPU only, no torch.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/pipeline/schedule.h"
#include "core/pipeline/schedule_sim.h"

using namespace lorapipe;

namespace {
schedule_options opts(int p, int m, bool offload = false) {
  schedule_options o;
  o.devices = p;
  o.micro_batches = m;
  o.offload_activations = offload;
  return o;
}
[[maybe_unused]] int count(const program& p, op k, int stage = -1) {
  int n = 0;
  for (const auto& d : p.devices)
    for (const auto& i : d) n += i.kind == k && (stage < 0 || i.stage == stage);
  return n;
}
// Every (stage, micro) has exactly one F and one B; every stage with LoRA grads steps once.
void check_structure(const program& p) {
  std::map<std::pair<int, int>, int> f, b;
  for (const auto& d : p.devices)
    for (const auto& i : d) {
      if (i.kind == op::forward) f[{i.stage, i.micro}]++;
      if (i.kind == op::backward) b[{i.stage, i.micro}]++;
    }
  for (const auto& [k, n] : f) EXPECT_EQ(n, 1) << "F stage " << k.first << " micro " << k.second;
  for (const auto& [k, n] : b) EXPECT_EQ(n, 1) << "B stage " << k.first << " micro " << k.second;
  // Every layer gets a backward for every micro-batch.
  int32_t n_layers = p.stages.back().last_layer;
  for (int32_t l = 0; l < n_layers; ++l)
    for (int32_t m = 0; m < p.micro_batches; ++m) {
      int covered = 0;
      for (const auto& [k, n] : b)
        if (k.second == m && p.stages[k.first].first_layer <= l && l < p.stages[k.first].last_layer) covered += n;
      EXPECT_EQ(covered, 1) << "layer " << l << " micro " << m;
    }
}
}  // namespace

TEST(Schedule, GeneratorsAreStructurallySoundAndSimulate) {
  for (const auto& name : schedule_names())
    for (int p : {1, 2, 3, 4})
      for (bool offload : {false, true}) {
        auto o = opts(p, 4 * p, offload);
        auto prog = make_schedule(name, 12, o);
        ASSERT_TRUE(prog.ok()) << name << " p=" << p << ": " << prog.message();
        EXPECT_EQ(prog->num_devices(), p);
        check_structure(*prog);
        auto sim = simulate(*prog, uniform_costs(*prog, 1.0, 2.0));
        EXPECT_TRUE(sim.ok) << name << " p=" << p << ": " << sim.error << "\n" << sim.grid;
      }
}

// The forward half of every program (validation on the pipeline devices): the same forwards and
// activation sends, nothing of the backward, every PREFETCH used by a FORWARD before its RELEASE, and
// it simulates without deadlock.
TEST(Schedule, ForwardOnlyKeepsTheForwardHalf) {
  for (const auto& name : schedule_names())
    for (int p : {1, 2, 3, 4})
      for (bool offload : {false, true}) {
        SCOPED_TRACE(name + " p=" + std::to_string(p) + (offload ? " offload" : ""));
        auto train = make_schedule(name, 12, opts(p, 4 * p, offload)).value();
        const program fwd = forward_only(train);
        EXPECT_EQ(fwd.num_devices(), train.num_devices());
        for (op k : {op::forward, op::send_act, op::recv_act}) EXPECT_EQ(count(fwd, k), count(train, k));
        for (op k : {op::backward, op::recompute, op::send_grad, op::recv_grad, op::offload_act, op::reload_act, op::optimizer_step})
          EXPECT_EQ(count(fwd, k), 0);
        for (size_t d = 0; d < fwd.devices.size(); ++d) {
          std::map<int32_t, bool> open;  // stage -> prefetched and not yet used by a forward
          for (const auto& in : fwd.devices[d]) {
            if (in.kind == op::prefetch_weights) open[in.stage] = true;
            if (in.kind == op::forward) open[in.stage] = false;
            if (in.kind == op::release_weights) {
              EXPECT_FALSE(open[in.stage]) << "device " << d << " stage " << in.stage;
            }
          }
        }
        if (count(train, op::prefetch_weights) > 0) {
          EXPECT_GT(count(fwd, op::prefetch_weights), 0);
        }
        EXPECT_LE(count(fwd, op::prefetch_weights), count(train, op::prefetch_weights));
        auto sim = simulate(fwd, uniform_costs(fwd, 1.0, 2.0));
        EXPECT_TRUE(sim.ok) << sim.error << "\n" << sim.grid;
      }
}

TEST(Schedule, TextFormRoundTrips) {
  for (const auto& name : schedule_names()) {
    auto prog = make_schedule(name, 8, opts(2, 4, true));
    ASSERT_TRUE(prog.ok());
    auto text = program_to_text(*prog);
    auto back = parse_program(text);
    ASSERT_TRUE(back.ok()) << back.message();
    EXPECT_EQ(program_to_text(*back), text);
    EXPECT_EQ(back->devices, prog->devices);
    EXPECT_EQ(back->stages, prog->stages);
  }
  EXPECT_EQ(instr_to_text({op::forward, 2, 0, -1}), "2F0");
  EXPECT_EQ(instr_to_text({op::send_act, 1, 1, 2}), "1SEND_F1@2");
  auto i = parse_instr("1SEND_F1@2");
  ASSERT_TRUE(i.ok());
  EXPECT_EQ(*i, (instr{op::send_act, 1, 1, 2}));
  EXPECT_EQ(parse_instr("0PW")->kind, op::prefetch_weights);
  EXPECT_EQ(parse_instr("0PW")->micro, -1);
  EXPECT_FALSE(parse_instr("F0").ok());
  EXPECT_FALSE(parse_instr("0FOO1").ok());
  EXPECT_FALSE(parse_instr("0F1@").ok());
  EXPECT_FALSE(parse_program("d0: 5F0\n").ok());  // stage out of range
}

TEST(Simulator, GpipeAnd1f1bBubbleIsPMinus1OverMPlusPMinus1) {
  for (const char* name : {"gpipe", "1f1b"})
    for (int p : {2, 3, 4})
      for (int m : {1, 4, 8}) {
        auto prog = make_schedule(name, 4 * p, opts(p, m));
        ASSERT_TRUE(prog.ok());
        auto sim = simulate(*prog, uniform_costs(*prog, 1.0, 2.0));
        ASSERT_TRUE(sim.ok) << sim.error;
        double want = double(p - 1) / (m + p - 1);
        std::printf("%-6s p=%d m=%d bubble %.4f expected %.4f\n", name, p, m, sim.bubble_ratio, want);
        EXPECT_NEAR(sim.bubble_ratio, want, 1e-9) << name << " p=" << p << " m=" << m;
      }
}

TEST(Simulator, InterleavedBubbleIsPMinus1OverVMPlusPMinus1) {
  for (int p : {2, 4})
    for (int v : {2, 3})
      for (int m : {p, 2 * p, 4 * p}) {
        auto o = opts(p, m);
        o.virtual_stages = v;
        auto prog = make_interleaved(even_partition(p * v, p * v), o);
        ASSERT_TRUE(prog.ok()) << prog.message();
        auto sim = simulate(*prog, uniform_costs(*prog, 1.0 / v, 2.0 / v));
        ASSERT_TRUE(sim.ok) << sim.error << "\n" << sim.grid;
        double want = double(p - 1) / (v * m + p - 1);
        std::printf("interleaved p=%d v=%d m=%d bubble %.4f expected %.4f\n", p, v, m, sim.bubble_ratio, want);
        EXPECT_NEAR(sim.bubble_ratio, want, 1e-9);
      }
}

TEST(Simulator, BrokenProgramsAreReportedWithTheStepMarked) {
  auto prog = make_schedule("1f1b", 4, opts(2, 2)).value();
  // Drop device 1's first RECV_F: its SEND has no partner.
  auto broken = prog;
  auto& d1 = broken.devices[1];
  for (size_t i = 0; i < d1.size(); ++i)
    if (d1[i].kind == op::recv_act) {
      d1.erase(d1.begin() + static_cast<long>(i));
      break;
    }
  auto sim = simulate(broken, uniform_costs(broken, 1, 2));
  EXPECT_FALSE(sim.ok);
  EXPECT_NE(sim.error.find("not paired"), std::string::npos) << sim.error;
  EXPECT_NE(sim.grid.find("[>"), std::string::npos) << sim.grid;
  // Swap device 0 so it waits for a gradient before sending the activation that produces it: deadlock.
  auto dead = prog;
  auto& d0 = dead.devices[0];
  auto recv_b = std::find_if(d0.begin(), d0.end(), [](const instr& i) { return i.kind == op::recv_grad; });
  auto recv = *recv_b;
  d0.erase(recv_b);
  d0.insert(d0.begin(), recv);
  sim = simulate(dead, uniform_costs(dead, 1, 2));
  EXPECT_FALSE(sim.ok);
  EXPECT_NE(sim.error.find("deadlock"), std::string::npos) << sim.error;
  EXPECT_EQ(sim.fail_device, 0);
  EXPECT_EQ(sim.fail_index, 0);
  EXPECT_NE(sim.grid.find("[>0RECV_B0@1<]"), std::string::npos) << sim.grid;
  std::printf("%s\n%s", sim.error.c_str(), sim.grid.c_str());
}

TEST(Simulator, StreamingOverlapsCopiesAndBoundsMemory) {
  auto o = opts(2, 3, true);
  auto prog = make_schedule("round-robin", 12, o).value();
  auto c = uniform_costs(prog, 1.0, 2.0);
  for (auto& w : c.weight_bytes) w = 100;
  c.act_bytes = 1;
  c.h2d_bytes_per_s = c.d2h_bytes_per_s = 400;  // a stage's weights upload in 0.25 s < its compute
  auto fast = simulate(prog, c);
  ASSERT_TRUE(fast.ok) << fast.error;
  auto slow_c = c;
  slow_c.h2d_bytes_per_s = slow_c.d2h_bytes_per_s = 10;  // 10 s per upload: copies dominate
  auto slow = simulate(prog, slow_c);
  ASSERT_TRUE(slow.ok);
  EXPECT_GT(slow.makespan_s, 1.5 * fast.makespan_s);
  // Fast copies hide completely behind compute in steady state (the first stages were prefetched at
  // the end of the previous step): same makespan as with no weight traffic at all.
  c.steady_state = true;
  fast = simulate(prog, c);
  ASSERT_TRUE(fast.ok);
  auto none_c = c;
  std::fill(none_c.weight_bytes.begin(), none_c.weight_bytes.end(), 0.0);
  auto none = simulate(prog, none_c);
  ASSERT_TRUE(none.ok);
  EXPECT_NEAR(fast.makespan_s, none.makespan_s, 1e-9);
  // Double buffering: two stages' weights (200 bytes) are resident at once, never three (300).
  for (double peak : fast.peak_bytes) {
    EXPECT_GE(peak, 200);
    EXPECT_LT(peak, 300);
  }
  std::printf("round-robin p=2 m=3: makespan %.2f s (fast copies) vs %.2f s (slow), bubble %.3f\n", fast.makespan_s,
              slow.makespan_s, fast.bubble_ratio);
}
