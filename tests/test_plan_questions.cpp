// Questions asked of a plan (core/engine/plan_questions.h) on the stories260K Llama: settings given
// as text (set_project_field), what-if answers equal to planning the changed project directly, the
// device shorthands (+N/-N, p2p), the largest sequence length and micro-batch that fit (one more is
// refused by the same memory plan), writing the plan's choices into a project file, the layer
// profiler with its cache, shared host links with the device order checked by the simulator, and
// GPU copy rates costing the choices.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/base/file_io.h"
#include "core/engine/compute_profile.h"
#include "core/engine/device_inventory.h"
#include "core/engine/plan_questions.h"
#include "core/engine/plan_report.h"
#include "core/pipeline/partition_search.h"
#include "core/train/layer_profile.h"
#include "test_paths.h"

using namespace lorapipe;
namespace fs = std::filesystem;

namespace {

project_config stories_pipeline() {
  project_config c;
  c.model.path = (test_data_dir() / "models/stories260K/hf").string();
  c.data.train = (test_data_dir() / "text/tinyshakespeare.txt").string();
  c.parallel.devices = "cpu:2";
  c.parallel.schedule = "1f1b";
  c.parallel.micro_batches = 4;
  c.parallel.partition = "3,2";
  c.run.batch_size = 8;
  c.data.seq_len = 64;
  c.offload.copy_gbps = 2;
  return c;
}

plan_summary plan_of(const project_config& c) {
  auto rep = make_plan(c, 100);
  EXPECT_TRUE(rep.ok()) << rep.message();
  return summarize_plan(c, rep.value());
}

}  // namespace

