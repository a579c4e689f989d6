// Discrete-event simulator for schedule programs. Checks that every SEND has its RECV (pairing) and
// that the program cannot deadlock, then reports makespan, bubble ratio and peak memory per device
// from per-stage compute times and per-device copy bandwidths. A failure names the stuck step and
// comes with the grid marking it.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/pipeline/schedule.h"

namespace lorapipe {

struct sim_costs {
  std::vector<double> forward_s;    // per stage, one micro-batch
  std::vector<double> backward_s;   // per stage, one micro-batch (without recompute)
  std::vector<double> recompute_s;  // per stage, one micro-batch (0 = same as forward)
  // Relative compute speed per device (empty or missing = 1): a compute on device d takes its
  // stage's time / device_speed[d] (the stage times are those of a speed-1 device).
  std::vector<double> device_speed;
  std::vector<double> weight_bytes;  // per stage
  double act_bytes = 0;             // one boundary activation (or gradient) of one micro-batch
  double stash_bytes_per_layer = 0;  // autograd graph kept per layer per micro-batch
  double head_bytes = 0;            // the head stage's chunked loss working set, during its forward and backward
  // A micro-batch's token ids and labels on a device (from its first F or R there to the end of the
  // step), and the token ids alone (the checkpoint at layer 0).
  double input_bytes = 0;
  double token_bytes = 0;
  // Recompute a layer at a time (pipeline_options::layer_recompute): every layer input of a
  // recomputed stage is checkpointed (and offloaded); RECOMPUTE keeps nothing; BACKWARD holds one
  // layer's graph at a time and uses the checkpoints up from the last layer.
  bool per_layer_recompute = false;
  // backward_s already holds the recompute (times measured with per_layer_recompute, where BACKWARD
  // does both); otherwise a per-layer BACKWARD costs backward_s plus the recompute.
  bool backward_includes_recompute = false;
  double h2d_bytes_per_s = 0;       // 0 = infinitely fast copies
  double d2h_bytes_per_s = 0;
  // Per device: the host link its copies share with the devices of the same number (GPUs behind one
  // PCIe switch, offload.copy_links) at the rates above each way, divided equally among the copies
  // in flight on it at once (simulate replays the program until that sharing settles); empty or
  // negative = a link of its own (its three engines independent).
  std::vector<int32_t> copy_link;
  double copy_latency_s = 0;
  // CPU virtual devices compute on the host's cores: at most host_compute_slots computes (cores /
  // threads per device) run at full speed at once, more divide them equally. Per device: true = on
  // the host's cores. 0 = as many as there are devices (no sharing; GPUs, or cores enough).
  double host_compute_slots = 0;
  std::vector<bool> on_host_cores;
  // Steady state: a stage prefetched again after a device's last compute (cross-iteration prefetch)
  // is already resident when the program starts, so its first PREFETCH costs nothing.
  bool steady_state = false;
  // Links (from, to) with rendezvous semantics (NCCL): the transfer happens once both ends have
  // posted and every earlier operation on the same communicator has completed (NCCL runs a
  // communicator's operations in order; past its buffer sizes a send waits for its receive). Other
  // links are mailboxes: a SEND never waits for its RECV.
  std::vector<std::pair<int32_t, int32_t>> rendezvous;
  // Links (from, to) that copy device to device (P2P, parallel.transport peer): one transfer on the
  // sender's download engine at its rate straight into the receiver, no host staging and no upload.
  std::vector<std::pair<int32_t, int32_t>> direct;
  // How rendezvous links map to communicators: false = one per direction (what the executor makes);
  // true = one per pair of devices carrying both directions (one ncclCommInitAll communicator per
  // device gives this): then a device that sends before it receives from a peer doing the same
  // deadlocks, which 1F1B does on two GPUs.
  bool shared_pair_communicator = false;
};

// Uniform costs: every stage's forward takes t_f, backward t_b, recompute t_f.
sim_costs uniform_costs(const program& p, double t_f, double t_b);

// When one compute instruction (F, R, B) runs in the simulation.
struct sim_interval {
  int32_t device = 0, index = 0;  // position in the device's instruction list
  instr in;
  double start_s = 0, end_s = 0;
};

// What a device holds, by kind (the memory plan's buffers over time).
enum class mem_kind : uint8_t {
  weights,      // a stage's frozen weights (PREFETCH..RELEASE)
  inputs,       // token ids and labels of a micro-batch
  activations,  // a boundary activation or gradient: from its F/B (or arrival) to its SEND's copy (or use)
  checkpoints,  // a recomputed stage's saved input: F to OFFLOAD, or RELOAD/F to RECOMPUTE
  graphs,       // an autograd graph kept for BACKWARD (F or RECOMPUTE to BACKWARD)
  head,         // the head's chunked loss working set while the head computes
};
inline constexpr int num_mem_kinds = 6;
const char* mem_kind_name(mem_kind k);  // "weights", "inputs", ...
struct mem_event {
  double t = 0;      // the latest an allocation's free / the earliest an arrival can happen, as the
                     // executor enforces it (outgoing copies done when the next compute ends;
                     // arrivals uploaded once the compute before their RECV has begun)
  double bytes = 0;  // + allocated, - freed
  mem_kind kind = mem_kind::weights;
  int32_t stage = -1, micro = -1;  // what it belongs to (-1: n/a)
  double t_expected = -1;  // when copies taking their simulated time do it (-1: at t)
};

struct sim_result {
  bool ok = false;
  std::string error;             // first problem found, with device and step
  int32_t fail_device = -1, fail_index = -1;
  std::string grid;              // on failure: the program grid with the failing step marked
  double makespan_s = 0;
  double bubble_ratio = 0;       // 1 - compute busy time / (devices x makespan)
  std::vector<double> busy_s;    // compute time per device
  std::vector<double> peak_bytes;  // per device: weights + activations + graphs at their peak
  // Per device, in the order the memory plan replays them (time, frees before allocations at the
  // same time).
  std::vector<std::vector<mem_event>> memory;
  std::vector<sim_interval> timeline;  // compute instructions in simulated time
};

sim_result simulate(const program& p, const sim_costs& c);

// Costs with compute times measured on the devices: each stage's forward, backward and recompute
// time becomes the median of `measured` (a step's trace of F, B and R) where the stage has one,
// each measurement scaled by its device's c.device_speed to a speed-1 time.
// What the memory plan and the step-time prediction use once a step has run (a profile).
sim_costs with_measured_compute(const program& p, sim_costs c, const std::vector<sim_interval>& measured);

// The weight arena a device needs (memory plan, made before anything is allocated): every
// PREFETCH_WEIGHTS places its stage's block (stage_bytes[stage]) best fit at `alignment`,
// RELEASE_WEIGHTS frees it, over two iterations so stages left resident or prefetched for the next
// iteration carry over, exactly as the executor does. bytes = the high-water offset. Blocks of
// different sizes can fragment the arena; when equal slots of the device's largest stage need less
// (the classic double buffer), every block is placed as one such slot instead.
struct weight_arena_plan {
  size_t bytes = 0;
  int32_t max_stages = 0;  // stages held at once (2 = double buffering)
  size_t slot_bytes = 0;   // > 0: every block takes this many bytes (fixed slots)
};
std::vector<weight_arena_plan> plan_weight_arenas(const program& p, const std::vector<size_t>& stage_bytes, size_t alignment);

}  // namespace lorapipe
