// Pipeline executor: see pipeline_executor.h.
#include "core/pipeline_executor.h"

#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include <torch/torch.h>

#include "core/errors.h"
#include "core/schedule_sim.h"

namespace lorapipe {
namespace {

using clock_type = std::chrono::steady_clock;

// Memory held in a device arena for as long as the owning tensor lives (RAII).
struct arena_block {
  memory_arena* arena;
  size_t offset;
  arena_block(memory_arena& a, size_t bytes) : arena(&a) {
    auto r = a.allocate(bytes);
    if (!r) throw out_of_memory_error(r.message());
    offset = *r;
  }
  ~arena_block() { arena->release(offset); }
  arena_block(const arena_block&) = delete;
  arena_block& operator=(const arena_block&) = delete;
};
using block_ptr = std::shared_ptr<arena_block>;

size_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

// A tensor that may still be in flight on a copy engine.
struct async_tensor {
  std::shared_future<void> done;
  std::shared_ptr<at::Tensor> value = std::make_shared<at::Tensor>();
  block_ptr mem;
  at::Tensor get() const {
    if (done.valid()) done.get();
    return *value;
  }
  static async_tensor ready(at::Tensor t, block_ptr m) {
    async_tensor a;
    *a.value = std::move(t);
    a.mem = std::move(m);
    return a;
  }
};

// Frozen weights of one stage on one device.
struct stage_weights {
  std::vector<layer_weights> layers;
  at::Tensor embed, final_norm, lm_head;
};

struct graph_stash {
  at::Tensor input;   // leaf with requires_grad (undefined for the embedding stage)
  at::Tensor output;  // hidden state [b,T,D], or the scaled loss for the head stage
  block_ptr mem;
};

struct aborted {};

}  // namespace

double stash_bytes_per_layer(const llama_config& c, int64_t tokens, size_t elem_bytes) {
  const double kv = static_cast<double>(c.num_kv_heads * c.head_dim), q = static_cast<double>(c.num_heads * c.head_dim);
  return static_cast<double>(tokens) * elem_bytes * (7.0 * c.hidden_size + 2 * q + 2 * kv + 3.0 * c.intermediate_size);
}

struct pipeline_executor::impl {
  const llama_weights& w;
  lora_adapters& lora;
  const program& prog;
  pipeline_options po;
  adamw_config opt_cfg;
  // Async optimizer: master weights, their optimizer, and the step in flight.
  std::vector<at::Tensor> master;
  std::unique_ptr<adamw> master_opt;
  std::future<double> pending;
  std::vector<compute_device*> devs;
  std::map<int32_t, std::unique_ptr<adamw>> optim;           // per stage that steps
  std::map<int32_t, std::vector<at::Tensor>> stage_params;   // LoRA parameters per stepping stage
  std::set<int32_t> recomputed;                              // stages with a RECOMPUTE instruction
  std::set<int32_t> backwarded;                              // stages with a BACKWARD instruction
  std::map<int32_t, std::set<int32_t>> checkpoints;          // forward stage -> boundaries it saves
  int32_t total_backward = 0;
  // Frozen weights on each device; they persist across steps until RELEASE_WEIGHTS (resident mode).
  struct resident_weights {
    std::shared_future<void> ready;
    std::shared_ptr<stage_weights> weights;
    std::shared_ptr<void> block;  // the stage's block in the device's weight arena
  };
  std::vector<weight_arena_plan> weight_plan;  // per device, from the program (memory plan)
  std::vector<std::map<int32_t, resident_weights>> on_device;

  // Per-step shared state.
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::tuple<char, int32_t, int32_t, int32_t>, async_tensor> mailbox;  // (A|G, boundary, micro, dest)
  std::map<std::pair<int32_t, int32_t>, async_tensor> host;                    // offloaded checkpoints
  int32_t backward_left = 0;
  bool failed = false;
  std::string error;
  bool norm_done = false;
  double grad_norm = 0, loss_sum = 0;
  std::vector<instr_timing> trace;
  clock_type::time_point t0;