TEST(PlanQuestions, SettingsAreTypedAndNamed) {
  project_config c;
  EXPECT_EQ(set_project_field(c, "seq_len", "2048").value(), "data.seq_len");
  EXPECT_EQ(c.data.seq_len, 2048);
  EXPECT_EQ(set_project_field(c, "offload.stream_weights", "off").value(), "offload.stream_weights");
  EXPECT_FALSE(c.offload.stream_weights);
  EXPECT_EQ(set_project_field(c, "copy_gbps", "1.5").value(), "offload.copy_gbps");
  EXPECT_DOUBLE_EQ(c.offload.copy_gbps, 1.5);
  EXPECT_EQ(set_project_field(c, "targets", "q_proj,v_proj").value(), "lora.targets");
  EXPECT_EQ(c.lora.targets, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(set_project_field(c, "r", "4").value(), "lora.r");
  EXPECT_EQ(project_field_text(c, "lora.targets"), "q_proj,v_proj");
  EXPECT_EQ(project_field_text(c, "offload.copy_gbps"), "1.5");
  EXPECT_EQ(set_project_field(c, "seq_len", "12x").message(), "data.seq_len: '12x' must be an integer");
  EXPECT_EQ(set_project_field(c, "stream_weights", "maybe").message(), "offload.stream_weights: 'maybe' must be true or false (on/off)");
  EXPECT_NE(set_project_field(c, "path", "x").message().find("path: ambiguous, say which: model.path, tokenizer.path"), std::string::npos);
  EXPECT_NE(set_project_field(c, "nope", "1").message().find("nope: no such project field"), std::string::npos);
  EXPECT_EQ(c.data.seq_len, 2048);  // a rejected setting leaves the config alone
}

TEST(PlanQuestions, WhatIfEqualsPlanningTheChangedProject) {
  const project_config c = stories_pipeline();
  const plan_summary base = plan_of(c);
  const auto a = what_if(c, base, "seq_len=128 micro_batches=2", 100, nullptr);
  ASSERT_TRUE(a.error.empty()) << a.error;
  ASSERT_EQ(a.changes.size(), 2u);
  EXPECT_EQ(a.changes[0].field, "data.seq_len");
  EXPECT_EQ(a.changes[0].before, "64");
  EXPECT_EQ(a.changes[0].after, "128");
  EXPECT_EQ(a.changes[1].field, "parallel.micro_batches");
  project_config direct = c;
  direct.data.seq_len = 128;
  direct.parallel.micro_batches = 2;
  const plan_summary want = plan_of(direct);
  EXPECT_EQ(a.after.micro_batches, 2);
  EXPECT_DOUBLE_EQ(a.after.step_s, want.step_s);
  EXPECT_EQ(a.after.peak_bytes, want.peak_bytes);
  EXPECT_GT(a.after.step_s, a.before.step_s);
  for (size_t d = 0; d < 2; ++d) EXPECT_GT(a.after.peak_bytes[d], a.before.peak_bytes[d]);
  const std::string text = what_if_text(a);
  EXPECT_NE(text.find("data.seq_len: 64 -> 128"), std::string::npos) << text;
  EXPECT_NE(text.find("1f1b x4 on cpu:2 (layers 3,2) -> 1f1b x2 on cpu:2 (layers 3,2)"), std::string::npos) << text;
  EXPECT_TRUE(a.notes.empty());
  EXPECT_EQ(tokens_per_s_text(36077.3), "36077");
  EXPECT_EQ(tokens_per_s_text(12.54), "12.5");
  EXPECT_EQ(tokens_per_s_text(0.37648), "0.376");
  project_config autoc = c;
  autoc.parallel.schedule = "auto";
  const auto held = apply_what_if(autoc, "micro_batches=2");
  ASSERT_EQ(held->notes.size(), 1u);
  EXPECT_NE(held->notes[0].find("schedule=NAME"), std::string::npos);
}

TEST(PlanQuestions, DevicesAddedOrRemovedAndP2POff) {
  project_config c = stories_pipeline();
  c.parallel.device_speeds = "1,0.5";
  const plan_summary base = plan_of(c);
  auto v = apply_what_if(c, "devices=+1 p2p=off");
  ASSERT_TRUE(v.ok()) << v.message();
  EXPECT_EQ(v->cfg.parallel.devices, "cpu:3");
  EXPECT_EQ(v->cfg.parallel.transport, "host");
  EXPECT_EQ(v->cfg.parallel.partition, "auto");  // "3,2" was for two stages
  EXPECT_EQ(v->cfg.parallel.device_speeds, "1,0.5,1");
  const auto a = what_if(c, base, "devices=+1 p2p=off", 100, nullptr);
  ASSERT_TRUE(a.error.empty()) << a.error;
  EXPECT_EQ(a.after.peak_bytes.size(), 3u);
  EXPECT_EQ(a.after.devices, "cpu:3");
  EXPECT_EQ(apply_what_if(c, "devices=-1")->cfg.parallel.devices, "cpu");
  EXPECT_NE(apply_what_if(c, "devices=-2").message().find("leaves no device"), std::string::npos);
  project_config g = c;
  g.parallel.devices = "cuda:0,2";
  EXPECT_EQ(apply_what_if(g, "devices=+2")->cfg.parallel.devices, "cuda:0,2,3,4");
  // Errors name the setting; an answer that cannot be planned says why, with the plan as it is.
  EXPECT_NE(apply_what_if(c, "p2p=maybe").message().find("p2p: 'maybe' must be on or off"), std::string::npos);
  EXPECT_NE(apply_what_if(c, "seq_len").message().find("expected field=value"), std::string::npos);
  const auto bad = what_if(c, base, "schedule=zigzag", 100, nullptr);
  EXPECT_NE(bad.error.find("parallel.schedule"), std::string::npos) << bad.error;
  EXPECT_NE(what_if_text(bad).find("cannot be planned"), std::string::npos);
}

TEST(PlanQuestions, LargestFitFitsAndOneMoreIsRefused) {
  project_config c = stories_pipeline();
  c.offload.device_memory_mb = 3;
  const auto f = largest_fit(c, project_capacity(c, nullptr));
  ASSERT_TRUE(f.ok()) << f.message();
  ASSERT_TRUE(f->bounded);
  EXPECT_EQ(f->rows_per_micro_batch, 2);
  ASSERT_GT(f->max_seq_len, 0);
  ASSERT_LT(f->max_seq_len, 512);  // memory, not the model's context, stops it
  EXPECT_FALSE(f->seq_len_at_model_limit);
  const auto refusal_at = [&](int64_t seq_len, int64_t rows) {
    project_config x = c;
    x.data.seq_len = seq_len;
    x.run.batch_size = rows * x.parallel.micro_batches;
    return make_plan(x, 100).value().memory_refusal;
  };
  EXPECT_EQ(refusal_at(f->max_seq_len, 2), "");
  EXPECT_NE(refusal_at(f->max_seq_len + 1, 2), "");
  ASSERT_GT(f->max_rows_per_micro_batch, 0);
  EXPECT_EQ(refusal_at(64, f->max_rows_per_micro_batch), "");
  EXPECT_NE(refusal_at(64, f->max_rows_per_micro_batch + 1), "");
  // Plenty of memory: the model's context length is the limit.
  c.offload.device_memory_mb = 4096;
  const auto roomy = largest_fit(c, project_capacity(c, nullptr));
  EXPECT_EQ(roomy->max_seq_len, 512);
  EXPECT_TRUE(roomy->seq_len_at_model_limit);
  // No capacity: nothing to search; too little: nothing fits.
  c.offload.device_memory_mb = 0;
  EXPECT_FALSE(largest_fit(c, project_capacity(c, nullptr))->bounded);
  c.offload.device_memory_mb = 0.05;
  const auto none = largest_fit(c, project_capacity(c, nullptr));
  EXPECT_EQ(none->max_seq_len, 0);
  EXPECT_NE(fit_limits_text(*none, c).find("not even one token"), std::string::npos);
  // A probe's stand-in capacity of CPU virtual devices bounds nothing; a GPU's measured memory does
  // (the tighter of it and the limit).
  device_inventory probed;
  probed.devices.resize(2);
  for (auto& d : probed.devices) d.capacity_bytes = size_t{1} << 40;
  c.offload.device_memory_mb = 0;
  EXPECT_EQ(project_capacity(c, &probed), (std::vector<size_t>{0, 0}));
  probed.devices[1].gpu = 0;
  probed.devices[1].capacity_bytes = 8 * 1048576;
  EXPECT_EQ(project_capacity(c, &probed), (std::vector<size_t>{0, 8 * 1048576}));
  c.offload.device_memory_mb = 3;
  EXPECT_EQ(project_capacity(c, &probed), (std::vector<size_t>{3 * 1048576, 3 * 1048576}));
  // One device: its memory is not planned, so a limit refuses nothing there (train would run it).
  project_config one = stories_pipeline();
  one.parallel.devices = "cpu";
  one.parallel.schedule = one.parallel.partition = "auto";
  one.offload.device_memory_mb = 0.05;
  const auto single = make_plan(one, 100);
  ASSERT_TRUE(single.ok()) << single.message();
  EXPECT_EQ(single->schedule, "single");
  EXPECT_EQ(single->memory_refusal, "");
  EXPECT_TRUE(check_project_memory(one).ok());
}

// Without offload.device_memory_mb, a GPU's measured memory bounds what auto chooses (before, the
// choice ignored it and the executor refused the run at its first step): the choice under a probed
// capacity is the one under the same explicit limit, it fits, and nothing fitting is an error.
TEST(PlanQuestions, AProbedGpuMemoryBoundsTheChoice) {
  project_config c = stories_pipeline();
  c.parallel.schedule = c.parallel.partition = "auto";
  const auto free = make_plan(c, 100);
  ASSERT_TRUE(free.ok()) << free.message();
  EXPECT_EQ(free->memory_bound_mb, 0);
  const auto peak_of = [](const plan_report& r) {
    double p = 0;
    for (const auto& d : r.memory.devices) p = std::max(p, static_cast<double>(d.peak_bytes));
    return static_cast<size_t>(p);
  };
  size_t least = SIZE_MAX;
  for (const auto& k : free->schedule_candidates)
    if (k.ok) least = std::min(least, static_cast<size_t>(k.peak_bytes));
  const size_t chosen = peak_of(*free);
  ASSERT_LT(least, chosen) << "the test needs a candidate smaller than the unbounded choice";
  device_inventory probed;
  probed.devices.resize(2);
  for (auto& d : probed.devices) d.gpu = 0, d.capacity_bytes = (least + chosen) / 2;
  const auto bounded = make_plan(c, 100, &probed);
  ASSERT_TRUE(bounded.ok()) << bounded.message();
  EXPECT_NEAR(bounded->memory_bound_mb, static_cast<double>((least + chosen) / 2) / 1048576.0, 1e-9);
  EXPECT_LE(peak_of(*bounded), (least + chosen) / 2);
  EXPECT_EQ(bounded->memory_refusal, "");
  // (so the choice changed: the unbounded one peaks at `chosen`, above the bound)
  project_config limited = c;
  limited.offload.device_memory_mb = bounded->memory_bound_mb;
  const auto explicit_limit = make_plan(limited, 100);
  ASSERT_TRUE(explicit_limit.ok()) << explicit_limit.message();
  EXPECT_EQ(explicit_limit->schedule, bounded->schedule);
  EXPECT_EQ(explicit_limit->prog.micro_batches, bounded->prog.micro_batches);
  EXPECT_EQ(explicit_limit->partition.sizes, bounded->partition.sizes);
  // Less than any candidate needs: no plan, and the error says so.
  for (auto& d : probed.devices) d.capacity_bytes = least / 4;
  const auto none = make_plan(c, 100, &probed);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.message().find("found no pipeline for 2 devices that fits"), std::string::npos) << none.message();
  // CPU virtual devices without a limit stay unbounded (their probed capacity is a stand-in).
  for (auto& d : probed.devices) d.gpu = -1;
  EXPECT_EQ(make_plan(c, 100, &probed)->memory_bound_mb, 0);
}

