// Partitions balanced by device speed (core/pipeline/partition_search.h): the min-max dynamic
// programme against brute force, the simulator's device speeds, choose_partition on a project with a
// slow device, the partition and device_speeds fields (validation naming the field, the config hash),
// and make_schedule with explicit stage sizes.
#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/pipeline/cost_model.h"
#include "core/pipeline/partition_search.h"
#include "core/base/hash.h"
#include "core/pipeline/schedule_sim.h"

using namespace lorapipe;

namespace {

// The largest stage time of `sizes` as min_max_partition defines it.
double max_stage(const std::vector<double>& layer_s, double embed, double head, const std::vector<double>& speed,
                 const std::vector<int32_t>& sizes) {
  double worst = 0;
  size_t l = 0;
  for (size_t s = 0; s < sizes.size(); ++s) {
    double t = (s == 0 ? embed : 0) + (s + 1 == sizes.size() ? head : 0);
    for (int32_t k = 0; k < sizes[s]; ++k) t += layer_s[l++];
    worst = std::max(worst, t / speed[s]);
  }
  return worst;
}

// Every composition of n into k parts of at least one.
void compositions(int32_t n, int32_t k, std::vector<int32_t>& cur, const std::function<void(const std::vector<int32_t>&)>& f) {
  if (k == 1) {
    cur.push_back(n);
    f(cur);
    cur.pop_back();
    return;
  }
  for (int32_t first = 1; first <= n - (k - 1); ++first) {
    cur.push_back(first);
    compositions(n - first, k - 1, cur, f);
    cur.pop_back();
  }
}

llama_config synthetic_8_layers() {
  return parse_llama_config(nlohmann::json{{"model_type", "llama"}, {"hidden_size", 256}, {"intermediate_size", 688},
                                           {"num_hidden_layers", 8}, {"num_attention_heads", 4}, {"num_key_value_heads", 4},
                                           {"vocab_size", 4096}, {"max_position_embeddings", 512}, {"rms_norm_eps", 1e-5}},
                            "synthetic")
      .value();
}

project_config two_devices(const std::string& schedule, const std::string& speeds) {
  project_config cfg;
  cfg.parallel.devices = "cpu:2";
  cfg.parallel.schedule = schedule;
  cfg.parallel.micro_batches = 4;
  cfg.parallel.device_speeds = speeds;
  cfg.run.batch_size = 8;
  cfg.data.seq_len = 128;
  cfg.offload.copy_gbps = 2;
  return cfg;
}

}  // namespace

TEST(Partition, MinMaxProgrammeMatchesBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost(0.5, 2.0), speed(0.25, 2.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t L = 2 + trial % 9, S = 1 + trial % std::min(L, 5);
    std::vector<double> layers(static_cast<size_t>(L)), speeds(static_cast<size_t>(S));
    for (auto& x : layers) x = cost(rng);
    for (auto& x : speeds) x = speed(rng);
    const double embed = trial % 3 == 0 ? cost(rng) : 0, head = cost(rng) * 2;
    const auto got = min_max_partition(layers, embed, head, speeds);
    ASSERT_EQ(got.size(), static_cast<size_t>(S));
    int32_t total = 0;
    for (int32_t x : got) {
      EXPECT_GE(x, 1);
      total += x;
    }
    EXPECT_EQ(total, L);
    double best = std::numeric_limits<double>::infinity();
    std::vector<int32_t> cur;
    compositions(L, S, cur, [&](const std::vector<int32_t>& c) { best = std::min(best, max_stage(layers, embed, head, speeds, c)); });
    EXPECT_DOUBLE_EQ(max_stage(layers, embed, head, speeds, got), best) << "trial " << trial << ": " << partition_text(got);
  }
  // Equal costs and speeds: the even partition, earlier stages taking the remainder.
  EXPECT_EQ(min_max_partition(std::vector<double>(7, 1.0), 0, 0, {1, 1, 1}), (std::vector<int32_t>{3, 2, 2}));
  // Ties are broken the same way at FLOP magnitudes (sums of ~1e12 costs round differently).
  EXPECT_EQ(min_max_partition(std::vector<double>(80, 1.676e12), 0, 0, std::vector<double>(6, 1.0)),
            (std::vector<int32_t>{14, 14, 13, 13, 13, 13}));
  // A device at half speed gets about a third of the layers.
  EXPECT_EQ(min_max_partition(std::vector<double>(9, 1.0), 0, 0, {1, 0.5}), (std::vector<int32_t>{6, 3}));
}

