// The engine API as a front-end uses it (core/engine): runs begun, executed, stopped and resumed
// through run sessions alone with a collecting observer; events in order; cancellation during a
// validation and inside a pipeline step; failures recorded without ending the process; streaming
// generation; the JSON event protocol; prompts for tokenizers without BOS.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/errors.h"
#include "core/base/safetensors.h"
#include "core/engine/event_json.h"
#include "core/engine/model_session.h"
#include "core/engine/plan_report.h"
#include "core/engine/run_queries.h"
#include "core/engine/run_session.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/runs/checkpoint.h"
#include "core/text/prompt.h"
#include "core/text/tokenizer.h"
#include "tests/test_observer.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;
using namespace lorapipe;

namespace {

using collector = event_log;

fs::path scratch(const std::string& tag) {
  auto d = fs::temp_directory_path() / ("lorapipe_engine_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A short, real fine-tune: stories260K on Tiny Shakespeare, LoRA dropout on.
project_config small_project(const fs::path& dir, const std::string& schedule, int64_t steps) {
  project_config c;
  c.model.path = (test_data_dir() / "models/stories260K/hf").string();
  c.data.train = (test_data_dir() / "text/tinyshakespeare.txt").string();
  c.data.seq_len = 32;
  c.lora.dropout = 0.1;
  c.run.steps = steps;
  c.run.batch_size = 4;
  c.run.threads = 2;
  c.run.eval_interval = 2;
  c.run.eval_batches = 2;
  c.run.sample_tokens = 4;
  c.run.checkpoint_interval = 0;
  c.run.trace_interval = 2;
  c.run.output_dir = (dir / "out").string();
  if (schedule != "single") {
    c.parallel.schedule = schedule;
    c.parallel.devices = "cpu:2";
    c.parallel.micro_batches = 2;
  }
  return c;
}

std::string run_status_in_db(const fs::path& db, int64_t run) { return show_run(db, run).value().record.status; }

std::vector<at::Tensor> adapter_at(const fs::path& dir) {
  auto w = load_llama(test_data_dir() / "models/stories260K/hf", {at::kFloat}).value();
  return load_peft_adapter(dir, w).value().parameters();
}

void expect_same_adapter(const fs::path& a, const fs::path& b) {
  auto x = adapter_at(a), y = adapter_at(b);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(torch::equal(x[i], y[i])) << "tensor " << i;
}

// The uninterrupted reference run of a project, through the API.
fs::path reference_adapter(const fs::path& dir, const project_config& cfg) {
  auto c = cfg;
  c.run.output_dir = (dir / "reference").string();
  auto h = begin_run(c, "reference.json", dir / "ref.db");
  EXPECT_TRUE(h.ok()) << h.message();
  cancel_token never;
  collector obs;
  auto r = execute_run(*h, obs, never);
  EXPECT_TRUE(r.ok()) << r.message();
  return fs::path(c.run.output_dir) / "adapter";
}

}  // namespace

TEST(Engine, PipelineRunThroughTheApiReportsEventsInOrder) {
  const auto dir = scratch("events");
  auto cfg = small_project(dir, "1f1b", 4);
  auto h = begin_run(cfg, (dir / "p.json").string(), dir / "runs.db");
  ASSERT_TRUE(h.ok()) << h.message();
  collector obs;
  cancel_token never;
  // Process-global state a run must leave alone: the thread count and the default generator.
  at::set_num_threads(1);
  const auto rng_before = at::detail::getDefaultCPUGenerator().get_state();
  auto r = execute_run(*h, obs, never);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r->status, run_status::completed);
  EXPECT_EQ(run_status_in_db(dir / "runs.db", h->run_id), "completed");
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), rng_before));
  EXPECT_EQ(obs.all<run_started_event>().at(0).threads, 2);

  // Loading and tokenising come first, with progress; then the run header naming the run.
  const auto phases = obs.all<phase_event>();
  ASSERT_FALSE(phases.empty());
  EXPECT_EQ(phases.front().what, phase::loading_model);
  const size_t started_at = obs.first_index<run_started_event>();
  ASSERT_LT(started_at, obs.events.size());
  bool tokenized_before = false;
  for (size_t i = 0; i < started_at; ++i)
    if (auto* p = std::get_if<phase_event>(&obs.events[i]); p && p->what == phase::tokenizing && p->done > 0) tokenized_before = true;
  EXPECT_TRUE(tokenized_before);
  const auto started = obs.all<run_started_event>();
  ASSERT_EQ(started.size(), 1u);
  EXPECT_EQ(started[0].run_id, h->run_id);
  EXPECT_EQ(started[0].total_steps, 4);
  EXPECT_EQ(started[0].database, (dir / "runs.db").string());
  EXPECT_EQ(started[0].devices, std::vector<std::string>{"cpu:2"});
  EXPECT_EQ(fs::path(started[0].adapter_dir), dir / "out" / "adapter");
  EXPECT_NE(started[0].config_json.find("\"1f1b\""), std::string::npos);

  // The plan as a value before the first step: two devices, every layer in exactly one stage.
  const size_t plan_at = obs.first_index<plan_event>(), step_at = obs.first_index<step_event>();
  ASSERT_LT(plan_at, step_at);
  const auto plan = obs.all<plan_event>()[0];
  EXPECT_EQ(plan.schedule, "1f1b");
  EXPECT_EQ(plan.arenas.size(), 2u);
  int32_t layers = 0;
  for (const auto& s : plan.stages) {
    layers += s.last_layer - s.first_layer;
    EXPECT_GT(s.weight_bytes, 0);
  }
  EXPECT_EQ(layers, 5);
  EXPECT_EQ(plan.links.size(), 2u);
  // `plan` (before anything runs, from config.json) agrees with the executor's real stage blocks
  // and weight arenas byte for byte.
  auto before = make_plan(cfg, 100);
  ASSERT_TRUE(before.ok()) << before.message();
  ASSERT_EQ(before->stage_bytes.size(), plan.stages.size());
  for (size_t s = 0; s < plan.stages.size(); ++s) EXPECT_EQ(static_cast<int64_t>(before->stage_bytes[s]), plan.stages[s].weight_bytes) << s;
  ASSERT_EQ(before->arenas.size(), plan.arenas.size());
  for (size_t d = 0; d < plan.arenas.size(); ++d) EXPECT_EQ(static_cast<int64_t>(before->arenas[d].bytes), plan.arenas[d].bytes) << d;

  // Steps 1..4 in order; validations at 0, 2 and 4; traces at steps 2 and 4 with as many measured
  // compute instructions as predicted ones.
  const auto steps = obs.all<step_event>();
  ASSERT_EQ(steps.size(), 4u);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].step, static_cast<int64_t>(i + 1));
    EXPECT_EQ(steps[i].device_peak_bytes.size(), 2u);
    EXPECT_GE(steps[i].bubble_ratio, 0.0);
  }
  std::vector<int64_t> eval_steps;
  for (const auto& e : obs.all<eval_event>()) eval_steps.push_back(e.step);
  EXPECT_EQ(eval_steps, (std::vector<int64_t>{0, 2, 4}));
  const auto traces = obs.all<trace_event>();
  ASSERT_EQ(traces.size(), 2u);
  EXPECT_EQ(traces[0].step, 2);
  EXPECT_FALSE(traces[0].measured.empty());
  EXPECT_EQ(traces[0].measured.size(), traces[0].predicted.size());
  EXPECT_GT(traces[0].predicted_step_s, 0.0);
  for (const auto& t : traces[0].measured) EXPECT_LE(t.start_s, t.end_s);

  // One checkpoint at the end; the run ends with run_finished.
  const auto ckpts = obs.all<checkpoint_event>();
  ASSERT_EQ(ckpts.size(), 1u);
  EXPECT_EQ(ckpts[0].step, 4);
  ASSERT_TRUE(std::holds_alternative<run_finished_event>(obs.events.back()));
  EXPECT_EQ(std::get<run_finished_event>(obs.events.back()).status, "completed");

  // The JSON protocol carries every field, versioned.
  const auto j = event_to_json(steps[1]);
  EXPECT_EQ(j["v"], event_protocol_version);
  EXPECT_EQ(j["event"], "step");
  EXPECT_EQ(j["device_peak_bytes"].size(), 2u);
  EXPECT_EQ(j["start_step"], 0);
  EXPECT_TRUE(j["bubble_ratio"].is_number());
  EXPECT_GT(j["process_peak_rss"].get<int64_t>(), 0);
  EXPECT_EQ(event_to_json(plan)["stages"].size(), plan.stages.size());
  EXPECT_EQ(event_to_json(traces[0])["measured"].size(), traces[0].measured.size());
}