  impl(const llama_weights& w_, lora_adapters& l, const program& p, std::vector<compute_device*> d, adamw_config opt,
       pipeline_options o)
      : w(w_), lora(l), prog(p), po(o), opt_cfg(opt), devs(std::move(d)), on_device(devs.size()) {
    for (const auto& list : prog.devices)
      for (const auto& in : list) {
        if (in.kind == op::recompute) recomputed.insert(in.stage);
        if (in.kind == op::backward) {
          ++total_backward;
          backwarded.insert(in.stage);
        }
      }
    for (const auto& list : prog.devices)
      for (const auto& in : list)
        if (in.kind == op::forward)
          for (int32_t x : recomputed) {
            const auto& sx = prog.stages[x];
            const int32_t b_end = po.layer_recompute ? sx.last_layer : sx.first_layer + 1;
            for (int32_t b = sx.first_layer; b < b_end; ++b)
              if (b >= prog.stages[in.stage].first_layer && b < std::max(prog.stages[in.stage].last_layer, prog.stages[in.stage].first_layer + 1))
                checkpoints[in.stage].insert(b);
          }
    for (const auto& list : prog.devices)
      for (const auto& in : list)
        if (in.kind == op::optimizer_step) {
          std::vector<at::Tensor> ps;
          const auto& st = prog.stages[in.stage];
          for (int32_t l = st.first_layer; l < st.last_layer; ++l)
            for (const auto& pair : lora.layers[l])
              if (pair.a.defined()) {
                ps.push_back(pair.a);
                ps.push_back(pair.b);
              }
          stage_params[in.stage] = ps;
          optim[in.stage] = std::make_unique<adamw>(ps, opt);
        }
    std::vector<size_t> stage_bytes;
    for (const auto& st : prog.stages) {
      std::vector<size_t> sizes;
      for (const auto& t : stage_host_weights(st)) sizes.push_back(nbytes(t));
      stage_bytes.push_back(layout_block(sizes, weight_alignment).bytes);
    }
    weight_plan = plan_weight_arenas(prog, stage_bytes, weight_alignment);
  }

  transport_kind link_kind(int32_t from, int32_t to) const {
    for (const auto& l : po.transports)
      if (l.from == from && l.to == to) return l.kind;
    return transport_kind::host_staged;
  }

  // The frozen host tensors of a stage, in the order they are laid out in its weight block.
  std::vector<at::Tensor> stage_host_weights(const stage_def& st) const {
    std::vector<at::Tensor> out;
    for (int32_t l = st.first_layer; l < st.last_layer; ++l) {
      out.push_back(w.layers[l].input_norm);
      out.push_back(w.layers[l].post_norm);
      for (const auto& p : w.layers[l].proj) out.push_back(p);
    }
    if (st.has_embed) out.push_back(w.embed);
    if (st.has_head) {
      out.push_back(w.final_norm);
      if (!(st.has_embed && w.cfg.tie_word_embeddings)) out.push_back(w.lm_head);
    }
    return out;
  }

  void fail(const std::string& msg) {
    std::lock_guard lock(mu);
    if (!failed) {
      failed = true;
      error = msg;
    }
    cv.notify_all();
  }
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred pred) {
    cv.wait(lock, [&] { return failed || pred(); });
    if (failed) throw aborted{};
  }