TEST(Partition, SimulatorRunsASlowDeviceAtItsSpeed) {
  const program p = make_schedule("1f1b", 4, schedule_options{2, 4, 2, false, false, false}).value();
  sim_costs c = uniform_costs(p, 1.0, 2.0);
  const sim_result same = simulate(p, c);
  c.device_speed = {1.0, 0.5};
  const sim_result slow = simulate(p, c);
  ASSERT_TRUE(same.ok && slow.ok);
  EXPECT_DOUBLE_EQ(slow.busy_s[0], same.busy_s[0]);
  EXPECT_DOUBLE_EQ(slow.busy_s[1], 2 * same.busy_s[1]);
  EXPECT_GT(slow.makespan_s, same.makespan_s * 1.5);
  // A measured trace from the slow device is normalised back to speed-1 stage times.
  const sim_costs measured = with_measured_compute(p, c, slow.timeline);
  EXPECT_DOUBLE_EQ(measured.forward_s[1], 1.0);
  EXPECT_DOUBLE_EQ(measured.backward_s[1], 2.0);
}

TEST(Partition, MakeScheduleTakesStageSizes) {
  schedule_options o{2, 4, 2, true, true, true};
  o.stage_layers = {4, 1};
  const program p = make_schedule("1f1b", 5, o).value();
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[0], (stage_def{0, 4, true, false}));
  EXPECT_EQ(p.stages[1], (stage_def{4, 5, false, true}));
  o.stage_layers = {2, 1, 1, 1};
  EXPECT_EQ(make_schedule("interleaved", 5, o).value().stages[0].last_layer, 2);
  o.stage_layers = {3, 2};
  const program rr = make_schedule("round-robin", 5, o).value();  // the forward stages; backward ones per layer below the tail
  EXPECT_EQ(rr.stages[1], (stage_def{3, 5, false, true}));
  o.stage_layers = {4, 1};
  auto bad = make_schedule("interleaved", 5, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("the partition has 2 stages, the schedule needs 4"), std::string::npos) << bad.message();
  o.stage_layers = {4, 2};
  EXPECT_NE(make_schedule("1f1b", 5, o).message().find("add up to 6 layers, the model has 5"), std::string::npos);
}