namespace {

// The stop-and-resume pattern: an uninterrupted reference run, then the same project with a stop
// requested by `when` (from an event, or from the pipeline probe), then a resume through the API
// (from the newest checkpoint or `from`) that must end with the reference's adapter, tensor for tensor.
struct stop_and_resume {
  collector first, second;
  result<run_outcome> stopped = error{"not run"}, resumed = error{"not run"};
  run_handle resume;
};
stop_and_resume stop_then_resume(const fs::path& dir, const project_config& cfg,
                                 const std::function<void(const engine_event&, cancel_token&)>& when,
                                 const std::function<void(const char*, cancel_token&)>& probe = {},
                                 std::optional<int64_t> from = std::nullopt) {
  stop_and_resume out;
  const auto want = reference_adapter(dir, cfg);
  const fs::path db = dir / "runs.db";
  auto h = begin_run(cfg, "p.json", db);
  EXPECT_TRUE(h.ok()) << h.message();
  if (!h) return out;
  cancel_token stop;
  out.first.hook = [&](const engine_event& e) {
    if (when) when(e, stop);
  };
  execute_options eo;
  if (probe) eo.probe = [&](const char* site) { probe(site, stop); };
  out.stopped = execute_run(*h, out.first, stop, eo);
  EXPECT_TRUE(out.stopped.ok()) << out.stopped.message();
  if (!out.stopped) return out;
  EXPECT_EQ(out.stopped->status, run_status::stopped);
  EXPECT_EQ(run_status_in_db(db, h->run_id), "interrupted");
  auto again = prepare_resume(db, h->run_id, from);
  EXPECT_TRUE(again.ok()) << again.message();
  if (!again) return out;
  out.resume = *again;
  cancel_token never;
  out.resumed = execute_run(*again, out.second, never);
  EXPECT_TRUE(out.resumed.ok()) << out.resumed.message();
  if (out.resumed) {
    EXPECT_EQ(out.resumed->status, run_status::completed);
  }
  expect_same_adapter(fs::path(cfg.run.output_dir) / "adapter", want);
  return out;
}

}  // namespace

