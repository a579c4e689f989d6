// Single-device training loop: see trainer.h.
#include "core/trainer.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/dataset.h"
#include "core/training_data.h"
#include "core/generate.h"
#include "core/llama_model.h"
#include "core/lora.h"
#include "core/optimizer.h"
#include "core/pipeline_executor.h"
#include "core/schedule.h"
#include "core/schedule_sim.h"
#include "core/safetensors.h"
#include "core/tensor_io.h"
#include "core/tokenizer.h"
#include "core/train_state.h"

namespace lorapipe {
namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

int configure_threads(int64_t requested) {
  int n = requested > 0 ? static_cast<int>(requested) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
  return at::get_num_threads();
}

namespace {

// Inputs and labels (i64 [B,T]) for the given windows.
std::pair<at::Tensor, at::Tensor> make_batch(const token_windows& w, const std::vector<int64_t>& idx) {
  const int64_t B = static_cast<int64_t>(idx.size()), T = w.seq_len;
  auto all = torch::empty({B, T + 1}, torch::kLong);  // i64 [B,T+1]
  auto* p = all.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* src = w.window(idx[b]);
    for (int64_t t = 0; t <= T; ++t) p[b * (T + 1) + t] = src[t];
  }
  auto labels = all.slice(1, 1, T + 1).clone();  // i64 [B,T]
  if (w.has_mask()) {  // loss mask: -100 where the target token is not trained on
    auto* l = labels.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* m = w.window_mask(idx[b]);
      for (int64_t t = 0; t < T; ++t)
        if (m[t + 1] == 0) l[b * T + t] = -100;
    }
  }
  return {all.slice(1, 0, T).contiguous(), labels};
}

int64_t trained_labels(const at::Tensor& y) { return y.ne(-100).sum().item<int64_t>(); }

// Token-weighted mean loss over the validation split and the number of label tokens it covers.
std::pair<double, int64_t> evaluate(const llama_weights& w, const lora_adapters* lora, const token_windows& val, int64_t batch,
                                    int64_t max_batches) {
  torch::NoGradGuard no_grad;
  double sum = 0;
  int64_t count = 0;
  const int64_t n = val.size();
  const int64_t limit = max_batches > 0 ? std::min(n, max_batches * batch) : n;
  for (int64_t s = 0; s < limit; s += batch) {
    std::vector<int64_t> idx;
    for (int64_t i = s; i < std::min(limit, s + batch); ++i) idx.push_back(i);
    auto [x, y] = make_batch(val, idx);
    const int64_t n = trained_labels(y);
    if (n == 0) continue;
    auto loss = causal_lm_loss(forward(w, lora, x), y);
    sum += loss.item<double>() * static_cast<double>(n);
    count += n;
  }
  return {count > 0 ? sum / static_cast<double>(count) : 0.0, count};
}

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

std::string sample(const llama_weights& w, const lora_adapters& lora, const tokenizer& tok, const project_config& cfg) {
  auto ids = tok.encode(cfg.run.sample_prompt);
  if (!ids) return {};
  std::vector<int32_t> prompt{tok.bos_id()};
  prompt.insert(prompt.end(), ids->begin(), ids->end());
  sampling_options so;
  so.max_new_tokens = cfg.run.sample_tokens;
  so.stop_id = tok.eos_id();
  auto out = generate(w, &lora, prompt, so);
  if (!out.empty() && out.back() == tok.eos_id()) out.pop_back();
  return tok.decode_continuation(prompt, out);
}

// What a project trains on or evaluates: the model, its tokenizer and the tokenised data.
struct project_inputs {
  llama_weights weights;
  std::unique_ptr<tokenizer> tok;
  fs::path tok_path;
  training_data data;
};

