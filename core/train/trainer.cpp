// The training run: see trainer.h. One `trainer` object holds a run's state; run_training walks
// its phases (load, init LoRA, build the pipeline, restore, loop, finish) and is the boundary
// where exceptions become error values and a stop request becomes a stopped run.
#include "core/train/trainer.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/file_io.h"
#include "core/data/dataset.h"
#include "core/model/lora.h"
#include "core/model/optimizer.h"
#include "core/model/tensor_io.h"
#include "core/pipeline/cost_model.h"
#include "core/train/evaluate.h"
#include "core/train/pipeline_setup.h"
#include "core/train/train_state.h"
#include "core/train/guard.h"
#include "offload/process_group.h"

namespace lorapipe {
namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

namespace {

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

struct step_numbers {
  double loss = 0, grad_norm = 0;
  std::vector<int64_t> peaks;
};

class trainer {
 public:
  trainer(const project_config& cfg, observer& obs, const train_options& opts)
      : cfg_(cfg), obs_(obs), opts_(opts), cancel_(opts.cancel), out_dir_(cfg.resolve(cfg.run.output_dir)) {}

  result<train_summary> run() {
    LP_TRY(validate_project(cfg_));
    thread_count_scope threads(cfg_.run.threads);
    std::error_code ec;
    fs::create_directories(out_dir_, ec);
    if (ec) return make_error("run.output_dir: cannot create {}: {}", out_dir_.string(), ec.message());
    if (rank() == 0) LP_TRY(write_file_atomic(out_dir_ / "project.json", project_to_json(cfg_)));
    auto loaded = load_project_inputs(data_config(), obs_, cancel_, opts_.preloaded, weight_selector());
    if (!loaded && is_cancelled(loaded.err())) return stopped_before_training();
    if (!loaded) return loaded.err();
    in_ = std::make_unique<project_inputs>(std::move(*loaded));
    LP_TRY_ASSIGN(resolved, resolve_auto_schedule(cfg_, in_->weights.cfg, auto_schedule_gflops));
    cfg_ = std::move(resolved);
    LP_TRY(setup_lora());
    plan_steps();
    announce(threads.threads());
    if (cfg_.parallel.schedule != "single") LP_TRY(build());
    if (!opts_.checkpoint_root.empty()) sweep_checkpoint_leftovers(opts_.checkpoint_root);
    resuming_ = !opts_.resume_from.empty();
    // Several processes: rank 0 reads the checkpoint and hands its state to the others (a rank on
    // another machine needs no copy of it).
    if (resuming_ && rank() == 0) LP_TRY(restore());
    LP_TRY(share_start());
    LP_TRY(check_same_start());
    sum_.start_step = step_;
    try {
      before_training();
      LP_TRY(loop());
      if (stopped_) return stop_now();
      LP_TRY(write_checkpoint(step_));  // the end: resumable, and a resume of a finished run is a no-op
      after_training();
    } catch (const cancelled_error&) {
      return stop_now();
    }
    return finish();
  }

 private:
  int rank() const { return opts_.group != nullptr ? opts_.group->rank() : 0; }
  // Several processes: each rank reads only the frozen tensors of the stages its devices run.
  std::function<result<weight_selection>(const llama_config&)> weight_selector() {
    if (opts_.group == nullptr || cfg_.parallel.schedule == "single") return {};
    return [this](const llama_config& mc) -> result<weight_selection> {
      LP_TRY_ASSIGN(sel, rank_weight_selection(cfg_, mc, opts_.group->rank(), opts_.group->world()));
      obs_.on_event(log_event{log_event::level::info, fmt::format("rank {} loads {} of {} layers: {}", opts_.group->rank(),
                                                                  std::count(sel.layers.begin(), sel.layers.end(), true),
                                                                  mc.num_layers, describe_weight_selection(sel))});
      return sel;
    };
  }
  // Several processes: every stage's LoRA weights and AdamW state onto every rank (all call it at the
  // same points of the loop: before validating, sampling, checkpointing and saving).
  // A stop request, between steps. Several processes: decided together (any rank asked: all stop at
  // the same step, so their checkpoint and collectives line up); inside a step or a validation
  // nothing is cancelled then.
  bool stop_requested() {
    if (opts_.group == nullptr) return cancel_requested(cancel_);
    at::Tensor flag = torch::full({1}, cancel_requested(cancel_) ? 1.0 : 0.0, torch::kDouble);  // f64 [1]
    if (auto st = opts_.group->all_reduce_sum(flag); !st.ok()) throw lorapipe_error(st.message());
    return flag.item<double>() > 0;
  }
  // Several processes: what this rank is doing, named in the others' errors should it die.
  void report(const std::string& what) {
    if (opts_.group != nullptr) opts_.group->report_context(what);
  }
  const cancel_token* inner_cancel() const { return opts_.group != nullptr ? nullptr : cancel_; }

