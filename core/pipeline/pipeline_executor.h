// Runs a schedule program on compute devices: one worker thread per device walks its instruction
// list (a switch over the instruction kind), frozen base weights are uploaded from host memory into
// each device's arena by PREFETCH_WEIGHTS (double-buffered by the generators) and freed by
// RELEASE_WEIGHTS, stage inputs are checkpointed, offloaded to host and reloaded for recompute,
// activations and gradients cross devices through the copy engines, host-staged or peer per link.
// LoRA parameters keep their AdamW state per stage; OPTIMIZER_STEP applies it after a global
// gradient-norm clip. One call = one training iteration.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/model/optimizer.h"
#include "core/base/result.h"
#include "core/base/cancel.h"
#include "core/pipeline/schedule.h"
#include "core/pipeline/memory_plan.h"
#include "core/pipeline/schedule_sim.h"
#include "core/pipeline/transport.h"
#include "offload/device.h"
#include "offload/process_group.h"

namespace lorapipe {

struct micro_batch {
  at::Tensor tokens;  // i64 [b,T]
  at::Tensor labels;  // i64 [b,T], -100 = ignored
  // 0: the loss is this micro-batch's mean over 1/micro_batches. > 0: the summed loss times this
  // (1 / trained tokens of the whole step), so masked batches give a token-weighted mean.
  double loss_scale = 0;
  uint64_t dropout_seed = 0;  // LoRA dropout masks: dropout_key(run seed, step, micro-batch)
  // Forward-only programs: the head returns the last position's logits (pipeline_step_result::
  // last_logits) instead of a loss; labels are not read.
  bool last_logits = false;
};

struct instr_timing {
  int32_t device;
  instr in;
  double start_s, end_s;  // since the step began; start_s once its inputs were there (waits left out)
};

struct pipeline_step_result {
  // Mean over micro-batches; with loss_scale > 0 the step's summed cross-entropy times loss_scale
  // (loss_scale 1: the summed cross-entropy over the labels, as validation wants it).
  double loss = 0;
  double grad_norm = 0;  // before clipping
  double seconds = 0;
  std::vector<size_t> peak_bytes;  // per device arena peak during the step (weight arena included)
  std::vector<size_t> weight_arena_bytes, weight_arena_peak;  // per device: reserved, used at the peak
  std::vector<instr_timing> trace;  // compute instructions (F, R, B) with times
  std::vector<at::Tensor> last_logits;  // micro_batch::last_logits: per micro-batch f32 [b,V] on the host
};


// One pipeline over several processes: each runs the workers of the device positions whose rank is
// its own (the others are null in the executor's device list). A SEND/RECV between positions of
// different ranks goes through the process group: downloaded to host memory, sent with a tag naming
// the message (kind, boundary, micro-batch), received into host memory and uploaded. The gradient
// clip takes the norm over every rank's stages (an all-reduce) and the step's loss is summed over
// ranks, so every rank returns the same loss and norm as the one-process run.
struct process_pipeline {
  process_group* group = nullptr;  // null: every device is in this process
  std::vector<int> rank_of;        // per device position
};

// The frozen tensors `rank` computes with: the layers (and embedding, head) of every stage that one
// of its device positions (rank_of, per position) runs, streams or recomputes (load_options::select).
weight_selection rank_weight_selection(const program& p, int64_t num_layers, const std::vector<int>& rank_of, int rank);

struct pipeline_options {
  // Recompute granularity: false = a stage at a time (RECOMPUTE rebuilds the whole stage's graph);
  // true = a layer at a time (every layer input is checkpointed/offloaded; BACKWARD recomputes and
  // back-propagates one layer after another: less memory, more host<->device traffic).
  bool layer_recompute = false;
  // One-step-stale asynchronous optimizer (opt-in): the AdamW step of iteration i runs on a master
  // copy of the LoRA weights while iteration i+1 computes with the weights from before step i.
  bool async_optimizer = false;
  // Per link (choose_transports); links not listed are host-staged.
  std::vector<link_transport> transports;
  // Checked before every instruction: a request ends the step with the error "cancelled" while no
  // stage has started its optimizer update (state unchanged: the step can simply be run again).
  // With an nccl link it is checked once, before the step starts (a device leaving mid-step would
  // leave its peer's send or receive unmatched).
  const cancel_token* cancel = nullptr;
  // Watchdog: a step in which no device finishes an instruction for this long fails, naming each
  // device's instruction, and NCCL communicators are aborted so that waits on the GPU end (0 = off).
  double watchdog_s = 600;
  // Called with the watchdog's message on the thread that called step(), when it fires (a step stuck
  // in a driver may not return for a while after).
  std::function<void(const std::string&)> on_watchdog;
  // The memory plan to check before a step allocates anything (the project's, as `plan` shows it);
  // null: the executor makes one from the micro-batches' shape with FLOP timing.
  std::shared_ptr<const memory_plan> memory;
  // Several processes (see process_pipeline); not with the async optimizer or forward-only programs.
  process_pipeline processes;
  // Test hook: called with "pipeline:instruction" before every instruction of every device.
  std::function<void(const char* site)> probe;
};

class pipeline_executor {
 public:
  pipeline_executor(const llama_weights& w, lora_adapters& lora, program prog, std::vector<compute_device*> devices,
                    adamw_config opt, pipeline_options po = {});
  ~pipeline_executor();
  pipeline_executor(const pipeline_executor&) = delete;
  pipeline_executor& operator=(const pipeline_executor&) = delete;

  // One iteration over micro-batches (as many as the program's micro_batches). Gradients are the
  // mean over all micro-batches. With apply_optimizer, OPTIMIZER_STEP clips them globally to
  // max_grad_norm and runs AdamW with `lr` (then zeroes them); without, they are left in .grad().
  result<pipeline_step_result> step(const std::vector<micro_batch>& mbs, double lr, double max_grad_norm,
                                    bool apply_optimizer = true);
  const program& prog() const { return prog_; }
  // Memory plan: the weight arena each device reserves (best-fit placement of the program's
  // PREFETCH/RELEASE sequence, made before anything is allocated).
  const std::vector<weight_arena_plan>& weight_plan() const;
  // The whole memory plan the last step() was checked against (null before the first step): what
  // each device holds at its peak, by buffer. A step whose plan exceeds a device's capacity is
  // refused before anything is allocated, naming the device, the shortfall and the buffer.
  const memory_plan* memory() const;
  // Async optimizer: waits for the pending step and installs its result in the LoRA weights (call
  // before saving or evaluating). No-op otherwise.
  void flush();
  // The AdamW instances that own the LoRA state (per stepping stage; with the async optimizer the
  // one on the master copies, whose parameters line up with lora.parameters()). Flushes first.
  std::vector<adamw*> optimizers();
  // Async optimizer: after LoRA weights were loaded into the parameters (resume), the master copy
  // the background step updates takes them over. No-op otherwise.
  void resync_master();
  // Several processes: every stage's LoRA weights and AdamW state to every rank (a collective: all
  // ranks call it at the same point), so that any of them holds the whole run. No-op in one process.
  // from_rank >= 0: everything from that rank instead (a resume: rank 0 read the checkpoint).
  status gather_state(int from_rank = -1);
  // Waits for weight uploads and drops every stage's weights kept resident between steps, emptying
  // the weight arenas: another executor (evaluation) can then use the same devices.
  void release_weights();

  struct impl;  // core/pipeline/pipeline_impl.h (internal)

 private:
  std::unique_ptr<impl> d_;
  program prog_;
};

}  // namespace lorapipe
