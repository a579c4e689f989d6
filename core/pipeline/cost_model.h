// The cost model of a project's pipeline, shared by `plan`, the trainer and (next) the planner:
// schedule options from the project, each stage's exact weight-block bytes as the executor lays
// them out (per-tensor alignment in the weight arena; a tied head counted once), activation and
// autograd-stash bytes, and simulator costs from FLOPs at an assumed throughput.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/base/result.h"
#include "core/pipeline/memory_plan.h"
#include "core/pipeline/schedule.h"
#include "core/pipeline/schedule_sim.h"
#include "core/project/llama_config.h"
#include "core/project/lora_target.h"
#include "core/project/project.h"

namespace lorapipe {

// Compute times the layer profiler measured (core/train/layer_profile.h) on a speed-1 device for
// micro-batches of `rows` sequences of `seq_len` tokens: each layer's forward with autograd (a FORWARD
// that keeps its graph, or a RECOMPUTE), without (a FORWARD whose stage is recomputed later), and its
// backward; the embedding; the head's loss forward and backward (final norm, LM head, loss).
struct shape_times {
  int64_t rows = 0, seq_len = 0;
  std::vector<double> layer_forward_s, layer_forward_nograd_s, layer_backward_s;  // per layer of the model
  double embed_s = 0, head_forward_s = 0, head_backward_s = 0;
};
// ... and the same at a second, smaller shape (`second.rows` 0 when not measured): other shapes are
// then charged along the line through both in FLOPs (a part per call plus a part per FLOP, neither
// below 0: a small micro-batch runs less efficiently than a large one), not in proportion to FLOPs.
struct measured_compute : shape_times {
  shape_times second;
};

// What the cost model charges for compute: FLOPs at `gflops` per device (backward twice the
// forward), or the layer profile's times when `measured` is set, scaled to other micro-batch shapes
// along the line through its two shapes in FLOPs (in proportion to FLOPs with one shape, or when
// the line does not rise or rises faster than in proportion).
struct compute_rates {
  double gflops = 100;
  std::shared_ptr<const measured_compute> measured;
  compute_rates(double g = 100) : gflops(g) {}  // NOLINT(google-explicit-constructor): a plain throughput reads as one
  explicit compute_rates(std::shared_ptr<const measured_compute> m) : measured(std::move(m)) {}
  // Seconds of layer `l`'s forward (with or without autograd), backward, and of the head's loss
  // forward and backward, for micro-batches of `rows` x `seq_len`.
  double layer_forward(const llama_config& c, int64_t l, int64_t rows, int64_t seq_len, bool grad = true) const;
  double layer_backward(const llama_config& c, int64_t l, int64_t rows, int64_t seq_len) const;
  double head_forward(const llama_config& c, int64_t rows, int64_t seq_len) const;
  double head_backward(const llama_config& c, int64_t rows, int64_t seq_len) const;
  std::string describe() const;  // "100 GFLOP/s per device (FLOPs)" or "the layer profile (...)"
};

// parallel.* and offload.* of a project as generator options (a single-device project: 1 device,
// 1 micro-batch).
schedule_options schedule_options_of(const project_config& cfg);

// Bytes of one element in the compute dtype (model.dtype).
size_t compute_element_bytes(const project_config& cfg);

// Sizes in bytes of the frozen tensors of a stage, in the order the executor places them in its
// weight block: per layer its layer_tensor_specs (norms, projections, biases); then the embedding; then the
// final norm and the LM head (not when the stage also embeds and the head is tied to it).
std::vector<size_t> stage_tensor_bytes(const stage_def& st, const llama_config& c, size_t elem);
// The weight block of every stage of a program (layout_block at weight_alignment).
std::vector<size_t> stage_weight_bytes(const program& p, const llama_config& c, size_t elem);

// The LoRA targets that make a layer's autograd graph keep more: a frozen projection's input is not
// kept (its weight needs no gradient), an adapted one's is. Attention's inputs are kept anyway; the
// feed-forward's are not: gate/up (or gate_up) add the normed hidden state, down its [I] input.
// Default: both (the most a graph keeps).
struct graph_targets {
  bool mlp_in = true, mlp_down = true;
};
graph_targets graph_targets_of(const std::vector<lora_target>& lora_targets);
graph_targets graph_targets_of(const std::vector<std::string>& lora_targets);  // "gate_proj", "down", ...
// Bytes an autograd graph keeps per layer for `tokens` tokens of sequences of `seq_len` (activation
// memory model shared with the simulator and the executor's arena accounting; the layer profiler
// measures it against the allocator).
double stash_bytes_per_layer(const llama_config& cfg, int64_t tokens, int64_t seq_len, size_t elem_bytes, graph_targets t = {});

// FLOPs of one decoder layer's forward, and of the final norm + LM head's, for a micro-batch of `rows`
// sequences of `seq_len` tokens (a backward costs twice the forward).
double layer_forward_flops(const llama_config& c, int64_t rows, int64_t seq_len);
double head_forward_flops(const llama_config& c, int64_t rows, int64_t seq_len);

// Simulator costs from FLOPs at `gflops` per device (backward twice the forward) for micro-batches
// of `rows` sequences of `seq_len` tokens in `elem`-byte compute dtype: exact stage weight bytes,
// boundary activation, stash, head working set and input bytes; copies at `copy_bytes_per_s`
// (0 = instant); steady state. What the executor plans with when nobody gave it a plan.
sim_costs flop_costs(const program& p, const llama_config& c, int64_t rows, int64_t seq_len, size_t elem, double gflops,
                     double copy_bytes_per_s, graph_targets targets = {});

// What the memory plan needs besides the program and its simulation, from the model's config:
// the weight arenas, each layer's LoRA A and B in the compute dtype (r x (in + out) per adapted
// projection), the RoPE tables (as the loader makes them), the host's frozen and LoRA bytes.
// lora_targets: names as in lora.targets (fit_lora_targets applied here).
memory_inputs memory_inputs_of(const program& p, const llama_config& c, size_t elem, int64_t lora_r,
                               const std::vector<std::string>& lora_targets);
// The cuBLAS workspaces each of the project's `devices` pipeline devices holds outside its arenas:
// cublas_workspaces_per_device on a CUDA device, sized for an unknown compute capability (the larger
// default) unless CUBLAS_WORKSPACE_CONFIG says otherwise; none on CPU virtual devices.
std::vector<workspace_charge> device_workspaces(const project_config& cfg, int32_t devices);
// The project's memory plan for its program (workspaces included) (estimate_costs at `gflops` for the timing).
memory_plan project_memory_plan(const program& p, const llama_config& c, const project_config& cfg, const compute_rates& rates);

// The memory plan the executor checks (project_memory_plan at auto_schedule_gflops), for a program
// already simulated with `rates`: that simulation is reused when it has the same timing.
memory_plan checked_memory_plan(const program& p, const llama_config& c, const project_config& cfg, const compute_rates& rates,
                                const sim_costs& costs, const sim_result& sim);

// Simulator costs for the project's program: compute from `rates` (FLOPs at a throughput, or the
// layer profile; a stage whose forward is recomputed later runs it without autograd), exact stage weight bytes, boundary activation bytes, stash bytes, copy
// bandwidth from offload.copy_gbps, shared host links from offload.copy_links, device speeds from
// parallel.device_speeds, recompute granularity from offload.recompute_granularity, the host's
// cores shared by CPU virtual devices (share_host_cores with host_core_count()); steady state
// (cross-iteration prefetches already resident).
sim_costs estimate_costs(const program& p, const llama_config& c, const project_config& cfg, const compute_rates& rates);

// CPU virtual devices that want more threads (parallel.threads_per_device each) than the host has
// `cores` share them: sim_costs::host_compute_slots = cores / threads; otherwise no sharing.
void share_host_cores(sim_costs& c, const program& p, const project_config& cfg, int cores);
int host_core_count();  // std::thread::hardware_concurrency(), at least 1

// Layers per stage as choose_partition (partition_search.h) chose them.
struct partition_choice {
  std::vector<int32_t> sizes;   // layers per stage (make_schedule's stage_layers; round-robin: forward stages)
  std::string how;              // "even", "balanced" or "given"
  // Round-robin: layers per backward stage (make_schedule's backward_layers; empty = one layer each)
  // and how they were chosen: "per-layer", "balanced" or "given" (empty for bound schedules).
  std::vector<int32_t> backward_sizes;
  std::string backward_how;
  double step_s = 0;            // simulated step with these sizes (0 when it does not fit or cannot run)
  double even_step_s = 0;       // simulated step with the even partition (round-robin: and one layer per backward stage; 0 when it does not fit or cannot run)
};
// parallel.schedule "auto": what the planner weighed and chose. One device: "single". Several:
// every pipeline schedule (schedule_names()) with each micro-batch count of micro_batch_counts,
// generated, checked and simulated with estimate_costs at `gflops`; a candidate whose memory plan
// peaks above offload.device_memory_mb (when set) does not fit. The
// fastest predicted step wins; ties go to fewer micro-batches (each costs a per-launch overhead the
// FLOP model does not see), then to the order of schedule_names().
struct schedule_candidate {
  std::string schedule;
  int32_t micro_batches = 0;
  bool ok = false;                  // generated, valid and fits
  std::string note;                 // why not, when !ok
  double step_s = 0, bubble_ratio = 0;
  double peak_bytes = 0;            // the largest device peak of its memory plan (the bound)
  std::string partition;            // layers per stage, "3,2" (choose_partition)
  std::string partition_how;        // even, balanced or given
  std::string backward_partition;   // round-robin: per-layer or "2,2,1" (backward_partition_text)
  partition_choice part;            // what choose_partition gave it (the three texts above are of it)
};
struct schedule_choice {
  std::string schedule;             // "single" on one device
  int32_t micro_batches = 1;
  std::vector<schedule_candidate> candidates;  // feasible ones fastest first, then the others (the first is the choice)
};
// The micro-batch counts auto weighs: every divisor of run.batch_size from the device count up to 2 x
// devices (more micro-batches: a smaller bubble and smaller activations, more per-micro-batch work;
// 4 x made planning 80 layers on 8 devices take minutes);
// when none, the divisors below the device count (a batch smaller than the pipeline still trains).
// At most 6: the multiples of the device count first, then the smallest others.
std::vector<int64_t> micro_batch_counts(int64_t batch_size, int64_t devices);
result<schedule_choice> choose_schedule(const project_config& cfg, const llama_config& mc, const compute_rates& rates);
// The project with offload.auto resolved (resolve_auto_offload), schedule "auto" replaced by
// choose_schedule's choice and, for a pipeline, partition "auto" by choose_partition's layer counts
// (what a run records and trains).
result<project_config> resolve_auto_schedule(const project_config& cfg, const llama_config& mc, const compute_rates& rates);
// offload.auto: every combination of stream_weights, recompute, activations and
// recompute_granularity (10; the project's schedule and partition resolved for each:
// resolve_auto_schedule) is predicted; the fastest that fits wins when at least 1% faster than the
// settings as set (any that fits, when those do not), among equals the one with fewest changes.
// Returns the project with the settings chosen and offload.auto off; one device (nothing to
// offload) or offload.auto off: the project as it is (offload.auto off).
struct offload_choice {
  bool weighed = false;               // offload.auto was on, on a pipeline
  std::vector<std::string> changes;   // "offload.stream_weights: true -> false" for each setting changed
  double given_step_s = 0, step_s = 0;  // predicted as set (0: does not fit or cannot run) and as chosen
};
result<project_config> resolve_auto_offload(const project_config& cfg, const llama_config& mc, const compute_rates& rates,
                                            offload_choice* why = nullptr);

// The throughput the automatic choice assumes (per device; the ranking depends on the ratio of
// compute to copy time, which offload.copy_gbps sets).
inline constexpr double auto_schedule_gflops = 100;

}  // namespace lorapipe