  // Runs the layers of a stage from `x` (embedding stage: token ids); saves checkpoints at the
  // requested boundaries into `ckpt` and returns the hidden state (or the loss for the head stage).
  at::Tensor run_stage(const layer_context& ctx, const stage_weights& sw, const stage_def& st, int32_t stage, const at::Tensor& input,
                       const micro_batch& mb, std::map<int32_t, at::Tensor>* ckpt, double* loss_out) {
    at::Tensor x = input;
    if (st.has_embed) {
      if (ckpt != nullptr && checkpoints[stage].count(0)) (*ckpt)[0] = mb.tokens;
      x = torch::embedding(sw.embed, input);  // [b,T,D]
    }
    for (int32_t l = st.first_layer; l < st.last_layer; ++l) {
      if (ckpt != nullptr && l > 0 && checkpoints[stage].count(l)) (*ckpt)[l] = x.detach();
      x = decoder_layer(ctx, l, sw.layers[l - st.first_layer], x, 0, nullptr);
    }
    if (!st.has_head) return x;
    auto logits = head_logits(w.cfg, sw.final_norm, sw.lm_head, x);
    if (mb.loss_scale > 0) {
      auto loss = causal_lm_loss_sum(logits, mb.labels) * mb.loss_scale;
      if (loss_out != nullptr) *loss_out = loss.item<double>() * prog.micro_batches;  // the step's loss is sum / micro_batches
      return loss;
    }
    auto loss = causal_lm_loss(logits, mb.labels);
    if (loss_out != nullptr) *loss_out = loss.item<double>();
    return loss / static_cast<double>(prog.micro_batches);
  }

  // Boundaries whose inputs a recomputed stage checkpoints: its first layer, or every layer.
  std::vector<int32_t> ckpt_bounds(int32_t s) const {
    const auto& st = prog.stages[s];
    std::vector<int32_t> out{st.first_layer};
    if (po.layer_recompute)
      for (int32_t l = st.first_layer + 1; l < st.last_layer; ++l) out.push_back(l);
    return out;
  }

