// The memory plan as data, made before anything is allocated: every buffer a pipeline step holds
// (weight arena, LoRA weights and RoPE tables on each device, micro-batch inputs, boundary
// activations and gradients, checkpoints, autograd graphs, the head's working set; on the host the
// frozen weights, the LoRA master weights, gradients and AdamW state, offloaded checkpoints) with
// bytes, home and lifetime; per device the peak and what is held at that moment. The executor
// checks it against each device's capacity before it reserves anything (check_memory_plan), `plan`
// prints it and the GUI's Plan page draws it. Device-side timing and ordering come from the
// simulator's memory events, which mirror the executor's arena charges. Torch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/base/result.h"
#include "core/pipeline/schedule.h"
#include "core/pipeline/schedule_sim.h"
#include "offload/device_facts.h"

namespace lorapipe {

// What the plan needs beyond the program, the simulator's costs and its result.
struct memory_inputs {
  std::vector<weight_arena_plan> arenas;    // per device (plan_weight_arenas)
  std::vector<size_t> lora_layer_bytes;     // per layer: its LoRA A and B as a device holds them
  size_t rope_bytes = 0;                    // RoPE tables, on every device
  size_t host_weight_bytes = 0;             // frozen weights in (pinned) host memory
  size_t lora_master_bytes = 0;             // f32 LoRA parameters on the host (gradients and AdamW
                                            // moments take as much again each)
  size_t alignment = 512;                   // every device block rounded up to this (CUDA: 512; CPU devices: 64)
  std::vector<workspace_charge> workspaces; // per device: cuBLAS workspaces outside the arenas (CUDA;
                                            // none on CPU devices or when empty)
};

// Per device and on the host ("host" = -1): one buffer of the plan.
struct planned_buffer {
  std::string name;      // "weight arena", "graphs of stage 2", ...
  int32_t home = -1;     // device index, -1 = host
  double bytes = 0;      // its size (for per-micro-batch buffers: one of them)
  int32_t count = 1;     // how many of them a step makes
  std::string lifetime;  // "whole run", "step", "F to B", ...
};

struct device_peak {
  double peak_bytes = 0;  // the largest total held at once: a bound the executor enforces (it checks
                          // capacity against this; the run cannot hold more)
  double expected_peak_bytes = 0;  // the same with copies taking their simulated time (what a
                                   // device's arena peak comes to; <= peak_bytes)
  double at_s = 0;        // when (simulated step time)
  // What is held at that moment, by buffer kind: "weight arena", "LoRA weights", "RoPE tables",
  // "cuBLAS workspaces" (CUDA), then mem_kind_name() of the simulated kinds other than weights.
  std::vector<std::pair<std::string, double>> held;
};

struct memory_plan {
  std::vector<planned_buffer> buffers;
  std::vector<device_peak> devices;
  double host_bytes = 0;  // host buffers together (offloaded checkpoints: all of a step at once)
  // Per device: what is held for the whole step (name, bytes), then the step's allocations and
  // frees in the order the plan replays them (the simulator's events but weights, which live in
  // the arena).
  std::vector<std::vector<std::pair<std::string, double>>> resident;
  std::vector<std::vector<mem_event>> replay;
};

// The plan for a program given its simulation (simulate(p, costs) with costs.input_bytes,
// token_bytes, act_bytes, stash_bytes_per_layer and head_bytes set).
memory_plan make_memory_plan(const program& p, const sim_costs& costs, const sim_result& sim, const memory_inputs& in);

// Refuses, before anything is allocated, a plan whose peak exceeds a device's capacity: the error
// names the device, how much is missing (bytes and percent) and the buffer whose allocation crosses
// the capacity in the plan's replay, with what is held at that moment.
status check_memory_plan(const memory_plan& plan, const std::vector<size_t>& capacity, const std::vector<std::string>& device_names);

// The plan as a table: one line per device (peak and what is held at it), then the host.
std::string memory_plan_text(const memory_plan& plan, const std::vector<std::string>& device_names);

}  // namespace lorapipe
