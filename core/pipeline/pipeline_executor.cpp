// Pipeline executor: construction, the step driver and the async optimizer (see
// pipeline_executor.h); the instructions themselves run in pipeline_worker.cpp.
#include "core/pipeline/pipeline_executor.h"

#include <limits>
#include <thread>

#include "core/pipeline/pipeline_impl.h"

namespace lorapipe {

weight_selection rank_weight_selection(const program& p, int64_t num_layers, const std::vector<int>& rank_of, int rank) {
  weight_selection sel;
  sel.layers.assign(static_cast<size_t>(num_layers), false);
  sel.embed = sel.head = false;
  for (size_t d = 0; d < p.devices.size(); ++d) {
    if (rank_of.at(d) != rank) continue;
    for (const auto& in : p.devices[d]) {
      if (in.kind != op::forward && in.kind != op::backward && in.kind != op::recompute && in.kind != op::prefetch_weights) continue;
      const stage_def& st = p.stages.at(static_cast<size_t>(in.stage));
      for (int32_t l = st.first_layer; l < st.last_layer; ++l) sel.layers[static_cast<size_t>(l)] = true;
      sel.embed = sel.embed || st.has_embed;
      sel.head = sel.head || st.has_head;
    }
  }
  return sel;
}

pipeline_executor::pipeline_executor(const llama_weights& w, lora_adapters& lora, program prog,
                                     std::vector<compute_device*> devices, adamw_config opt, pipeline_options po)
    : prog_(std::move(prog)) {
  d_ = std::make_unique<impl>(w, lora, prog_, std::move(devices), opt, po);
}

void pipeline_executor::flush() {
  auto& s = *d_;
  if (!s.pending.valid()) return;
  s.pending.get();
  torch::NoGradGuard ng;
  auto params = s.lora.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(s.master[i]);
}

const std::vector<weight_arena_plan>& pipeline_executor::weight_plan() const { return d_->weight_plan; }
const memory_plan* pipeline_executor::memory() const { return d_->po.memory ? d_->po.memory.get() : d_->mplan ? &*d_->mplan : nullptr; }

status pipeline_executor::impl::check_memory(const std::vector<micro_batch>& mbs) {
  if (mbs.empty() || mbs[0].tokens.dim() != 2) return ok_status();
  const std::pair<int64_t, int64_t> shape{mbs[0].tokens.size(0), mbs[0].tokens.size(1)};
  if (!po.memory && (!mplan || mplan_shape != shape)) {
    sim_costs costs = flop_costs(prog, w.cfg, shape.first, shape.second, w.embed.element_size(), auto_schedule_gflops, 0,
                                  graph_targets_of(lora.cfg.targets));
    costs.per_layer_recompute = po.layer_recompute;
    if (!mbs[0].labels.defined()) costs.input_bytes = costs.token_bytes;
    const sim_result sim = simulate(prog, costs);
    if (!sim.ok) return ok_status();  // the program's own problems are reported by running it
    memory_inputs in;
    in.arenas = weight_plan;
    in.alignment = 1;
    for (auto* d : devs) {
      if (d != nullptr) in.alignment = std::max(in.alignment, d->arena().alignment());
      in.workspaces.push_back(d != nullptr ? d->library_workspaces() : workspace_charge{});
    }
    for (const auto& layer : lora.layers) {
      size_t b = 0;
      for (const auto& pair : layer) b += (pair.a.defined() ? pair.a.numel() + pair.b.numel() : 0) * w.embed.element_size();
      in.lora_layer_bytes.push_back(b);
    }
    for (const auto* t : {&w.rope.full, &w.rope.local}) in.rope_bytes += nbytes(t->cos) + nbytes(t->sin) + nbytes(t->inv_freq);
    mplan = make_memory_plan(prog, costs, sim, in);
    mplan_shape = shape;
  }
  std::vector<size_t> capacity;
  std::vector<std::string> names;
  for (size_t i = 0; i < devs.size(); ++i) {  // a device of another process is checked there
    capacity.push_back(devs[i] != nullptr ? devs[i]->arena().capacity() : std::numeric_limits<size_t>::max());
    names.push_back(devs[i] != nullptr ? devs[i]->name() : fmt::format("device {} (another process)", i));
  }
  return check_memory_plan(po.memory ? *po.memory : *mplan, capacity, names);
}

std::vector<adamw*> pipeline_executor::optimizers() {
  auto& s = *d_;
  if (s.po.async_optimizer) {
    flush();
    if (s.master.empty()) {
      torch::NoGradGuard ng;
      for (const auto& p : s.lora.parameters()) s.master.push_back(p.detach().clone());
      s.master_opt = std::make_unique<adamw>(s.master, s.opt_cfg);
    }
    return {s.master_opt.get()};
  }
  std::vector<adamw*> out;
  for (auto& [stage, o] : s.optim) out.push_back(o.get());
  return out;
}

void pipeline_executor::resync_master() {
  auto& s = *d_;
  if (!s.po.async_optimizer || s.master.empty()) return;
  torch::NoGradGuard ng;
  auto params = s.lora.parameters();
  for (size_t i = 0; i < params.size(); ++i) s.master[i].copy_(params[i]);
}

void pipeline_executor::impl::watch_workers() {
  std::unique_lock lock(mu);
  uint64_t seen = progress;
  auto last_change = clock_type::now();
  while (workers_left > 0) {
    const auto poll = po.watchdog_s > 0 ? std::chrono::duration<double>(std::min(1.0, po.watchdog_s / 4)) : std::chrono::duration<double>(1.0);
    cv.wait_for(lock, poll);
    if (progress != seen) {
      seen = progress;
      last_change = clock_type::now();
      continue;
    }
    if (po.watchdog_s <= 0 || failed || std::chrono::duration<double>(clock_type::now() - last_change).count() < po.watchdog_s) continue;
    std::string where;
    for (size_t d = 0; d < devs.size(); ++d)
      if (pc[d] >= 0 && static_cast<size_t>(pc[d]) < prog.devices[d].size())
        where += fmt::format("{}{} at step {} ({})", where.empty() ? "" : ", ", devs[d]->name(), pc[d],
                             instr_to_text(prog.devices[d][static_cast<size_t>(pc[d])]));
    lock.unlock();
    const std::string msg = fmt::format("watchdog: no device went on to its next instruction for {:g} s; {}", po.watchdog_s, where);
    if (po.on_watchdog) po.on_watchdog(msg);  // now, on the stepping thread: the step may not return soon
    fail(msg);
    lock.lock();
  }
}

// After the optimizer step, over several processes: a stage's LoRA weights go from the rank that
// stepped them to every other rank computing with those layers (round-robin runs a stage's forward
// and backward on different devices). Every rank walks the stages in the same order.
status pipeline_executor::impl::share_updated_lora() {
  std::map<int32_t, int> stepped_by;                 // stage -> rank
  std::map<int32_t, std::set<int>> layer_users;      // layer -> ranks computing with it
  for (int32_t d = 0; d < static_cast<int32_t>(prog.devices.size()); ++d)
    for (const auto& in : prog.devices[d]) {
      const int r = po.processes.rank_of[static_cast<size_t>(d)];
      if (in.kind == op::optimizer_step) stepped_by[in.stage] = r;
      if (in.kind == op::forward || in.kind == op::recompute || in.kind == op::backward)
        for (int32_t l = prog.stages[in.stage].first_layer; l < prog.stages[in.stage].last_layer; ++l) layer_users[l].insert(r);
    }
  torch::NoGradGuard ng;
  for (const auto& [stage, owner] : stepped_by) {
    const auto& st = prog.stages[stage];
    std::vector<at::Tensor> ps;
    bool elsewhere = false;
    for (int32_t l = st.first_layer; l < st.last_layer; ++l) {
      for (int r : layer_users[l]) elsewhere = elsewhere || r != owner;
      for (const auto& pair : lora.layers[l])
        if (pair.a.defined()) ps.push_back(pair.a), ps.push_back(pair.b);
    }
    if (!elsewhere || ps.empty()) continue;
    std::vector<at::Tensor> flat;
    for (const auto& p : ps) flat.push_back(p.detach().reshape(-1));
    at::Tensor all = torch::cat(flat);  // the stage's LoRA weights, one buffer
    LP_TRY(po.processes.group->broadcast(all, owner));
    int64_t off = 0;
    for (auto& p : ps) {
      p.detach().copy_(all.slice(0, off, off + p.numel()).view(p.sizes()));
      off += p.numel();
    }
  }
  return ok_status();
}

// Every stage's LoRA weights and AdamW state from the rank that steps it to all ranks (each walks
// the stages in the same order): afterwards any rank can validate, sample or checkpoint the run.
status pipeline_executor::impl::gather_state(int from_rank) {
  torch::NoGradGuard ng;
  for (auto& [stage, o] : optim) {
    int owner = from_rank;
    for (int32_t d = 0; from_rank < 0 && d < static_cast<int32_t>(prog.devices.size()); ++d)
      for (const auto& in : prog.devices[d])
        if (in.kind == op::optimizer_step && in.stage == stage) owner = po.processes.rank_of[static_cast<size_t>(d)];
    std::vector<at::Tensor> parts;
    for (auto* v : {&stage_params[stage], &o->exp_avg(), &o->exp_avg_sq()})
      for (const auto& t : *v) parts.push_back(t.detach().reshape(-1).to(torch::kDouble));
    parts.push_back(torch::full({1}, static_cast<double>(o->steps_taken()), torch::kDouble));
    at::Tensor all = torch::cat(parts);  // f64: weights, moments, step count
    LP_TRY(po.processes.group->broadcast(all, owner));
    if (owner == po.processes.group->rank()) continue;
    int64_t off = 0;
    for (auto* v : {&stage_params[stage], &o->exp_avg(), &o->exp_avg_sq()})
      for (auto& t : *v) {
        t.detach().copy_(all.slice(0, off, off + t.numel()).view(t.sizes()));
        off += t.numel();
      }
    o->set_steps_taken(static_cast<int64_t>(all[off].item<double>()));
  }
  return ok_status();
}

status pipeline_executor::gather_state(int from_rank) {
  if (d_->po.processes.group == nullptr) return ok_status();
  return d_->gather_state(from_rank);
}

void pipeline_executor::release_weights() {
  for (auto* d : d_->devs)
    if (d != nullptr) d->weight_upload().submit(0, [] {}).wait();
  for (auto& m : d_->on_device) m.clear();
}

pipeline_executor::~pipeline_executor() {
  if (d_->pending.valid()) d_->pending.wait();
  // Copies still in flight reference this executor (deliveries into its mailbox): every download
  // (which may queue an upload elsewhere), then every upload and weight upload.
  for (auto* d : d_->devs)
    if (d != nullptr) d->download().submit(0, [] {}).wait();
  for (auto* d : d_->devs)
    if (d != nullptr) {
      d->upload().submit(0, [] {}).wait();
      d->weight_upload().submit(0, [] {}).wait();
    }
}

result<pipeline_step_result> pipeline_executor::step(const std::vector<micro_batch>& mbs, double lr, double max_grad_norm,
                                                     bool apply_optimizer) {
  auto& s = *d_;
  if (static_cast<int32_t>(mbs.size()) != prog_.micro_batches)
    return make_error("pipeline: {} micro-batches given, the program expects {}", mbs.size(), prog_.micro_batches);
  if (s.devs.size() != prog_.devices.size())
    return make_error("pipeline: program for {} devices, {} given", prog_.devices.size(), s.devs.size());
  const auto& pp = s.po.processes;
  if (pp.group != nullptr) {
    if (pp.rank_of.size() != s.devs.size()) return make_error("pipeline: a rank for each of the {} devices is needed", s.devs.size());
    if (s.po.async_optimizer) return make_error("pipeline: the asynchronous optimizer does not run over several processes");
  }
  for (size_t d = 0; d < s.devs.size(); ++d)
    if ((s.devs[d] == nullptr) == s.local(static_cast<int32_t>(d)))
      return make_error("pipeline: device {} is {} but {}", d, s.devs[d] == nullptr ? "missing" : "given",
                        s.local(static_cast<int32_t>(d)) ? "runs in this process" : "runs in another process");
  LP_TRY(s.check_memory(mbs));
  // The weight arenas of the memory plan, reserved before anything else is allocated.
  for (size_t d = 0; d < s.devs.size(); ++d) {
    if (s.devs[d] == nullptr) continue;
    try {
      LP_TRY(s.devs[d]->reserve_weight_arena(s.weight_plan[d].bytes));
    } catch (const std::exception& e) {
      return make_error("{}: weight arena of {} bytes: {}", s.devs[d]->name(), s.weight_plan[d].bytes, e.what());
    }
  }
  if (s.cancel_between_steps_only() && cancel_requested(s.po.cancel)) return make_error("cancelled");
  {
    std::lock_guard lock(s.mu);
    ++s.generation;
    s.mailbox.clear();
  }
  s.host.clear();
  s.backward_left = s.total_backward;
  s.failed = false;
  s.cancelled = false;
  s.error.clear();
  s.norm_done = false;
  s.norm_ready = false;
  s.grad_norm = 0;
  s.loss_sum = 0;
  s.trace.clear();
  s.last_logits.clear();
  for (auto* d : s.devs) {
    if (d == nullptr) continue;
    d->arena().reset_peak();
    if (auto* wa = d->weight_arena()) wa->reset_peak();
  }
  const int main_threads = at::get_num_threads();
  s.t0 = clock_type::now();
  {
    std::lock_guard lock(s.mu);
    s.pc.assign(s.devs.size(), -1);
    s.computes_started.assign(s.devs.size(), 0);
    s.gated.assign(s.devs.size(), {});
    s.workers_left = 0;
    for (int32_t d = 0; d < static_cast<int32_t>(s.devs.size()); ++d)
      if (s.devs[d] != nullptr) s.pc[d] = 0, ++s.workers_left;
  }
  std::vector<std::thread> threads;
  for (int32_t d = 0; d < static_cast<int32_t>(s.devs.size()); ++d)
    if (s.devs[d] != nullptr) threads.emplace_back([&, d] {
      try {
        s.worker(d, mbs, lr, max_grad_norm, apply_optimizer);
      } catch (const aborted&) {
      } catch (const std::exception& e) {
        s.fail_on(*s.devs[d], e);
      }
      std::lock_guard lock(s.mu);
      s.pc[d] = -1;
      --s.workers_left;
      s.cv.notify_all();
    });
  s.watch_workers();
  for (auto& t : threads) t.join();
  // Let in-flight activation copies finish before their memory and tensors go away. Weight uploads
  // may continue: the cross-iteration prefetch overlaps whatever runs between steps, and the next
  // step's PREFETCH finds the stage resident (waiting for the upload only if it is still running).
  // Every download first (a host-staged download queues the upload on the receiving device), then
  // every upload.
  for (auto* d : s.devs)
    if (d != nullptr) d->download().submit(0, [] {}).wait();
  for (auto* d : s.devs)
    if (d != nullptr) d->upload().submit(0, [] {}).wait();
  if (pp.group != nullptr && !s.failed)  // every tensor sent to another rank has arrived there
    if (auto st = s.finish_process_sends(); !st.ok()) s.fail(st.message());
  if (pp.group != nullptr && !s.failed && s.local_stages.empty()) {
    // No OPTIMIZER_STEP here (round-robin can leave a device without one): this rank still takes
    // part in the norm's all-reduce, adding nothing, so every rank's collectives line up.
    try {
      s.grad_norm = s.global_clip(apply_optimizer ? max_grad_norm : 0.0);
    } catch (const std::exception& e) {
      s.fail(e.what());
    }
  }
  s.process_sends.clear();
  at::set_num_threads(main_threads);
  pipeline_step_result r;
  r.seconds = std::chrono::duration<double>(clock_type::now() - s.t0).count();
  s.mailbox.clear();
  s.host.clear();
  {
    std::lock_guard lock(s.mu);
    s.gated.assign(s.devs.size(), {});  // after a failure: messages whose receiver never got there
  }
  if (s.failed) {
    for (auto* d : s.devs)
      if (d != nullptr) d->weight_upload().submit(0, [] {}).wait();
    for (auto& m : s.on_device) m.clear();
    for (auto& p : s.lora.parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
    if (s.cancelled) return make_error("cancelled");
    return make_error("pipeline step failed: {}", s.error);
  }
  if (pp.group != nullptr && apply_optimizer) LP_TRY(s.share_updated_lora());
  if (pp.group != nullptr) {  // the head's loss, from whichever rank runs it
    at::Tensor loss = torch::full({1}, s.loss_sum, torch::kDouble);  // f64 [1]
    LP_TRY(pp.group->all_reduce_sum(loss));
    s.loss_sum = loss.item<double>();
  }
  r.loss = s.loss_sum / prog_.micro_batches;
  r.grad_norm = s.grad_norm;
  if (s.po.async_optimizer && apply_optimizer) {
    // Install the previous step's result (weights for the next iteration: one step stale), then
    // hand this iteration's gradients to a background AdamW step on the master weights.
    auto params = s.lora.parameters();
    torch::NoGradGuard ng;
    if (s.master.empty()) {
      for (const auto& p : params) s.master.push_back(p.detach().clone());
      s.master_opt = std::make_unique<adamw>(s.master, s.opt_cfg);
    }
    r.grad_norm = 0;  // the norm of the previous iteration's gradients (known once its step is done)
    if (s.pending.valid()) {
      r.grad_norm = s.pending.get();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(s.master[i]);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      s.master[i].mutable_grad() = params[i].grad().clone();
      params[i].mutable_grad().zero_();
    }
    s.pending = std::async(std::launch::async, [&s, lr, max_grad_norm] {
      at::set_num_threads(1);
      const double norm = clip_grad_norm(s.master, max_grad_norm);
      s.master_opt->step(lr);
      return norm;
    });
  }
  for (auto* d : s.devs) {
    if (d == nullptr) {  // measured in its own process
      r.peak_bytes.push_back(0), r.weight_arena_bytes.push_back(0), r.weight_arena_peak.push_back(0);
      continue;
    }
    r.peak_bytes.push_back(d->arena().peak());
    r.weight_arena_bytes.push_back(d->weight_arena() != nullptr ? d->weight_arena()->capacity() : 0);
    r.weight_arena_peak.push_back(d->weight_arena() != nullptr ? d->weight_arena()->peak() : 0);
  }
  r.trace = s.trace;
  for (auto& [m, l] : s.last_logits) r.last_logits.push_back(l);
  return r;
}

}  // namespace lorapipe
