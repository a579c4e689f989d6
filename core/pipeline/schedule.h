// Pipeline schedules as data. A program is one instruction list per device; pure generator functions
// build GPipe, 1F1B, interleaved 1F1B and RoundPipe-style round-robin dispatch programs. Programs have
// a round-trip text form ("2F0", "1SEND_F1@2", "0PW") and a device-by-time grid printer that can mark
// a failing step. No torch here: the executor (torch) and the simulator (schedule_sim.h) consume these.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

enum class op : uint8_t {
  load_micro_batch,  // LOAD: tokens (and labels) of micro-batch m onto this device
  forward,           // F: run the stage on micro-batch m (no graph kept if a RECOMPUTE follows)
  backward,          // B: backward of the stage (from the graph of F or of RECOMPUTE)
  recompute,         // R: forward again from the stage's checkpointed input, keeping the graph
  send_act,          // SEND_F: stage output of m to `peer`
  recv_act,          // RECV_F: stage input of m from `peer`
  send_grad,         // SEND_B: gradient w.r.t. the stage input of m to `peer`
  recv_grad,         // RECV_B: gradient w.r.t. the stage output of m from `peer`
  prefetch_weights,  // PW: upload the stage's frozen weights into the device weight arena (async)
  release_weights,   // RW: free them
  offload_act,       // OFF: move the stage's checkpointed input of m to host memory (async)
  reload_act,        // ON: bring it back before RECOMPUTE (async)
  optimizer_step,    // STEP: AdamW on the stage's LoRA parameters
};
inline constexpr int num_ops = 13;
const char* op_mnemonic(op k);

struct instr {
  op kind = op::forward;
  int32_t stage = 0;
  int32_t micro = -1;  // -1 for per-stage instructions (PW, RW, STEP)
  int32_t peer = -1;   // device on the other side of SEND/RECV
  bool operator==(const instr&) const = default;
};

// A stage: a contiguous layer range [first_layer, last_layer); the first stage also embeds tokens,
// the head stage also runs final norm + LM head + loss.
struct stage_def {
  int32_t first_layer = 0;
  int32_t last_layer = 0;
  bool has_embed = false;
  bool has_head = false;
  bool operator==(const stage_def&) const = default;
};

struct program {
  std::string schedule;              // generator name
  int32_t micro_batches = 0;
  std::vector<stage_def> stages;     // indexed by instr.stage
  std::vector<std::vector<instr>> devices;
  int32_t num_devices() const { return static_cast<int32_t>(devices.size()); }
};

struct schedule_options {
  int32_t devices = 2;
  int32_t micro_batches = 4;
  int32_t virtual_stages = 2;    // interleaved: chunks per device
  bool recompute = true;         // checkpoint stage inputs, recompute before backward
  bool offload_activations = true;  // move checkpoints to host between F and B
  bool stream_weights = true;    // PW before first use, RW after last use in the iteration
  // Layers per stage for make_schedule (bound schedules: every stage; round-robin: the forward
  // stages, any number of them); empty = even_partition.
  std::vector<int32_t> stage_layers;
  // Round-robin: layers per backward stage, from layer 0 up to the fused tail's first layer; empty =
  // one layer each.
  std::vector<int32_t> backward_layers;
};

// Even split of n_layers into n_stages contiguous ranges (earlier stages get the remainder), or
// explicit sizes. The first stage embeds, the last one has the head.
std::vector<stage_def> even_partition(int32_t n_layers, int32_t n_stages);
result<std::vector<stage_def>> partition_from_sizes(int32_t n_layers, const std::vector<int32_t>& sizes);

// Bound schedules: stage s runs on device s % devices.
result<program> make_gpipe(const std::vector<stage_def>& stages, const schedule_options& o);
result<program> make_1f1b(const std::vector<stage_def>& stages, const schedule_options& o);
// Megatron interleaved 1F1B: stages.size() == devices * virtual_stages; micro_batches % devices == 0.
result<program> make_interleaved(const std::vector<stage_def>& stages, const schedule_options& o);
// RoundPipe stateless dispatch: forward stages then backward stages (reversed layer order), each
// stage x all micro-batches sent to the next device in turn; backward stages may be finer than
// forward ones; the last forward stage carries the head and is fused with the tail backward.
result<program> make_round_robin(const std::vector<stage_def>& forward_stages,
                                 const std::vector<stage_def>& backward_stages, const schedule_options& o);
// By name: gpipe, 1f1b, interleaved, round-robin, with o.stage_layers (and o.backward_layers) or
// default partitions for n_layers.
result<program> make_schedule(const std::string& name, int32_t n_layers, const schedule_options& o);
const std::vector<std::string>& schedule_names();
// How many stages make_schedule(name, n_layers, o) partitions the layers into (round-robin: its
// forward stages); the length o.stage_layers must have (round-robin: the default; any count from 1
// to n_layers may be given).
int32_t schedule_stage_count(const std::string& name, int32_t n_layers, const schedule_options& o);
// The forward half of a training program, for evaluation on the same devices and stages: each
// device keeps its LOAD_MICRO_BATCH, FORWARD, SEND_ACT, RECV_ACT and the PREFETCH/RELEASE pairs of
// the stages it runs forward (in the training order); backward, recompute, gradient transfers,
// offloads and optimizer steps are dropped.
program forward_only(const program& training);

// The layer boundaries whose inputs each forward stage checkpoints (forward stage -> boundaries):
// for every stage with a RECOMPUTE, its first layer (per_layer: each of its layers), saved by the
// forward stage whose layers contain it (forward and backward partitions may differ, as in
// round-robin). Boundary 0 holds the token ids. The executor saves exactly these; the simulator
// and the memory plan charge them.
std::map<int32_t, std::set<int32_t>> checkpoint_boundaries(const program& p, bool per_layer);

// Text form: header lines "schedule NAME micro_batches M", "stage i first last [embed] [head]",
// then "dN: instr instr ...". parse(to_text(p)) == p.
// What a SEND/RECV carries: the activation ('A') leaving a stage at its last layer, or the
// gradient ('G') leaving it at its first layer; `boundary` is that layer index.
struct message {
  char kind = 'A';
  int32_t boundary = 0;
};
message message_of(const program& p, const instr& in);

std::string instr_to_text(const instr& i);
result<instr> parse_instr(const std::string& s);
std::string program_to_text(const program& p);
result<program> parse_program(const std::string& text);

// Device-by-time grid: one row per device, one column per instruction slot. When `mark_device`
// >= 0, the instruction at (mark_device, mark_index) is bracketed as [>...<].
std::string program_grid(const program& p, int32_t mark_device = -1, int32_t mark_index = -1);

}  // namespace lorapipe
