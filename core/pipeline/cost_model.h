// The cost model of a project's pipeline, shared by `plan`, the trainer and (next) the planner:
// schedule options from the project, each stage's exact weight-block bytes as the executor lays
// them out (per-tensor alignment in the weight arena; a tied head counted once), activation and
// autograd-stash bytes, and simulator costs from FLOPs at an assumed throughput.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

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

// Simulator costs for the project's program: compute from FLOPs at `gflops` per device (backward
// twice the forward), exact stage weight bytes, boundary activation bytes, stash bytes, copy
// bandwidth from offload.copy_gbps; steady state (cross-iteration prefetches already resident).
sim_costs estimate_costs(const program& p, const llama_config& c, const project_config& cfg, double gflops);

}  // namespace lorapipe