// One device at half speed: the balanced partition gives the slow device fewer layers and the
// simulator predicts it at least 15% faster than the even one; "even" and explicit sizes are kept.
TEST(Partition, BalancesStagesAcrossDevicesOfDifferentSpeed) {
  const llama_config mc = synthetic_8_layers();
  for (const std::string schedule : {"1f1b", "gpipe", "interleaved"}) {
    SCOPED_TRACE(schedule);
    project_config cfg = two_devices(schedule, "1,0.5");
    auto pc = choose_partition(cfg, mc, 100);
    ASSERT_TRUE(pc.ok()) << pc.message();
    EXPECT_EQ(pc->how, "balanced");
    EXPECT_LT(pc->step_s, 0.85 * pc->even_step_s) << partition_text(pc->sizes);
    int32_t fast = 0, slow = 0;
    for (size_t s = 0; s < pc->sizes.size(); ++s) (s % 2 == 0 ? fast : slow) += pc->sizes[s];
    EXPECT_GT(fast, slow) << partition_text(pc->sizes);
    // The program the trainer builds is the one chosen.
    const program p = project_program(cfg, mc, 100).value();
    std::vector<int32_t> sizes;
    for (const auto& st : p.stages) sizes.push_back(st.last_layer - st.first_layer);
    EXPECT_EQ(sizes, pc->sizes);
    cfg.parallel.partition = "even";
    EXPECT_EQ(choose_partition(cfg, mc, 100).value().how, "even");
  }
  // The balanced partition is a local optimum of the simulated step: moving one layer across any
  // boundary, simulated here independently, is no faster.
  {
    const project_config cfg = two_devices("1f1b", "1,0.5");
    const auto pc = choose_partition(cfg, mc, 100).value();
    const auto step_of = [&](const std::vector<int32_t>& sizes) {
      schedule_options so = schedule_options_of(cfg);
      so.stage_layers = sizes;
      const program p = make_schedule("1f1b", 8, so).value();
      return simulate(p, estimate_costs(p, mc, cfg, 100)).makespan_s;
    };
    EXPECT_DOUBLE_EQ(step_of(pc.sizes), pc.step_s);
    for (int dir : {-1, 1}) {
      auto t = pc.sizes;
      t[0] += dir;
      t[1] -= dir;
      if (t[0] >= 1 && t[1] >= 1) EXPECT_GE(step_of(t), pc.step_s * (1 - 1e-9)) << partition_text(t);
    }
  }
  // The slow device first: the layers move the other way.
  auto flipped = choose_partition(two_devices("1f1b", "0.5,1"), mc, 100).value();
  EXPECT_LT(flipped.sizes[0], flipped.sizes[1]) << partition_text(flipped.sizes);
  project_config given = two_devices("gpipe", "1,0.5");
  given.parallel.partition = "3,5";
  auto g = choose_partition(given, mc, 100).value();
  EXPECT_EQ(g.how, "given");
  EXPECT_EQ(g.sizes, (std::vector<int32_t>{3, 5}));
  given.parallel.partition = "3,4";
  auto short_by_one = choose_partition(given, mc, 100);
  ASSERT_FALSE(short_by_one.ok());
  EXPECT_NE(short_by_one.message().find("parallel.partition: '3,4' adds up to 7 layers; the model has 8"), std::string::npos)
      << short_by_one.message();
  given.parallel.partition = "2,2,4";
  auto wrong = choose_partition(given, mc, 100);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("parallel.partition: '2,2,4' has 3 stages; gpipe on 2 device(s) needs 2"), std::string::npos)
      << wrong.message();
}

// A memory limit the balanced partition would exceed keeps a partition that fits.
TEST(Partition, BalancingRespectsTheDeviceMemoryLimit) {
  const llama_config mc = synthetic_8_layers();
  project_config cfg = two_devices("1f1b", "1,0.5");
  cfg.offload.recompute = false;  // graphs of every layer stay: memory follows the layer count
  cfg.offload.activations = false;
  const auto free = choose_partition(cfg, mc, 100).value();
  schedule_options so = schedule_options_of(cfg);
  const auto peak_of = [&](const std::vector<int32_t>& sizes) {
    so.stage_layers = sizes;
    const program p = make_schedule("1f1b", 8, so).value();
    const sim_costs c = estimate_costs(p, mc, cfg, 100);
    const memory_plan m = make_memory_plan(p, c, simulate(p, c), memory_inputs_of(p, mc, 4, cfg.lora.r, cfg.lora.targets));
    return m.devices[0].peak_bytes;
  };
  // Cap device 0 just under what the balanced split needs there: it must give up layers.
  cfg.offload.device_memory_mb = (peak_of(free.sizes) - 1) / 1048576.0;
  const auto capped = choose_partition(cfg, mc, 100).value();
  EXPECT_LT(capped.sizes[0], free.sizes[0]) << partition_text(capped.sizes) << " vs " << partition_text(free.sizes);
  EXPECT_LE(peak_of(capped.sizes), cfg.offload.device_memory_mb * 1048576.0);
}

