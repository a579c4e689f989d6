// Schedules as data: structure of each generator, text round trip, the grid printer, and the
// simulator (pairing, deadlock, bubble formulas, peak memory). CPU only, no torch.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/pipeline/schedule.h"
#include "core/pipeline/schedule_sim.h"
#include "core/pipeline/sim_sharing.h"

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

namespace {
// Two devices that each upload one stage's weights (bytes per stage given) at the start and then
// run a forward of it: when each forward can start says when its upload was through.
program two_uploads() {
  program p;
  p.schedule = "uploads";
  p.micro_batches = 1;
  p.stages = {{0, 1, true, false}, {0, 1, true, false}};
  for (int32_t d = 0; d < 2; ++d)
    p.devices.push_back({{op::prefetch_weights, d, -1, -1}, {op::load_micro_batch, d, 0, -1}, {op::forward, d, 0, -1}});
  return p;
}
double forward_start(const sim_result& r, int32_t device) {
  for (const auto& t : r.timeline)
    if (t.device == device && t.in.kind == op::forward) return t.start_s;
  return -1;
}
}  // namespace

// Copies on one shared host link divide its bandwidth among those in flight at once (processor
// sharing, as the copy engines on offload.copy_links do), not one after another: two equal uploads
// both end at twice the time alone; a short upload next to a long one ends after twice its own time
// (not after the long one), and the long one is late only by the short one's bytes.
TEST(Simulator, CopiesOnASharedLinkDivideItsBandwidth) {
  const program p = two_uploads();
  sim_costs c = uniform_costs(p, 1.0, 2.0);
  c.h2d_bytes_per_s = c.d2h_bytes_per_s = 100;
  c.weight_bytes = {100, 100};
  sim_result own = simulate(p, c);
  ASSERT_TRUE(own.ok) << own.error;
  EXPECT_NEAR(forward_start(own, 0), 1.0, 1e-9);
  EXPECT_NEAR(forward_start(own, 1), 1.0, 1e-9);
  c.copy_link = {0, 0};
  sim_result shared = simulate(p, c);
  ASSERT_TRUE(shared.ok) << shared.error;
  EXPECT_NEAR(forward_start(shared, 0), 2.0, 0.01);
  EXPECT_NEAR(forward_start(shared, 1), 2.0, 0.01);
  EXPECT_NEAR(shared.makespan_s, 3.0, 0.01);
  c.weight_bytes = {1000, 100};  // 10 s and 1 s alone
  shared = simulate(p, c);
  ASSERT_TRUE(shared.ok) << shared.error;
  EXPECT_NEAR(forward_start(shared, 1), 2.0, 0.02);
  EXPECT_NEAR(forward_start(shared, 0), 11.0, 0.02);
  c.weight_bytes = {100, 1000};  // the same with the long one booked second
  shared = simulate(p, c);
  ASSERT_TRUE(shared.ok) << shared.error;
  EXPECT_NEAR(forward_start(shared, 0), 2.0, 0.02);
  EXPECT_NEAR(forward_start(shared, 1), 11.0, 0.02);
  c.copy_link = {0, 1};  // links of their own: nothing shared
  shared = simulate(p, c);
  ASSERT_TRUE(shared.ok) << shared.error;
  EXPECT_NEAR(forward_start(shared, 0), 1.0, 1e-9);
  EXPECT_NEAR(forward_start(shared, 1), 10.0, 1e-9);
}

// The latency of a copy comes before its bytes and is not shared: two equal uploads of 1 s of bytes
// after 0.5 s of latency each are through at 0.5 + 2 s, not hidden behind the latency.
TEST(Simulator, ACopysLatencyComesBeforeItsSharedBytes) {
  const program p = two_uploads();
  sim_costs c = uniform_costs(p, 1.0, 2.0);
  c.h2d_bytes_per_s = c.d2h_bytes_per_s = 100;
  c.copy_latency_s = 0.5;
  c.weight_bytes = {100, 100};
  c.copy_link = {0, 0};
  const sim_result r = simulate(p, c);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_NEAR(forward_start(r, 0), 2.5, 0.01);
  EXPECT_NEAR(forward_start(r, 1), 2.5, 0.01);
}

