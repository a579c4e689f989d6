// The executor's workers: one thread per device walks its instruction list; execute() is a switch
// over the instruction kinds (no default:) calling one method per kind, in the manner of
// DeepSpeed's _exec_* table. See pipeline_executor.h for what the instructions mean.
#include "core/pipeline/pipeline_impl.h"

namespace lorapipe {
using impl = pipeline_executor::impl;

void impl::worker(int32_t d, const std::vector<micro_batch>& mbs, double lr, double max_norm, bool apply) {
  compute_device& dev = *devs[d];
  dev.enter_compute_thread();
  worker_ctx c(d, dev, mbs, lr, max_norm, apply);
  load_device_lora(c);
  int64_t i = 0;
  for (const auto& in : prog.devices[d]) {
    {
      std::lock_guard lock(mu);
      pc[d] = i++;
      ++progress;
    }
    if (po.probe) po.probe("pipeline:instruction");
    if (cancel_requested(po.cancel) && !cancel_between_steps_only() && cancel_before_update()) throw aborted{};
    execute(c, in);
    if (po.processes.group != nullptr)  // what the other ranks' errors name should this process die
      po.processes.group->report_done(d, fmt::format("{} completed {} ({} of {})", dev.name(), instr_to_text(in), i, prog.devices[d].size()));
  }
  if (!c.stash.empty()) throw lorapipe_error(fmt::format("{}: {} graphs left without backward", dev.name(), c.stash.size()));
}

// A stop request ends the step as a failure named "cancelled", but only while no stage has
// started its optimizer update (the global norm is taken first): the LoRA state stays that of
// the last whole step.
bool impl::cancel_before_update() {
  std::lock_guard lock(mu);
  if (norm_done || failed) return failed;
  failed = cancelled = true;
  error = "cancelled";
  cv.notify_all();
  return true;
}

void impl::execute(worker_ctx& c, const instr& in) {
  switch (in.kind) {
    case op::load_micro_batch: return;  // micro-batches are host tensors; the stage reads tokens/labels directly
    case op::prefetch_weights: return exec_prefetch(c, in);
    case op::release_weights: return exec_release(c, in);
    case op::forward: return exec_forward(c, in);
    case op::recompute: return exec_recompute(c, in);
    case op::backward: return po.layer_recompute && recomputed.count(in.stage) ? exec_backward_by_layer(c, in) : exec_backward(c, in);
    case op::send_act:
    case op::send_grad: return exec_send(c, in);
    case op::recv_act:
    case op::recv_grad: return exec_recv(c, in);
    case op::offload_act: return exec_offload(c, in);
    case op::reload_act: return exec_reload(c, in);
    case op::optimizer_step: return exec_optimizer_step(c, in);
  }
}

// LoRA weights on this device once per step, not per micro-batch and layer: on CPU devices they
// are the host tensors themselves (to() aliases); on GPUs copies whose gradients flow back to the
// host leaves the optimizers own. Likewise the RoPE tables.
void impl::load_device_lora(worker_ctx& c) {
  c.lora.cfg = lora.cfg;
  c.lora.layers.resize(lora.layers.size());
  for (const auto& in : prog.devices[c.d])
    if (in.kind == op::forward || in.kind == op::recompute || in.kind == op::backward)
      for (int32_t l = prog.stages[in.stage].first_layer; l < prog.stages[in.stage].last_layer; ++l)
        for (int i = 0; i < num_lora_targets; ++i) {
          const auto& p = lora.layers[l][i];
          if (p.a.defined() && !c.lora.layers[l][i].a.defined())
            c.lora.layers[l][i] = {p.a.to(c.tdev, w.embed.scalar_type()), p.b.to(c.tdev, w.embed.scalar_type())};
        }
  c.rope = w.rope.to(c.tdev);
  size_t bytes = 0;
  for (const auto& layer : c.lora.layers)
    for (const auto& pair : layer) bytes += nbytes(pair.a) + nbytes(pair.b);
  for (const auto* t : {&c.rope.full, &c.rope.local}) bytes += nbytes(t->cos) + nbytes(t->sin) + nbytes(t->inv_freq);
  c.held.push_back(std::make_shared<arena_block>(c.dev.arena(), bytes));
}

const micro_batch& impl::mb(worker_ctx& c, int32_t m) {
  auto it = c.batch.find(m);
  if (it == c.batch.end()) {
    const auto& h = c.mbs[m];
    it = c.batch.emplace(m, micro_batch{h.tokens.to(c.tdev), h.labels.defined() ? h.labels.to(c.tdev) : h.labels, h.loss_scale,
                                        h.dropout_seed, h.last_logits})
             .first;
    c.held.push_back(std::make_shared<arena_block>(c.dev.arena(), nbytes(it->second.tokens) + nbytes(it->second.labels)));
  }
  return it->second;
}

layer_context impl::context(worker_ctx& c, int32_t m) const {
  // A forward-only program (evaluation) has no BACKWARD: no LoRA dropout.
  return layer_context{w.cfg, c.rope, &c.lora, !backwarded.empty(), c.mbs[m].dropout_seed};
}

at::Tensor impl::take(worker_ctx& c, char k, int32_t b, int32_t m) {
  auto it = c.local.find({k, b, m});
  if (it == c.local.end()) throw lorapipe_error(fmt::format("{}: missing {} at layer {} of micro-batch {}", c.dev.name(), k, b, m));
  const auto w0 = clock_type::now();
  auto t = it->second.get();
  c.waited_s += std::chrono::duration<double>(clock_type::now() - w0).count();
  c.local.erase(it);
  return t;
}

void impl::keep(worker_ctx& c, char k, int32_t b, int32_t m, const at::Tensor& t) {
  c.local[{k, b, m}] = async_tensor::ready(t, std::make_shared<arena_block>(c.dev.arena(), nbytes(t)));
}

const stage_weights& impl::stage_w(worker_ctx& c, int32_t s) {
  auto& weights = on_device[c.d];
  auto it = weights.find(s);
  if (it == weights.end()) throw lorapipe_error(fmt::format("{}: stage {} computes without PREFETCH_WEIGHTS", c.dev.name(), s));
  const auto w0 = clock_type::now();
  it->second.ready.get();
  c.waited_s += std::chrono::duration<double>(clock_type::now() - w0).count();
  return *it->second.weights;
}

// A compute instruction: opens the gate of messages waiting to be uploaded here, runs, is traced
// (without the time it waited for its inputs), then waits for the outgoing copies issued before it
// began.
void impl::timed(worker_ctx& c, const instr& in, const std::function<void()>& fn) {
  const auto before = std::move(c.outgoing);
  c.outgoing.clear();
  std::vector<std::function<void()>> open;
  {
    std::lock_guard lock(mu);
    const int64_t n = ++computes_started[c.d];
    auto& waiting = gated[c.d];
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (it->after > n) {
        ++it;
        continue;
      }
      open.push_back(std::move(it->submit));
      it = waiting.erase(it);
    }
  }
  for (auto& submit : open) submit();
  c.waited_s = 0;
  const auto a = clock_type::now();
  fn();
  c.dev.pace_compute(std::chrono::duration<double>(clock_type::now() - a).count() - c.waited_s);
  const auto b = clock_type::now();
  {
    // The interval starts once the inputs were there: its length is the compute alone.
    std::lock_guard lock(mu);
    trace.push_back({c.d, in, std::chrono::duration<double>(a - t0).count() + c.waited_s, std::chrono::duration<double>(b - t0).count()});
  }
  for (const auto& f : before) f.wait();  // a failed copy reports through fail_on
}