  // The project as this rank reads its data: ranks other than 0 keep a data.on_disk cache of their own
  // (output_dir/rank-R/data-cache), since local ranks share rank 0's output folder and a cache is
  // rewritten, mapped and removed by the process that made it.
  project_config data_config() const {
    project_config c = cfg_;
    if (rank() != 0) c.run.output_dir = (out_dir_ / fmt::format("rank-{}", rank())).string();
    return c;
  }

  // Several processes: rank 0's starting point (a resume's step, data position and every stage's
  // LoRA weights and AdamW state) on every rank.
  status share_start() {
    if (opts_.group == nullptr) return ok_status();
    at::Tensor s = torch::tensor({resuming_ ? 1.0 : 0.0, static_cast<double>(step_), static_cast<double>(cursor_), sum_.first_val_loss,
                                  eval_pending_ ? 1.0 : 0.0},
                                 torch::kDouble);  // f64 [5]
    LP_TRY(opts_.group->broadcast(s, 0));
    if (rank() != 0) {
      resuming_ = s[0].item<double>() > 0;
      step_ = static_cast<int64_t>(s[1].item<double>());
      cursor_ = static_cast<int64_t>(s[2].item<double>());
      sum_.first_val_loss = s[3].item<double>();
      eval_pending_ = s[4].item<double>() > 0;
      checkpointed_step_ = resuming_ ? step_ : -1;  // as on rank 0: every rank gathers for the same checkpoints
    }
    if (!resuming_) return ok_status();
    if (rig_.executor) LP_TRY(rig_.executor->gather_state(/*from_rank=*/0));  // every rank: a collective
    if (rank() != 0) obs_.on_event(log_event{log_event::level::info, fmt::format("resuming at step {} from rank 0's checkpoint", step_)});
    return ok_status();
  }

  // Several processes: every rank starts from the same step and data position and reads the same
  // training data (its fingerprint: a data file that differs on another host with as many sequences
  // would train the last stages on other labels). Every rank's values go to every rank, so all refuse
  // together, naming the ranks that differ and their values.
  status check_same_start() {
    if (opts_.group == nullptr) return ok_status();
    const uint64_t fp = windows_fingerprint(in_->data.train);
    const int world = opts_.group->world();
    at::Tensor rows = torch::zeros({world, 5}, torch::kDouble);  // f64 [world,5]: each rank fills its row, each value exact
    rows[rank()] = torch::tensor({static_cast<double>(step_), static_cast<double>(cursor_), static_cast<double>(in_->data.train.size()),
                                  static_cast<double>(fp >> 32), static_cast<double>(fp & 0xffffffffu)},
                                 torch::kDouble);
    LP_TRY(opts_.group->all_reduce_sum(rows));
    const auto start_text = [&](int r) {
      const at::Tensor t = rows[r];
      const uint64_t f = (static_cast<uint64_t>(t[3].item<double>()) << 32) | static_cast<uint64_t>(t[4].item<double>());
      return fmt::format("rank {}: step {}, data position {}, {} training sequences, data fingerprint {:016x}", r,
                         static_cast<int64_t>(t[0].item<double>()), static_cast<int64_t>(t[1].item<double>()),
                         static_cast<int64_t>(t[2].item<double>()), f);
    };
    std::string who, theirs;
    for (int r = 1; r < world; ++r)
      if (!torch::equal(rows[r], rows[0])) {
        who += fmt::format("{}{}", who.empty() ? "" : ", ", r);
        theirs += "; " + start_text(r);
      }
    if (who.empty()) return ok_status();
    return make_error("distributed: rank(s) {} start from another point or read other training data than rank 0 ({}{}); every rank "
                      "must resume from the same checkpoint and read the same data",
                      who, start_text(0), theirs);
  }