// A copy that begins while another is half way: device 1 computes for 1 s first, then uploads 1 s of
// bytes beside device 0's 10 s upload begun at 0; from then on each gets half the link: device 1's is
// through at 3, device 0's at 11 (1 s alone, 2 s at half, then the 8 s left alone).
TEST(Simulator, ACopyJoiningALinkMidwaySharesFromThen) {
  program p;
  p.schedule = "late upload";
  p.micro_batches = 1;
  p.stages = {{0, 1, true, false}, {0, 1, true, false}, {0, 1, true, false}};
  p.devices.push_back({{op::prefetch_weights, 0, -1, -1}, {op::load_micro_batch, 0, 0, -1}, {op::forward, 0, 0, -1}});
  p.devices.push_back({{op::prefetch_weights, 2, -1, -1},
                       {op::load_micro_batch, 2, 0, -1},
                       {op::forward, 2, 0, -1},
                       {op::prefetch_weights, 1, -1, -1},
                       {op::load_micro_batch, 1, 0, -1},
                       {op::forward, 1, 0, -1}});
  sim_costs c = uniform_costs(p, 1.0, 2.0);
  c.h2d_bytes_per_s = c.d2h_bytes_per_s = 100;
  c.weight_bytes = {1000, 100, 0};
  c.copy_link = {0, 0};
  const sim_result r = simulate(p, c);
  ASSERT_TRUE(r.ok) << r.error << "\n" << r.grid;
  double late = -1;
  for (const auto& t : r.timeline)
    if (t.device == 1 && t.in.kind == op::forward && t.in.stage == 1) late = t.start_s;
  EXPECT_NEAR(late, 3.0, 0.02) << r.grid;
  EXPECT_NEAR(forward_start(r, 0), 11.0, 0.02) << r.grid;
}

// Processor sharing in time order, worked by hand on one core: A (2 s of work) from 0, B (1 s) from
// 0.5, C (1 s) from 1. Alone to 0.5 (A has 1.5 left); A and B at half rate to 1 (1.25 and 0.75 left);
// three at a third: B ends at 3.25 (A 0.5 left, C 0.25); two at half: C ends at 3.75; A alone ends at 4.
TEST(Simulator, TheHostsCoresAreSharedInTimeOrder) {
  sim_sharing::core_pool pool(1);
  pool.join({0, 0}, 0.0, 2.0);
  pool.join({1, 0}, 0.5, 1.0);
  pool.join({2, 0}, 1.0, 1.0);
  pool.join({1, 0}, 0.5, 1.0);  // asked again by a blocked device: still one piece
  int events = 0;
  while (pool.advance()) ASSERT_LT(++events, 20);
  EXPECT_NEAR(pool.end_of({0, 0}).value_or(-1), 4.0, 1e-12);
  EXPECT_NEAR(pool.end_of({1, 0}).value_or(-1), 3.25, 1e-12);
  EXPECT_NEAR(pool.end_of({2, 0}).value_or(-1), 3.75, 1e-12);
  // Far into a long step a short piece still ends (t - now rounds away most of its work there).
  sim_sharing::core_pool late(2);
  late.join({0, 0}, 1e9, 1e-9);
  late.join({1, 0}, 1e9, 3e-9);
  events = 0;
  while (late.advance()) ASSERT_LT(++events, 20);
  EXPECT_NEAR(late.end_of({0, 0}).value_or(-1), 1e9 + 1e-9, 1e-6);
  EXPECT_NEAR(late.end_of({1, 0}).value_or(-1), 1e9 + 3e-9, 1e-6);
  // Fewer pieces than cores: each runs at full rate, not faster. An end is unknown until the pool
  // gets there; a piece joining after the pool's time starts then; no work ends at its start.
  sim_sharing::core_pool two(2);
  two.join({0, 0}, 0.0, 1.0);
  EXPECT_FALSE(two.end_of({0, 0}).has_value());
  ASSERT_TRUE(two.advance());  // to its start
  ASSERT_TRUE(two.advance());  // to its end
  EXPECT_NEAR(two.end_of({0, 0}).value_or(-1), 1.0, 1e-12);
  two.join({1, 0}, 0.5, 1.0);
  two.join({2, 0}, 3.0, 0.0);
  while (two.advance()) {
  }
  EXPECT_NEAR(two.end_of({1, 0}).value_or(-1), 2.0, 1e-12);
  EXPECT_NEAR(two.end_of({2, 0}).value_or(-1), 3.0, 1e-12);
  EXPECT_FALSE(two.advance());
}