void impl::upload_when_open(int32_t dest, int64_t after, std::function<void()> submit) {
  {
    std::lock_guard lock(mu);
    if (computes_started[dest] < after && !failed) {
      gated[dest].push_back({after, std::move(submit)});
      return;
    }
  }
  submit();
}

// Arena bytes an autograd graph over `layers` layers holds while it waits for its backward.
block_ptr impl::stash_block(worker_ctx& c, int32_t layers) {
  const double per_layer = stash_bytes_per_layer(w.cfg, c.tokens_per_micro, c.seq_len, w.embed.element_size(),
                                                 graph_targets_of(lora.cfg.targets));
  return std::make_shared<arena_block>(c.dev.arena(), static_cast<size_t>(per_layer * std::max(1, layers)));
}

// The head's chunked loss working set (f32 logits, softmax, gradient of one chunk) while it computes.
block_ptr impl::head_block(worker_ctx& c, const stage_def& st) {
  if (!st.has_head) return nullptr;
  return std::make_shared<arena_block>(c.dev.arena(), static_cast<size_t>(head_working_bytes(w.cfg, c.tokens_per_micro)));
}

void impl::backward_done() {
  std::lock_guard lock(mu);
  --backward_left;
  cv.notify_all();
}

// Placement now, in program order (the memory plan sized the arena for exactly this sequence);
// the copy runs on the weight-upload engine.
void impl::exec_prefetch(worker_ctx& c, const instr& in) {
  auto& weights = on_device[c.d];
  const int32_t s = in.stage;
  if (weights.count(s)) return;  // still resident from an earlier step
  const auto& st = prog.stages[s];
  auto host_list = stage_host_weights(st);
  auto place = c.dev.place_weights(host_list, weight_plan[c.d].slot_bytes);
  if (!place) throw out_of_memory_error(place.message());
  auto sw = std::make_shared<stage_weights>();
  compute_device* devp = &c.dev;
  const size_t bytes = place->bytes;
  weights[s] = {c.dev.weight_upload().submit(bytes, [sw, st, devp, p = *place, host_list, tied = w.cfg.tie_word_embeddings,
                                                      specs = layer_tensor_specs(w.cfg)] {
                  auto t = devp->upload_weights(p, host_list);
                  size_t i = 0;
                  for (int32_t l = st.first_layer; l < st.last_layer; ++l) {
                    layer_weights lw;
                    for (const auto& spec : specs) lw[spec.slot] = t[i++];
                    sw->layers.push_back(std::move(lw));
                  }
                  if (st.has_embed) sw->embed = t[i++];
                  if (st.has_head) {
                    sw->final_norm = t[i++];
                    sw->lm_head = st.has_embed && tied ? sw->embed : t[i++];
                  }
                }),
                sw, place->block};
}

