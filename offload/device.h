// The device interface the pipeline executor drives: a memory arena (capacity-limited, OOM like a
// GPU), three copy engines (weight upload, activation upload, download: so weight prefetch never
// waits in line before the critical activation traffic; on a shared link, offload.copy_links, the two
// uploads take turns), the tensor copies those engines run, a preallocated
// weight arena that PREFETCH_WEIGHTS places frozen weights in, an exact-size host staging pool, and
// the setup of a compute thread. Implementations: CPU virtual devices (here) and CUDA devices
// (offload/cuda/). What differs between them is where memory lives and how bytes get there; the
// placement, accounting and release logic is shared (device.cpp) and so runs in the CPU tests.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "core/base/result.h"
#include "offload/device_facts.h"
#include "offload/copy_engine.h"
#include "offload/memory_arena.h"
#include "offload/staging_pool.h"

namespace lorapipe {


struct weight_region;  // the preallocated memory behind a weight arena (device.cpp)
class process_group;   // offload/process_group.h

// One block of a weight arena, allocated by place_weights on the worker thread (so placement follows
// program order) and filled by upload_weights on the weight-upload engine. The block goes back to
// the arena when the placement and every tensor made from it are gone.
struct weight_placement {
  std::shared_ptr<void> block;  // owns the arena block
  char* base = nullptr;         // device address of the block
  std::vector<size_t> offsets;  // per tensor, from base
  size_t bytes = 0;
};

class compute_device {
 public:
  virtual ~compute_device();
  virtual const std::string& name() const = 0;
  virtual memory_arena& arena() = 0;
  virtual copy_engine& weight_upload() = 0;  // host -> device: frozen weights (PREFETCH_WEIGHTS)
  virtual copy_engine& upload() = 0;         // host -> device: reloaded checkpoints, received tensors
  virtual copy_engine& download() = 0;       // device -> host: offloaded checkpoints, sent tensors
  virtual int compute_threads() const = 0;
  virtual c10::Device torch_device() const = 0;
  virtual int gpu() const { return -1; }  // the CUDA ordinal behind the device; -1 on CPU
  // CUDA: the caching allocator's peak on the GPU behind this device since the last reset (the weight
  // arenas are allocated apart from it); nullopt on CPU, where the arena is the memory. Compared with
  // the memory plan after the first step (memory_plan_warnings).
  virtual std::optional<size_t> measured_gpu_peak_bytes() const { return std::nullopt; }
  virtual void reset_measured_peak() {}
  // What its compute libraries hold outside the arenas (CUDA: cuBLAS workspaces), charged by the
  // memory plan.
  virtual workspace_charge library_workspaces() const { return {}; }
  // Run on the copy engines' threads: the returned tensor is complete when the call returns.
  // copy_out lands in the staging pool (exact size; pinned on CUDA).
  virtual at::Tensor copy_in(const at::Tensor& host) = 0;
  virtual at::Tensor copy_out(const at::Tensor& on_device) = 0;
  // Peer transport: `src` (on device `from`) copied straight into this device, no host bounce.
  // Runs on `from`'s download engine. Only for links choose_transports() marked peer.
  virtual at::Tensor copy_from_peer(compute_device& from, const at::Tensor& src) = 0;
  // Called once by the executor's worker thread of this device before it computes.
  virtual void enter_compute_thread() = 0;
  // Called on the worker thread after each compute instruction (F, R, B) that took busy_s: a CPU
  // virtual device slower than the fastest of cpu_device_options::speed idles (fastest/speed - 1) x
  // busy_s to model a slower device. No-op elsewhere.
  virtual void pace_compute(double busy_s) { (void)busy_s; }
  virtual double compute_speed() const { return 1; }
  // The host link its copies share with other devices ("copy link 1": offload.copy_links on CPU
  // virtual devices), empty when it has one of its own.
  virtual std::string shared_link_name() const { return {}; }
  // NCCL transport (CUDA builds, after enable_nccl): stream-ordered send to / receive from the
  // pipeline device `peer`, called on this device's worker thread in program order; no host wait
  // (the received tensor is ready for this device's compute stream). Others throw device_error.
  virtual void nccl_send(int peer, const at::Tensor& t);
  virtual at::Tensor nccl_recv(int peer, at::IntArrayRef sizes, at::ScalarType dtype);
  // After a failure: aborts this device's NCCL communicators (ncclCommAbort), so that kernels and host
  // waits blocked on a peer that will never post end with an error. Idempotent; no-op without NCCL.
  virtual void abort_communication() {}