  void worker(int32_t d, const std::vector<micro_batch>& mbs, double lr, double max_norm, bool apply) {
    compute_device& dev = *devs[d];
    dev.enter_compute_thread();
    const c10::Device tdev = dev.torch_device();
    // Micro-batches (token ids and labels, tiny) move to the device on first use.
    std::map<int32_t, micro_batch> batch;
    auto mb = [&](int32_t m) -> const micro_batch& {
      auto it = batch.find(m);
      if (it == batch.end()) it = batch.emplace(m, micro_batch{mbs[m].tokens.to(tdev), mbs[m].labels.to(tdev), mbs[m].loss_scale}).first;
      return it->second;
    };
    // LoRA weights and RoPE tables on this device once per step, not per micro-batch and layer: on CPU
    // devices they are the host tensors themselves (to() aliases); on GPUs copies whose gradients
    // flow back to the host leaves the optimizers own.
    lora_adapters dev_lora;
    dev_lora.cfg = lora.cfg;
    dev_lora.layers.resize(lora.layers.size());
    for (const auto& in : prog.devices[d])
      if (in.kind == op::forward || in.kind == op::recompute || in.kind == op::backward)
        for (int32_t l = prog.stages[in.stage].first_layer; l < prog.stages[in.stage].last_layer; ++l)
          for (int i = 0; i < num_lora_targets; ++i) {
            const auto& p = lora.layers[l][i];
            if (p.a.defined() && !dev_lora.layers[l][i].a.defined())
              dev_lora.layers[l][i] = {p.a.to(tdev, w.embed.scalar_type()), p.b.to(tdev, w.embed.scalar_type())};
          }
    const rope_tables dev_rope{w.rope.cos.to(tdev), w.rope.sin.to(tdev)};
    const layer_context ctx{w.cfg, dev_rope, &dev_lora, true};
    std::map<std::tuple<char, int32_t, int32_t>, async_tensor> local;  // (a|g|c, boundary, micro)
    auto& weights = on_device[d];
    std::map<std::pair<int32_t, int32_t>, graph_stash> stash;
    const int64_t tokens_per_micro = mbs.empty() ? 0 : mbs[0].tokens.numel();
    auto take = [&](char k, int32_t b, int32_t m) {
      auto it = local.find({k, b, m});
      if (it == local.end()) throw lorapipe_error(fmt::format("{}: missing {} at layer {} of micro-batch {}", dev.name(), k, b, m));
      auto t = it->second.get();
      local.erase(it);
      return t;
    };
    auto keep = [&](char k, int32_t b, int32_t m, const at::Tensor& t) {
      local[{k, b, m}] = async_tensor::ready(t, std::make_shared<arena_block>(dev.arena(), nbytes(t)));
    };
    auto stage_w = [&](int32_t s) -> const stage_weights& {
      auto it = weights.find(s);
      if (it == weights.end()) throw lorapipe_error(fmt::format("{}: stage {} computes without PREFETCH_WEIGHTS", dev.name(), s));
      it->second.ready.get();
      return *it->second.weights;
    };
    auto timed = [&](const instr& in, auto&& fn) {
      const auto a = clock_type::now();
      fn();
      const auto b = clock_type::now();
      std::lock_guard lock(mu);
      trace.push_back({d, in, std::chrono::duration<double>(a - t0).count(), std::chrono::duration<double>(b - t0).count()});
    };
    // Ships a tensor to another device, then the mailbox. Host-staged: download here into the
    // staging pool, then upload there. Peer: one copy driven by this device's download engine.
    auto send = [&](char kind, int32_t boundary, int32_t m, int32_t peer, async_tensor t) {
      const size_t bytes = nbytes(t.get());
      compute_device* to = devs[peer];
      compute_device* from = &dev;
      auto deliver = [this, to, bytes, kind, boundary, m, peer](auto&& copy) {
        try {
          auto mem = std::make_shared<arena_block>(to->arena(), bytes);
          auto on_device = async_tensor::ready(copy(), mem);
          std::lock_guard lock(mu);
          mailbox[{kind, boundary, m, peer}] = on_device;
          cv.notify_all();
        } catch (const std::exception& e) {
          fail(e.what());
        }
      };
      if (link_kind(d, peer) == transport_kind::nccl) {  // stream-ordered on this thread; RECV posts the other end
        dev.nccl_send(peer, t.get());
        return;
      }
      if (link_kind(d, peer) == transport_kind::peer) {
        dev.download().submit(bytes, [t, from, to, deliver] { deliver([&] { return to->copy_from_peer(*from, t.get()); }); });
        return;
      }
      auto host_copy = std::make_shared<at::Tensor>();
      dev.download().submit(bytes, [t, host_copy, bytes, from, to, deliver] {
        *host_copy = from->copy_out(t.get());
        to->upload().submit(bytes, [host_copy, to, deliver] { deliver([&] { return to->copy_in(*host_copy); }); });
      });
    };
    auto recv = [&](char kind, int32_t boundary, int32_t m, int32_t from) {
      const char slot = kind == 'A' ? 'a' : 'g';
      if (link_kind(from, d) == transport_kind::nccl) {  // activations and gradients: [b,T,D] in the compute dtype
        const auto& tok = mbs[m].tokens;
        auto t = dev.nccl_recv(from, {tok.size(0), tok.size(1), w.cfg.hidden_size}, w.embed.scalar_type());
        keep(slot, boundary, m, t);
        return;
      }
      std::unique_lock lock(mu);
      const auto key = std::make_tuple(kind, boundary, m, d);
      wait(lock, [&] { return mailbox.count(key) > 0; });
      local[{slot, boundary, m}] = mailbox[key];  // its arena block moves along
      mailbox.erase(key);
    };

    for (const auto& in : prog.devices[d]) {
      const auto& st = prog.stages[in.stage];
      const int32_t s = in.stage, m = in.micro;
      switch (in.kind) {
        case op::load_micro_batch:
          break;  // micro-batches are host tensors; the stage reads tokens/labels directly
        case op::prefetch_weights: {
          if (weights.count(s)) break;  // still resident from an earlier step
          // Placement now, in program order (the memory plan sized the arena for exactly this
          // sequence); the copy runs on the weight-upload engine.
          auto host_list = stage_host_weights(st);
          auto place = dev.place_weights(host_list, weight_plan[d].slot_bytes);
          if (!place) throw out_of_memory_error(place.message());
          auto sw = std::make_shared<stage_weights>();
          compute_device* devp = &dev;
          const size_t bytes = place->bytes;
          weights[s] = {dev.weight_upload().submit(bytes, [sw, st, devp, p = *place, host_list, tied = w.cfg.tie_word_embeddings] {
            auto t = devp->upload_weights(p, host_list);
            size_t i = 0;
            for (int32_t l = st.first_layer; l < st.last_layer; ++l) {
              layer_weights lw;
              lw.input_norm = t[i++];
              lw.post_norm = t[i++];
              for (int k = 0; k < num_lora_targets; ++k) lw.proj[k] = t[i++];
              sw->layers.push_back(std::move(lw));
            }
            if (st.has_embed) sw->embed = t[i++];
            if (st.has_head) {
              sw->final_norm = t[i++];
              sw->lm_head = st.has_embed && tied ? sw->embed : t[i++];
            }
          }), sw, place->block};
          break;
        }
        case op::release_weights:
          if (auto it = weights.find(s); it != weights.end()) {
            it->second.ready.get();
            std::weak_ptr<void> block = it->second.block;
            weights.erase(it);
            // The memory plan reuses this range for the next PREFETCH: nothing may still view it.
            if (!block.expired())
              throw lorapipe_error(fmt::format("{}: stage {}'s weights are still in use at RELEASE_WEIGHTS", dev.name(), s));
          }
          break;
        case op::forward:
          timed(in, [&] {
            const auto& sw = stage_w(s);
            // The graph is kept only when this stage's backward uses it directly (no recompute).
            const bool keep_graph = backwarded.count(s) && !recomputed.count(s);
            at::Tensor x = st.has_embed ? mb(m).tokens : take('a', st.first_layer, m);
            std::map<int32_t, at::Tensor> ckpt;
            double loss = 0;
            if (keep_graph) {
              if (!st.has_embed) x = x.detach().requires_grad_(true);
              auto out = run_stage(ctx, sw, st, s, x, mb(m), &ckpt, &loss);
              auto mem = std::make_shared<arena_block>(
                  dev.arena(), static_cast<size_t>(stash_bytes_per_layer(w.cfg, tokens_per_micro, x.element_size()) *
                                                   std::max(1, st.last_layer - st.first_layer)));
              if (!st.has_head) keep('a', st.last_layer, m, out.detach());
              stash[{s, m}] = {st.has_embed ? at::Tensor() : x, out, mem};
            } else {
              torch::NoGradGuard ng;
              auto out = run_stage(ctx, sw, st, s, x, mb(m), &ckpt, &loss);
              if (!st.has_head) keep('a', st.last_layer, m, out);
            }
            for (auto& [b, t] : ckpt) keep('c', b, m, t);
            if (st.has_head) {
              std::lock_guard lock(mu);
              loss_sum += loss;
            }
          });
          break;
        case op::recompute:
          if (po.layer_recompute) break;  // BACKWARD recomputes one layer at a time
          timed(in, [&] {
            const auto& sw = stage_w(s);
            at::Tensor x = take('c', st.first_layer, m);
            if (!st.has_embed) x = x.detach().requires_grad_(true);
            double loss = 0;
            auto out = run_stage(ctx, sw, st, s, x, mb(m), nullptr, st.has_head ? &loss : nullptr);
            auto mem = std::make_shared<arena_block>(
                dev.arena(), static_cast<size_t>(stash_bytes_per_layer(w.cfg, tokens_per_micro, w.embed.element_size()) *
                                                 std::max(1, st.last_layer - st.first_layer)));
            stash[{s, m}] = {st.has_embed ? at::Tensor() : x, out, mem};
          });
          break;
        case op::backward:
          if (po.layer_recompute && recomputed.count(s)) {
            timed(in, [&] {
              const auto& sw = stage_w(s);
              at::Tensor grad = st.has_head ? at::Tensor() : take('g', st.last_layer, m);
              at::Tensor grad_in;
              for (int32_t l = st.last_layer - 1; l >= st.first_layer; --l) {
                at::Tensor x = take('c', l, m), leaf;
                if (l == 0) {
                  torch::NoGradGuard ng;
                  x = torch::embedding(sw.embed, x);  // checkpoint 0 holds token ids; the embedding is frozen
                } else {
                  leaf = x.detach().requires_grad_(true);
                  x = leaf;
                }
                arena_block mem(dev.arena(), static_cast<size_t>(stash_bytes_per_layer(w.cfg, tokens_per_micro, w.embed.element_size())));
                auto out = decoder_layer(ctx, l, sw.layers[l - st.first_layer], x, 0, nullptr);
                if (st.has_head && l == st.last_layer - 1) {
                  auto logits = head_logits(w.cfg, sw.final_norm, sw.lm_head, out);
                  if (mb(m).loss_scale > 0) (causal_lm_loss_sum(logits, mb(m).labels) * mb(m).loss_scale).backward();
                  else (causal_lm_loss(logits, mb(m).labels) / static_cast<double>(prog.micro_batches)).backward();
                } else {
                  out.backward(grad);
                }
                if (leaf.defined()) grad = leaf.grad();
              }
              if (!st.has_embed) keep('g', st.first_layer, m, grad);
              std::lock_guard lock(mu);
              --backward_left;
              cv.notify_all();
            });
            break;
          }
          timed(in, [&] {
            stage_w(s);
            auto it = stash.find({s, m});
            if (it == stash.end()) throw lorapipe_error(fmt::format("{}: backward of stage {} micro-batch {} has no graph", dev.name(), s, m));
            auto g = std::move(it->second);
            stash.erase(it);
            if (st.has_head) {
              g.output.backward();
            } else {
              auto grad = take('g', st.last_layer, m);
              g.output.backward(grad);
            }
            if (!st.has_embed) keep('g', st.first_layer, m, g.input.grad());
            std::lock_guard lock(mu);
            --backward_left;
            cv.notify_all();
          });
          break;
        case op::send_act: {
          auto it = local.find({'a', st.last_layer, m});
          if (it == local.end()) throw lorapipe_error(fmt::format("{}: nothing to send for {}", dev.name(), instr_to_text(in)));
          send('A', st.last_layer, m, in.peer, it->second);
          local.erase(it);
          break;
        }
        case op::send_grad: {
          auto it = local.find({'g', st.first_layer, m});
          if (it == local.end()) throw lorapipe_error(fmt::format("{}: nothing to send for {}", dev.name(), instr_to_text(in)));
          send('G', st.first_layer, m, in.peer, it->second);
          local.erase(it);
          break;
        }
        case op::recv_act:
          recv('A', st.first_layer, m, in.peer);
          break;
        case op::recv_grad:
          recv('G', st.last_layer, m, in.peer);
          break;
        case op::offload_act:
          for (int32_t b : ckpt_bounds(s)) {
            auto it = local.find({'c', b, m});
            if (it == local.end()) throw lorapipe_error(fmt::format("{}: no checkpoint at layer {} for {}", dev.name(), b, instr_to_text(in)));
            async_tensor src = it->second;
            local.erase(it);
            async_tensor dst;
            compute_device* devp = &dev;
            dst.done = dev.download().submit(nbytes(src.get()), [src, devp, v = dst.value] { *v = devp->copy_out(src.get()); });
            std::lock_guard lock(mu);
            host[{b, m}] = dst;
            cv.notify_all();
          }
          break;
        case op::reload_act:
          for (int32_t b : ckpt_bounds(s)) {
            async_tensor src;
            {
              std::unique_lock lock(mu);
              const auto key = std::make_pair(b, m);
              wait(lock, [&] { return host.count(key) > 0; });
              src = host[key];
              host.erase(key);
            }
            src.get();  // (host copy finished)
            async_tensor dst;
            dst.mem = std::make_shared<arena_block>(dev.arena(), nbytes(*src.value));
            compute_device* devp = &dev;
            dst.done = dev.upload().submit(nbytes(*src.value), [src, devp, v = dst.value] { *v = devp->copy_in(src.get()); });
            local[{'c', b, m}] = dst;
          }
          break;
        case op::optimizer_step: {
          std::unique_lock lock(mu);
          wait(lock, [&] { return backward_left == 0; });
          if (po.async_optimizer) break;  // stepped on master weights after the iteration (one step stale)
          if (!norm_done) {  // global clip over every stage's LoRA gradients, once
            grad_norm = clip_grad_norm(lora.parameters(), apply ? max_norm : 0.0);
            norm_done = true;
          }
          lock.unlock();
          if (apply) {
            optim[s]->step(lr);
            optim[s]->zero_grad();
          }
          break;
        }
      }
    }
    if (!stash.empty()) throw lorapipe_error(fmt::format("{}: {} graphs left without backward", dev.name(), stash.size()));
  }
};

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

