// Internal to core/pipeline: the executor's state (pipeline_executor::impl) shared by
// pipeline_executor.cpp (construction, the step driver, the async optimizer) and
// pipeline_worker.cpp (one method per instruction kind). Not a public header.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/errors.h"
#include "core/pipeline/cost_model.h"
#include "core/pipeline/memory_plan.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule_sim.h"

namespace lorapipe {
namespace pipeline_detail {

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

inline size_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

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

}  // namespace pipeline_detail
using namespace pipeline_detail;


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
  std::set<int32_t> local_stages;                            // stepping stages of this process
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
  // Step number: a delivery made for an earlier step (none should outlive its step's drain) is dropped
  // rather than handed to the next step's receive with a matching key.
  uint64_t generation = 0;
  std::map<std::pair<int32_t, int32_t>, async_tensor> host;                    // offloaded checkpoints
  int32_t backward_left = 0;
  bool failed = false;
  bool cancelled = false;  // the failure was a stop request (cancel_before_update)
  std::string error;
  bool norm_done = false;   // the clip has begun (the update is under way)
  bool norm_ready = false;  // grad_norm is known
  double grad_norm = 0, loss_sum = 0;
  std::vector<instr_timing> trace;
  std::map<int32_t, at::Tensor> last_logits;  // micro_batch::last_logits, by micro-batch
  clock_type::time_point t0;