  void gather() {
    if (opts_.group == nullptr || !rig_.executor) return;
    if (auto st = rig_.executor->gather_state(); !st.ok()) throw lorapipe_error(st.message());
  }

  status setup_lora() {
    auto& w = in_->weights;
    lora_config lc;
    lc.r = cfg_.lora.r;
    lc.alpha = cfg_.lora.alpha;
    lc.dropout = cfg_.lora.dropout;
    lc.targets.clear();
    for (const auto& t : cfg_.lora.targets) lc.targets.push_back(*lora_target_from_name(t));
    lora_ = lorapipe::init_lora(w, lc, static_cast<uint64_t>(cfg_.run.seed));
    if (!cfg_.lora.init_adapter.empty()) {  // continue a previous fine-tune
      auto loaded = load_peft_adapter(cfg_.resolve(cfg_.lora.init_adapter), w);
      if (!loaded) return make_error("lora.init_adapter: {}", loaded.message());
      lora_ = std::move(*loaded);
      lora_.cfg.dropout = cfg_.lora.dropout;
      obs_.on_event(log_event{log_event::level::info, fmt::format("continuing from adapter {} (r={}, alpha={})",
                                                                  cfg_.resolve(cfg_.lora.init_adapter).string(), lora_.cfg.r, lora_.cfg.alpha)});
    }
    lora_.base_model = cfg_.resolve(cfg_.model.path).string();
    params_ = lora_.parameters();
    opt_ = std::make_unique<adamw>(params_, adamw_config{cfg_.optimizer.lr, cfg_.optimizer.beta1, cfg_.optimizer.beta2,
                                                         cfg_.optimizer.eps, cfg_.optimizer.weight_decay});
    return ok_status();
  }

  // run.epochs, when set, decides the step count from the data size.
  void plan_steps() {
    const auto& data = in_->data;
    const int64_t seqs_per_step = cfg_.run.batch_size * cfg_.run.grad_accum;
    total_steps_ = cfg_.run.epochs > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(cfg_.run.epochs * static_cast<double>(data.train.size()) /
                                                                                              static_cast<double>(seqs_per_step))))
                                       : cfg_.run.steps;
    if (cfg_.run.epochs > 0)
      obs_.on_event(log_event{log_event::level::info, fmt::format("run.epochs {}: {} steps of {} sequences over {} training sequences",
                                                                  cfg_.run.epochs, total_steps_, seqs_per_step, data.train.size())});
    sched_ = lr_schedule{cfg_.optimizer.lr, cfg_.optimizer.warmup_steps, total_steps_, cfg_.optimizer.min_lr_ratio};
    tokens_per_step_ = cfg_.run.batch_size * cfg_.run.grad_accum * cfg_.data.seq_len;
    sampler_ = std::make_unique<epoch_sampler>(data.train.size(), static_cast<uint64_t>(cfg_.run.seed));
  }

  void announce(int threads) {
    const auto& data = in_->data;
    const auto& s = data.stats;
    if (s.format != data_format::text || s.skipped > 0)
      obs_.on_event(log_event{log_event::level::info,
                              fmt::format("data: {} format, {} examples ({} skipped, {} truncated, {} dropped), {} tokens of which {} trained on; template {}",
                                          data_format_name(s.format), s.examples, s.skipped, s.truncated, s.dropped, s.tokens,
                                          s.trained_tokens, data.template_source.empty() ? "none" : data.template_source)});
    run_started_event ev = opts_.run;
    ev.model = in_->weights.source;
    ev.parameters = in_->weights.cfg.num_parameters();
    ev.lora_parameters = lora_.num_parameters();
    ev.train_sequences = data.train.size();
    ev.val_sequences = data.val.size();
    ev.total_steps = total_steps_;
    ev.tokens_per_step = tokens_per_step_;
    ev.threads = threads;
    if (ev.config_json.empty()) ev.config_json = project_to_json(with_absolute_paths(cfg_));
    if (ev.devices.empty()) ev.devices = {cfg_.parallel.schedule == "single" ? std::string("cpu") : cfg_.parallel.devices};
    if (ev.output_dir.empty()) ev.output_dir = out_dir_.string();
    ev.adapter_dir = (out_dir_ / "adapter").string();
    if (ev.checkpoint_dir.empty()) ev.checkpoint_dir = opts_.checkpoint_root.string();
    obs_.on_event(ev);
  }