// Stop requested while the validation after step 2 runs: the run stops with a checkpoint at step 2;
// a resume through the API repeats that validation and ends bit-identical to an uninterrupted run.
TEST(Engine, CancelDuringValidationStopsAndResumesBitIdentical) {
  const auto dir = scratch("cancel_eval");
  auto t = stop_then_resume(dir, small_project(dir, "single", 4), [](const engine_event& e, cancel_token& stop) {
    if (auto* p = std::get_if<phase_event>(&e); p && p->what == phase::evaluating && p->step == 2 && p->done == 1) stop.request();
  });
  ASSERT_TRUE(t.stopped.ok());
  EXPECT_EQ(t.stopped->summary.steps, 2);
  EXPECT_EQ(t.first.all<step_event>().size(), 2u);
  for (const auto& e : t.first.all<eval_event>()) EXPECT_NE(e.step, 2);  // the interrupted validation reported nothing
  ASSERT_EQ(t.first.all<checkpoint_event>().size(), 1u);
  EXPECT_EQ(t.first.all<checkpoint_event>()[0].step, 2);
  EXPECT_EQ(t.resume.start_step, 2);
  std::vector<int64_t> eval_steps;
  for (const auto& e : t.second.all<eval_event>()) eval_steps.push_back(e.step);
  EXPECT_EQ(eval_steps, (std::vector<int64_t>{2, 4}));  // the pending validation first
}