pipeline_executor::~pipeline_executor() {
  if (d_->pending.valid()) d_->pending.wait();
  for (auto* d : d_->devs) d->weight_upload().submit(0, [] {}).wait();  // uploads still reference this executor
}

result<pipeline_step_result> pipeline_executor::step(const std::vector<micro_batch>& mbs, double lr, double max_grad_norm,
                                                     bool apply_optimizer) {
  auto& s = *d_;
  if (static_cast<int32_t>(mbs.size()) != prog_.micro_batches)
    return make_error("pipeline: {} micro-batches given, the program expects {}", mbs.size(), prog_.micro_batches);
  if (s.devs.size() != prog_.devices.size())
    return make_error("pipeline: program for {} devices, {} given", prog_.devices.size(), s.devs.size());
  // The weight arenas of the memory plan, reserved before anything else is allocated.
  for (size_t d = 0; d < s.devs.size(); ++d) {
    try {
      LP_TRY(s.devs[d]->reserve_weight_arena(s.weight_plan[d].bytes));
    } catch (const std::exception& e) {
      return make_error("{}: weight arena of {} bytes: {}", s.devs[d]->name(), s.weight_plan[d].bytes, e.what());
    }
  }
  s.mailbox.clear();
  s.host.clear();
  s.backward_left = s.total_backward;
  s.failed = false;
  s.error.clear();
  s.norm_done = false;
  s.grad_norm = 0;
  s.loss_sum = 0;
  s.trace.clear();
  for (auto* d : s.devs) {
    d->arena().reset_peak();
    if (auto* wa = d->weight_arena()) wa->reset_peak();
  }
  const int main_threads = at::get_num_threads();
  s.t0 = clock_type::now();
  std::vector<std::thread> threads;
  for (int32_t d = 0; d < static_cast<int32_t>(s.devs.size()); ++d)
    threads.emplace_back([&, d] {
      try {
        s.worker(d, mbs, lr, max_grad_norm, apply_optimizer);
      } catch (const aborted&) {
      } catch (const c10::Error& e) {
        s.fail(fmt::format("{}: {}", s.devs[d]->name(), e.what_without_backtrace()));
      } catch (const std::exception& e) {
        s.fail(fmt::format("{}: {}", s.devs[d]->name(), e.what()));
      }
    });
  for (auto& t : threads) t.join();
  // Let in-flight activation copies finish before their memory and tensors go away. Weight uploads
  // may continue: the cross-iteration prefetch overlaps whatever runs between steps, and the next
  // step's PREFETCH finds the stage resident (waiting for the upload only if it is still running).
  for (auto* d : s.devs) {
    d->download().submit(0, [] {}).wait();
    d->upload().submit(0, [] {}).wait();
  }
  at::set_num_threads(main_threads);
  pipeline_step_result r;
  r.seconds = std::chrono::duration<double>(clock_type::now() - s.t0).count();
  s.mailbox.clear();
  s.host.clear();
  if (s.failed) {
    for (auto* d : s.devs) d->weight_upload().submit(0, [] {}).wait();
    for (auto& m : s.on_device) m.clear();
    for (auto& p : s.lora.parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
    return make_error("pipeline step failed: {}", s.error);
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
    r.peak_bytes.push_back(d->arena().peak());
    r.weight_arena_bytes.push_back(d->weight_arena() != nullptr ? d->weight_arena()->capacity() : 0);
    r.weight_arena_peak.push_back(d->weight_arena() != nullptr ? d->weight_arena()->peak() : 0);
  }
  r.trace = s.trace;
  return r;
}

}  // namespace lorapipe