  impl(const llama_weights& w_, lora_adapters& l, const program& p, std::vector<compute_device*> d, adamw_config opt,
       pipeline_options o)
      : w(w_), lora(l), prog(p), po(o), opt_cfg(opt), devs(std::move(d)), on_device(devs.size()) {
    for (int32_t d = 0; d < static_cast<int32_t>(prog.devices.size()); ++d)
      for (const auto& in : prog.devices[d]) {
        if (in.kind == op::recompute) recomputed.insert(in.stage);
        if (in.kind == op::backward) {
          if (local(d)) ++total_backward;  // OPTIMIZER_STEP waits for this process's backwards
          backwarded.insert(in.stage);
        }
      }
    checkpoints = checkpoint_boundaries(prog, po.layer_recompute);
    for (int32_t d = 0; d < static_cast<int32_t>(prog.devices.size()); ++d)
      for (const auto& in : prog.devices[d])
        if (in.kind == op::offload_act || in.kind == op::reload_act)
          for (int32_t b : ckpt_bounds(in.stage)) (in.kind == op::offload_act ? ckpt_offloaded_on : ckpt_reloaded_on)[{b, in.micro}] = d;
    // Every stepping stage has its AdamW here, also a stage another process steps: its state comes
    // over by gather_state, so that this process can checkpoint or continue the whole run.
    for (int32_t d = 0; d < static_cast<int32_t>(prog.devices.size()); ++d)
      for (const auto& in : prog.devices[d])
        if (in.kind == op::optimizer_step) {
          if (local(d)) local_stages.insert(in.stage);
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
    uses_nccl = cancel_between_steps_only();
    for (int32_t d = 0; d < static_cast<int32_t>(prog.devices.size()); ++d) {
      int64_t computes = 0;
      for (const auto& in : prog.devices[d]) {
        if (timed_compute(in)) ++computes;
        if (in.kind == op::recv_act || in.kind == op::recv_grad) {
          const auto msg = message_of(prog, in);
          recv_gate[{msg.kind, msg.boundary, in.micro, d}] = computes;
        }
      }
    }
  }

  // Compute instructions the worker times (F, B, and R unless layer_recompute makes it a no-op).
  // Several processes: whether position d runs here, and whether a link crosses processes.
  bool local(int32_t d) const {
    const auto& pp = po.processes;
    return pp.group == nullptr || pp.rank_of.at(static_cast<size_t>(d)) == pp.group->rank();
  }
  bool crosses_process(int32_t from, int32_t to) const {
    const auto& pp = po.processes;
    return pp.group != nullptr && pp.rank_of.at(static_cast<size_t>(from)) != pp.rank_of.at(static_cast<size_t>(to));
  }
  // A message's tag, the same on both ranks: (kind: A activation, G gradient, C checkpoint; boundary:
  // a layer index, 0..num_layers; micro-batch).
  int process_tag(char kind, int32_t boundary, int32_t m) const {
    return ((m * (static_cast<int32_t>(w.cfg.num_layers) + 1) + boundary) * 3) + (kind == 'A' ? 0 : kind == 'G' ? 1 : 2);
  }
  // Where each offloaded checkpoint (boundary, micro-batch) is offloaded and reloaded: round-robin
  // reloads a stage's input on the device that runs its backward, maybe in another process.
  std::map<std::pair<int32_t, int32_t>, int32_t> ckpt_offloaded_on, ckpt_reloaded_on;
  std::vector<process_group::pending_send> process_sends;  // this step's sends to other ranks (under mu)
  status share_updated_lora();
  status gather_state(int from_rank);
  status finish_process_sends();
  void keep_process_send(process_group::pending_send s);
  double global_clip(double max_norm);

  bool timed_compute(const instr& in) const {
    return in.kind == op::forward || in.kind == op::backward || (in.kind == op::recompute && !po.layer_recompute);
  }

  bool cancel_between_steps_only() const {  // any nccl link
    for (const auto& l : po.transports)
      if (l.kind == transport_kind::nccl) return true;
    return false;
  }

  transport_kind link_kind(int32_t from, int32_t to) const {
    for (const auto& l : po.transports)
      if (l.from == from && l.to == to) return l.kind;
    return transport_kind::host_staged;
  }

  // The frozen host tensors of a stage, in the order they are laid out in its weight block.
  std::vector<at::Tensor> stage_host_weights(const stage_def& st) const {
    std::vector<at::Tensor> out;
    const auto specs = layer_tensor_specs(w.cfg);
    for (int32_t l = st.first_layer; l < st.last_layer; ++l)
      for (const auto& spec : specs) out.push_back(w.layers[l][spec.slot]);
    if (st.has_embed) out.push_back(w.embed);
    if (st.has_head) {
      out.push_back(w.final_norm);
      if (!(st.has_embed && w.cfg.tie_word_embeddings)) out.push_back(w.lm_head);
    }
    return out;
  }

  // Watchdog bookkeeping (under mu): instructions started so far, each device's position (-1: done).
  uint64_t progress = 0;
  std::vector<int64_t> pc;
  int32_t workers_left = 0;
  bool uses_nccl = false;

  // A failure on a copy-engine thread, named after the device whose copy failed.
  void fail_on(const compute_device& d, const std::exception& e) {
    const auto* c10e = dynamic_cast<const c10::Error*>(&e);
    fail(fmt::format("{}: {}", d.name(), c10e != nullptr ? c10e->what_without_backtrace() : e.what()));
  }
  void fail(const std::string& msg) {
    bool first = false;
    {
      std::lock_guard lock(mu);
      if (!failed) {
        failed = first = true;
        error = msg;
      }
      cv.notify_all();
    }
    // A device that waits on the GPU for a peer that will never send (a failed worker, a hung link)
    // only returns once the communicators are aborted.
    if (first && uses_nccl)
      for (auto* d : devs)
        if (d != nullptr) d->abort_communication();
  }
  // The step driver's wait for the workers, with the watchdog (pipeline_options::watchdog_s).
  void watch_workers();

  // The memory plan for micro-batches shaped like `mbs` (made once per shape), checked against
  // every device's capacity before the step allocates anything.
  std::optional<memory_plan> mplan;
  // Memory bounds the plan relies on (under mu). A host-staged message is uploaded into its
  // receiver only once the receiver has started the compute before its RECV (recv_gate: how many
  // computes that is); until then it waits in host staging (gated).
  std::map<std::tuple<char, int32_t, int32_t, int32_t>, int64_t> recv_gate;  // (A|G, boundary, micro, dest)
  std::vector<int64_t> computes_started;                                      // per device, this step
  struct gated_upload {
    int64_t after;
    std::function<void()> submit;
  };
  std::vector<std::vector<gated_upload>> gated;  // per receiving device
  void upload_when_open(int32_t dest, int64_t after, std::function<void()> submit);
  std::pair<int64_t, int64_t> mplan_shape{-1, -1};
  status check_memory(const std::vector<micro_batch>& mbs);
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
      if (ckpt != nullptr && saves_checkpoint(stage, 0)) (*ckpt)[0] = mb.tokens;
      x = embed_with(w.cfg, sw.embed, input);  // [b,T,D]
    }
    for (int32_t l = st.first_layer; l < st.last_layer; ++l) {
      if (ckpt != nullptr && l > 0 && saves_checkpoint(stage, l)) (*ckpt)[l] = x.detach();
      x = decoder_layer(ctx, l, sw.layers[l - st.first_layer], x, 0, nullptr);
    }
    if (!st.has_head) return x;
    if (mb.last_logits) {  // generation: only the last position, back on the host
      auto last = head_logits(w.cfg, sw.final_norm, sw.lm_head, x.slice(1, x.size(1) - 1)).select(1, 0);  // [b,V]
      return last.to(at::kCPU, at::kFloat);
    }
    return head_loss(sw, x, mb, loss_out);
  }

  // The head stage's loss (for backward): the head and cross-entropy on labelled positions only, in
  // chunks (head_loss_sum); token-weighted over the step when micro-batches carry a loss_scale, else
  // the micro-batch mean over micro_batches. `loss_out`: this micro-batch's reported loss.
  at::Tensor head_loss(const stage_weights& sw, const at::Tensor& x, const micro_batch& mb, double* loss_out) const {
    auto sum = head_loss_sum(w.cfg, sw.final_norm, sw.lm_head, x, mb.labels);  // f32 []
    if (mb.loss_scale > 0) {
      auto loss = sum * mb.loss_scale;
      if (loss_out != nullptr) *loss_out = loss.item<double>() * prog.micro_batches;  // the step's loss is sum / micro_batches
      return loss;
    }
    auto loss = sum / mb.labels.ne(-100).sum().clamp_min(1).to(torch::kFloat);
    if (loss_out != nullptr) *loss_out = loss.item<double>();
    return loss / static_cast<double>(prog.micro_batches);
  }

  // Read-only after construction (workers share it): never operator[] here.
  bool saves_checkpoint(int32_t stage, int32_t boundary) const {
    auto it = checkpoints.find(stage);
    return it != checkpoints.end() && it->second.count(boundary) > 0;
  }

  // Boundaries whose inputs a recomputed stage checkpoints: its first layer, or every layer.
  std::vector<int32_t> ckpt_bounds(int32_t s) const {
    const auto& st = prog.stages[s];
    std::vector<int32_t> out{st.first_layer};
    if (po.layer_recompute)
      for (int32_t l = st.first_layer + 1; l < st.last_layer; ++l) out.push_back(l);
    return out;
  }

  // What one device's worker holds during a step (its locals, shared by the instruction methods).
  struct worker_ctx {
    worker_ctx(int32_t d_, compute_device& dev_, const std::vector<micro_batch>& mbs_, double lr_, double max_norm_, bool apply_)
        : d(d_), dev(dev_), tdev(dev_.torch_device()), mbs(mbs_), lr(lr_), max_norm(max_norm_), apply(apply_),
          tokens_per_micro(mbs_.empty() ? 0 : mbs_[0].tokens.numel()),
          seq_len(mbs_.empty() ? 0 : mbs_[0].tokens.size(-1)) {}
    int32_t d;
    compute_device& dev;
    c10::Device tdev;
    const std::vector<micro_batch>& mbs;
    double lr, max_norm;
    bool apply;
    std::map<int32_t, micro_batch> batch;                               // on this device, on first use
    lora_adapters lora;                                                 // device copies, once per step
    rope_tables rope;
    std::map<std::tuple<char, int32_t, int32_t>, async_tensor> local;  // (a|g|c, boundary, micro)
    std::map<std::pair<int32_t, int32_t>, graph_stash> stash;          // (stage, micro) -> graph
    int64_t tokens_per_micro = 0, seq_len = 0;  // of a micro-batch ([rows, seq_len] tokens)
    std::vector<block_ptr> held;  // arena charges of the step: LoRA and RoPE copies, micro-batch inputs
    // Outgoing copies (SEND, OFFLOAD) issued since the last compute began: the next compute waits
    // for them when it ends, so their sources are back by then (the memory plan's bound).
    std::vector<std::shared_future<void>> outgoing;
    // Time the current compute instruction spent waiting for its inputs (arrivals, reloads, weight
    // uploads): left out of its traced interval and of pace_compute, so a profile holds compute alone.
    double waited_s = 0;
  };

  // pipeline_worker.cpp: one worker thread per device runs its instruction list.
  void worker(int32_t d, const std::vector<micro_batch>& mbs, double lr, double max_norm, bool apply);
  void execute(worker_ctx& c, const instr& in);
  void exec_prefetch(worker_ctx& c, const instr& in);
  void exec_release(worker_ctx& c, const instr& in);
  void exec_forward(worker_ctx& c, const instr& in);
  void exec_recompute(worker_ctx& c, const instr& in);
  void exec_backward(worker_ctx& c, const instr& in);
  void exec_backward_by_layer(worker_ctx& c, const instr& in);
  void exec_send(worker_ctx& c, const instr& in);
  void exec_recv(worker_ctx& c, const instr& in);
  void exec_offload(worker_ctx& c, const instr& in);
  void exec_reload(worker_ctx& c, const instr& in);
  void exec_optimizer_step(worker_ctx& c, const instr& in);
  // Worker helpers.
  void load_device_lora(worker_ctx& c);
  const micro_batch& mb(worker_ctx& c, int32_t m);
  layer_context context(worker_ctx& c, int32_t m) const;
  at::Tensor take(worker_ctx& c, char k, int32_t b, int32_t m);
  void keep(worker_ctx& c, char k, int32_t b, int32_t m, const at::Tensor& t);
  const stage_weights& stage_w(worker_ctx& c, int32_t s);
  void timed(worker_ctx& c, const instr& in, const std::function<void()>& fn);
  block_ptr stash_block(worker_ctx& c, int32_t layers);
  block_ptr head_block(worker_ctx& c, const stage_def& st);  // null unless st has the head
  void send(worker_ctx& c, char kind, int32_t boundary, int32_t m, int32_t peer, async_tensor t);
  void recv(worker_ctx& c, char kind, int32_t boundary, int32_t m, int32_t from);
  void send_to_rank(worker_ctx& c, async_tensor t, int32_t peer, int tag);
  void backward_done();
  bool cancel_before_update();
};

}  // namespace lorapipe
