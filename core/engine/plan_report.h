// The plan of a project before anything runs: its pipeline program, checked and simulated with the
// cost model (FLOPs at an assumed throughput, the executor's exact stage weight bytes), the weight
// arena each device reserves, the head's chunked working set, and the transport of every link.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/base/result.h"
#include "core/pipeline/cost_model.h"
#include "core/pipeline/partition_search.h"
#include "core/pipeline/schedule.h"
#include "core/pipeline/schedule_sim.h"
#include "core/pipeline/transport.h"
#include "offload/device_probe.h"
#include "core/project/project.h"

namespace lorapipe {

struct plan_report {
  // parallel.schedule as the project asked for it; when "auto", `schedule_candidates` holds what the
  // planner weighed (feasible ones fastest first) and prog is its choice.
  std::string requested_schedule;
  // offload.auto: what the planner changed (resolve_auto_offload), and the offload settings planned.
  offload_choice offload_auto;
  bool stream_weights = true, activations = true, recompute = true;
  std::string recompute_granularity;
  std::vector<schedule_candidate> schedule_candidates;
  std::string schedule;  // what runs: "single", or prog's pipeline schedule (a single run's prog is one gpipe stage)
  program prog;
  // Layers per stage and how they were chosen (parallel.partition: given, even, or balanced by
  // device speed), with the even partition's simulated step for comparison (pipelines only).
  partition_choice partition;
  std::vector<double> device_speeds;
  sim_result sim;
  int64_t tokens_per_micro_batch = 0;
  double gflops = 0;
  // What compute was charged (compute_rates::describe): the project's layer profile when one is
  // cached or given (then the choices and the prediction use it), else FLOPs.
  std::string compute;
  std::shared_ptr<const measured_compute> measured;  // the layer profile used, if any
  std::vector<size_t> stage_bytes;           // weight block per stage
  std::vector<weight_arena_plan> arenas;     // per device
  std::vector<device_facts> devices;
  std::vector<link_transport> links;
  // The head stage's loss runs on labelled positions in chunks (head_loss_sum): rows per chunk and
  // the working set of one chunk (f32 logits, softmax, gradient) on the device holding the head,
  // next to what the same for full logits of a micro-batch would take.
  int64_t head_chunk_rows = 0;
  int64_t head_working_bytes = 0;
  int64_t full_logits_bytes = 0;
  // Every buffer with its home and lifetime, each device's peak (the bound the executor checks
  // before allocating, and the expected arena peak) and what it holds then, the host's total.
  memory_plan memory;
  // With offload.device_memory_mb set, or on GPUs (90% of their free memory, probed or now): why
  // the plan does not fit it (naming the device, the shortfall and the buffer), empty when it fits.
  std::string memory_refusal;
  // The bound the choices were made to fit, in MiB a device (0: unbounded).
  double memory_bound_mb = 0;
  // How the choices costed copies on GPUs whose rate the project leaves unstated
  // (with_planning_copy_rates): "12.60 GB/s, estimated from the PCIe links (...)"; empty when they
  // used the project's offload.copy_gbps (or free copies, without any rate known).
  std::string copy_rates;
};

// The choices (schedule auto, partition auto) are made with the trainer's inputs: the layer profile
// (`profile`, else the project's cached one: project_compute_rates), else FLOPs at
// auto_schedule_gflops. Without a profile `gflops` sets the prediction; the probe's measured copy
// rate (with_probed_bandwidth), when given, costs the copies. On GPUs without offload.copy_gbps, the
// choices too cost copies at the inventory's rates (a probe's, or gpu_planning_inventory's: a cached
// probe, else the PCIe estimate), as the trainer's do, and the memory plan is made with that rate
// (the run records it). The choices fit offload.device_memory_mb,
// or when it is 0 the GPU devices' capacities in the probe (a probe, or gpu_planning_inventory as the
// trainer uses), the smallest device's for all.
result<plan_report> make_plan(const project_config& cfg, double gflops, const device_inventory* probe = nullptr,
                              std::shared_ptr<const measured_compute> profile = nullptr);

// Before a run is recorded: a project whose memory plan exceeds offload.device_memory_mb (or on
// GPUs without it, 90% of their free memory) is refused with check_memory_plan's message (a no-op
// on CPU virtual devices without a limit). `cfg`'s schedule resolved.
status check_project_memory(const project_config& cfg);
// The same with the GPU devices' capacities from `gpus` (gpu_planning_inventory; nullptr: unbounded
// without a limit).
status check_project_memory(const project_config& cfg, const device_inventory* gpus);

// The model's config.json (or a llama2.c checkpoint's header) a project names.
result<llama_config> project_model_config(const project_config& cfg);
// The project with parallel.schedule "auto" and, for a pipeline, parallel.partition "auto" resolved
// (resolve_auto_schedule with project_compute_rates). What a run records and trains.
// Its choices fit offload.device_memory_mb, or when that is 0 the GPUs' memory now, and cost copies
// on GPUs at offload.copy_gbps, or when that is 0 at gpu_planning_inventory's rates (read only when
// something is to be chosen), which are then recorded in offload.copy_gbps (and copy_links): the
// executor's memory plan and a resume cost copies as the choices did (GPU copies are never throttled).
result<project_config> resolve_project_schedule(const project_config& cfg);
// The same with the GPU devices' capacities and copy rates taken from `gpus` (nullptr: unbounded
// without a limit, copies at offload.copy_gbps).
result<project_config> resolve_project_schedule(const project_config& cfg, const device_inventory* gpus);

// offload.auto's choice in words (empty when offload.auto was off): the settings planned, what
// changed, and the predicted step against the settings as set.
std::string offload_choice_text(const plan_report& r);
// Why a feasible schedule candidate lost to the chosen one (`winner`, the first): "; lost: 4.6% slower",
// "; lost: as fast, more micro-batches" (or "listed later"); "; chosen" for the winner itself.
std::string candidate_loss_text(const schedule_candidate& c, const schedule_candidate& winner);

}  // namespace lorapipe