// Stop requested in the middle of pipeline step 3 (its 10th instruction): the step is discarded,
// the run stops at step 2 with a checkpoint, and resuming reaches the uninterrupted adapter.
TEST(Engine, CancelInsideAPipelineStepStopsAndResumesBitIdentical) {
  const auto dir = scratch("cancel_step");
  auto cfg = small_project(dir, "1f1b", 4);
  cfg.run.eval_interval = 0;
  std::atomic<int64_t> steps_seen{0};
  std::atomic<int> in_step3{0};
  auto t = stop_then_resume(
      dir, cfg, [&](const engine_event& e, cancel_token&) { steps_seen += std::holds_alternative<step_event>(e) ? 1 : 0; },
      [&](const char* site, cancel_token& stop) {
        if (std::string(site) == "pipeline:instruction" && steps_seen == 2 && ++in_step3 == 10) stop.request();
      });
  ASSERT_TRUE(t.stopped.ok());
  EXPECT_EQ(t.stopped->summary.steps, 2);
  EXPECT_EQ(t.first.all<step_event>().size(), 2u);
  ASSERT_EQ(t.first.all<checkpoint_event>().size(), 1u);
  EXPECT_EQ(t.first.all<checkpoint_event>()[0].step, 2);
  ASSERT_FALSE(t.second.all<step_event>().empty());
  EXPECT_EQ(t.second.all<step_event>().front().step, 3);
}

// The one-step-stale asynchronous optimizer: a run stopped at step 5 and resumed from its older
// checkpoint at step 3 ends bit-identical to an uninterrupted run (the master copy the background
// update works on takes the checkpoint's weights; it used to keep the initial ones).
TEST(Engine, AsyncOptimizerResumesFromAnOlderCheckpointBitIdentical) {
  const auto dir = scratch("async");
  auto cfg = small_project(dir, "1f1b", 8);
  cfg.optimizer.asynchronous = true;
  cfg.run.eval_interval = 0;
  cfg.run.checkpoint_interval = 3;
  cfg.run.keep_checkpoints = 0;
  auto t = stop_then_resume(
      dir, cfg,
      [](const engine_event& e, cancel_token& stop) {
        if (auto* s = std::get_if<step_event>(&e); s && s->step == 5) stop.request();
      },
      {}, 3);
  EXPECT_EQ(t.resume.start_step, 3);
}

// Resume from an older checkpoint abandons the newer ones: stopped at step 6 (checkpoints 2, 4, 6),
// resumed from step 2 and stopped again at step 3, a plain resume continues from step 3, not from the
// abandoned step 6, and the run ends with the uninterrupted adapter.
TEST(Engine, ResumeFromAnOlderCheckpointAbandonsTheNewerOnes) {
  const auto dir = scratch("timeline");
  auto cfg = small_project(dir, "single", 8);
  cfg.run.eval_interval = 0;
  cfg.run.sample_tokens = 0;
  cfg.run.checkpoint_interval = 2;
  cfg.run.keep_checkpoints = 0;
  const auto want = reference_adapter(dir, cfg);
  const fs::path db = dir / "runs.db";
  auto stop_at = [](int64_t step) {
    return [step](const engine_event& e, cancel_token& stop) {
      if (auto* s = std::get_if<step_event>(&e); s && s->step == step) stop.request();
    };
  };
  auto h = begin_run(cfg, "p.json", db);
  ASSERT_TRUE(h.ok()) << h.message();
  cancel_token stop1;
  collector first;
  first.hook = [&](const engine_event& e) { stop_at(6)(e, stop1); };
  ASSERT_EQ(execute_run(*h, first, stop1)->status, run_status::stopped);
  auto steps_on_disk = [&] {
    std::vector<int64_t> v;
    for (const auto& c : list_checkpoints(h->checkpoint_root)) v.push_back(c.step);
    return v;
  };
  auto steps_in_db = [&] {
    std::vector<int64_t> v;
    const auto details = show_run(db, h->run_id).value();
    for (const auto& c : details.checkpoints) v.push_back(c.step);
    return v;
  };
  ASSERT_EQ(steps_on_disk(), (std::vector<int64_t>{2, 4, 6}));

  auto older = prepare_resume(db, h->run_id, 2);
  ASSERT_TRUE(older.ok()) << older.message();
  EXPECT_EQ(steps_on_disk(), (std::vector<int64_t>{2}));
  EXPECT_EQ(steps_in_db(), (std::vector<int64_t>{2}));
  cancel_token stop2;
  collector second;
  second.hook = [&](const engine_event& e) { stop_at(3)(e, stop2); };
  ASSERT_EQ(execute_run(*older, second, stop2)->status, run_status::stopped);
  EXPECT_EQ(steps_on_disk(), (std::vector<int64_t>{2, 3}));

  auto plain = prepare_resume(db, h->run_id, std::nullopt);
  ASSERT_TRUE(plain.ok()) << plain.message();
  EXPECT_EQ(plain->start_step, 3);
  cancel_token never;
  collector third;
  auto done = execute_run(*plain, third, never);
  ASSERT_TRUE(done.ok()) << done.message();
  EXPECT_EQ(done->status, run_status::completed);
  ASSERT_FALSE(third.all<step_event>().empty());
  EXPECT_EQ(third.all<step_event>().front().step, 4);
  expect_same_adapter(fs::path(cfg.run.output_dir) / "adapter", want);
}