void impl::exec_release(worker_ctx& c, const instr& in) {
  auto& weights = on_device[c.d];
  auto it = weights.find(in.stage);
  if (it == weights.end()) return;
  it->second.ready.get();
  std::weak_ptr<void> block = it->second.block;
  weights.erase(it);
  // The memory plan reuses this range for the next PREFETCH: nothing may still view it.
  if (!block.expired())
    throw lorapipe_error(fmt::format("{}: stage {}'s weights are still in use at RELEASE_WEIGHTS", c.dev.name(), in.stage));
}

void impl::exec_forward(worker_ctx& c, const instr& in) {
  timed(c, in, [&] {
    const int32_t s = in.stage, m = in.micro;
    const auto& st = prog.stages[s];
    const auto& sw = stage_w(c, s);
    // The graph is kept only when this stage's backward uses it directly (no recompute).
    const bool keep_graph = backwarded.count(s) && !recomputed.count(s);
    at::Tensor x = st.has_embed ? mb(c, m).tokens : take(c, 'a', st.first_layer, m);
    std::map<int32_t, at::Tensor> ckpt;
    double loss = 0;
    auto head = head_block(c, st);
    if (keep_graph) {
      if (!st.has_embed) x = x.detach().requires_grad_(true);
      auto out = run_stage(context(c, m), sw, st, s, x, mb(c, m), &ckpt, &loss);
      head.reset();
      auto mem = stash_block(c, st.last_layer - st.first_layer);
      if (!st.has_head) keep(c, 'a', st.last_layer, m, out.detach());
      c.stash[{s, m}] = {st.has_embed ? at::Tensor() : x, out, mem};
    } else {
      torch::NoGradGuard ng;
      auto out = run_stage(context(c, m), sw, st, s, x, mb(c, m), &ckpt, &loss);
      head.reset();
      if (!st.has_head) keep(c, 'a', st.last_layer, m, out);
      if (st.has_head && mb(c, m).last_logits) {
        std::lock_guard lock(mu);
        last_logits[m] = out;
      }
    }
    for (auto& [b, t] : ckpt) keep(c, 'c', b, m, t);
    if (st.has_head) {
      std::lock_guard lock(mu);
      loss_sum += loss;
    }
  });
}

void impl::exec_recompute(worker_ctx& c, const instr& in) {
  if (po.layer_recompute) return;  // BACKWARD recomputes one layer at a time
  timed(c, in, [&] {
    const int32_t s = in.stage, m = in.micro;
    const auto& st = prog.stages[s];
    const auto& sw = stage_w(c, s);
    at::Tensor x = take(c, 'c', st.first_layer, m);
    if (!st.has_embed) x = x.detach().requires_grad_(true);
    double loss = 0;
    auto head = head_block(c, st);
    auto out = run_stage(context(c, m), sw, st, s, x, mb(c, m), nullptr, st.has_head ? &loss : nullptr);
    head.reset();
    c.stash[{s, m}] = {st.has_embed ? at::Tensor() : x, out, stash_block(c, st.last_layer - st.first_layer)};
  });
}