  status build() {
    pipeline_options po;
    po.cancel = opts_.group != nullptr ? nullptr : cancel_;  // several processes: decided together (stop_requested)
    po.probe = opts_.probe;
    if (opts_.group != nullptr) {  // contiguous blocks of device positions, one per rank
      po.processes.rank_of = rank_of_positions(device_count(cfg_.parallel.devices), opts_.group->world());
      po.processes.group = opts_.group;
    }
    LP_TRY_ASSIGN(rig, build_pipeline(cfg_, in_->weights, lora_, obs_, po));
    rig_ = std::move(rig);
    return ok_status();
  }

  // The optimizers that own the LoRA state and the PEFT names of their parameters (checkpoints).
  std::vector<optimizer_group> optimizer_groups() {
    auto names = lora_.parameter_names();
    if (!rig_.executor) return {{opt_.get(), names}};
    std::vector<optimizer_group> groups;
    for (adamw* o : rig_.executor->optimizers()) {
      optimizer_group g{o, {}};
      for (size_t k = 0; k < o->params().size(); ++k) {
        size_t i = 0;  // by identity; the async optimizer's master copies line up by position
        while (i < params_.size() && !params_[i].is_same(o->params()[k])) ++i;
        g.names.push_back(names[i < params_.size() ? i : k]);
      }
      groups.push_back(std::move(g));
    }
    return groups;
  }

  status restore() {
    const fs::path& from = opts_.resume_from;
    LP_TRY_ASSIGN(info, verify_checkpoint(from));
    LP_TRY_ASSIGN(st, load_train_state(from, lora_, optimizer_groups()));
    if (rig_.executor) rig_.executor->resync_master();  // async optimizer: its master copy takes the loaded weights
    if (st.train_sequences != in_->data.train.size())
      return make_error("{}: the checkpoint was trained on {} sequences, the data now gives {} (data.train changed?)", from.string(),
                        st.train_sequences, in_->data.train.size());
    if (!opts_.config_hash.empty() && !st.config_hash.empty() && st.config_hash != opts_.config_hash)
      return make_error("{}: the checkpoint belongs to a run with a different configuration (config hash {} vs {})", from.string(),
                        st.config_hash.substr(0, 12), opts_.config_hash.substr(0, 12));
    if (st.step > total_steps_)
      return make_error("{}: checkpoint at step {} is past the run's {} steps", from.string(), st.step, total_steps_);
    step_ = st.step;
    cursor_ = st.cursor;
    sum_.first_val_loss = st.first_val_loss;
    eval_pending_ = st.eval_pending && st.step < total_steps_;
    checkpointed_step_ = st.step;
    sum_.last_checkpoint = info.dir.string();
    obs_.on_event(log_event{log_event::level::info, fmt::format("resuming at step {} from {}", step_, info.dir.string())});
    return ok_status();
  }

  bool has_val() const { return in_->data.val.size() > 0; }

  // The before/after sample: greedy, on the pipeline devices when training runs there.
  std::string sample(int64_t at, const cancel_token* cancel) {
    report(fmt::format("sample at step {}", at));
    gather();
    if (!rig_.evaluator) return sample_text(in_->weights, lora_, *in_->tok, cfg_, obs_, at, cancel);
    pipeline_validation scope(rig_);
    return sample_text(*in_->tok, cfg_, obs_, at, cancel, [&](const std::vector<int32_t>& prompt, const sampling_options& so) {
      return pipeline_greedy(rig_, prompt, so.max_new_tokens, so.stop_id, in_->weights.cfg.context_length(),
                             [&](int32_t id) { return (!so.on_token || so.on_token(id)) && !cancel_requested(so.cancel); });
    });
  }

