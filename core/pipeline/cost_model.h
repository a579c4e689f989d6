// The cost model of a project's pipeline, shared by `plan`, the trainer and (next) the planner:
// schedule options from the project, each stage's exact weight-block bytes as the executor lays
// them out (per-tensor alignment in the weight arena; a tied head counted once), activation and
// autograd-stash bytes, and simulator costs from FLOPs at an assumed throughput.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/base/result.h"
#include "core/pipeline/memory_plan.h"
#include "core/pipeline/schedule.h"
#include "core/pipeline/schedule_sim.h"
#include "core/project/llama_config.h"
#include "core/project/project.h"

namespace lorapipe {

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

// Bytes an autograd graph keeps per layer for `tokens` tokens (activation memory model shared with
// the simulator and the executor's arena accounting).
double stash_bytes_per_layer(const llama_config& cfg, int64_t tokens, size_t elem_bytes);

// FLOPs of one decoder layer's forward, and of the final norm + LM head's, for a micro-batch of `rows`
// sequences of `seq_len` tokens (a backward costs twice the forward).
double layer_forward_flops(const llama_config& c, int64_t rows, int64_t seq_len);
double head_forward_flops(const llama_config& c, int64_t rows, int64_t seq_len);

// Simulator costs from FLOPs at `gflops` per device (backward twice the forward) for micro-batches
// of `rows` sequences of `seq_len` tokens in `elem`-byte compute dtype: exact stage weight bytes,
// boundary activation, stash, head working set and input bytes; copies at `copy_bytes_per_s`
// (0 = instant); steady state. What the executor plans with when nobody gave it a plan.
sim_costs flop_costs(const program& p, const llama_config& c, int64_t rows, int64_t seq_len, size_t elem, double gflops,
                     double copy_bytes_per_s);

// What the memory plan needs besides the program and its simulation, from the model's config:
// the weight arenas, each layer's LoRA A and B in the compute dtype (r x (in + out) per adapted
// projection), the RoPE tables (as the loader makes them), the host's frozen and LoRA bytes.
// lora_targets: names as in lora.targets (fit_lora_targets applied here).
memory_inputs memory_inputs_of(const program& p, const llama_config& c, size_t elem, int64_t lora_r,
                               const std::vector<std::string>& lora_targets);
// The project's memory plan for its program (estimate_costs at `gflops` for the timing).
memory_plan project_memory_plan(const program& p, const llama_config& c, const project_config& cfg, double gflops);

// Simulator costs for the project's program: compute from FLOPs at `gflops` per device (backward
// twice the forward), exact stage weight bytes, boundary activation bytes, stash bytes, copy
// bandwidth from offload.copy_gbps, device speeds from parallel.device_speeds, recompute granularity
// from offload.recompute_granularity; steady state
// (cross-iteration prefetches already resident).
sim_costs estimate_costs(const program& p, const llama_config& c, const project_config& cfg, double gflops);

// parallel.schedule "auto": what the planner weighed and chose. One device: "single". Several:
// every pipeline schedule (schedule_names()) with each micro-batch count in {devices, 2 x devices}
// that divides run.batch_size, generated, checked and simulated with estimate_costs at `gflops`; a
// candidate whose memory plan peaks above offload.device_memory_mb (when set) does not fit. The
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
};
struct schedule_choice {
  std::string schedule;             // "single" on one device
  int32_t micro_batches = 1;
  std::vector<schedule_candidate> candidates;  // feasible ones fastest first, then the others
};
result<schedule_choice> choose_schedule(const project_config& cfg, const llama_config& mc, double gflops);
// The project with schedule "auto" replaced by choose_schedule's choice and, for a pipeline, partition
// "auto" by choose_partition's layer counts (what a run records and trains).
result<project_config> resolve_auto_schedule(const project_config& cfg, const llama_config& mc, double gflops);
// The throughput the automatic choice assumes (per device; the ranking depends on the ratio of
// compute to copy time, which offload.copy_gbps sets).
inline constexpr double auto_schedule_gflops = 100;

}  // namespace lorapipe