// On GPUs whose project states no copy rate, the choices cost copies at the inventory's rates (a
// cached probe or the PCIe estimate: gpu_planning_inventory), the same as with offload.copy_gbps set
// to that rate, and not as free; the run records that rate, so the memory plan the executor makes
// from the recorded project is the one the choices were fitted with, and a choice made to fit the
// GPUs passes the check before launch. (Fake GPUs on CPU virtual devices: the choices are the same code.)
TEST(PlanQuestions, GpuCopyRatesCostTheChoicesAsTheTrainersDo) {
  project_config c = stories_pipeline();
  c.parallel.schedule = c.parallel.partition = "auto";
  c.offload.copy_gbps = 0;
  device_inventory gpus;
  gpus.devices.resize(2);
  for (int g = 0; g < 2; ++g) {
    auto& d = gpus.devices[static_cast<size_t>(g)];
    d.gpu = g;
    d.h2d_bytes_per_s = d.d2h_bytes_per_s = d.h2d_concurrent_bytes_per_s = d.d2h_concurrent_bytes_per_s = 0.2e9;
  }
  gpus.rates_from = "estimated from the PCIe links (test)";
  project_config stated = c;
  stated.offload.copy_gbps = 0.2;
  const auto free = make_plan(c, 100), costed = make_plan(c, 100, &gpus), as_stated = make_plan(stated, 100);
  ASSERT_TRUE(free.ok() && costed.ok() && as_stated.ok()) << free.message() << costed.message() << as_stated.message();
  const auto label = [](const plan_report& r) {
    return fmt::format("{} x{} {} / {}", r.schedule, r.prog.micro_batches, partition_text(r.partition.sizes), backward_partition_text(r.partition));
  };
  EXPECT_EQ(label(*costed), label(*as_stated));
  ASSERT_NE(label(*free), label(*as_stated)) << "the test needs a choice that copies at 0.2 GB/s change";
  EXPECT_NEAR(costed->sim.makespan_s, as_stated->sim.makespan_s, 1e-9 * as_stated->sim.makespan_s);  // the prediction too
  EXPECT_EQ(costed->copy_rates, "0.20 GB/s, estimated from the PCIe links (test)");
  EXPECT_EQ(free->copy_rates, "");
  EXPECT_EQ(make_plan(stated, 100, &gpus)->copy_rates, "");  // a stated rate is the project's
  project_config ranks = c;
  ranks.distributed.processes = 2;  // several processes: no rank reads the GPUs, so none costs at them
  EXPECT_EQ(with_planning_copy_rates(ranks, &gpus).offload.copy_gbps, 0);
  // The trainer's resolution chooses alike and records the rate.
  auto resolved = resolve_project_schedule(c, &gpus);
  ASSERT_TRUE(resolved.ok()) << resolved.message();
  EXPECT_EQ(resolved->parallel.schedule, costed->schedule);
  EXPECT_EQ(resolved->parallel.micro_batches, costed->prog.micro_batches);
  EXPECT_EQ(resolved->parallel.partition, partition_text(costed->partition.sizes));
  EXPECT_EQ(resolved->parallel.backward_partition, backward_partition_text(costed->partition));
  EXPECT_DOUBLE_EQ(resolved->offload.copy_gbps, 0.2);
  EXPECT_EQ(resolved->offload.copy_links, "");
  // The executor's memory plan (pipeline_setup: the recorded project, auto_schedule_gflops) is the one shown.
  const auto mc = project_model_config(c).value();
  const memory_plan executors = project_memory_plan(costed->prog, mc, *resolved, auto_schedule_gflops);
  ASSERT_EQ(executors.devices.size(), costed->memory.devices.size());
  for (size_t d = 0; d < executors.devices.size(); ++d) {
    EXPECT_EQ(executors.devices[d].peak_bytes, costed->memory.devices[d].peak_bytes) << d;
    EXPECT_EQ(executors.devices[d].expected_peak_bytes, costed->memory.devices[d].expected_peak_bytes) << d;
  }
  // Bounded by the GPUs' memory: what the choices fit passes the check before launch (begin_run's).
  double peak = 0;
  for (const auto& d : costed->memory.devices) peak = std::max(peak, static_cast<double>(d.peak_bytes));
  double least = peak;
  for (const auto& k : costed->schedule_candidates)
    if (k.ok) least = std::min(least, static_cast<double>(k.peak_bytes));
  ASSERT_LT(least, peak) << "the test needs a candidate smaller than the unbounded choice";
  for (auto& d : gpus.devices) d.capacity_bytes = static_cast<size_t>((least + peak) / 2);  // below the unbounded choice's peak
  auto bounded = resolve_project_schedule(c, &gpus);
  ASSERT_TRUE(bounded.ok()) << bounded.message();
  EXPECT_TRUE(check_project_memory(*bounded, &gpus).ok()) << check_project_memory(*bounded, &gpus).message();
  EXPECT_NE(label(*make_plan(*bounded, 100, &gpus)), label(*costed));  // (so the bound changed the choice)
  // Two pipeline devices on one GPU share its link: recorded as a shared link at the rate alone.
  for (auto& d : gpus.devices) d.gpu = 0, d.upstream = {"0000:00:01.0"}, d.capacity_bytes = 0, d.h2d_concurrent_bytes_per_s = d.d2h_concurrent_bytes_per_s = 0.1e9;
  auto shared = resolve_project_schedule(c, &gpus);
  ASSERT_TRUE(shared.ok()) << shared.message();
  EXPECT_EQ(shared->offload.copy_links, "0,0");
  EXPECT_DOUBLE_EQ(shared->offload.copy_gbps, 0.2);
  EXPECT_NE(make_plan(c, 100, &gpus)->copy_rates.find("0.20 GB/s on shared links (offload.copy_links 0,0)"), std::string::npos);
  // What a run on GPUs records is a valid project (begin_run's check and a resume validate it).
  project_config on_gpu = *shared;
  on_gpu.parallel.devices = "cuda:0,0";
  EXPECT_TRUE(validate_project(on_gpu).ok()) << validate_project(on_gpu).message();
  on_gpu.parallel.devices = "cuda:0,1";
  on_gpu.offload.copy_gbps = 0;  // (links without a rate stay refused)
  EXPECT_NE(validate_project(on_gpu).message().find("offload.copy_links: a shared link needs a bandwidth"), std::string::npos);
}