  // Validation at `at`; a stop during it leaves eval_pending set for the checkpoint.
  double validate(int64_t at) {
    report(fmt::format("validation at step {}", at));
    gather();
    eval_pending_ = true;
    // On the pipeline devices when training runs there (the same program's forward half); on the host
    // weights otherwise.
    auto r = [&] {
      if (!rig_.evaluator)
        return evaluate_windows(in_->weights, &lora_, in_->data.val, cfg_.run.batch_size, cfg_.run.eval_batches, obs_, at, inner_cancel());
      pipeline_validation scope(rig_);
      return evaluate_windows(in_->data.val, cfg_.run.batch_size, cfg_.run.eval_batches, obs_, at, inner_cancel(),
                              [&](const at::Tensor& x, const at::Tensor& y) {
                                return pipeline_batch_loss(rig_, x, y, cfg_.run.batch_size);
                              });
    }();
    eval_pending_ = false;
    obs_.on_event(eval_event{at, r.loss, r.tokens});
    return r.loss;
  }

  void before_training() {
    const bool resuming = resuming_;
    if (has_val() && (!resuming || eval_pending_)) {
      const double loss = validate(step_);
      if (step_ == 0) sum_.first_val_loss = loss;
    }
    if (cfg_.run.sample_tokens > 0 && !resuming)
      obs_.on_event(sample_event{"before", cfg_.run.sample_prompt, sample(0, inner_cancel())});
  }

  status loop() {
    const auto t_start = clock_type::now();
    for (; step_ < total_steps_; ++step_) {
      if (stop_requested()) {
        stopped_ = true;
        return ok_status();
      }
      const auto t0 = clock_type::now();
      const double lr = sched_.at(step_);
      const int64_t cursor_before = cursor_;
      report(fmt::format("training step {} of {}", step_ + 1, total_steps_));
      auto numbers = rig_.executor ? pipeline_step(lr) : single_step(lr);
      if (!numbers && is_cancelled(numbers.err())) {  // the step is discarded whole; its data comes again on resume
        cursor_ = cursor_before;
        stopped_ = true;
        return ok_status();
      }
      if (!numbers) return numbers.err();
      const double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
      busy_s_ += dt;
      obs_.on_event(step_event{step_ + 1, total_steps_, numbers->loss, lr, numbers->grad_norm, tokens_per_step_ / std::max(dt, 1e-9),
                               std::chrono::duration<double>(clock_type::now() - t_start).count(), sum_.start_step,
                               std::move(numbers->peaks), peak_rss_bytes(), rig_.bubble_ratio});
      if (has_val() && cfg_.run.eval_interval > 0 && (step_ + 1) % cfg_.run.eval_interval == 0 && step_ + 1 < total_steps_) {
        ++step_;  // a stop inside this validation checkpoints the finished step
        validate(step_);
        --step_;
      }
      if (cfg_.run.checkpoint_interval > 0 && (step_ + 1) % cfg_.run.checkpoint_interval == 0) LP_TRY(write_checkpoint(step_ + 1));
    }
    return ok_status();
  }

  std::vector<int64_t> draw(int64_t n) {
    std::vector<int64_t> idx;
    for (int64_t b = 0; b < n; ++b) idx.push_back(sampler_->at(cursor_++));
    return idx;
  }

  result<step_numbers> pipeline_step(double lr) {
    auto [x, y] = make_batch(in_->data.train, draw(cfg_.run.batch_size));  // i64 [B,T] each
    std::vector<micro_batch> mbs;
    auto xs = x.chunk(cfg_.parallel.micro_batches), ys = y.chunk(cfg_.parallel.micro_batches);
    // Masked data: every micro-batch's summed loss over the step's trained tokens (token-weighted mean).
    const double scale = in_->data.train.has_mask() ? 1.0 / static_cast<double>(std::max<int64_t>(1, trained_labels(y))) : 0.0;
    for (size_t i = 0; i < xs.size(); ++i)
      mbs.push_back({xs[i].contiguous(), ys[i].contiguous(), scale,
                     dropout_key(static_cast<uint64_t>(cfg_.run.seed), step_, static_cast<int64_t>(i))});
    if (!memory_checked_)  // the first step alone: not the validation or sample before it
      for (auto& d : rig_.devices)
        if (d) d->reset_measured_peak();
    LP_TRY_ASSIGN(r, rig_.executor->step(mbs, lr, cfg_.optimizer.grad_clip));
    if (!memory_checked_) {  // GPUs: the plan against what the allocator really held, once
      memory_checked_ = true;
      std::vector<compute_device*> raw;
      for (auto& d : rig_.devices)
        if (d) raw.push_back(d.get());  // several processes: each rank checks its own, rank 0 reports them all
      std::string mine;
      for (const auto& w : memory_plan_warnings(raw)) {
        obs_.on_event(log_event{log_event::level::warning, w});
        mine += w + "\n";
      }
      LP_TRY(share_warnings(mine));
    }
    if (cfg_.run.trace_interval > 0 && (step_ + 1) % cfg_.run.trace_interval == 0)
      obs_.on_event(make_trace_event(rig_.executor->prog(), r, rig_.plan, step_ + 1));
    std::vector<int64_t> peaks(r.peak_bytes.begin(), r.peak_bytes.end());
    LP_TRY(gather_peaks(peaks));
    return step_numbers{r.loss, r.grad_norm, std::move(peaks)};
  }