  // Weight arena: reserves exactly `bytes` of device memory for the device's lifetime, charged to
  // arena() (so activations get the rest). A second call with the same or a smaller size keeps the
  // arena; a larger one replaces it (no block may be in use then). Out of memory like a GPU.
  status reserve_weight_arena(size_t bytes);
  memory_arena* weight_arena() const;
  // A block for `host` tensors (each at a weight_alignment offset; exact total, or `slot_bytes` when
  // larger: fixed slots of the memory plan), or out of memory.
  result<weight_placement> place_weights(const std::vector<at::Tensor>& host, size_t slot_bytes = 0);
  // Copies `host` into the placement (weight-upload engine thread; complete on return). The tensors
  // alias the block and keep it alive.
  std::vector<at::Tensor> upload_weights(const weight_placement& p, const std::vector<at::Tensor>& host);
  staging_stats staging() const;

 protected:
  compute_device();
  // Device memory for a weight arena (freed by the returned pointer's deleter).
  virtual std::shared_ptr<void> allocate_region(size_t bytes) = 0;
  // Copies a contiguous host tensor to `dst` in device memory. Between begin and end (same thread)
  // copies may be asynchronous; after end they are complete.
  virtual void weight_upload_begin() {}
  virtual void copy_weights_to(void* dst, const at::Tensor& host) = 0;
  virtual void weight_upload_end() {}
  // A weight block went back to the arena (any thread). CUDA: later uploads into the arena must
  // wait until the compute stream has passed this point.
  virtual void weights_released() {}
  // Derived destructors call this first: no release notification reaches a half-destroyed device,
  // and the region's charge leaves arena() while it still exists.
  void detach_weight_arena();
  // Host staging memory (pinned on CUDA) for copy_out.
  std::shared_ptr<staging_pool> staging_;

 private:
  friend struct weight_region;
  std::shared_ptr<weight_region> region_;
};

struct cpu_device_options {
  size_t capacity_bytes = size_t{1} << 40;  // arena size; allocation beyond it fails like a GPU OOM
  double copy_bytes_per_s = 0;              // per copy engine; 0 = unthrottled
  double copy_latency_s = 0;
  int compute_threads = 1;
  // Per device (index -> speed; missing = 1): relative compute speed of CPU virtual devices; the
  // fastest runs at the host's speed, a device at half its speed takes twice as long.
  std::vector<double> speed;
  // CUDA: host bytes streamed weights may page-lock, shared by the pipeline's devices (0 = half of RAM).
  size_t pinned_budget_bytes = 0;
  // Test hook: called with "copy_in", "copy_out" or "copy_from_peer" before each such copy; may throw
  // (a failing transfer).
  std::function<void(const char* what)> copy_fault;
  // Per device (index -> link number, offload.copy_links; empty: a link of its own each): CPU virtual
  // devices with the same number share one host link of copy_bytes_per_s each way (make_devices
  // creates the links: h2d_link and d2h_link by index).
  std::vector<int> copy_link;
  std::vector<std::shared_ptr<shared_link>> h2d_link, d2h_link;
};

// A CPU "virtual device": tensors stay in host RAM, but every byte is accounted in the arena, frozen
// weights live in a real preallocated weight region, and every transfer goes through the throttled
// copy engines, so pipelines behave like real ones.
class cpu_device final : public compute_device {
 public:
  cpu_device(int index, const cpu_device_options& o);
  ~cpu_device() override;
  const std::string& name() const override { return name_; }
  memory_arena& arena() override { return arena_; }
  copy_engine& weight_upload() override { return wup_; }
  copy_engine& upload() override { return up_; }
  copy_engine& download() override { return down_; }
  int compute_threads() const override { return threads_; }
  c10::Device torch_device() const override { return c10::Device(c10::DeviceType::CPU); }
  at::Tensor copy_in(const at::Tensor& host) override;
  at::Tensor copy_out(const at::Tensor& on_device) override;
  at::Tensor copy_from_peer(compute_device& from, const at::Tensor& src) override;
  void enter_compute_thread() override;
  void pace_compute(double busy_s) override;
  double compute_speed() const override { return speed_; }
  std::string shared_link_name() const override { return link_; }