TEST(PlanQuestions, WritingThePlanKeepsTheRestOfTheFile) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lp_write_{}", ::getpid());
  fs::create_directories(dir);
  project_config c = stories_pipeline();
  c.parallel.schedule = "auto";
  c.parallel.partition = "auto";
  c.parallel.device_speeds = "1,0.5";
  // A hand-written file: fields in its own order, most left at their defaults.
  nlohmann::ordered_json j;
  j["name"] = "mine";
  j["run"] = {{"batch_size", 8}, {"steps", 3}};
  j["model"] = {{"path", c.model.path}};
  j["data"] = {{"train", c.data.train}, {"seq_len", 64}};
  j["parallel"] = {{"devices", "cpu:2"}, {"device_speeds", "1,0.5"}};
  j["offload"] = {{"copy_gbps", 2}};
  const fs::path file = dir / "p.json";
  ASSERT_TRUE(write_file_atomic(file, j.dump(2)).ok());
  auto loaded = load_project(file);
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  auto rep = make_plan(*loaded, 100);
  ASSERT_TRUE(rep.ok()) << rep.message();
  ASSERT_EQ(rep->partition.how, "balanced");
  ASSERT_TRUE(write_plan_choices(file, *loaded, *rep).ok());
  const auto back = nlohmann::ordered_json::parse(read_text_file(file).value());
  std::vector<std::string> keys;
  for (const auto& [k, v] : back.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"name", "run", "model", "data", "parallel", "offload"}));
  EXPECT_EQ(back["run"], j["run"]);
  EXPECT_EQ(back["data"], j["data"]);
  EXPECT_EQ(back["parallel"]["schedule"], rep->prog.schedule);
  EXPECT_EQ(back["parallel"]["micro_batches"], rep->prog.micro_batches);
  EXPECT_EQ(back["parallel"]["partition"], partition_text(rep->partition.sizes));
  EXPECT_EQ(back["parallel"]["device_speeds"], "1,0.5");
  // The written project plans to the same program.
  auto again = make_plan(load_project(file).value(), 100);
  ASSERT_TRUE(again.ok()) << again.message();
  EXPECT_EQ(program_to_text(again->prog), program_to_text(rep->prog));
  {  // Round-robin: its backward stages are written with the forward ones and plan to the same program.
    nlohmann::ordered_json rr = j;
    rr["parallel"] = {{"devices", "cpu:2"}, {"schedule", "round-robin"}};
    rr["offload"] = {{"copy_gbps", 0.05}};  // slow copies: fewer backward stages cross fewer boundaries
    ASSERT_TRUE(write_file_atomic(file, rr.dump(2)).ok());
    const auto rr_cfg = load_project(file).value();
    const auto rr_rep = make_plan(rr_cfg, 100).value();
    ASSERT_EQ(rr_rep.partition.backward_how, "balanced");
    ASSERT_FALSE(rr_rep.partition.backward_sizes.empty());
    ASSERT_TRUE(write_plan_choices(file, rr_cfg, rr_rep).ok());
    const auto rr_back = nlohmann::ordered_json::parse(read_text_file(file).value());
    EXPECT_EQ(rr_back["parallel"]["backward_partition"], partition_text(rr_rep.partition.backward_sizes));
    EXPECT_EQ(rr_back["parallel"]["partition"], partition_text(rr_rep.partition.sizes));
    const auto kept = load_project(file).value();
    EXPECT_EQ(program_to_text(make_plan(kept, 100).value().prog), program_to_text(rr_rep.prog));
    EXPECT_NE(summarize_plan(kept, make_plan(kept, 100).value()).partition.find(" / backward "), std::string::npos);
    // Another schedule has no backward stages: the counts go back to auto, and the change is listed.
    auto other = apply_what_if(kept, "schedule=1f1b");
    ASSERT_TRUE(other.ok()) << other.message();
    EXPECT_EQ(other->cfg.parallel.backward_partition, "auto");
    EXPECT_TRUE(std::any_of(other->changes.begin(), other->changes.end(),
                            [](const what_if_change& c) { return c.field == "parallel.backward_partition" && c.after == "auto"; }));
  }
  {  // offload.auto: the settings it chose are written (and offload.auto off); a what-if that sets one holds it.
    nlohmann::ordered_json oa = j;
    oa["parallel"] = {{"devices", "cpu:2"}, {"schedule", "1f1b"}};
    oa["offload"] = {{"copy_gbps", 0.05}, {"auto", true}};
    ASSERT_TRUE(write_file_atomic(file, oa.dump(2)).ok());
    const auto oa_cfg = load_project(file).value();
    const auto oa_rep = make_plan(oa_cfg, 100).value();
    ASSERT_TRUE(oa_rep.offload_auto.weighed);
    ASSERT_FALSE(oa_rep.offload_auto.changes.empty()) << offload_choice_text(oa_rep);
    EXPECT_NE(offload_choice_text(oa_rep).find("offload auto chose"), std::string::npos) << offload_choice_text(oa_rep);
    ASSERT_TRUE(write_plan_choices(file, oa_cfg, oa_rep).ok());
    const auto oa_back = nlohmann::ordered_json::parse(read_text_file(file).value());
    EXPECT_EQ(oa_back["offload"]["auto"], false);
    EXPECT_EQ(oa_back["offload"]["stream_weights"], oa_rep.stream_weights);
    EXPECT_EQ(oa_back["offload"]["recompute"], oa_rep.recompute);
    const auto kept = load_project(file).value();
    const auto kept_rep = make_plan(kept, 100).value();
    EXPECT_FALSE(kept_rep.offload_auto.weighed);
    EXPECT_EQ(program_to_text(kept_rep.prog), program_to_text(oa_rep.prog));
    const std::string flip = fmt::format("offload.stream_weights={}", oa_rep.stream_weights ? "false" : "true");
    auto held = apply_what_if(oa_cfg, flip);
    ASSERT_TRUE(held.ok()) << held.message();
    EXPECT_FALSE(held->cfg.offload.automatic);
    EXPECT_EQ(held->cfg.offload.stream_weights, !oa_rep.stream_weights);
  }
  // One device: the plan is "single" (no pipeline); "auto" stays (it trains single here and plans a
  // pipeline when devices are added: the file then still trains with --devices cpu:2).
  nlohmann::ordered_json one = j;
  one["parallel"] = {{"devices", "cpu"}};
  ASSERT_TRUE(write_file_atomic(file, one.dump(2)).ok());
  const auto single_cfg = load_project(file).value();
  const auto single = make_plan(single_cfg, 100).value();
  EXPECT_EQ(single.schedule, "single");
  EXPECT_EQ(summarize_plan(single_cfg, single).schedule, "single");
  ASSERT_TRUE(write_plan_choices(file, single_cfg, single).ok());
  const auto one_back = nlohmann::ordered_json::parse(read_text_file(file).value());
  EXPECT_EQ(one_back["parallel"], (nlohmann::ordered_json{{"devices", "cpu"}, {"schedule", "auto"}}));
  auto widened = load_project(file).value();
  widened.parallel.devices = "cpu:2";
  EXPECT_TRUE(validate_project(widened).ok());
  const auto fit = largest_fit(with_plan_choices(single_cfg, single), {size_t{1} << 30});
  EXPECT_NE(fit->note.find("not planned"), std::string::npos) << fit->note;
  // A file that is not a project object is left alone.
  ASSERT_TRUE(write_file_atomic(file, "[1, 2]").ok());
  EXPECT_FALSE(write_plan_choices(file, *loaded, *rep).ok());
  EXPECT_EQ(read_text_file(file).value(), "[1, 2]");
  fs::remove_all(dir);
}