  // Several processes: every device's arena peak of the step (each rank measures its own devices)
  // reaches every rank, so rank 0's step event (the run database, the front-ends) has them all.
  status gather_peaks(std::vector<int64_t>& peaks) {
    if (opts_.group == nullptr) return ok_status();
    at::Tensor all = torch::zeros({static_cast<int64_t>(peaks.size())}, torch::kDouble);  // f64 [devices]
    for (size_t d = 0; d < peaks.size() && d < rig_.devices.size(); ++d)
      if (rig_.devices[d]) all[static_cast<int64_t>(d)] = static_cast<double>(peaks[d]);
    LP_TRY(opts_.group->all_reduce_sum(all));
    for (size_t d = 0; d < peaks.size(); ++d) peaks[d] = static_cast<int64_t>(all[static_cast<int64_t>(d)].item<double>());
    return ok_status();
  }

  // Several processes: the memory-plan warnings of the first step go to rank 0, which reports them
  // as its own events (named by rank), so the run database keeps them whichever host they came from.
  status share_warnings(const std::string& mine) {
    if (opts_.group == nullptr) return ok_status();
    if (rank() != 0) return opts_.group->store_set(fmt::format("warnings/{}", rank()), mine.empty() ? "-" : mine);
    for (int r = 1; r < opts_.group->world(); ++r) {
      LP_TRY_ASSIGN(text, opts_.group->store_get(fmt::format("warnings/{}", r)));
      if (text == "-") continue;
      std::istringstream lines(text);
      for (std::string w; std::getline(lines, w);)
        if (!w.empty()) obs_.on_event(log_event{log_event::level::warning, fmt::format("rank {}: {}", r, w)});
    }
    return ok_status();
  }

  result<step_numbers> single_step(double lr) {
    const bool masked = in_->data.train.has_mask();
    std::vector<std::pair<at::Tensor, at::Tensor>> batches;
    int64_t step_trained = 0;
    for (int64_t micro = 0; micro < cfg_.run.grad_accum; ++micro) {
      batches.push_back(make_batch(in_->data.train, draw(cfg_.run.batch_size)));  // i64 [B,T] each
      if (masked) step_trained += trained_labels(batches.back().second);
    }
    double loss_sum = 0;
    for (size_t micro = 0; micro < batches.size(); ++micro) {
      const auto& [x, y] = batches[micro];
      const uint64_t key = dropout_key(static_cast<uint64_t>(cfg_.run.seed), step_, static_cast<int64_t>(micro));
      // The head and the loss only on labelled positions, in chunks (never the [B,T,V] logits).
      const auto& w = in_->weights;
      auto sum = head_loss_sum(w.cfg, w.final_norm, w.lm_head, forward_hidden(w, &lora_, x, true, key), y);  // f32 []
      if (!masked) {
        auto loss = sum / static_cast<double>(std::max<int64_t>(1, trained_labels(y)));  // f32 []
        (loss / static_cast<double>(cfg_.run.grad_accum)).backward();
        loss_sum += loss.item<double>() / static_cast<double>(cfg_.run.grad_accum);
      } else {  // token-weighted over the whole step: sum over trained labels / their count
        auto loss = sum / static_cast<double>(std::max<int64_t>(1, step_trained));
        loss.backward();
        loss_sum += loss.item<double>();
      }
    }
    const double gnorm = clip_grad_norm(params_, cfg_.optimizer.grad_clip);
    opt_->step(lr);
    opt_->zero_grad();
    return step_numbers{loss_sum, gnorm, {}};
  }

