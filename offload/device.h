// The device interface the pipeline executor drives: a memory arena (capacity-limited, OOM like a
// GPU), an upload (host->device) and a download (device->host) copy engine, and a compute thread
// budget. Implementations: CPU virtual devices (here) and CUDA devices (offload/cuda/, GPU builds).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/result.h"
#include "offload/copy_engine.h"
#include "offload/memory_arena.h"

namespace lorapipe {

class compute_device {
 public:
  virtual ~compute_device() = default;
  virtual const std::string& name() const = 0;
  virtual memory_arena& arena() = 0;
  virtual copy_engine& upload() = 0;    // host -> device (weights, reloaded activations, received tensors)
  virtual copy_engine& download() = 0;  // device -> host (offloaded activations, sent tensors)
  virtual int compute_threads() const = 0;
};

struct cpu_device_options {
  size_t capacity_bytes = size_t{1} << 40;  // arena size; allocation beyond it fails like a GPU OOM
  double copy_bytes_per_s = 0;              // per copy engine; 0 = unthrottled
  double copy_latency_s = 0;
  int compute_threads = 1;
};

// A CPU "virtual device": tensors stay in host RAM, but every byte is accounted in the arena and
// every transfer goes through the throttled copy engines, so pipelines behave like real ones.
class cpu_device final : public compute_device {
 public:
  cpu_device(int index, const cpu_device_options& o);
  const std::string& name() const override { return name_; }
  memory_arena& arena() override { return arena_; }
  copy_engine& upload() override { return up_; }
  copy_engine& download() override { return down_; }
  int compute_threads() const override { return threads_; }

 private:
  std::string name_;
  memory_arena arena_;
  copy_engine up_, down_;
  int threads_;
};

// "cpu", "cpu:N" -> N CPU virtual devices. (CUDA devices are created by the CUDA build.)
result<std::vector<std::unique_ptr<compute_device>>> make_devices(const std::string& spec, const cpu_device_options& o);

}  // namespace lorapipe