result<project_inputs> load_project_inputs(const project_config& cfg) {
  LP_TRY_ASSIGN(dtype, parse_dtype_name(cfg.model.dtype));
  const fs::path model_path = cfg.resolve(cfg.model.path);
  LP_TRY_ASSIGN(w, load_llama(model_path, {dtype}));
  const fs::path tok_path = cfg.tokenizer.path.empty() ? model_path : cfg.resolve(cfg.tokenizer.path);
  LP_TRY_ASSIGN(tok, load_tokenizer(tok_path));
  if (tok->vocab_size() > w.cfg.vocab_size)
    return make_error("tokenizer has {} tokens but the model only {}", tok->vocab_size(), w.cfg.vocab_size);
  if (cfg.data.seq_len > w.cfg.max_position_embeddings)
    return make_error("data.seq_len: {} exceeds the model's context length {}", cfg.data.seq_len,
                      w.cfg.max_position_embeddings);
  std::error_code ec;
  const fs::path tok_dir = fs::is_directory(tok_path, ec) ? tok_path : tok_path.parent_path();
  LP_TRY_ASSIGN(data, load_training_data(cfg, *tok, tok_dir));
  return project_inputs{std::move(w), std::move(tok), tok_path, std::move(data)};
}

}  // namespace

std::string config_hash(const project_config& cfg) {
  project_config c = with_absolute_paths(cfg);
  c.run.output_dir.clear();
  c.run.database.clear();
  const std::string text = project_to_json(c);
  return sha256_hex(text.data(), text.size());
}