  // Seals the state after `at` steps: the run database first gets everything reported so far.
  status write_checkpoint(int64_t at) {
    if (at == checkpointed_step_ && !eval_pending_) return ok_status();
    report(fmt::format("checkpoint at step {}", at));
    gather();
    if (opts_.checkpoint_root.empty() || rank() != 0) {  // (the ranks keep the same bookkeeping)
      checkpointed_step_ = at;
      return ok_status();
    }
    obs_.on_event(phase_event{phase::checkpointing, 0, 0, at, opts_.checkpoint_root.string()});
    auto groups = optimizer_groups();
    if (auto e = obs_.sync(); !e.empty()) return make_error("run database: {}", e);
    trainer_state st{at, cursor_, cfg_.run.seed, in_->data.train.size(), opts_.config_hash, sched_, sum_.first_val_loss, eval_pending_};
    LP_TRY_ASSIGN(info, lorapipe::write_checkpoint(opts_.checkpoint_root, at,
                                                   [&](const fs::path& d) { return save_train_state(d, lora_, groups, st); }, opts_.probe));
    LP_TRY_ASSIGN(removed, prune_checkpoints(opts_.checkpoint_root, cfg_.run.keep_checkpoints));
    discard_abandoned_checkpoints(opts_.checkpoint_root);  // a resume from an older checkpoint's other timeline
    checkpointed_step_ = at;
    sum_.last_checkpoint = info.dir.string();
    obs_.on_event(checkpoint_event{at, info.dir.string(), info.manifest_sha256, info.bytes, removed});
    return ok_status();
  }

  void after_training() {
    if (rig_.executor) rig_.executor->flush();  // async optimizer: the last step's update lands in the adapter
    if (has_val()) sum_.final_val_loss = validate(step_);
    // Not cancellable: the final validation is already recorded, and the sample is short.
    if (cfg_.run.sample_tokens > 0)
      obs_.on_event(sample_event{"after", cfg_.run.sample_prompt, sample(step_, nullptr)});
  }

  // A stop before any LoRA state exists: nothing to checkpoint; resuming starts from the beginning.
  result<train_summary> stopped_before_training() {
    sum_.stopped = true;
    sum_.steps = sum_.start_step = opts_.run.start_step;  // a resumed run keeps its checkpoint
    sum_.last_checkpoint = opts_.resume_from.string();
    obs_.on_event(run_finished_event{sum_.steps, 0, 0, 0, {}, true, "stopped", {}});
    return sum_;
  }

  // Stopped (Ctrl-C, Stop button): checkpoint where the last whole step ended and leave; the
  // validation at this step would not be part of the resumed run either.
  result<train_summary> stop_now() {
    if (rig_.executor) rig_.executor->flush();
    LP_TRY(write_checkpoint(step_));
    sum_.stopped = true;
    return finish();
  }

  double mean_tokens_per_s() const {
    const int64_t ran = step_ - sum_.start_step;
    return busy_s_ > 0 ? static_cast<double>(tokens_per_step_ * ran) / busy_s_ : 0;
  }

  // The adapter (also of a stopped run), summary.json and the run_finished event.
  result<train_summary> finish() {
    sum_.steps = step_;
    sum_.mean_tokens_per_s = mean_tokens_per_s();
    sum_.adapter_dir = (out_dir_ / "adapter").string();
    gather();
    if (rank() != 0) {  // rank 0 writes the adapter and the summary
      obs_.on_event(run_finished_event{sum_.steps, sum_.first_val_loss, sum_.final_val_loss, sum_.mean_tokens_per_s, sum_.adapter_dir,
                                       sum_.stopped, sum_.stopped ? "stopped" : "completed", {}});
      return sum_;
    }
    obs_.on_event(phase_event{phase::saving_adapter, 0, 0, step_, sum_.adapter_dir});
    LP_TRY(save_peft_adapter(lora_, out_dir_ / "adapter"));
    if (cfg_.run.save_merged) {
      obs_.on_event(phase_event{phase::exporting, 0, 0, step_, (out_dir_ / "merged").string()});
      // Several processes: this rank read only its stages' weights; the export reads the others a
      // layer at a time.
      LP_TRY(export_merged(in_->weights, lora_, out_dir_ / "merged", in_->tok_path));
    }
    nlohmann::json s = {{"steps", sum_.steps},
                        {"first_val_loss", sum_.first_val_loss},
                        {"final_val_loss", sum_.final_val_loss},
                        {"mean_tokens_per_s", sum_.mean_tokens_per_s},
                        {"stopped_early", sum_.stopped}};
    LP_TRY(write_file_atomic(out_dir_ / "summary.json", s.dump(2) + "\n"));
    obs_.on_event(run_finished_event{sum_.steps, sum_.first_val_loss, sum_.final_val_loss, sum_.mean_tokens_per_s, sum_.adapter_dir,
                                     sum_.stopped, sum_.stopped ? "stopped" : "completed", {}});
    return sum_;
  }