// Per-layer recompute: every layer input was checkpointed; recompute and back-propagate one layer
// after another, from the last.
void impl::exec_backward_by_layer(worker_ctx& c, const instr& in) {
  timed(c, in, [&] {
    const int32_t s = in.stage, m = in.micro;
    const auto& st = prog.stages[s];
    const auto& sw = stage_w(c, s);
    const auto ctx = context(c, m);
    at::Tensor grad = st.has_head ? at::Tensor() : take(c, 'g', st.last_layer, m);
    auto head = head_block(c, st);
    for (int32_t l = st.last_layer - 1; l >= st.first_layer; --l) {
      at::Tensor x = take(c, 'c', l, m), leaf;
      if (l == 0) {
        torch::NoGradGuard ng;
        x = embed_with(w.cfg, sw.embed, x);  // checkpoint 0 holds token ids; the embedding is frozen
      } else {
        leaf = x.detach().requires_grad_(true);
        x = leaf;
      }
      auto mem = stash_block(c, 1);
      auto out = decoder_layer(ctx, l, sw.layers[l - st.first_layer], x, 0, nullptr);
      if (st.has_head && l == st.last_layer - 1) {
        head_loss(sw, out, mb(c, m), nullptr).backward();
      } else {
        out.backward(grad);
      }
      if (leaf.defined()) grad = leaf.grad();
    }
    head.reset();
    if (!st.has_embed) keep(c, 'g', st.first_layer, m, grad);
    backward_done();
  });
}

void impl::exec_backward(worker_ctx& c, const instr& in) {
  timed(c, in, [&] {
    const int32_t s = in.stage, m = in.micro;
    const auto& st = prog.stages[s];
    stage_w(c, s);
    auto it = c.stash.find({s, m});
    if (it == c.stash.end()) throw lorapipe_error(fmt::format("{}: backward of stage {} micro-batch {} has no graph", c.dev.name(), s, m));
    auto g = std::move(it->second);
    c.stash.erase(it);
    auto head = head_block(c, st);
    if (st.has_head) g.output.backward();
    else g.output.backward(take(c, 'g', st.last_layer, m));
    // The graph and the head's working set go back before the input gradient is kept (the memory
    // plan frees them first).
    head.reset();
    const at::Tensor grad_in = st.has_embed ? at::Tensor() : g.input.grad();
    g = graph_stash{};
    if (!st.has_embed) keep(c, 'g', st.first_layer, m, grad_in);
    backward_done();
  });
}

void impl::exec_send(worker_ctx& c, const instr& in) {
  const auto msg = message_of(prog, in);
  const char slot = msg.kind == 'A' ? 'a' : 'g';
  auto it = c.local.find({slot, msg.boundary, in.micro});
  if (it == c.local.end()) throw lorapipe_error(fmt::format("{}: nothing to send for {}", c.dev.name(), instr_to_text(in)));
  send(c, msg.kind, msg.boundary, in.micro, in.peer, it->second);
  c.local.erase(it);
}

void impl::exec_recv(worker_ctx& c, const instr& in) {
  const auto msg = message_of(prog, in);
  recv(c, msg.kind, msg.boundary, in.micro, in.peer);
}

// Ships a tensor to another device, then the mailbox. Host-staged: download here into the staging
// pool, then upload there. Peer: one copy driven by this device's download engine. NCCL:
// stream-ordered on this thread; the RECV posts the other end.
void impl::send(worker_ctx& c, char kind, int32_t boundary, int32_t m, int32_t peer, async_tensor t) {
  const size_t bytes = nbytes(t.get());
  compute_device* to = devs[peer];
  compute_device* from = &c.dev;
  const uint64_t gen = [&] {
    std::lock_guard lock(mu);
    return generation;
  }();
  auto deliver = [this, to, bytes, kind, boundary, m, peer, gen](auto&& copy) {
    try {
      auto mem = std::make_shared<arena_block>(to->arena(), bytes);
      auto on_device = async_tensor::ready(copy(), mem);
      std::lock_guard lock(mu);
      if (gen != generation) return;
      mailbox[{kind, boundary, m, peer}] = on_device;
      cv.notify_all();
    } catch (const std::exception& e) {
      fail_on(*to, e);
    }
  };
  const transport_kind link = link_kind(c.d, peer);
  if (link == transport_kind::nccl) {  // also to another process: the link's communicator spans both
    c.dev.nccl_send(peer, t.get());
    return;
  }
  if (crosses_process(c.d, peer)) return send_to_rank(c, t, peer, process_tag(kind, boundary, m));
  if (link == transport_kind::peer) {  // not gated: one copy, driven by the sender
    c.outgoing.push_back(
        c.dev.download().submit(bytes, [t, from, to, deliver] { deliver([&] { return to->copy_from_peer(*from, t.get()); }); }));
    return;
  }
  const int64_t after = recv_gate.at({kind, boundary, m, peer});
  // Nobody waits on these futures: a failing copy must fail the step itself, or the receiver waits forever.
  auto host_copy = std::make_shared<at::Tensor>();
  c.outgoing.push_back(c.dev.download().submit(bytes, [this, t, host_copy, bytes, from, to, deliver, peer, after] {
    try {
      *host_copy = from->copy_out(t.get());
    } catch (const std::exception& e) {
      return fail_on(*from, e);
    }
    upload_when_open(peer, after, [host_copy, to, deliver, bytes] {
      to->upload().submit(bytes, [host_copy, to, deliver] { deliver([&] { return to->copy_in(*host_copy); }); });
    });
  }));
}