// The layer profiler on stories260K (CPU), its cache, and the planner picking the cached profile up.
TEST(LayerProfile, MeasuresEveryLayerCachesAndPlansWithIt) {
  const fs::path cache = fs::temp_directory_path() / fmt::format("lp_profile_{}", ::getpid()) / "lorapipe";
  fs::remove_all(cache.parent_path());
  const project_config c = stories_pipeline();
  const llama_config mc = project_model_config(c).value();
  EXPECT_EQ(project_compute_rates(c, mc, cache).measured, nullptr);  // nothing cached: FLOPs
  profile_request req;
  req.cache_dir = cache;
  req.options.min_seconds = 0.05;
  auto first = profile_project(c, mc, req);
  ASSERT_TRUE(first.ok()) << first.message();
  EXPECT_FALSE(first->from_cache);
  EXPECT_EQ(first->cache_note, "");
  const auto& m = first->profile.compute;
  EXPECT_EQ(m.rows, 2);
  EXPECT_EQ(m.seq_len, 64);
  ASSERT_EQ(m.layer_forward_s.size(), 5u);
  for (size_t l = 0; l < 5; ++l) {
    EXPECT_GT(m.layer_forward_s[l], 0);
    EXPECT_GT(m.layer_forward_nograd_s[l], 0);
    EXPECT_GT(m.layer_backward_s[l], 0);
  }
  EXPECT_GT(m.head_forward_s, m.embed_s);  // a [128 x 64] x [64 x 512] product and its loss against a gather
  EXPECT_GT(m.head_backward_s, 0);
  EXPECT_GE(first->profile.repeats, 5);
  // The second shape, measured in the same rounds: half the rows, every time measured.
  EXPECT_EQ(m.second.rows, 1);
  EXPECT_EQ(m.second.seq_len, 64);
  ASSERT_EQ(m.second.layer_forward_s.size(), 5u);
  ASSERT_EQ(m.second.layer_backward_s.size(), 5u);
  for (size_t l = 0; l < 5; ++l) {
    EXPECT_GT(m.second.layer_forward_s[l], 0);
    EXPECT_GT(m.second.layer_forward_nograd_s[l], 0);
    EXPECT_GT(m.second.layer_backward_s[l], 0);
  }
  EXPECT_GT(m.second.head_forward_s, 0);
  EXPECT_GT(m.second.head_backward_s, 0);
  EXPECT_NE(layer_profile_text(first->profile).find("at 1 x 64 tokens"), std::string::npos) << layer_profile_text(first->profile);
  // The autograd graph a layer keeps, measured through LibTorch's allocator, against the memory
  // plan's model of it: the model must not fall short of it (the executor reserves the model's bytes
  // for each graph), nor be far above it (a measurement that saw nothing, or a model that wastes).
  const auto& prof = first->profile;
  EXPECT_DOUBLE_EQ(prof.graph_bytes_per_token_model, stash_bytes_per_layer(mc, 1, c.data.seq_len, 4, graph_targets_of(c.lora.targets)));
  EXPECT_GE(prof.graph_bytes_per_token_model, 0.98 * prof.graph_bytes_per_token) << prof.graph_bytes_per_token;
  EXPECT_GE(prof.graph_bytes_per_token, 0.6 * prof.graph_bytes_per_token_model) << prof.graph_bytes_per_token;
  std::printf("autograd graph per token and layer: measured %.0f B, memory plan %.0f B\n", prof.graph_bytes_per_token,
              prof.graph_bytes_per_token_model);
  EXPECT_NE(layer_profile_text(first->profile).find("layers 0-4: forward"), std::string::npos) << layer_profile_text(first->profile);
  // Cached: the same numbers back, and the planner charges them.
  auto second = profile_project(c, mc, req);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->from_cache);
  EXPECT_EQ(second->profile.compute.layer_backward_s, m.layer_backward_s);
  EXPECT_EQ(second->profile.compute.second.layer_backward_s, m.second.layer_backward_s);
  EXPECT_EQ(second->profile.compute.second.head_forward_s, m.second.head_forward_s);
  const compute_rates rates = project_compute_rates(c, mc, cache);
  ASSERT_NE(rates.measured, nullptr);
  EXPECT_EQ(rates.measured->head_forward_s, m.head_forward_s);
  // make_plan finds the cached profile by itself (in $XDG_CACHE_HOME/lorapipe) and charges it,
  // choices included.
  project_config choosing = c;
  choosing.parallel.partition = "auto";
  const char* saved = std::getenv("XDG_CACHE_HOME");
  const std::string saved_value = saved ? saved : "";
  ::setenv("XDG_CACHE_HOME", cache.parent_path().c_str(), 1);
  const auto rep = make_plan(choosing, 100);
  if (saved) ::setenv("XDG_CACHE_HOME", saved_value.c_str(), 1);
  else ::unsetenv("XDG_CACHE_HOME");
  const auto flops = make_plan(choosing, 100);
  ASSERT_TRUE(rep.ok()) << rep.message();
  ASSERT_NE(rep->measured, nullptr);
  EXPECT_EQ(rep->measured->layer_backward_s, m.layer_backward_s);
  EXPECT_NE(rep->compute.find("layer profile"), std::string::npos);
  EXPECT_EQ(rep->partition.sizes, choose_partition(choosing, mc, rates).value().sizes);
  EXPECT_DOUBLE_EQ(rep->sim.makespan_s, simulate(rep->prog, estimate_costs(rep->prog, mc, choosing, rates)).makespan_s);
  ASSERT_TRUE(flops.ok());
  EXPECT_EQ(flops->measured, nullptr);  // the test's own cache (ctest sets XDG_CACHE_HOME) has none
  EXPECT_NE(flops->compute.find("GFLOP/s"), std::string::npos);
  EXPECT_NE(flops->sim.makespan_s, rep->sim.makespan_s);
  // Another shape: the nearest cached one stands in (scaled by FLOPs); another device setting is
  // another key; a damaged file is measured again.
  project_config longer = c;
  longer.data.seq_len = 128;
  EXPECT_EQ(layer_profile_key(longer, mc).value(), first->key);
  ASSERT_NE(project_compute_rates(longer, mc, cache).measured, nullptr);
  EXPECT_EQ(project_compute_rates(longer, mc, cache).measured->seq_len, 64);
  project_config threads = c;
  threads.parallel.threads_per_device = 2;
  EXPECT_NE(layer_profile_key(threads, mc).value(), first->key);
  EXPECT_EQ(project_compute_rates(threads, mc, cache).measured, nullptr);
  // A what-if reuses the plan's profile for the same key (another shape: scaled), not for another.
  const plan_summary base = summarize_plan(c, make_plan(c, 100, nullptr, rates.measured).value());
  const auto scaled = what_if(c, base, "seq_len=128", 100, nullptr, rates.measured);
  EXPECT_DOUBLE_EQ(scaled.after.step_s, make_plan(longer, 100, nullptr, rates.measured)->sim.makespan_s);
  const auto other = what_if(c, base, "threads_per_device=2", 100, nullptr, rates.measured);
  EXPECT_DOUBLE_EQ(other.after.step_s, make_plan(threads, 100, nullptr, nullptr)->sim.makespan_s);
  EXPECT_NE(other.after.step_s, make_plan(threads, 100, nullptr, rates.measured)->sim.makespan_s);
  project_config dropout = c;
  dropout.lora.dropout = 0.1;
  EXPECT_NE(layer_profile_key(dropout, mc).value(), first->key);
  // A profile cached before the second shape was measured still loads, charged in proportion to FLOPs.
  {
    auto j = nlohmann::json::parse(read_text_file(first->cache_file).value());
    j["compute"].erase("second");
    ASSERT_TRUE(write_file_atomic(first->cache_file, j.dump()).ok());
    const compute_rates old = project_compute_rates(c, mc, cache);
    ASSERT_NE(old.measured, nullptr);
    EXPECT_EQ(old.measured->second.rows, 0);
    EXPECT_EQ(old.measured->layer_backward_s, m.layer_backward_s);
    EXPECT_NE(old.describe().find("scaled by FLOPs"), std::string::npos) << old.describe();
    EXPECT_NE(rates.describe().find("along the line"), std::string::npos) << rates.describe();
  }
  // A second shape that does not cover every layer is dropped when loaded; a profile missing a field
  // of its own shape is unreadable (measured again), not zero.
  {
    auto j = nlohmann::json::parse(layer_profile_to_json(first->profile, first->key));
    j["compute"]["second"]["layer_backward_s"] = nlohmann::json::array({1e-3});
    auto partial = layer_profile_from_json(j.dump(), first->key);
    ASSERT_TRUE(partial.ok()) << partial.message();
    EXPECT_EQ(partial->compute.second.rows, 0);
    EXPECT_EQ(layer_profile_text(*partial).find("at 1 x 64 tokens"), std::string::npos);
    j = nlohmann::json::parse(layer_profile_to_json(first->profile, first->key));
    j["compute"].erase("head_forward_s");
    EXPECT_FALSE(layer_profile_from_json(j.dump(), first->key).ok());
  }
  // One sequence per micro-batch: the second shape halves the sequence; a single token has none.
  {
    profile_options quick;
    quick.warmup = 1, quick.warmup_seconds = 0, quick.repeats = 1, quick.min_seconds = 0;
    project_config one = c;
    one.run.batch_size = one.parallel.micro_batches;
    const auto p1 = profile_layers(one, mc, quick);
    ASSERT_TRUE(p1.ok()) << p1.message();
    EXPECT_EQ(p1->compute.rows, 1);
    EXPECT_EQ(p1->compute.second.rows, 1);
    EXPECT_EQ(p1->compute.second.seq_len, 32);
    EXPECT_GT(p1->compute.second.layer_backward_s.at(4), 0);
    one.data.seq_len = 1;
    const auto p0 = profile_layers(one, mc, quick);
    ASSERT_TRUE(p0.ok()) << p0.message();
    EXPECT_EQ(p0->compute.second.rows, 0);
    EXPECT_TRUE(p0->compute.second.layer_forward_s.empty());
  }
  ASSERT_TRUE(write_file_atomic(first->cache_file, "{\"key\": \"" + first->key + "\"}").ok());
  EXPECT_EQ(project_compute_rates(c, mc, cache).measured, nullptr);
  auto third = profile_project(c, mc, req);
  ASSERT_TRUE(third.ok());
  EXPECT_FALSE(third->from_cache);
  EXPECT_NE(layer_profile_from_json(read_text_file(first->cache_file).value(), "other").message().find("another"), std::string::npos);
  fs::remove_all(cache.parent_path());
}