 protected:
  std::shared_ptr<void> allocate_region(size_t bytes) override;
  void copy_weights_to(void* dst, const at::Tensor& host) override;

 private:
  std::string name_;
  double speed_ = 1;
  double idle_per_busy_ = 0;  // fastest speed / this speed - 1
  memory_arena arena_;
  copy_engine wup_, up_, down_;
  int threads_;
  std::function<void(const char*)> fault_;
  std::string link_;
};

// "cpu", "cpu:N" -> N CPU virtual devices; "cuda:0,1,.." -> CUDA devices (CUDA builds with a GPU;
// an index may repeat to run several pipeline devices on one GPU).
// `here` (one flag per device; empty: all): the positions to create; the others stay null (devices of
// another process of the same pipeline; their GPUs need not exist on this machine). `on_this_host`
// (empty: `here`): the positions of every process on this machine, which share its GPUs' memory.
result<std::vector<std::unique_ptr<compute_device>>> make_devices(const std::string& spec, const cpu_device_options& o,
                                                                  const std::vector<bool>& here = {},
                                                                  const std::vector<bool>& on_this_host = {});
// What make_devices gives each GPU device of `spec` when no capacity is set, without creating
// any: 90% of each GPU's free memory now, split between the devices on it (all taken as on this
// machine). Empty for CPU virtual devices (unbounded) and in a build without CUDA.
result<std::vector<size_t>> gpu_device_budgets(const std::string& spec);
// The devices a spec names (names as the devices will have, GPU ordinals) without creating them.
result<std::vector<device_facts>> describe_devices(const std::string& spec);
// What choose_transports needs to know of each device (name, GPU ordinal).
inline std::vector<device_facts> facts_of(const std::vector<compute_device*>& devices) {
  std::vector<device_facts> out;
  for (const auto* d : devices) out.push_back({d->name(), d->gpu()});
  return out;
}
// Whether GPU `to` can access GPU `from`'s memory directly (enabling it); false without CUDA.
bool gpu_peer_access(int from, int to);
// The CUDA of this process: the CUDART_VERSION compiled against (0 = a build without CUDA), the
// runtime library loaded and the driver's CUDA version (0 = none), as 13000 for 13.0. Never throws.
struct cuda_versions {
  int compiled = 0, runtime = 0, driver = 0;
};
cuda_versions cuda_version_info();
// Whether this build has the NCCL transport.
bool nccl_available();
// Creates the NCCL communicators of the nccl transport: one two-rank communicator per link direction
// (from, to) (device positions; the sender is rank 0), each driven on a stream of its own on both
// ends and connected by one tiny exchange here, so a link's operations wait only on each other: what
// the simulator's rendezvous semantics check before a run (sim_costs::rendezvous). CUDA devices on
// distinct GPUs only.
// Several processes (group; rank_of: the rank of each device position; devices of other processes
// are null): a link with one end here gets this end of a two-rank communicator shared with the
// other process (the sender's NCCL id passes through the group's store; every process walks the
// links in the same order, so the blocking initialisations pair up); links with no end here are
// skipped. GPUs must be distinct within each process.
status enable_nccl(const std::vector<compute_device*>& devices, const std::vector<std::pair<int32_t, int32_t>>& links,
                   process_group* group = nullptr, const std::vector<int>& rank_of = {});

// After a step: per GPU, the arena peaks the plan charged its pipeline devices (and their cuBLAS
// workspaces) against the allocator
// peak plus their weight arenas (plan_drift_warning); resets the measured peaks.
std::vector<std::string> memory_plan_warnings(const std::vector<compute_device*>& devices);
// Plan against measurement on one GPU: a warning when what the GPU held differs from what the memory
// plan charged its pipeline devices by more than 5% (nullopt within it).
std::optional<std::string> plan_drift_warning(const std::string& gpu, size_t planned_bytes, size_t measured_bytes);

}  // namespace lorapipe