// To the rank running device position `peer`: into host memory on this device's download engine,
// then posted (isend); the step's end waits until it has arrived.
void impl::send_to_rank(worker_ctx& c, async_tensor t, int32_t peer, int tag) {
  compute_device* from = &c.dev;
  const int rank = po.processes.rank_of[static_cast<size_t>(peer)];
  c.outgoing.push_back(c.dev.download().submit(nbytes(t.get()), [this, t, from, rank, tag] {
    try {
      auto sent = po.processes.group->isend(from->copy_out(t.get()), rank, tag);
      if (!sent.ok()) return fail(sent.message());
      std::lock_guard lock(mu);
      keep_process_send(std::move(*sent));
    } catch (const std::exception& e) {
      fail_on(*from, e);
    }
  }));
}

void impl::recv(worker_ctx& c, char kind, int32_t boundary, int32_t m, int32_t from) {
  const char slot = kind == 'A' ? 'a' : 'g';
  if (link_kind(from, c.d) == transport_kind::nccl) {  // activations and gradients: [b,T,D] in the compute dtype
    const auto& tok = c.mbs[m].tokens;
    keep(c, slot, boundary, m, c.dev.nccl_recv(from, {tok.size(0), tok.size(1), w.cfg.hidden_size}, w.embed.scalar_type()));
    return;
  }
  if (crosses_process(from, c.d)) {  // through host memory and Gloo
    const auto& tok = c.mbs[m].tokens;
    at::Tensor host = at::empty({tok.size(0), tok.size(1), w.cfg.hidden_size}, w.embed.options().device(at::kCPU));
    if (auto st = po.processes.group->recv(host, po.processes.rank_of[static_cast<size_t>(from)], process_tag(kind, boundary, m)); !st.ok())
      throw lorapipe_error(fmt::format("{}: {} (waiting for {} of boundary {}, micro-batch {})", c.dev.name(), st.message(),
                                       kind == 'A' ? "the activation" : "the gradient", boundary, m));
    keep(c, slot, boundary, m, c.dev.copy_in(host));
    return;
  }
  std::unique_lock lock(mu);
  const auto key = std::make_tuple(kind, boundary, m, c.d);
  wait(lock, [&] { return mailbox.count(key) > 0; });
  c.local[{slot, boundary, m}] = mailbox[key];  // its arena block moves along
  mailbox.erase(key);
}

void impl::exec_offload(worker_ctx& c, const instr& in) {
  for (int32_t b : ckpt_bounds(in.stage)) {
    auto it = c.local.find({'c', b, in.micro});
    if (it == c.local.end()) throw lorapipe_error(fmt::format("{}: no checkpoint at layer {} for {}", c.dev.name(), b, instr_to_text(in)));
    async_tensor src = it->second;
    c.local.erase(it);
    compute_device* devp = &c.dev;
    if (auto r = ckpt_reloaded_on.find({b, in.micro}); r != ckpt_reloaded_on.end() && crosses_process(c.d, r->second)) {
      if (b == 0) continue;  // the token ids: the other rank has the micro-batch too
      send_to_rank(c, src, r->second, process_tag('C', b, in.micro));
      continue;
    }
    async_tensor dst;
    dst.done = c.dev.download().submit(nbytes(src.get()), [src, devp, v = dst.value] { *v = devp->copy_out(src.get()); });
    c.outgoing.push_back(dst.done);
    std::lock_guard lock(mu);
    host[{b, in.micro}] = dst;
    cv.notify_all();
  }
}

