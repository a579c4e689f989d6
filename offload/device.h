// The device interface the pipeline executor drives: a memory arena (capacity-limited, OOM like a
// GPU), three copy engines (weight upload, activation upload, download: so weight prefetch never
// delays the critical activation traffic), the tensor copies those engines run, and the setup of a
// compute thread. Implementations: CPU virtual devices (here) and CUDA devices (offload/cuda/).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "core/result.h"
#include "offload/copy_engine.h"
#include "offload/memory_arena.h"

namespace lorapipe {

class compute_device {
 public:
  virtual ~compute_device() = default;
  virtual const std::string& name() const = 0;
  virtual memory_arena& arena() = 0;
  virtual copy_engine& weight_upload() = 0;  // host -> device: frozen weights (PREFETCH_WEIGHTS)
  virtual copy_engine& upload() = 0;         // host -> device: reloaded checkpoints, received tensors
  virtual copy_engine& download() = 0;       // device -> host: offloaded checkpoints, sent tensors
  virtual int compute_threads() const = 0;
  virtual c10::Device torch_device() const = 0;
  // Run on the copy engines' threads: the returned tensor is complete when the call returns.
  // `weights`: the copy is a frozen weight (weight-upload stream; host memory may be registered).
  virtual at::Tensor copy_in(const at::Tensor& host, bool weights) = 0;
  virtual at::Tensor copy_out(const at::Tensor& on_device) = 0;
  // Called once by the executor's worker thread of this device before it computes.
  virtual void enter_compute_thread() = 0;
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
  copy_engine& weight_upload() override { return wup_; }
  copy_engine& upload() override { return up_; }
  copy_engine& download() override { return down_; }
  int compute_threads() const override { return threads_; }
  c10::Device torch_device() const override { return c10::Device(c10::DeviceType::CPU); }
  at::Tensor copy_in(const at::Tensor& host, bool weights) override;
  at::Tensor copy_out(const at::Tensor& on_device) override;
  void enter_compute_thread() override;

 private:
  std::string name_;
  memory_arena arena_;
  copy_engine wup_, up_, down_;
  int threads_;
};

// "cpu", "cpu:N" -> N CPU virtual devices; "cuda:0,1,.." -> CUDA devices (CUDA builds with a GPU;
// an index may repeat to run several pipeline devices on one GPU).
result<std::vector<std::unique_ptr<compute_device>>> make_devices(const std::string& spec, const cpu_device_options& o);

}  // namespace lorapipe