// At Llama-7B proportions (feed-forward 2.69 x hidden, grouped KV heads) with LoRA on the attention
// only and on all seven projections: the memory plan's graph covers what the allocator measures
// (adapted feed-forward projections keep their inputs; the plan once fell 4% short of all seven).
TEST(LayerProfile, TheMemoryPlanCoversTheGraphForEveryTargetSet) {
  const llama_config mc = parse_llama_config(nlohmann::json{{"model_type", "llama"}, {"hidden_size", 256}, {"intermediate_size", 688},
                                                            {"num_hidden_layers", 2}, {"num_attention_heads", 8},
                                                            {"num_key_value_heads", 2}, {"vocab_size", 512},
                                                            {"max_position_embeddings", 512}, {"rms_norm_eps", 1e-5}},
                                             "7b-shaped")
                              .value();
  project_config c = stories_pipeline();
  c.data.seq_len = 128;
  profile_options quick;
  quick.warmup = quick.repeats = 1;
  quick.warmup_seconds = quick.min_seconds = 0;
  std::vector<double> model;  // per target set
  for (const auto& targets : {std::vector<std::string>{"q_proj", "v_proj"}, std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"},
                              std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
                              std::vector<std::string>{"down_proj"}}) {
    c.lora.targets = targets;
    auto p = profile_layers(c, mc, quick);
    ASSERT_TRUE(p.ok()) << p.message();
    EXPECT_GE(p->graph_bytes_per_token_model, 0.98 * p->graph_bytes_per_token) << targets.size() << " targets";
    EXPECT_GE(p->graph_bytes_per_token, 0.6 * p->graph_bytes_per_token_model) << targets.size() << " targets";
    std::printf("%zu targets: graph per token and layer measured %.0f B, memory plan %.0f B (%+.1f%%)\n", targets.size(),
                p->graph_bytes_per_token, p->graph_bytes_per_token_model, 100 * (p->graph_bytes_per_token_model / p->graph_bytes_per_token - 1));
    model.push_back(p->graph_bytes_per_token_model);
  }
  // The targets count: attention-only sets keep no feed-forward input, down_proj alone keeps [I].
  EXPECT_EQ(model[0], model[1]);
  EXPECT_EQ(model[2] - model[1], 4.0 * (256 + 688));
  EXPECT_EQ(model[3] - model[1], 4.0 * 688);
}