// A device error inside a pipeline step fails the run (error value, status failed, run_finished
// with the message); the same process then trains another run to completion.
TEST(Engine, FailedStepIsRecordedAndTheProcessRunsAgain) {
  const auto dir = scratch("fail");
  auto cfg = small_project(dir, "gpipe", 3);
  cfg.run.eval_interval = 0;
  cfg.run.sample_tokens = 0;
  const fs::path db = dir / "runs.db";
  auto h = begin_run(cfg, "p.json", db);
  ASSERT_TRUE(h.ok()) << h.message();
  std::atomic<int> n{0};
  execute_options eo;
  eo.probe = [&](const char* site) {
    if (std::string(site) == "pipeline:instruction" && ++n == 30) throw device_error("injected: the GPU fell off the bus");
  };
  cancel_token never;
  collector obs;
  auto r = execute_run(*h, obs, never, eo);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("injected: the GPU fell off the bus"), std::string::npos) << r.message();
  EXPECT_EQ(run_status_in_db(db, h->run_id), "failed");
  EXPECT_NE(show_run(db, h->run_id)->record.error.find("injected"), std::string::npos);
  ASSERT_TRUE(std::holds_alternative<run_finished_event>(obs.events.back()));
  EXPECT_EQ(std::get<run_finished_event>(obs.events.back()).status, "failed");

  auto cfg2 = cfg;
  cfg2.run.output_dir = (dir / "second").string();
  auto h2 = begin_run(cfg2, "p.json", db);
  ASSERT_TRUE(h2.ok()) << h2.message();
  collector obs2;
  auto r2 = execute_run(*h2, obs2, never);
  ASSERT_TRUE(r2.ok()) << r2.message();
  EXPECT_EQ(r2->status, run_status::completed);
  EXPECT_EQ(run_status_in_db(db, h2->run_id), "completed");
  EXPECT_TRUE(fs::exists(dir / "second" / "adapter" / "adapter_model.safetensors"));
}

// Bad input never throws out of the API: it comes back as a value naming the problem.
TEST(Engine, BadInputComesBackAsValues) {
  const auto dir = scratch("bad");
  auto cfg = small_project(dir, "single", 2);
  cfg.lora.r = 0;
  auto h = begin_run(cfg, "bad.json", dir / "runs.db");
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.message().find("lora.r"), std::string::npos);
  auto missing = prepare_resume(dir / "runs.db", 99, std::nullopt);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("no run 99"), std::string::npos);
  auto m = model_session::open({(dir / "nope").string(), "", "", "float32", 2});
  EXPECT_FALSE(m.ok());
}