TEST(Partition, FieldsAreValidatedByName) {
  project_config c;
  c.parallel.devices = "cpu:2";
  for (const std::string bad : {"abc", "3,", "0,5", "2.5,2", "-1,6"}) {
    c.parallel.partition = bad;
    auto r = partition_sizes(c);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.message().rfind("parallel.partition: '" + bad + "'", 0), 0u) << r.message();
  }
  c.parallel.partition = " 3, 2 ";
  EXPECT_EQ(partition_sizes(c).value(), (std::vector<int32_t>{3, 2}));
  c.parallel.partition = "even";
  EXPECT_TRUE(partition_sizes(c).value().empty());
  EXPECT_EQ(device_speeds(c).value(), (std::vector<double>{1, 1}));
  c.parallel.device_speeds = "1";
  EXPECT_NE(device_speeds(c).message().find("parallel.device_speeds: '1' must list one speed per device (2 for cpu:2)"), std::string::npos);
  c.parallel.device_speeds = "1,0";
  EXPECT_NE(device_speeds(c).message().find("parallel.device_speeds: 0 is out of range"), std::string::npos);
  c.parallel.device_speeds = "1, 0.5";
  EXPECT_EQ(device_speeds(c).value(), (std::vector<double>{1, 0.5}));
  // New fields at their defaults leave the config hash of older projects alone (the hash of the
  // snapshot without them); set, they change it.
  project_config d;
  const std::string h = config_hash(d);
  project_config snap = with_absolute_paths(d);
  snap.run.output_dir.clear();
  snap.run.database.clear();
  auto j = nlohmann::json::parse(project_to_json(snap));
  EXPECT_EQ(j["parallel"]["partition"], "auto");
  j["parallel"].erase("partition");
  j["parallel"].erase("backward_partition");
  j["parallel"].erase("device_speeds");
  j["offload"].erase("copy_links");
  j["offload"].erase("auto");
  j.erase("distributed");
  const std::string old_text = j.dump(2) + "\n";
  EXPECT_EQ(h, sha256_hex(old_text.data(), old_text.size()));
  {  // offload.copy_links: one link number per CPU virtual device, with a bandwidth; set, it changes the hash
    project_config l;
    l.parallel.devices = "cpu:4";
    EXPECT_TRUE(copy_links(l).value().empty());
    l.offload.copy_links = "0,0,1,1";
    EXPECT_NE(copy_links(l).message().find("offload.copy_links: a shared link needs a bandwidth"), std::string::npos) << copy_links(l).message();
    l.offload.copy_gbps = 2;
    EXPECT_EQ(copy_links(l).value(), (std::vector<int>{0, 0, 1, 1}));
    project_config unlinked = l;
    unlinked.offload.copy_links.clear();
    EXPECT_NE(config_hash(l), config_hash(unlinked));
    for (const std::string bad : {"0,1", "0,1,2,x", "0,1,2,1.5", "0,1,2,99"}) {
      l.offload.copy_links = bad;
      EXPECT_EQ(copy_links(l).message().rfind("offload.copy_links: ", 0), 0u) << bad << ": " << copy_links(l).message();
      EXPECT_NE(validate_project(l).message().find("offload.copy_links"), std::string::npos) << bad;
    }
    l.parallel.devices = "cuda:0,1,2,3";  // on GPUs, the links the planner costs as shared (a run records them): valid with a rate
    l.offload.copy_links = "0,0,1,1";
    EXPECT_EQ(validate_project(l).message().find("offload.copy_links"), std::string::npos) << validate_project(l).message();
    l.offload.copy_links = "0,0,1";  // still one number per device
    EXPECT_NE(validate_project(l).message().find("offload.copy_links: '0,0,1' must give one link number per device (4 for cuda:0,1,2,3)"),
              std::string::npos)
        << validate_project(l).message();
  }
  {  // the distributed section, each rejection naming its field
    project_config v;  // (no model or data: those errors come along, and are not looked at)
    v.parallel.devices = "cpu:2";
    v.parallel.schedule = "1f1b";
    v.distributed.processes = 2;
    EXPECT_EQ(validate_project(v).message().find("distributed"), std::string::npos) << validate_project(v).message();
    auto refused = [&](const project_config& x, const std::string& needle) {
      const auto st = validate_project(x);
      EXPECT_FALSE(st.ok()) << needle;
      if (!st.ok()) EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    };
    auto x = v;
    x.distributed.processes = 3;
    refused(x, "distributed.processes: 3 processes need a pipeline schedule on at least as many devices");
    x = v, x.distributed.processes = 0;
    refused(x, "distributed.processes: must be in 1..64");
    x = v, x.parallel.schedule = "single";
    refused(x, "distributed.processes: 2 processes need a pipeline schedule");
    x = v, x.optimizer.asynchronous = true;
    refused(x, "distributed.processes: cannot be combined with optimizer.asynchronous");
    for (const char* r : {"nohost", ":29500", "host:", "host:70000", "host:12a"}) {
      x = v, x.distributed.rendezvous = r;
      refused(x, "distributed.rendezvous: must be host:port");
    }
    x = v, x.distributed.timeout_s = 0;
    refused(x, "distributed.timeout_s");
  }
  // How many processes run it, and where they meet, is not part of what a run computes.
  project_config spread = d;
  spread.distributed.processes = 2;
  spread.distributed.rendezvous = "10.0.0.1:29500";
  spread.distributed.timeout_s = 30;
  EXPECT_EQ(config_hash(spread), h);
  d.parallel.partition = "even";  // what runs older than the field trained: their checkpoints still resume
  EXPECT_EQ(config_hash(d), h);
  d.parallel.partition = "4,4";
  EXPECT_NE(config_hash(d), h);
  d.parallel.partition = "auto";
  d.parallel.device_speeds = "1";
  EXPECT_NE(config_hash(d), h);
  d.parallel.device_speeds.clear();
  // parallel.backward_partition: per-layer is what round-robin ran before the field; counts change the hash.
  d.parallel.backward_partition = "per-layer";
  EXPECT_EQ(config_hash(d), h);
  d.parallel.schedule = "round-robin";
  d.parallel.partition = "3,3,2";
  const std::string rr = config_hash(d);
  d.parallel.backward_partition = "3,3";
  EXPECT_NE(config_hash(d), rr);
  for (const std::string bad : {"abc", "2,", "0,6", "1.5,4.5"}) {
    d.parallel.backward_partition = bad;
    auto r = backward_partition_sizes(d);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.message().rfind("parallel.backward_partition: '" + bad + "'", 0), 0u) << r.message();
  }
  {
    project_config b;
    b.parallel.devices = "cpu:2";
    const auto field_ok = [&] { return validate_project(b).message().find("backward_partition") == std::string::npos; };
    b.parallel.backward_partition = "per-layer";  // any schedule: round-robin's when auto picks it
    EXPECT_TRUE(field_ok()) << validate_project(b).message();
    b.parallel.backward_partition = "3,2";
    EXPECT_NE(validate_project(b).message().find("parallel.backward_partition: layer counts need parallel.schedule round-robin"),
              std::string::npos);
    b.parallel.schedule = "round-robin";
    EXPECT_NE(validate_project(b).message().find("parallel.backward_partition: layer counts need parallel.partition as layer counts"),
              std::string::npos);
    b.parallel.partition = "3,2,3";
    EXPECT_TRUE(field_ok()) << validate_project(b).message();
  }
  // Layer counts need a pipeline.
  project_config single;
  single.parallel.partition = "3,2";
  auto st = validate_project(single);
  EXPECT_NE(st.message().find("parallel.partition: layer counts need a pipeline schedule on several devices"), std::string::npos)
      << st.message();
  // Too few layers for the schedule's stages names the schedule.
  project_config many = two_devices("interleaved", "");
  many.parallel.virtual_stages = 8;
  auto few = choose_partition(many, synthetic_8_layers(), 100);
  ASSERT_FALSE(few.ok());
  EXPECT_NE(few.message().find("parallel.schedule: interleaved: 8 layers cannot fill its 16 stages"), std::string::npos) << few.message();
}