// The offload settings the planner does not choose, flipped one at a time: those that are faster
// and still fit, fastest first; a limit at the plan's own peak drops those that need more memory.
TEST(PlanQuestions, FasterOffloadSettingsFitAndAreFaster) {
  project_config c = stories_pipeline();
  const plan_summary base = plan_of(c);
  const auto fast = faster_offload_settings(c, base, 100, nullptr, nullptr);
  ASSERT_FALSE(fast.empty());
  std::vector<std::string> asked;
  for (size_t i = 0; i < fast.size(); ++i) {
    asked.push_back(fast[i].question);
    EXPECT_LT(fast[i].after.step_s, base.step_s * 0.99) << fast[i].question;
    EXPECT_TRUE(fast[i].after.refusal.empty());
    if (i > 0) EXPECT_LE(fast[i - 1].after.step_s, fast[i].after.step_s);
  }
  EXPECT_NE(std::find(asked.begin(), asked.end(), "offload.recompute=off"), asked.end());
  // Capacity at the plan's own peak: keeping every graph (recompute off) no longer fits.
  double peak = 0;
  for (double p : base.peak_bytes) peak = std::max(peak, p);
  c.offload.device_memory_mb = peak / 1048576.0 * 1.001;
  const plan_summary capped = plan_of(c);
  ASSERT_TRUE(capped.refusal.empty()) << capped.refusal;
  for (const auto& a : faster_offload_settings(c, capped, 100, nullptr, nullptr)) {
    EXPECT_NE(a.question, "offload.recompute=off");
    EXPECT_TRUE(a.after.refusal.empty());
  }
}

