// Questions a user asks of a plan before launch, answered with the same planner the trainer uses:
// "what if" a setting changed (the sequence length, the devices, a device added or removed, P2P
// off, ...: planned again and compared with the plan as it is), "how far can I go" (the longest
// sequence and the most sequences per micro-batch whose memory plans fit every device), and
// "keep this" (the plan's choices written into the project file, the rest of the file untouched).
// Torch-free; shared by `lorapipe-cli plan` and the GUI's Plan page.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/base/result.h"
#include "core/engine/device_inventory.h"
#include "core/engine/plan_report.h"
#include "core/project/project.h"

namespace lorapipe {

// The headline numbers of a plan.
struct plan_summary {
  std::string schedule;                 // concrete (single, gpipe, 1f1b, ...)
  int32_t micro_batches = 1;
  std::string partition;                // layers per stage, "3,2" (empty for single; "3,3,2 / backward 2,2,2" for round-robin's own backward stages)
  std::string devices;                  // parallel.devices
  double step_s = 0;                    // simulated step
  double tokens_per_s = 0;              // run.batch_size x data.seq_len per step
  double bubble_ratio = 0;
  std::vector<double> peak_bytes;       // per device: the memory plan's bound
  double host_bytes = 0;
  std::string refusal;                  // why it does not fit offload.device_memory_mb (empty: fits)
};
plan_summary summarize_plan(const project_config& cfg, const plan_report& rep);
// Tokens per second as people read them: "36077", "12.5", "0.376".
std::string tokens_per_s_text(double tokens_per_s);

// A what-if question: space-separated settings, each `field=value` with a project field (in full or
// by an unambiguous last part: seq_len, devices, micro_batches, ...) and two shorthands:
// `p2p=off|on` (parallel.transport host | peer) and `devices=+N|-N` (devices added to or removed
// from the end of parallel.devices). When the device count changes, layer counts and device speeds
// given for the old devices are dropped (partition auto; speeds extended with 1 or cut).
struct what_if_change {
  std::string field, before, after;
};
struct what_if_variant {
  project_config cfg;
  std::vector<what_if_change> changes;
  std::vector<std::string> notes;  // a change the planner overrides (micro-batches under schedule auto)
};
result<what_if_variant> apply_what_if(const project_config& cfg, const std::string& question);

struct what_if_answer {
  std::string question;
  std::vector<what_if_change> changes;
  std::vector<std::string> notes;
  plan_summary before, after;
  std::string error;  // the variant cannot be planned (invalid setting, no schedule fits, ...)
};
// Plans the variant as make_plan(cfg, gflops, probe, profile) would (the probe only while the
// devices are the same; `profile`, the layer profile the plan as it is used, if any, scaled by FLOPs
// to the variant's shapes) and pairs it with `base`, the summary of the plan as it is.
what_if_answer what_if(const project_config& cfg, const plan_summary& base, const std::string& question, double gflops,
                       const device_inventory* probe, std::shared_ptr<const measured_compute> profile = nullptr);
std::string what_if_text(const what_if_answer& a);

// The offload settings the planner does not choose (offload.auto off), each flipped on its own (weight streaming,
// activation offload, recompute, recompute granularity) and planned as what-if questions; those
// that still fit and make the step at least 1% faster, fastest first. Pipelines only. Pass the
// project with the plan's choices made (with_plan_choices) to hold its schedule and partition.
std::vector<what_if_answer> faster_offload_settings(const project_config& cfg, const plan_summary& base, double gflops,
                                                    const device_inventory* probe, std::shared_ptr<const measured_compute> profile);

// The device order for the plan (Mobius' cross mapping checked by the simulator): cross_mapping's
// order is planned in full (devices, speeds and capacities moved with their devices, shared links
// costed: with_probed_bandwidth) and kept only when its predicted step is at least 1% faster than
// `given`'s (make_plan(cfg, gflops, &probe, ...)) and it fits; otherwise `order.setting` is empty and
// `order.why` says why.
struct device_order_answer {
  device_order order;
  double given_step_s = 0, mapped_step_s = 0;  // predicted (0 = not planned)
  // When the order is kept: the project in it and its plan (what `plan --write` stores).
  std::optional<project_config> mapped_cfg;
  std::optional<plan_report> mapped_plan;
};
device_order_answer plan_device_order(const project_config& cfg, const plan_report& given, double gflops, const device_inventory& probe);

// The memory each pipeline device may use: the probe's capacities when given, else
// offload.device_memory_mb on every device; 0 = unbounded (CPU devices without a limit; CUDA
// devices are known only from a probe).
std::vector<size_t> project_capacity(const project_config& cfg, const device_inventory* probe);
// The smallest capacity given (0 = unlimited ones are skipped; 0 when none is limited).
size_t smallest_capacity(const std::vector<size_t>& capacity);

// The largest data.seq_len (run.batch_size as it is) and the most sequences per micro-batch
// (data.seq_len as it is) whose memory plans fit every device's capacity, with the project's
// (resolved) schedule and partition held fixed. 0 when not even the smallest fits.
struct fit_limits {
  bool bounded = false;       // some device has a capacity; else nothing below is searched
  std::string note;           // why not searched, or what the answer is limited by
  int64_t max_seq_len = 0;
  bool seq_len_at_model_limit = false;  // the model's context length stops the search, not memory
  int64_t max_rows_per_micro_batch = 0;
  int64_t rows_per_micro_batch = 0;     // as the project has it, for comparison
};
result<fit_limits> largest_fit(const project_config& cfg, const std::vector<size_t>& capacity);
std::string fit_limits_text(const fit_limits& f, const project_config& cfg);

// The project with the plan's choices made concrete: parallel.schedule, micro_batches and partition
// as the plan has them (partition "even" when the planner kept the even one), for round-robin
// parallel.backward_partition (per-layer or counts; the forward partition as counts with them), and
// with offload.auto the offload settings it chose (offload.auto then off).
project_config with_plan_choices(const project_config& cfg, const plan_report& rep);

// The project file with the plan's choices stored: parallel.schedule, micro_batches, partition and backward_partition
// (with offload.auto: the offload settings it chose, and offload.auto false)
// (and parallel.devices / schedule overrides the plan was made with; the device order, device speeds
// and copy links of `planned`); other fields and their order are kept as the file has them. Written
// atomically.
status write_plan_choices(const std::filesystem::path& project_file, const project_config& planned, const plan_report& rep);

}  // namespace lorapipe