result<train_summary> run_training(const project_config& cfg, observer& obs, const train_options& opts) {
  const std::atomic<bool>* stop = opts.stop;
  LP_TRY(validate_project(cfg));
  const int threads = configure_threads(cfg.run.threads);
  const fs::path out_dir = cfg.resolve(cfg.run.output_dir);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return make_error("run.output_dir: cannot create {}: {}", out_dir.string(), ec.message());
  LP_TRY(write_file_atomic(out_dir / "project.json", project_to_json(cfg)));

  LP_TRY_ASSIGN(in, load_project_inputs(cfg));
  auto& w = in.weights;
  auto& tok = in.tok;
  auto& data = in.data;
  const fs::path& tok_path = in.tok_path;
  const fs::path model_path = cfg.resolve(cfg.model.path);
  if (data.stats.format != data_format::text || data.stats.skipped > 0)
    obs.on_event(log_event{log_event::level::info,
                           fmt::format("data: {} format, {} examples ({} skipped, {} truncated, {} dropped), {} tokens of which {} trained on; template {}",
                                       data_format_name(data.stats.format), data.stats.examples, data.stats.skipped, data.stats.truncated,
                                       data.stats.dropped, data.stats.tokens, data.stats.trained_tokens,
                                       data.template_source.empty() ? "none" : data.template_source)});

  lora_config lc;
  lc.r = cfg.lora.r;
  lc.alpha = cfg.lora.alpha;
  lc.dropout = cfg.lora.dropout;
  lc.targets.clear();
  for (const auto& t : cfg.lora.targets) lc.targets.push_back(*lora_target_from_name(t));
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  auto lora = init_lora(w, lc, static_cast<uint64_t>(cfg.run.seed));
  if (!cfg.lora.init_adapter.empty()) {  // continue a previous fine-tune
    auto loaded = load_peft_adapter(cfg.resolve(cfg.lora.init_adapter), w);
    if (!loaded) return make_error("lora.init_adapter: {}", loaded.message());
    lora = std::move(*loaded);
    lora.cfg.dropout = cfg.lora.dropout;
    obs.on_event(log_event{log_event::level::info, fmt::format("continuing from adapter {} (r={}, alpha={})",
                                                               cfg.resolve(cfg.lora.init_adapter).string(), lora.cfg.r, lora.cfg.alpha)});
  }
  lora.base_model = model_path.string();
  auto params = lora.parameters();
  adamw opt(params, {cfg.optimizer.lr, cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.eps,
                     cfg.optimizer.weight_decay});
  // run.epochs, when set, decides the step count from the data size.
  const int64_t seqs_per_step = cfg.run.batch_size * cfg.run.grad_accum;
  const int64_t total_steps =
      cfg.run.epochs > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(cfg.run.epochs * static_cast<double>(data.train.size()) /
                                                                                 static_cast<double>(seqs_per_step))))
                         : cfg.run.steps;
  if (cfg.run.epochs > 0)
    obs.on_event(log_event{log_event::level::info, fmt::format("run.epochs {}: {} steps of {} sequences over {} training sequences",
                                                               cfg.run.epochs, total_steps, seqs_per_step, data.train.size())});
  lr_schedule sched{cfg.optimizer.lr, cfg.optimizer.warmup_steps, total_steps, cfg.optimizer.min_lr_ratio};

  const int64_t tokens_per_step = cfg.run.batch_size * cfg.run.grad_accum * cfg.data.seq_len;
  obs.on_event(run_started_event{w.source, w.cfg.num_parameters(), lora.num_parameters(), data.train.size(),
                                 data.val.size(), total_steps, tokens_per_step, threads});
  train_summary sum;
  const bool has_val = data.val.size() > 0;
  const bool resuming = !opts.resume_from.empty();
  if (has_val && !resuming) {
    auto [loss, n] = evaluate(w, &lora, data.val, cfg.run.batch_size, cfg.run.eval_batches);
    sum.first_val_loss = loss;
    obs.on_event(eval_event{0, loss, n});
  }
  if (cfg.run.sample_tokens > 0 && !resuming)
    obs.on_event(sample_event{"before", cfg.run.sample_prompt, sample(w, lora, *tok, cfg)});

  // Pipelines: devices, a program from the schedule generator (checked by the simulator), an executor.
  const bool pipelined = cfg.parallel.schedule != "single";
  std::vector<std::unique_ptr<compute_device>> devices;
  std::unique_ptr<pipeline_executor> pipe;
  double bubble = -1;
  if (pipelined) {
    cpu_device_options dopts;
    if (cfg.offload.device_memory_mb > 0) dopts.capacity_bytes = static_cast<size_t>(cfg.offload.device_memory_mb * 1048576.0);
    dopts.copy_bytes_per_s = cfg.offload.copy_gbps * 1e9;
    dopts.compute_threads = static_cast<int>(cfg.parallel.threads_per_device);
    LP_TRY_ASSIGN(devs, make_devices(cfg.parallel.devices, dopts));
    devices = std::move(devs);
    schedule_options so;
    so.devices = static_cast<int32_t>(devices.size());
    so.micro_batches = static_cast<int32_t>(cfg.parallel.micro_batches);
    so.virtual_stages = static_cast<int32_t>(cfg.parallel.virtual_stages);
    so.recompute = cfg.offload.recompute;
    so.offload_activations = cfg.offload.activations && cfg.offload.recompute;
    so.stream_weights = cfg.offload.stream_weights;
    auto prog = make_schedule(cfg.parallel.schedule, static_cast<int32_t>(w.cfg.num_layers), so);
    if (!prog) return make_error("parallel.schedule: {}", prog.message());
    auto check = simulate(*prog, uniform_costs(*prog, 1.0, 2.0));
    if (!check.ok) return make_error("parallel.schedule: generated program is invalid: {}\n{}", check.error, check.grid);
    std::vector<compute_device*> raw;
    for (auto& d : devices) raw.push_back(d.get());
    const auto facts = facts_of(raw);
    LP_TRY_ASSIGN(links, choose_transports(*prog, facts, cfg.parallel.transport, gpu_peer_access, nccl_available()));
    if (cfg.parallel.transport == "nccl") LP_TRY(enable_nccl(raw));
    obs.on_event(log_event{log_event::level::info,
                           fmt::format("pipeline: {} on {} ({} stages, {} micro-batches; weights {}, activations {})",
                                       prog->schedule, cfg.parallel.devices, prog->stages.size(), prog->micro_batches,
                                       so.stream_weights ? "streamed" : "resident", so.offload_activations ? "offloaded" : "on device")});
    obs.on_event(log_event{log_event::level::info, "transports: " + describe_transports(links, facts)});
    bubble = check.bubble_ratio;
    pipeline_options po;
    po.layer_recompute = cfg.offload.recompute_granularity == "layer";
    po.async_optimizer = cfg.optimizer.asynchronous;
    po.transports = links;
    if (po.async_optimizer)
      obs.on_event(log_event{log_event::level::warning, "asynchronous optimizer: each step computes with weights one update stale"});
    pipe = std::make_unique<pipeline_executor>(w, lora, std::move(*prog), raw,
                                               adamw_config{cfg.optimizer.lr, cfg.optimizer.beta1, cfg.optimizer.beta2,
                                                            cfg.optimizer.eps, cfg.optimizer.weight_decay},
                                               po);
    std::string arenas;
    for (size_t d = 0; d < raw.size(); ++d) {
      const auto& wp = pipe->weight_plan()[d];
      arenas += fmt::format("{}{} {:.2f} MiB ({} stage(s) at once{})", d ? "; " : "", raw[d]->name(), wp.bytes / 1048576.0, wp.max_stages,
                            wp.slot_bytes ? fmt::format(", slots of {:.2f} MiB", wp.slot_bytes / 1048576.0) : "");
    }
    obs.on_event(log_event{log_event::level::info, "memory plan: weight arenas " + arenas});
  }

  // The optimizers that own the LoRA state and the PEFT names of their parameters (checkpoints).
  auto optimizer_groups = [&] {
    std::vector<optimizer_group> groups;
    auto names = lora.parameter_names();
    if (!pipe) return std::vector<optimizer_group>{{&opt, names}};
    const auto all = lora.parameters();
    for (adamw* o : pipe->optimizers()) {
      optimizer_group g{o, {}};
      for (size_t k = 0; k < o->params().size(); ++k) {
        size_t i = 0;  // by identity; the async optimizer's master copies line up by position
        while (i < all.size() && !all[i].is_same(o->params()[k])) ++i;
        g.names.push_back(names[i < all.size() ? i : k]);
      }
      groups.push_back(std::move(g));
    }
    return groups;
  };

  const bool masked = data.train.has_mask();
  epoch_sampler sampler(data.train.size(), static_cast<uint64_t>(cfg.run.seed));
  int64_t cursor = 0;
  int64_t step = 0;
  int64_t checkpointed_step = -1;
  if (!opts.checkpoint_root.empty()) sweep_checkpoint_leftovers(opts.checkpoint_root);
  if (resuming) {
    LP_TRY_ASSIGN(info, verify_checkpoint(opts.resume_from));
    LP_TRY_ASSIGN(st, load_train_state(opts.resume_from, lora, optimizer_groups()));
    if (st.train_sequences != data.train.size())
      return make_error("{}: the checkpoint was trained on {} sequences, the data now gives {} (data.train changed?)",
                        opts.resume_from.string(), st.train_sequences, data.train.size());
    if (!opts.config_hash.empty() && !st.config_hash.empty() && st.config_hash != opts.config_hash)
      return make_error("{}: the checkpoint belongs to a run with a different configuration (config hash {} vs {})",
                        opts.resume_from.string(), st.config_hash.substr(0, 12), opts.config_hash.substr(0, 12));
    if (st.step > total_steps)
      return make_error("{}: checkpoint at step {} is past the run's {} steps", opts.resume_from.string(), st.step, total_steps);
    step = st.step;
    cursor = st.cursor;
    sum.first_val_loss = st.first_val_loss;
    checkpointed_step = st.step;
    sum.last_checkpoint = info.dir.string();
    obs.on_event(log_event{log_event::level::info, fmt::format("resuming at step {} from {}", step, info.dir.string())});
  }
  sum.start_step = step;
  // Seal the state after `at` steps: the run database first gets everything reported so far.
  auto write_ckpt = [&](int64_t at) -> status {
    if (opts.checkpoint_root.empty() || at == checkpointed_step) return ok_status();
    auto groups = optimizer_groups();
    if (auto e = obs.sync(); !e.empty()) return make_error("run database: {}", e);
    trainer_state st{at, cursor, cfg.run.seed, data.train.size(), opts.config_hash, sched, sum.first_val_loss};
    LP_TRY_ASSIGN(info, write_checkpoint(opts.checkpoint_root, at,
                                         [&](const fs::path& d) { return save_train_state(d, lora, groups, st); }, opts.probe));
    LP_TRY_ASSIGN(removed, prune_checkpoints(opts.checkpoint_root, cfg.run.keep_checkpoints));
    checkpointed_step = at;
    sum.last_checkpoint = info.dir.string();
    obs.on_event(checkpoint_event{at, info.dir.string(), info.manifest_sha256, info.bytes, removed});
    return ok_status();
  };

  double busy_s = 0;
  bool stopped = false;
  const auto t_start = clock_type::now();
  for (; step < total_steps; ++step) {
    if (stop != nullptr && stop->load()) {
      stopped = true;
      break;
    }
    const auto t0 = clock_type::now();
    double loss_mean = 0, gnorm = 0;
    std::vector<int64_t> peaks;
    const double lr = sched.at(step);
    if (pipe) {
      std::vector<int64_t> idx;
      for (int64_t b = 0; b < cfg.run.batch_size; ++b) idx.push_back(sampler.at(cursor++));
      auto [x, y] = make_batch(data.train, idx);  // i64 [B,T] each
      std::vector<micro_batch> mbs;
      auto xs = x.chunk(cfg.parallel.micro_batches), ys = y.chunk(cfg.parallel.micro_batches);
      // Masked data: every micro-batch's summed loss over the step's trained tokens (token-weighted mean).
      const double scale = masked ? 1.0 / static_cast<double>(std::max<int64_t>(1, trained_labels(y))) : 0.0;
      for (size_t i = 0; i < xs.size(); ++i) mbs.push_back({xs[i].contiguous(), ys[i].contiguous(), scale});
      LP_TRY_ASSIGN(r, pipe->step(mbs, lr, cfg.optimizer.grad_clip));
      loss_mean = r.loss;
      gnorm = r.grad_norm;
      peaks.assign(r.peak_bytes.begin(), r.peak_bytes.end());
    } else {
      double loss_sum = 0;
      std::vector<std::pair<at::Tensor, at::Tensor>> batches;
      int64_t step_trained = 0;
      for (int64_t micro = 0; micro < cfg.run.grad_accum; ++micro) {
        std::vector<int64_t> idx;
        for (int64_t b = 0; b < cfg.run.batch_size; ++b) idx.push_back(sampler.at(cursor++));
        batches.push_back(make_batch(data.train, idx));  // i64 [B,T] each
        if (masked) step_trained += trained_labels(batches.back().second);
      }
      for (auto& [x, y] : batches) {
        auto logits = forward(w, &lora, x, 0, nullptr, true);  // f32 [B,T,V]
        if (!masked) {
          auto loss = causal_lm_loss(logits, y);  // f32 []
          (loss / static_cast<double>(cfg.run.grad_accum)).backward();
          loss_sum += loss.item<double>() / static_cast<double>(cfg.run.grad_accum);
        } else {  // token-weighted over the whole step: sum over trained labels / their count
          auto loss = causal_lm_loss_sum(logits, y) / static_cast<double>(std::max<int64_t>(1, step_trained));
          loss.backward();
          loss_sum += loss.item<double>();
        }
      }
      gnorm = clip_grad_norm(params, cfg.optimizer.grad_clip);
      opt.step(lr);
      opt.zero_grad();
      loss_mean = loss_sum;
    }
    const double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
    busy_s += dt;
    step_event ev{step + 1, total_steps, loss_mean, lr, gnorm, tokens_per_step / std::max(dt, 1e-9),
                  std::chrono::duration<double>(clock_type::now() - t_start).count(), sum.start_step, std::move(peaks), peak_rss_bytes(), bubble};
    obs.on_event(ev);
    if (has_val && cfg.run.eval_interval > 0 && (step + 1) % cfg.run.eval_interval == 0 && step + 1 < total_steps) {
      auto [loss, n] = evaluate(w, &lora, data.val, cfg.run.batch_size, cfg.run.eval_batches);
      obs.on_event(eval_event{step + 1, loss, n});
    }
    if (cfg.run.checkpoint_interval > 0 && (step + 1) % cfg.run.checkpoint_interval == 0) LP_TRY(write_ckpt(step + 1));
  }
  LP_TRY(write_ckpt(step));  // the end (or where Ctrl-C stopped): resumable, and a resume of a finished run is a no-op
  if (pipe) pipe->flush();  // async optimizer: the last step's update lands in the adapter
  sum.steps = step;
  sum.stopped = stopped;
  const int64_t ran = step - sum.start_step;
  sum.mean_tokens_per_s = busy_s > 0 ? static_cast<double>(tokens_per_step * ran) / busy_s : 0;
  // Stopped (Ctrl-C): leave quickly; the validation at this step would also not be part of the resumed run.
  if (has_val && !stopped) {
    auto [loss, n] = evaluate(w, &lora, data.val, cfg.run.batch_size, cfg.run.eval_batches);
    sum.final_val_loss = loss;
    obs.on_event(eval_event{step, loss, n});
  }
  if (cfg.run.sample_tokens > 0 && !stopped) obs.on_event(sample_event{"after", cfg.run.sample_prompt, sample(w, lora, *tok, cfg)});
  sum.adapter_dir = (out_dir / "adapter").string();
  LP_TRY(save_peft_adapter(lora, out_dir / "adapter"));
  if (cfg.run.save_merged) LP_TRY(export_merged(w, lora, out_dir / "merged", tok_path));
  nlohmann::json s = {{"steps", sum.steps},
                      {"first_val_loss", sum.first_val_loss},
                      {"final_val_loss", sum.final_val_loss},
                      {"mean_tokens_per_s", sum.mean_tokens_per_s},
                      {"stopped_early", stopped}};
  LP_TRY(write_file_atomic(out_dir / "summary.json", s.dump(2) + "\n"));
  obs.on_event(run_finished_event{sum.steps, sum.first_val_loss, sum.final_val_loss, sum.mean_tokens_per_s,
                                  sum.adapter_dir, stopped});
  return sum;
}