  project_config cfg_;  // parallel.schedule "auto" resolved once the model is loaded
  observer& obs_;
  const train_options& opts_;
  const cancel_token* cancel_;
  const fs::path out_dir_;
  std::unique_ptr<project_inputs> in_;
  lora_adapters lora_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<adamw> opt_;
  lr_schedule sched_;
  int64_t total_steps_ = 0, tokens_per_step_ = 0;
  pipeline_rig rig_;
  bool memory_checked_ = false;
  bool resuming_ = false;  // from a checkpoint (several processes: rank 0's)
  std::unique_ptr<epoch_sampler> sampler_;
  int64_t cursor_ = 0, step_ = 0, checkpointed_step_ = -1;
  bool stopped_ = false, eval_pending_ = false;
  double busy_s_ = 0;
  train_summary sum_;
};

}  // namespace

result<train_summary> run_training(const project_config& cfg, observer& obs, const train_options& opts) {
  return guarded([&]() -> result<train_summary> { return trainer(cfg, obs, opts).run(); });
}

result<eval_summary> evaluate_project(const project_config& cfg_in, const fs::path& adapter_dir, const std::string& data_file,
                                      observer& obs, const cancel_token* cancel) {
  return guarded([&]() -> result<eval_summary> {
    project_config cfg = cfg_in;
    if (!data_file.empty()) {
      cfg.data.train = fs::absolute(data_file).string();
      cfg.data.val_fraction = 0;
      cfg.data.on_disk = false;
    }
    LP_TRY(validate_project(cfg));
    thread_count_scope threads(cfg.run.threads);
    LP_TRY_ASSIGN(in, load_project_inputs(cfg, obs, cancel));
    LP_TRY_ASSIGN(resolved, resolve_auto_schedule(cfg, in.weights.cfg, auto_schedule_gflops));
    cfg = std::move(resolved);
    lora_adapters lora;
    if (!adapter_dir.empty()) {
      LP_TRY_ASSIGN(l, load_peft_adapter(adapter_dir, in.weights));
      lora = std::move(l);
    }
    const token_windows& set = data_file.empty() ? in.data.val : in.data.train;
    if (set.size() == 0)
      return make_error("{}: no evaluation sequences (data.val_fraction is 0 or the data is shorter than data.seq_len)",
                        data_file.empty() ? cfg.resolve(cfg.data.train).string() : data_file);
    eval_result r;
    if (cfg.parallel.schedule == "single") {
      r = evaluate_windows(in.weights, adapter_dir.empty() ? nullptr : &lora, set, cfg.run.batch_size, 0, obs, 0, cancel);
    } else {  // on the project's pipeline devices (the base model: a fresh LoRA, whose B is zero)
      if (adapter_dir.empty()) lora = init_lora(in.weights, lora_config{}, 0);
      LP_TRY_ASSIGN(rig, build_pipeline(cfg, in.weights, lora, obs, {}));
      pipeline_validation scope(rig);
      r = evaluate_windows(set, cfg.run.batch_size, 0, obs, 0, cancel, [&](const at::Tensor& x, const at::Tensor& y) {
        return pipeline_batch_loss(rig, x, y, cfg.run.batch_size);
      });
    }
    return eval_summary{r.loss, std::exp(r.loss), r.tokens, set.size(),
                        data_file.empty() ? cfg.resolve(cfg.data.train).string() + " (validation split)" : fs::absolute(data_file).string()};
  });
}

}  // namespace lorapipe