void impl::exec_reload(worker_ctx& c, const instr& in) {
  for (int32_t b : ckpt_bounds(in.stage)) {
    async_tensor src;
    const auto o = ckpt_offloaded_on.find({b, in.micro});
    const bool remote = o != ckpt_offloaded_on.end() && crosses_process(o->second, c.d);
    if (remote && b == 0) {
      *src.value = c.mbs[in.micro].tokens;  // layer 0's input is the token ids, which this rank has
    } else if (remote) {
      const auto& tok = c.mbs[in.micro].tokens;  // a layer input: [b,T,D] in the compute dtype
      *src.value = at::empty({tok.size(0), tok.size(1), w.cfg.hidden_size}, w.embed.options().device(at::kCPU));
      const int rank = po.processes.rank_of[static_cast<size_t>(o->second)];
      if (auto st = po.processes.group->recv(*src.value, rank, process_tag('C', b, in.micro)); !st.ok())
        throw lorapipe_error(fmt::format("{}: {} (waiting for the checkpoint at layer {}, micro-batch {})", c.dev.name(), st.message(), b, in.micro));
    } else {
      std::unique_lock lock(mu);
      const auto key = std::make_pair(b, in.micro);
      wait(lock, [&] { return host.count(key) > 0; });
      src = host[key];
      host.erase(key);
    }
    src.get();  // (host copy finished)
    async_tensor dst;
    dst.mem = std::make_shared<arena_block>(c.dev.arena(), nbytes(*src.value));
    compute_device* devp = &c.dev;
    dst.done = c.dev.upload().submit(nbytes(*src.value), [src, devp, v = dst.value] { *v = devp->copy_in(src.get()); });
    c.local[{'c', b, in.micro}] = dst;
  }
}

// The norm over the stages of every rank: each sums the squares of its own stages' gradients, one
// all-reduce adds them up; every rank then scales its gradients by the same factor.
double impl::global_clip(double max_norm) {
  torch::NoGradGuard ng;
  std::vector<at::Tensor> grads;
  for (const auto& [stage, ps] : stage_params)
    if (local_stages.count(stage) > 0)
      for (const auto& p : ps)
        if (p.grad().defined()) grads.push_back(p.grad());
  double local_sq = 0;
  for (const auto& g : grads) local_sq += g.to(torch::kDouble).pow(2).sum().item<double>();
  at::Tensor sq = torch::full({1}, local_sq, torch::kDouble);  // f64 [1]
  if (auto st = po.processes.group->all_reduce_sum(sq); !st.ok()) throw lorapipe_error(st.message());
  const double norm = std::sqrt(sq.item<double>());
  if (max_norm > 0 && norm > max_norm && !grads.empty()) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  return norm;
}

// Holds a send to another rank until it is received; sends already received are dropped with their
// host copies (pinned on GPUs) rather than kept to the end of the step. Under mu.
void impl::keep_process_send(process_group::pending_send s) {
  std::erase_if(process_sends, [](const process_group::pending_send& p) { return p.done(); });
  process_sends.push_back(std::move(s));
}

// Waits until every tensor sent to another rank this step has been received there.
status impl::finish_process_sends() {
  std::vector<process_group::pending_send> sends;
  {
    std::lock_guard lock(mu);
    sends.swap(process_sends);
  }
  for (auto& s : sends) LP_TRY(s.wait());
  return ok_status();
}

void impl::exec_optimizer_step(worker_ctx& c, const instr& in) {
  std::unique_lock lock(mu);
  wait(lock, [&] { return backward_left == 0; });
  if (po.async_optimizer) return;  // stepped on master weights after the iteration (one step stale)
  if (!norm_done) {  // global clip over every stage's LoRA gradients, once
    norm_done = true;  // (no stop request is taken from here on)
    if (po.processes.group != nullptr) {
      // Over every rank, without the lock: other workers here may still have gradients to send.
      lock.unlock();
      const double n = global_clip(c.apply ? c.max_norm : 0.0);
      lock.lock();
      grad_norm = n;
    } else {
      grad_norm = clip_grad_norm(lora.parameters(), c.apply ? c.max_norm : 0.0);
    }
    norm_ready = true;
    cv.notify_all();
  }
  wait(lock, [&] { return norm_ready; });
  lock.unlock();
  if (c.apply) {
    optim.at(in.stage)->step(c.lr);
    optim.at(in.stage)->zero_grad();
  }
}

}  // namespace lorapipe
