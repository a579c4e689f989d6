// Training tests: a real fine-tune of stories260K on Tiny Shakespeare lowers validation loss and
// shifts the sample; gradient accumulation equals the big batch; runs are deterministic by seed;
// LR schedule and clipping.
#include <gtest/gtest.h>

#include <filesystem>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/runs/checkpoint.h"
#include "core/model/optimizer.h"
#include "core/project/project.h"
#include "core/train/trainer.h"
#include "tests/test_observer.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;
using namespace lorapipe;

namespace {
using recorder = event_log;

project_config shakespeare(const std::string& out, int64_t steps) {
  project_config c;
  c.model.path = (test_data_dir() / "models/stories260K/hf").string();
  c.data.train = (test_data_dir() / "text/tinyshakespeare.txt").string();
  c.data.seq_len = 128;
  c.run.steps = steps;
  c.run.batch_size = 8;
  c.run.threads = 2;
  c.run.eval_interval = 0;
  c.run.eval_batches = 8;
  c.run.sample_tokens = 32;
  c.run.output_dir = (fs::temp_directory_path() / ("lorapipe_train_" + out + "_" + std::to_string(::getpid()))).string();
  return c;
}

std::vector<at::Tensor> adapter_of(const project_config& c) {
  auto w = load_llama(c.model.path, {at::kFloat}).value();
  return load_peft_adapter(fs::path(c.run.output_dir) / "adapter", w).value().parameters();
}
}  // namespace

TEST(Training, FineTuneOnShakespeareLowersValidationLoss) {
  auto c = shakespeare("ft", 250);
  recorder r;
  auto s = run_training(c, r);
  ASSERT_TRUE(s.ok()) << s.message();
  auto samples = r.all<sample_event>();
  ASSERT_EQ(samples.size(), 2u);
  std::printf("validation loss before %.4f after %.4f\nsample before: %s\nsample after:  %s\n", s->first_val_loss,
              s->final_val_loss, samples[0].text.c_str(), samples[1].text.c_str());
  EXPECT_LT(s->final_val_loss, s->first_val_loss - 1.5);
  EXPECT_NE(samples[0].text, samples[1].text);
  EXPECT_EQ(r.all<step_event>().size(), 250u);
  EXPECT_TRUE(fs::exists(fs::path(c.run.output_dir) / "adapter/adapter_model.safetensors"));
  // Shakespeare's corpus is full of speaker lines "NAME:\n"; the tuned sample should pick up colons/newlines.
  auto count = [](const std::string& t, char ch) { return std::count(t.begin(), t.end(), ch); };
  EXPECT_GT(count(samples[1].text, ':') + count(samples[1].text, '\n'), count(samples[0].text, ':') + count(samples[0].text, '\n'));
}

project_config quiz(const std::string& out, int64_t steps) {
  auto c = shakespeare(out, steps);
  c.data.train = (test_data_dir() / "instruct/quiz_chat.jsonl").string();
  c.data.seq_len = 128;
  c.data.val_fraction = 0.1;
  c.run.eval_batches = 0;  // the whole validation split
  c.run.sample_prompt = "User: What is the capital of France?\nAssistant:";
  c.run.sample_tokens = 12;
  return c;
}

TEST(Training, InstructionTuneOnQuizChatLowersMaskedValidationLoss) {
  // Chat JSONL through the built-in template; loss (training and validation) only on assistant tokens.
  auto c = quiz("quiz", 200);
  recorder r;
  auto s = run_training(c, r);
  ASSERT_TRUE(s.ok()) << s.message();
  auto samples = r.all<sample_event>();
  ASSERT_EQ(samples.size(), 2u);
  std::printf("masked validation loss before %.4f after %.4f\nsample before: %s\nsample after:  %s\n", s->first_val_loss,
              s->final_val_loss, samples[0].text.c_str(), samples[1].text.c_str());
  EXPECT_LT(s->final_val_loss, s->first_val_loss - 1.0);
  bool logged = false;
  for (const auto& l : r.all<log_event>()) logged = logged || l.message.find("chat format, 600 examples") != std::string::npos;
  EXPECT_TRUE(logged);
  // train_on=all trains on the prompts too: a different run, and its validation loss is not the masked one.
  auto all = quiz("quiz_all", 1);
  all.data.train_on = "all";
  recorder r2;
  auto s2 = run_training(all, r2);
  ASSERT_TRUE(s2.ok()) << s2.message();
  EXPECT_GT(std::abs(s2->first_val_loss - s->first_val_loss), 0.05);
}

