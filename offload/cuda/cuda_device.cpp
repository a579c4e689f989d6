// CUDA pipeline device: see cuda_device.h.
#include "offload/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <set>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/Parallel.h>
#include <ATen/cuda/CUDAEvent.h>

#include "offload/cuda/cuda_check.h"

namespace lorapipe {
namespace {

class cuda_device final : public compute_device {
 public:
  cuda_device(int index, int gpu, size_t capacity, const cpu_device_options& o)
      : name_("cuda:" + std::to_string(gpu) + "#" + std::to_string(index)),
        gpu_(gpu),
        arena_(name_, capacity, 512, /*contiguous=*/false),
        wup_(name_ + "/h2d-weights"),
        up_(name_ + "/h2d"),
        down_(name_ + "/d2h"),
        threads_(o.compute_threads),
        compute_(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(gpu))),
        wstream_(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(gpu))),
        astream_(c10::cuda::getStreamFromPool(true, static_cast<c10::DeviceIndex>(gpu))),  // activations first
        dstream_(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(gpu))) {}

  ~cuda_device() override {
    std::lock_guard lock(mu_);
    for (const void* p : registered_) cudaHostUnregister(const_cast<void*>(p));
  }

  const std::string& name() const override { return name_; }
  memory_arena& arena() override { return arena_; }
  copy_engine& weight_upload() override { return wup_; }
  copy_engine& upload() override { return up_; }
  copy_engine& download() override { return down_; }
  int compute_threads() const override { return threads_; }
  c10::Device torch_device() const override { return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(gpu_)); }

  at::Tensor copy_in(const at::Tensor& host, bool weights) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
    auto& s = weights ? wstream_ : astream_;
    c10::cuda::CUDAStreamGuard sg(s);
    if (weights) pin(host);
    auto out = host.to(torch_device(), /*non_blocking=*/true);
    s.synchronize();
    out.record_stream(compute_);  // used on the compute stream from now on
    return out;
  }

  at::Tensor copy_out(const at::Tensor& on_device) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
    at::cuda::CUDAEvent produced;
    produced.record(compute_);  // everything the compute stream did so far, including this tensor
    produced.block(dstream_);
    c10::cuda::CUDAStreamGuard sg(dstream_);
    auto out = at::empty(on_device.sizes(), on_device.options().device(at::kCPU).pinned_memory(true));
    out.copy_(on_device, /*non_blocking=*/true);
    on_device.record_stream(dstream_);
    dstream_.synchronize();
    return out;
  }

  void enter_compute_thread() override {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(gpu_));
    c10::cuda::setCurrentCUDAStream(compute_);
    at::set_num_threads(threads_);
  }

 private:
  // Page-locks a frozen host tensor's storage in place, once (exact size, no staging copy).
  void pin(const at::Tensor& host) {
    const void* p = host.storage().data();
    const size_t n = host.storage().nbytes();
    std::lock_guard lock(mu_);
    if (n == 0 || registered_.count(p)) return;
    cudaError_t e = cudaHostRegister(const_cast<void*>(p), n, cudaHostRegisterPortable);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();
      return;
    }
    LP_CUDA_CHECK(e);
    registered_.insert(p);
  }

  std::string name_;
  int gpu_;
  memory_arena arena_;
  copy_engine wup_, up_, down_;
  int threads_;
  c10::cuda::CUDAStream compute_, wstream_, astream_, dstream_;
  std::mutex mu_;
  std::set<const void*> registered_;
};

}  // namespace

result<std::unique_ptr<compute_device>> make_cuda_device(int index, int gpu, const cpu_device_options& o) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  if (gpu >= count) return make_error("parallel.devices: cuda:{} does not exist ({} GPUs visible)", gpu, count);
  size_t free_b = 0, total_b = 0;
  LP_CUDA_CHECK(cudaSetDevice(gpu));
  LP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t capacity = o.capacity_bytes < (size_t{1} << 40) ? o.capacity_bytes : free_b / 10 * 9;
  return std::unique_ptr<compute_device>(std::make_unique<cuda_device>(index, gpu, capacity, o));
}

}  // namespace lorapipe