// Measured compute (a layer profile) in the cost model: each instruction charges what the executor
// runs (a FORWARD without autograd when a RECOMPUTE follows, the head's loss in F, R and B), times
// scale by FLOPs to other micro-batch shapes, and the partition search balances by them.
TEST(Partition, LayerProfileTimesAreChargedAsTheExecutorRuns) {
  const llama_config mc = synthetic_8_layers();
  auto m = std::make_shared<measured_compute>();
  m->rows = 2;
  m->seq_len = 128;
  m->layer_forward_s.assign(8, 2e-3);
  m->layer_forward_nograd_s.assign(8, 1e-3);
  m->layer_backward_s.assign(8, 5e-3);
  m->embed_s = 0.1e-3;
  m->head_forward_s = 7e-3;
  m->head_backward_s = 11e-3;
  const compute_rates rates{std::shared_ptr<const measured_compute>(m)};
  project_config cfg = two_devices("1f1b", "");  // 8 sequences in 4 micro-batches: the profiled shape
  cfg.parallel.partition = "3,5";
  for (bool recompute : {true, false}) {
    cfg.offload.recompute = recompute;
    const program p = project_program(cfg, mc, rates).value();
    const sim_costs c = estimate_costs(p, mc, cfg, rates);
    const double f = recompute ? 1e-3 : 2e-3;
    EXPECT_NEAR(c.forward_s[0], 0.1e-3 + 3 * f, 1e-12) << recompute;
    EXPECT_NEAR(c.forward_s[1], 5 * f + 7e-3, 1e-12) << recompute;
    EXPECT_NEAR(c.recompute_s[1], 5 * 2e-3 + 7e-3, 1e-12);
    EXPECT_NEAR(c.backward_s[0], 3 * 5e-3, 1e-12);
    EXPECT_NEAR(c.backward_s[1], 5 * 5e-3 + 11e-3, 1e-12);
  }
  // Twice the tokens per micro-batch: the layers' and the head's FLOPs set the scale.
  EXPECT_NEAR(rates.layer_backward(mc, 0, 2, 256), 5e-3 * layer_forward_flops(mc, 2, 256) / layer_forward_flops(mc, 2, 128), 1e-12);
  EXPECT_NEAR(rates.head_forward(mc, 4, 128), 2 * 7e-3, 1e-12);
  EXPECT_NE(rates.describe().find("layer profile"), std::string::npos);
  EXPECT_NE(compute_rates(100).describe().find("100 GFLOP/s"), std::string::npos);
  // A second shape measured (1 x 128, where a part per call weighs more): other shapes are charged
  // along the line through both in FLOPs. At either shape what was measured; at 4 x 128 the line
  // extended, below proportion; a line that does not rise, or rises faster than in proportion (its
  // part per call below 0), is noise and every shape is charged in proportion to the first.
  auto both = std::make_shared<measured_compute>(*m);
  both->second = {1, 128, std::vector<double>(8, 1.5e-3), std::vector<double>(8, 0.8e-3), std::vector<double>(8, 6e-3), 0.06e-3, 4e-3, 1e-3};
  const compute_rates lined{std::shared_ptr<const measured_compute>(both)};
  const double f1 = layer_forward_flops(mc, 1, 128), f2 = layer_forward_flops(mc, 2, 128), f4 = layer_forward_flops(mc, 4, 128);
  const double h1 = head_forward_flops(mc, 1, 128), h2 = head_forward_flops(mc, 2, 128), h4 = head_forward_flops(mc, 4, 128);
  EXPECT_NEAR(lined.layer_forward(mc, 3, 2, 128), 2e-3, 1e-15);
  EXPECT_NEAR(lined.layer_forward(mc, 3, 1, 128), 1.5e-3, 1e-15);
  EXPECT_NEAR(lined.layer_forward(mc, 3, 1, 128, false), 0.8e-3, 1e-15);
  EXPECT_NEAR(lined.layer_forward(mc, 3, 4, 128), 2e-3 + 0.5e-3 / (f2 - f1) * (f4 - f2), 1e-15);
  EXPECT_LT(lined.layer_forward(mc, 3, 4, 128), rates.layer_forward(mc, 3, 4, 128));
  // Past twice the first shape, in proportion to the line's value there (not the line extended).
  const double f8 = layer_forward_flops(mc, 8, 128);
  EXPECT_NEAR(lined.layer_forward(mc, 3, 8, 128), lined.layer_forward(mc, 3, 4, 128) * f8 / f4, 1e-15);
  EXPECT_GT(lined.layer_forward(mc, 3, 8, 128), 2e-3 + 0.5e-3 / (f2 - f1) * (f8 - f2));
  // The embedding along the line in tokens (0.1 ms at 256, 0.06 ms at 128: 0.02 ms per call): at 4 x
  // 128 tokens (2 micro-batches of the 8 sequences) 0.18 ms, with three layers' forwards.
  {
    project_config wide = two_devices("1f1b", "");
    wide.parallel.partition = "3,5";
    wide.parallel.micro_batches = 2;
    wide.offload.recompute = false;
    const program p = project_program(wide, mc, lined).value();
    EXPECT_NEAR(estimate_costs(p, mc, wide, lined).forward_s[0], 0.18e-3 + 3 * lined.layer_forward(mc, 0, 4, 128), 1e-12);
  }
  EXPECT_NEAR(lined.head_forward(mc, 4, 128), 7e-3 + 3e-3 / (h2 - h1) * (h4 - h2), 1e-15);
  EXPECT_NEAR(lined.head_forward(mc, 1, 128), 4e-3, 1e-15);
  EXPECT_NEAR(lined.layer_backward(mc, 3, 4, 128), 2 * 5e-3, 1e-15);  // 6 ms at 1 x 128 against 5 at 2 x 128: falls
  EXPECT_NEAR(lined.head_backward(mc, 2, 128), 11e-3, 1e-15);
  EXPECT_NEAR(lined.head_backward(mc, 1, 16), 11e-3 * head_forward_flops(mc, 1, 16) / h2, 1e-15);  // 1 ms at 1 x 128: steeper
  EXPECT_NEAR(lined.head_backward(mc, 4, 128), 2 * 11e-3, 1e-15);
  both->second.head_backward_s = 5e-3;  // still steeper than proportion: -1 ms per call
  EXPECT_NEAR(lined.head_backward(mc, 4, 128), 2 * 11e-3, 1e-15);
  both->second.head_backward_s = 6e-3;  // 1 ms per call, 5 ms per 1 x 128
  EXPECT_NEAR(lined.head_backward(mc, 4, 128), 1e-3 + 5e-3 * h4 / h1, 1e-15);
  EXPECT_NE(lined.describe().find("2 x 128 and 1 x 128 tokens per micro-batch, other shapes along the line"), std::string::npos)
      << lined.describe();
  both->second.layer_backward_s.resize(7);  // a second shape that does not cover every layer is not used
  EXPECT_NEAR(lined.layer_forward(mc, 3, 4, 128), rates.layer_forward(mc, 3, 4, 128), 1e-15);
  // A head far dearer than FLOPs say: the balanced partition gives the last stage fewer layers
  // than the FLOP model does.
  m->head_forward_s = 40e-3;
  m->head_backward_s = 80e-3;
  project_config bal = two_devices("1f1b", "");
  const auto by_flops = choose_partition(bal, mc, 100).value();
  const auto by_profile = choose_partition(bal, mc, rates).value();
  EXPECT_EQ(by_profile.how, "balanced");
  EXPECT_LT(by_profile.sizes[1], by_flops.sizes[1]) << partition_text(by_profile.sizes) << " vs " << partition_text(by_flops.sizes);
}