// Generation streams every token through the callback; stopping after k tokens yields exactly k,
// whether the callback says so or a cancel request does.
TEST(Engine, GenerationStreamsTokensAndStopsAfterK) {
  auto m = model_session::open({(test_data_dir() / "models/stories260K/hf").string(), "", "", "float32", 2});
  ASSERT_TRUE(m.ok()) << m.message();
  generate_request req;
  req.prompt = "Once upon a time";
  req.max_new_tokens = 24;
  std::string streamed;
  int calls = 0;
  auto full = m->generate(req, [&](int32_t, const std::string& piece) {
    ++calls;
    streamed += piece;
    return true;
  });
  ASSERT_TRUE(full.ok()) << full.message();
  EXPECT_EQ(calls, static_cast<int>(full->ids.size()));
  EXPECT_EQ(streamed, full->text);
  EXPECT_GT(full->ids.size(), 8u);

  int seen = 0;
  auto five = m->generate(req, [&](int32_t, const std::string&) { return ++seen < 5; });
  ASSERT_TRUE(five.ok());
  EXPECT_EQ(five->ids.size(), 5u);
  EXPECT_EQ(std::vector<int32_t>(full->ids.begin(), full->ids.begin() + 5), five->ids);

  cancel_token stop;
  int k = 0;
  auto three = m->generate(req, [&](int32_t, const std::string&) {
    if (++k == 3) stop.request();
    return true;
  }, &stop);
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(three->ids.size(), 3u);
}

// Train, then chat, with the base weights loaded once: the run shares the model session's weights
// (no loading phase), and the session then generates with the run's adapter.
TEST(Engine, TrainThenChatWithoutReloading) {
  const auto dir = scratch("reuse");
  auto cfg = small_project(dir, "single", 30);
  cfg.optimizer.lr = 0.01;
  cfg.run.sample_tokens = 0;
  auto m = model_session::open({cfg.model.path, "", "", "float32", 2});
  ASSERT_TRUE(m.ok()) << m.message();
  ASSERT_NE(m->weights_for(cfg), nullptr);
  generate_request req;
  req.prompt = "Once upon a time";
  req.max_new_tokens = 16;
  const auto base = m->generate(req).value().ids;
  auto h = begin_run(cfg, "p.json", dir / "runs.db");
  ASSERT_TRUE(h.ok()) << h.message();
  execute_options eo;
  eo.model = &*m;
  cancel_token never;
  collector obs;
  auto r = execute_run(*h, obs, never, eo);
  ASSERT_TRUE(r.ok()) << r.message();
  for (const auto& p : obs.all<phase_event>()) EXPECT_NE(p.what, phase::loading_model);
  ASSERT_TRUE(m->set_adapter(r->summary.adapter_dir).ok());
  const auto tuned = m->generate(req).value().ids;
  EXPECT_NE(tuned, base);
  ASSERT_TRUE(m->set_adapter("").ok());
  EXPECT_EQ(m->generate(req).value().ids, base);  // the shared base weights were not changed by training
}

// Tokenizers without BOS (Qwen3, GPT-2 style) get no BOS (id -1 used to be prepended).
TEST(Engine, PromptsForTokenizersWithoutBos) {
  auto tok = load_tokenizer(test_data_dir() / "tokenizers/qwen3");
  ASSERT_TRUE(tok.ok()) << tok.message();
  ASSERT_LT((*tok)->bos_id(), 0);
  auto ids = prepare_prompt(**tok, "Once upon a time", {});
  ASSERT_TRUE(ids.ok()) << ids.message();
  EXPECT_EQ(*ids, (*tok)->encode("Once upon a time").value());
  for (int32_t id : *ids) EXPECT_GE(id, 0);
  auto sp = load_tokenizer(test_data_dir() / "models/stories260K/hf");
  ASSERT_TRUE(sp.ok());
  auto with_bos = prepare_prompt(**sp, "Once upon a time", {});
  ASSERT_TRUE(with_bos.ok());
  EXPECT_EQ(with_bos->front(), (*sp)->bos_id());
  EXPECT_FALSE(prepare_prompt(**tok, "", {}).ok());
}