TEST(Training, MaskedLossIsTokenWeightedAcrossAccumulationAndPipelines) {
  // With loss masks the micro-batches hold different numbers of trained tokens; the step's loss and
  // gradient are the mean over all trained tokens, so batch 8 == 4 x accumulate 2 == a 4-micro-batch pipeline.
  auto big = quiz("mbig", 3), acc = quiz("macc", 3), pipe = quiz("mpipe", 3);
  for (auto* c : {&big, &acc, &pipe}) c->run.sample_tokens = 0;
  acc.run.batch_size = 4;
  acc.run.grad_accum = 2;
  pipe.parallel.devices = "cpu:2";
  pipe.parallel.schedule = "1f1b";
  pipe.parallel.micro_batches = 4;
  recorder r1, r2, r3;
  ASSERT_TRUE(run_training(big, r1).ok());
  ASSERT_TRUE(run_training(acc, r2).ok());
  auto p = run_training(pipe, r3);
  ASSERT_TRUE(p.ok()) << p.message();
  auto l1 = r1.all<step_event>(), l2 = r2.all<step_event>(), l3 = r3.all<step_event>();
  ASSERT_EQ(l1.size(), 3u);
  double worst = 0;
  for (size_t i = 0; i < 3; ++i) {
    worst = std::max({worst, std::abs(l1[i].loss - l2[i].loss), std::abs(l1[i].loss - l3[i].loss)});
    EXPECT_NEAR(l1[i].grad_norm, l2[i].grad_norm, 1e-4 * l1[i].grad_norm);
    EXPECT_NEAR(l1[i].grad_norm, l3[i].grad_norm, 1e-4 * l1[i].grad_norm);
  }
  std::printf("masked loss: batch 8 vs 4x2 accumulation vs 1f1b cpu:2 (4 micro-batches): max step-loss diff %.3g\n", worst);
  EXPECT_LT(worst, 1e-5);
  // The same run with the tokenised data in memory-mapped files: bit-identical.
  auto disk = quiz("mdisk", 3);
  disk.run.sample_tokens = 0;
  disk.data.on_disk = true;
  recorder r4;
  ASSERT_TRUE(run_training(disk, r4).ok());
  auto l4 = r4.all<step_event>();
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(l1[i].loss, l4[i].loss);
  EXPECT_TRUE(fs::exists(fs::path(disk.run.output_dir) / "data-cache/train.tokens"));
  auto a = adapter_of(big), b = adapter_of(acc), q = adapter_of(pipe);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), 1e-5);
    EXPECT_LT((a[i] - q[i]).abs().max().item<double>(), 1e-5);
  }
}

TEST(Training, GradientAccumulationEqualsLargeBatch) {
  auto big = shakespeare("big", 3);
  big.run.sample_tokens = 0;
  big.optimizer.grad_clip = 0;
  auto acc = big;
  acc.run.batch_size = 4;
  acc.run.grad_accum = 2;
  acc.run.output_dir += "_acc";
  recorder r1, r2;
  ASSERT_TRUE(run_training(big, r1).ok());
  ASSERT_TRUE(run_training(acc, r2).ok());
  auto a = adapter_of(big), b = adapter_of(acc);
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  std::printf("accumulation 2x4 vs batch 8: max param diff %.3e\n", d);
  EXPECT_LE(d, 1e-5);
  EXPECT_GT(d + (a[1].abs().max().item<double>()), 0.0);
}

TEST(Training, SameSeedSameResultOtherSeedDifferent) {
  auto c1 = shakespeare("s1", 4), c2 = shakespeare("s2", 4), c3 = shakespeare("s3", 4);
  for (auto* c : {&c1, &c2, &c3}) {
    c->run.sample_tokens = 0;
    c->lora.dropout = 0.1;
  }
  c3.run.seed = 99;
  recorder r;
  for (auto* c : {&c1, &c2, &c3}) ASSERT_TRUE(run_training(*c, r).ok());
  auto a = adapter_of(c1), b = adapter_of(c2), x = adapter_of(c3);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
  EXPECT_FALSE(torch::equal(a[0], x[0]));
}

TEST(Training, ContinuesFromASavedAdapter) {
  auto first = shakespeare("cont1", 30);
  first.run.sample_tokens = 0;
  recorder r1;
  auto s1 = run_training(first, r1);
  ASSERT_TRUE(s1.ok()) << s1.message();
  auto second = shakespeare("cont2", 10);
  second.run.sample_tokens = 0;
  second.lora.init_adapter = (fs::path(first.run.output_dir) / "adapter").string();
  recorder r2;
  auto s2 = run_training(second, r2);
  ASSERT_TRUE(s2.ok()) << s2.message();
  // The continued run starts where the first ended (same validation loss), not from scratch.
  std::printf("first run: %.4f -> %.4f; continued run starts at %.4f\n", s1->first_val_loss, s1->final_val_loss, s2->first_val_loss);
  EXPECT_NEAR(s2->first_val_loss, s1->final_val_loss, 1e-6);
  EXPECT_LT(s2->first_val_loss, s1->first_val_loss - 0.5);
  auto bad = shakespeare("cont3", 1);
  bad.lora.init_adapter = "/nonexistent";
  recorder r3;
  auto s3 = run_training(bad, r3);
  ASSERT_FALSE(s3.ok());
  EXPECT_NE(s3.message().find("lora.init_adapter"), std::string::npos);
}

