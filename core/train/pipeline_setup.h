// Building a project's pipeline: devices from parallel.devices, the program from the schedule
// generator (checked by the simulator), transports per link, the executor and its memory plan,
// reported as one plan_event. And the per-step trace next to the simulator's prediction.
// Internal to core/train.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/base/events.h"
#include "core/pipeline/pipeline_executor.h"
#include "core/pipeline/schedule_sim.h"
#include "core/project/project.h"
#include "offload/device.h"

namespace lorapipe {

struct pipeline_rig {
  std::vector<std::unique_ptr<compute_device>> devices;  // outlive the executor (declared first)
  std::unique_ptr<pipeline_executor> executor;
  std::unique_ptr<pipeline_executor> evaluator;  // forward_only(program) on the same devices: validation
  plan_event plan;
  double bubble_ratio = -1;  // simulated with unit costs
  process_group* group = nullptr;  // several processes: the one the executors share
};

// The options of the project's devices: capacity (offload.device_memory_mb), copy throttle, threads,
// speeds, pinned budget. Errors name the field.
result<cpu_device_options> device_options_of(const project_config& cfg);

// The frozen tensors rank `rank` computes with: the layers (and embedding, head) of every stage that
// one of its device positions runs, in the program the project resolves to for this model.
result<weight_selection> rank_weight_selection(const project_config& cfg, const llama_config& mc, int rank, int world);
std::string describe_weight_selection(const weight_selection& sel);  // "layers 0-2, embedding"

// Several processes (base.processes): only this rank's devices are created (the others are null in
// `devices`), and the evaluator runs its forward half over the same processes.
result<pipeline_rig> build_pipeline(const project_config& cfg, const llama_weights& w, lora_adapters& lora, observer& obs,
                                    const pipeline_options& base);

// Validation on the pipeline devices: the batch's summed cross-entropy over its labels through the
// forward-only program (inputs, labels: i64 [b,T], b <= batch; padded to `batch` with rows whose labels
// are all ignored). Call release_weights() on the training executor before a validation's first batch
// and on the evaluator after its last (pipeline_validation does both). Throws on failure.
double pipeline_batch_loss(pipeline_rig& rig, const at::Tensor& x, const at::Tensor& y, int64_t batch);
// Greedy generation on the pipeline devices (the run's samples when it trains on GPUs; over several
// processes every rank calls it and gets the head rank's tokens): each new token
// is the argmax of the last position's logits from the forward-only program over the whole sequence
// so far (no KV cache: every micro-batch slot carries the same sequence). Stops after max_new tokens,
// after stop_id, at the context length, or when on_token returns false. Call inside a
// pipeline_validation scope. Throws on failure.
std::vector<int32_t> pipeline_greedy(pipeline_rig& rig, const std::vector<int32_t>& prompt, int64_t max_new, int32_t stop_id,
                                     int64_t context_length, const std::function<bool(int32_t)>& on_token);
class pipeline_validation {  // scope of one validation: the devices' weight arenas change hands
 public:
  explicit pipeline_validation(pipeline_rig& rig) : rig_(rig) { rig_.executor->release_weights(); }
  ~pipeline_validation() { rig_.evaluator->release_weights(); }
  pipeline_validation(const pipeline_validation&) = delete;
  pipeline_validation& operator=(const pipeline_validation&) = delete;

 private:
  pipeline_rig& rig_;
};

// The measured timeline of one step next to the simulator's prediction for the same program, with
// per-stage compute costs calibrated from this very measurement (mean F, R, B time per stage).
trace_event make_trace_event(const program& p, const pipeline_step_result& r, const plan_event& plan, int64_t step);

}  // namespace lorapipe