namespace {
// Four CPU virtual devices as a probe sees them on offload.copy_links 0,0,1,1: each alone at the
// throttle, half of it with every device copying.
device_inventory four_on_two_links(double bytes_per_s) {
  device_inventory inv;
  for (int d = 0; d < 4; ++d) {
    probed_device p;
    p.name = "cpu:" + std::to_string(d);
    p.kind = "cpu";
    p.upstream = {"copy link " + std::to_string(d / 2)};
    p.h2d_bytes_per_s = p.d2h_bytes_per_s = bytes_per_s;
    p.h2d_concurrent_bytes_per_s = p.d2h_concurrent_bytes_per_s = bytes_per_s / 2;
    inv.devices.push_back(p);
  }
  inv.measured = true;
  return inv;
}
}  // namespace

// Shared links in the plan: the probe's groups are costed as links (the simulator divides a group's
// link among the copies in flight on it, so a plan whose copies collide on them predicts a longer step
// than the same with a link each), and the cross-mapped order is taken only when the simulator
// predicts it faster, with both predictions reported.
TEST(PlanQuestions, SharedLinksAreCostedAndTheDeviceOrderIsChecked) {
  project_config c = stories_pipeline();
  c.parallel.devices = "cpu:4";
  c.parallel.schedule = "round-robin";
  c.parallel.partition = "auto";
  c.offload.copy_gbps = 0.02;
  c.offload.copy_links = "0,0,1,1";
  const device_inventory inv = four_on_two_links(0.02e9);
  const project_config costed = with_probed_bandwidth(c, inv);
  EXPECT_EQ(costed.offload.copy_links, "0,0,1,1");
  EXPECT_DOUBLE_EQ(costed.offload.copy_gbps, 0.02);  // the rate alone: the links do the sharing
  project_config own = c;
  own.offload.copy_links.clear();
  auto shared = make_plan(c, 100), separate = make_plan(own, 100);
  ASSERT_TRUE(shared.ok()) << shared.message();
  ASSERT_TRUE(separate.ok()) << separate.message();
  EXPECT_GT(shared->sim.makespan_s, separate->sim.makespan_s * 1.01) << "copies on shared links take turns";

  auto given = make_plan(c, 100, &inv);
  ASSERT_TRUE(given.ok()) << given.message();
  const device_order_answer a = plan_device_order(c, *given, 100, inv);
  ASSERT_GT(a.given_step_s, 0);
  ASSERT_GT(a.mapped_step_s, 0);
  EXPECT_DOUBLE_EQ(a.given_step_s, given->sim.makespan_s);
  EXPECT_EQ(a.mapped_plan.has_value(), !a.order.setting.empty());
  EXPECT_EQ(a.order.setting.empty(), a.mapped_step_s > 0.99 * a.given_step_s) << a.order.why;
  EXPECT_NE(a.order.why.find(a.order.setting.empty() ? "simulator predicts no gain" : "predicted step"), std::string::npos) << a.order.why;
  // Without sharing that costs anything, nothing is proposed.
  device_inventory quiet = inv;
  for (auto& d : quiet.devices) d.h2d_concurrent_bytes_per_s = d.d2h_concurrent_bytes_per_s = d.h2d_bytes_per_s;
  EXPECT_TRUE(plan_device_order(c, *given, 100, quiet).order.setting.empty());
  EXPECT_TRUE(with_probed_bandwidth(own, quiet).offload.copy_links.empty());
}