// Round-robin's own backward stages (RoundPipe's asymmetric partition): the even forward stages with
// one layer per backward stage when held; auto searches the backward partition (and, with the
// forward partition auto too, the forward stage count and sizes) with the simulator and finds the
// brute-force best within 2%; what it chooses is written into the project and trains the same
// program; given counts are checked against the fused tail, naming the field.
TEST(Partition, RoundRobinChoosesItsBackwardStages) {
  const llama_config mc = synthetic_8_layers();
  project_config cfg = two_devices("round-robin", "");
  cfg.offload.copy_gbps = 0.05;  // slow copies: every backward stage boundary and checkpoint costs
  cfg.parallel.partition = "even";
  cfg.parallel.backward_partition = "per-layer";
  const auto held = choose_partition(cfg, mc, 100).value();
  EXPECT_EQ(held.sizes, (std::vector<int32_t>{3, 3, 2}));
  EXPECT_TRUE(held.backward_sizes.empty());
  EXPECT_EQ(held.backward_how, "per-layer");
  EXPECT_EQ(backward_partition_text(held), "per-layer");
  EXPECT_EQ(project_program(cfg, mc, 100).value().stages.size(), 3u + 6u);

  cfg.parallel.backward_partition = "auto";
  const auto searched = choose_partition(cfg, mc, 100).value();
  EXPECT_EQ(searched.sizes, held.sizes);
  EXPECT_EQ(searched.how, "even");
  EXPECT_EQ(searched.backward_how, "balanced");
  EXPECT_LT(searched.step_s, 0.98 * held.step_s);
  EXPECT_EQ(searched.even_step_s, held.step_s);
  double best = std::numeric_limits<double>::infinity();
  std::vector<int32_t> cur, best_sizes;
  for (int32_t k = 1; k <= 6; ++k)
    compositions(6, k, cur, [&](const std::vector<int32_t>& b) {
      schedule_options so = schedule_options_of(cfg);
      so.stage_layers = {3, 3, 2};
      so.backward_layers = b;
      const program p = make_schedule("round-robin", 8, so).value();
      const double t = simulate(p, estimate_costs(p, mc, cfg, 100)).makespan_s;
      if (t < best) best = t, best_sizes = b;
    });
  EXPECT_LE(searched.step_s, best * 1.02) << backward_partition_text(searched) << " vs the best " << partition_text(best_sizes);

  cfg.parallel.partition = "auto";  // the forward stages searched too: never slower
  const auto both = choose_partition(cfg, mc, 100).value();
  EXPECT_LE(both.step_s, searched.step_s * (1 + 1e-9));
  const project_config resolved = resolve_auto_schedule(cfg, mc, 100).value();
  EXPECT_EQ(resolved.parallel.partition, partition_text(both.sizes));
  EXPECT_EQ(resolved.parallel.backward_partition, backward_partition_text(both));
  EXPECT_EQ(validate_project(resolved).message().find("parallel."), std::string::npos) << validate_project(resolved).message();
  EXPECT_EQ(program_to_text(project_program(resolved, mc, 100).value()), program_to_text(project_program(cfg, mc, 100).value()));

  cfg.parallel.partition = "3,3,2";
  cfg.parallel.backward_partition = "4,2";
  const auto given = choose_partition(cfg, mc, 100).value();
  EXPECT_EQ(given.backward_sizes, (std::vector<int32_t>{4, 2}));
  EXPECT_EQ(given.backward_how, "given");
  const program p = project_program(cfg, mc, 100).value();
  ASSERT_EQ(p.stages.size(), 5u);
  EXPECT_EQ(p.stages[3], (stage_def{0, 4, true, false}));
  EXPECT_EQ(p.stages[4], (stage_def{4, 6, false, false}));
  cfg.parallel.backward_partition = "4,1";
  auto short_by_one = choose_partition(cfg, mc, 100);
  ASSERT_FALSE(short_by_one.ok());
  EXPECT_NE(short_by_one.message().find("parallel.backward_partition: '4,1' adds up to 5 layers; the layers before the fused tail "
                                        "(forward stages 3,3,2) are 6"),
            std::string::npos)
      << short_by_one.message();
  // Round-robin's forward stages may be as many as the user likes, but every device needs a job.
  cfg.parallel.partition = "5,3";
  cfg.parallel.backward_partition = "auto";
  EXPECT_EQ(choose_partition(cfg, mc, 100).value().sizes, (std::vector<int32_t>{5, 3}));
  cfg.parallel.devices = "cpu:8";
  cfg.parallel.backward_partition = "5";
  auto idle = choose_partition(cfg, mc, 100);
  ASSERT_FALSE(idle.ok());
  EXPECT_NE(idle.message().find("parallel.partition: round-robin with forward stages 5,3 and backward stages 5 has 3 jobs for 8 devices"),
            std::string::npos)
      << idle.message();
}