TEST(Training, RejectsBadProjectWithFieldNames) {
  auto c = shakespeare("bad", 1);
  c.lora.r = 0;
  c.data.train = "/nonexistent.txt";
  recorder r;
  auto s = run_training(c, r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lora.r"), std::string::npos);
  EXPECT_NE(s.message().find("data.train"), std::string::npos);
}

TEST(Optimizer, ScheduleAndClipping) {
  lr_schedule s{1.0, 10, 110, 0.1};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_NEAR(s.at(10), 1.0, 1e-12);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  auto p = torch::zeros({4}).set_requires_grad(true);
  p.mutable_grad() = torch::tensor({3.0f, 4.0f, 0.0f, 0.0f});
  EXPECT_NEAR(clip_grad_norm({p}, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(p.grad().norm().item<double>(), 1.0, 1e-5);
  EXPECT_NEAR(clip_grad_norm({p}, 0.0), 1.0, 1e-5);  // 0 = report only
}

// Ctrl-C (the stop flag) writes a checkpoint; resuming from it reproduces the uninterrupted run bit
// for bit: LoRA weights, AdamW moments, LR position, dropout RNG and data cursor all come back.
TEST(Training, StopAndResumeIsBitIdentical) {
  for (const std::string sched : {"single", "interleaved"}) {
    auto make = [&](const std::string& tag) {
      auto c = shakespeare("resume_" + sched + "_" + tag, 10);
      c.data.seq_len = 64;
      c.run.batch_size = 4;
      c.run.sample_tokens = 0;
      c.run.eval_interval = 5;
      c.run.eval_batches = 2;
      c.run.checkpoint_interval = 3;
      c.run.keep_checkpoints = 2;
      c.lora.dropout = 0.1;  // counter-based masks: reproducible in pipelines too
      if (sched != "single") {
        c.parallel.schedule = sched;
        c.parallel.devices = "cpu:2";
        c.parallel.micro_batches = 2;
      }
      fs::remove_all(c.run.output_dir);
      return c;
    };
    auto full = make("full"), part = make("part");
    recorder r_full;
    train_options o_full;
    o_full.checkpoint_root = fs::path(full.run.output_dir) / "ck";
    ASSERT_TRUE(run_training(full, r_full, o_full).ok());

    struct stopper : observer {
      recorder log;
      cancel_token stop;
      void on_event(const engine_event& e) override {
        log.on_event(e);
        if (auto* s = std::get_if<step_event>(&e); s != nullptr && s->step == 4) stop.request();
      }
    } first;
    train_options o_part;
    o_part.checkpoint_root = fs::path(part.run.output_dir) / "ck";
    o_part.cancel = &first.stop;
    auto s1 = run_training(part, first, o_part);
    ASSERT_TRUE(s1.ok()) << s1.message();
    EXPECT_TRUE(s1->stopped);
    EXPECT_EQ(s1->steps, 4);
    auto cks = list_checkpoints(o_part.checkpoint_root);
    ASSERT_EQ(cks.size(), 2u);  // steps 3 and 4 (keep 2)
    EXPECT_EQ(cks.back().step, 4);

    recorder second;
    train_options o_resume;
    o_resume.checkpoint_root = o_part.checkpoint_root;
    o_resume.resume_from = cks.back().dir;
    auto s2 = run_training(part, second, o_resume);
    ASSERT_TRUE(s2.ok()) << s2.message();
    EXPECT_EQ(s2->start_step, 4);
    EXPECT_EQ(s2->steps, 10);

    std::vector<double> want, got;
    for (const auto& e : r_full.all<step_event>()) want.push_back(e.loss);
    for (const auto& e : first.log.all<step_event>()) got.push_back(e.loss);
    for (const auto& e : second.all<step_event>()) got.push_back(e.loss);
    EXPECT_EQ(got, want) << sched;  // exact
    EXPECT_EQ(r_full.all<eval_event>().back().val_loss, second.all<eval_event>().back().val_loss) << sched;
    auto a = adapter_of(full), b = adapter_of(part);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << sched << " tensor " << i;

    // A checkpoint written for another configuration is refused (hash recorded in trainer_state.json).
    auto hashed = make("hashed");
    hashed.run.steps = 3;
    train_options o_h;
    o_h.checkpoint_root = fs::path(hashed.run.output_dir) / "ck";
    o_h.config_hash = config_hash(hashed);
    recorder r_h;
    ASSERT_TRUE(run_training(hashed, r_h, o_h).ok());
    auto other = hashed;
    other.optimizer.lr *= 2;
    o_h.resume_from = list_checkpoints(o_h.checkpoint_root).back().dir;
    o_h.config_hash = config_hash(other);
    auto refused = run_training(other, r_h, o_h);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find("different configuration"), std::string::npos) << refused.message();
    fs::remove_all(hashed.run.output_dir);
    fs::remove_all(full.run.output_dir);
    fs::remove_all(part.run.output_dir);
  }
}
