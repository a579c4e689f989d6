// The layer partition of a project's pipeline: which contiguous layers each stage runs. `auto`
// balances stages by their predicted time on the speed of the device that runs them (HetPipe-style
// balancing for devices of different speed): a min-max dynamic programme over per-layer costs gives
// a start, then the simulator (with the memory plan when offload.device_memory_mb is set) refines it
// by moving one layer across a boundary at a time. Round-robin has forward and backward stages of
// their own (RoundPipe's asymmetric partition): the search also takes the number of forward stages
// and the backward partition (parallel.backward_partition). Torch-free; shared by `plan`, `auto`,
// the trainer and the GUI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/result.h"
#include "core/pipeline/cost_model.h"
#include "core/pipeline/schedule.h"
#include "core/project/llama_config.h"
#include "core/project/project.h"

namespace lorapipe {

// Contiguous partition of layer costs `layer_s` into stage_speed.size() stages of at least one layer
// each, minimising the largest stage time (sum of its layers' costs, plus embed_s on the first and
// head_s on the last stage, divided by the stage's speed); among those, the one with the smallest sum
// of squared stage times, then the one whose earlier stages take more layers (as even_partition
// does). Needs layer_s.size() >= stages >= 1.
// With `last_layer_s` given, the last stage's layers cost that instead of layer_s (round-robin's fused
// tail runs its layers forward and backward).
std::vector<int32_t> min_max_partition(const std::vector<double>& layer_s, double embed_s, double head_s,
                                       const std::vector<double>& stage_speed, const std::vector<double>& last_layer_s = {});

// partition_choice (cost_model.h): what choose_partition returns.
// parallel.partition for the project's (resolved, pipelined) schedule: given sizes, the even
// partition, or for auto the balanced one when the simulator predicts it at least 2% faster than
// even (else even: the partition every schedule was tested with). Round-robin: parallel.partition
// and parallel.backward_partition, each given or searched (auto: the forward stage count and sizes,
// the backward stage count and sizes), taken when at least 2% faster than the even forward
// partition with one layer per backward stage. Errors name the field.
result<partition_choice> choose_partition(const project_config& cfg, const llama_config& mc, const compute_rates& rates);
// parallel.backward_partition as a run records it: "per-layer" or "2,2,1" (empty for bound schedules).
std::string backward_partition_text(const partition_choice& c);

// The project's program: the schedule generator with choose_partition's sizes (a single-device
// project: one gpipe stage over every layer).
result<program> project_program(const project_config& cfg, const llama_config& mc, const compute_rates& rates);
// The same with the layers per stage already chosen (ignored for a single-device project; round-robin:
// `backward` layers per backward stage, empty = one each).
result<program> partitioned_program(const project_config& cfg, const llama_config& mc, const std::vector<int32_t>& sizes,
                                    const std::vector<int32_t>& backward);

// "3,2" for {3, 2}.
std::string partition_text(const std::vector<int32_t>& sizes);

}  // namespace lorapipe