result<eval_summary> evaluate_project(const project_config& cfg_in, const fs::path& adapter_dir, const std::string& data_file) {
  project_config cfg = cfg_in;
  if (!data_file.empty()) {
    cfg.data.train = fs::absolute(data_file).string();
    cfg.data.val_fraction = 0;
    cfg.data.on_disk = false;
  }
  LP_TRY(validate_project(cfg));
  configure_threads(cfg.run.threads);
  LP_TRY_ASSIGN(in, load_project_inputs(cfg));
  auto& w = in.weights;
  auto& data = in.data;
  lora_adapters lora;
  if (!adapter_dir.empty()) {
    LP_TRY_ASSIGN(l, load_peft_adapter(adapter_dir, w));
    lora = std::move(l);
  }
  const token_windows& set = data_file.empty() ? data.val : data.train;
  if (set.size() == 0)
    return make_error("{}: no evaluation sequences (data.val_fraction is 0 or the data is shorter than data.seq_len)",
                      data_file.empty() ? cfg.resolve(cfg.data.train).string() : data_file);
  auto [loss, n] = evaluate(w, adapter_dir.empty() ? nullptr : &lora, set, cfg.run.batch_size, 0);
  return eval_summary{loss, std::exp(loss), n, set.size(), data_file.empty() ? cfg.resolve(cfg.data.train).string() + " (validation split)" : fs::absolute(data_file).string()};
}

}  // namespace lorapipe