// The JSON-lines protocol read back (what the GUI does with a child's stream): every event a real
// pipeline run reports survives event_to_json -> text -> event_from_json unchanged; bad lines are
// errors naming the problem.
TEST(Engine, EventsRoundTripThroughTheJsonProtocol) {
  const auto dir = scratch("events");
  auto cfg = small_project(dir, "gpipe", 3);
  cfg.run.checkpoint_interval = 2;
  const fs::path db = dir / "runs.db";
  auto h = begin_run(cfg, "p.json", db);
  ASSERT_TRUE(h.ok()) << h.message();
  cancel_token never;
  collector obs;
  ASSERT_TRUE(execute_run(*h, obs, never).ok());
  std::set<size_t> kinds;
  for (const auto& e : obs.events) {
    kinds.insert(e.index());
    const std::string line = event_to_json(e).dump();
    auto back = event_from_json(line);
    ASSERT_TRUE(back.ok()) << back.message() << " in " << line;
    EXPECT_EQ(back->index(), e.index());
    EXPECT_EQ(event_to_json(*back).dump(), line);
  }
  EXPECT_EQ(kinds.size(), std::variant_size_v<engine_event>) << "a real run reports every kind of event";
  EXPECT_NE(event_from_json("not json").message().find("not a JSON object"), std::string::npos);
  EXPECT_NE(event_from_json(R"({"v":1})").message().find("no \"event\""), std::string::npos);
  EXPECT_NE(event_from_json(R"({"v":1,"event":"teleport"})").message().find("unknown event 'teleport'"), std::string::npos);
  EXPECT_NE(event_from_json(R"({"v":99,"event":"step"})").message().find("newer"), std::string::npos);
  EXPECT_NE(event_from_json(R"({"v":1,"event":"phase","phase":"dreaming"})").message().find("unknown phase"), std::string::npos);

  // Deleting: a live run is refused; a finished one goes with its checkpoints when asked.
  const auto ckpt_dir = fs::path(cfg.run.output_dir) / "checkpoints" / ("run-" + std::to_string(h->run_id));
  EXPECT_TRUE(fs::exists(ckpt_dir));
  auto live = begin_run(cfg, "p.json", db);  // recorded as running by this (live) process
  ASSERT_TRUE(live.ok());
  EXPECT_NE(delete_run(db, live->run_id, false).message().find("still running"), std::string::npos);
  ASSERT_TRUE(delete_run(db, h->run_id, true).ok());
  EXPECT_FALSE(show_run(db, h->run_id).ok());
  EXPECT_FALSE(fs::exists(ckpt_dir));
  EXPECT_TRUE(fs::exists(fs::path(cfg.run.output_dir) / "adapter"));  // the adapter is the user's
  EXPECT_NE(delete_run(db, h->run_id, false).message().find("no run"), std::string::npos);
  EXPECT_TRUE(show_run(db, live->run_id).ok());
}

// What a model path holds, without loading weights: the HF folder and the llama2.c file agree.
TEST(Engine, DescribeModelReadsTheConfigWithoutTheWeights) {
  auto hf = describe_model((test_data_dir() / "models/stories260K/hf").string());
  ASSERT_TRUE(hf.ok()) << hf.message();
  EXPECT_EQ(hf->format, "hf");
  EXPECT_EQ(hf->architecture, "llama");
  EXPECT_EQ(hf->layers, 5);
  EXPECT_EQ(hf->hidden_size, 64);
  EXPECT_EQ(hf->heads, 8);
  EXPECT_EQ(hf->kv_heads, 4);
  EXPECT_EQ(hf->vocab_size, 512);
  EXPECT_EQ(hf->context_length, 512);
  EXPECT_EQ(fs::path(hf->tokenizer).filename(), "tokenizer.model");
  // The count from the config equals the elements stored in the checkpoint (its head is tied).
  auto st = safetensors_file::open(test_data_dir() / "models/stories260K/hf/model.safetensors").value();
  int64_t params = 0;
  for (const auto& t : st.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (t.name.find("rotary") == std::string::npos) params += n;
  }
  EXPECT_EQ(hf->parameters, params);
  auto c = describe_model((test_data_dir() / "models/stories260K/llama2c/stories260K.bin").string());
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_EQ(c->format, "llama2c");
  EXPECT_EQ(c->parameters, hf->parameters);
  EXPECT_EQ(c->layers, 5);
  EXPECT_EQ(c->kv_heads, 4);
  EXPECT_FALSE(c->tokenizer.empty());
  EXPECT_NE(describe_model("/no/such/model").message().find("does not exist"), std::string::npos);
  EXPECT_FALSE(describe_model((test_data_dir() / "text/tinyshakespeare.txt").string()).ok());
}