// Eight CPU virtual devices on two cores: no schedule's step can be shorter than the compute of all
// of them on two cores (the replay once booked devices one after another and settled the sharing in
// passes, which oscillated: it put 1F1B 8% and interleaved 12% under this bound here), nor longer than
// running one compute at a time.
TEST(Simulator, EightCpuDevicesOnTwoCoresRespectTheCoresBound) {
  for (const std::string name : {"gpipe", "1f1b", "interleaved", "round-robin"}) {
    auto prog = make_schedule(name, 16, opts(8, 16)).value();
    sim_costs c = uniform_costs(prog, 1.0, 2.0);
    c.host_compute_slots = 2;
    c.on_host_cores.assign(8, true);
    const sim_result r = simulate(prog, c);
    ASSERT_TRUE(r.ok) << name << ": " << r.error;
    double work = 0;  // seconds at full rate
    for (const auto& d : prog.devices)
      for (const auto& in : d) {
        const size_t s = static_cast<size_t>(in.stage);
        if (in.kind == op::forward) work += c.forward_s[s];
        if (in.kind == op::recompute) work += c.recompute_s[s] > 0 ? c.recompute_s[s] : c.forward_s[s];
        if (in.kind == op::backward) work += c.backward_s[s];
      }
    EXPECT_GE(r.makespan_s, work / 2 * (1 - 1e-9)) << name << "\n" << r.grid;
    EXPECT_LE(r.makespan_s, work * (1 + 1e-9)) << name;
  }
}

// CPU virtual devices share the host's cores: three 1 s forwards at once on two slots take 1.5 s
// each; a device off the host's cores (a GPU) shares nothing; a device at half speed holds a core
// only for its share of the work and idles the rest (as cpu_device does), so it does not slow the
// others beyond that.
TEST(Simulator, CpuDevicesShareTheHostsCores) {
  program p;
  p.schedule = "three forwards";
  p.micro_batches = 1;
  for (int32_t d = 0; d < 3; ++d) {
    p.stages.push_back({0, 1, true, false});
    p.devices.push_back({{op::prefetch_weights, d, -1, -1}, {op::load_micro_batch, d, 0, -1}, {op::forward, d, 0, -1}});
  }
  sim_costs c = uniform_costs(p, 1.0, 2.0);
  c.weight_bytes = {0, 0, 0};
  const auto ends = [&](const sim_costs& costs) {
    const sim_result r = simulate(p, costs);
    EXPECT_TRUE(r.ok) << r.error;
    std::vector<double> out(3, -1);
    for (const auto& t : r.timeline) out[static_cast<size_t>(t.device)] = t.end_s - t.start_s;
    return out;
  };
  EXPECT_NEAR(ends(c)[0], 1.0, 1e-9);  // no sharing asked for
  c.host_compute_slots = 2;
  c.on_host_cores = {true, true, true};
  for (double e : ends(c)) EXPECT_NEAR(e, 1.5, 0.01);
  c.on_host_cores = {true, true, false};
  for (double e : ends(c)) EXPECT_NEAR(e, 1.0, 0.01);
  c.host_compute_slots = 1;  // two on one core: 2 s each
  c.device_speed = {1.0, 0.5, 1.0};
  const auto slow = ends(c);
  // Device 1 works 1 s on the core at the fastest speed, sharing it with device 0 from 0 to 2, then
  // idles as long again: 4 s; device 0 shares the core the whole of its second: 2 s.
  EXPECT_NEAR(slow[0], 2.0, 0.01);
  EXPECT_NEAR(slow[1], 4.0, 0.01);
  EXPECT_NEAR(slow[2], 1.0, 0.01);
}
