// CUDA pipeline device: see cuda_device.h.
#include "offload/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <set>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "offload/cuda/cuda_check.h"
#include "offload/cuda/cuda_resources.h"
#ifdef LORAPIPE_HAS_NCCL
#include "offload/cuda/nccl_comm.h"
#endif

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
        compute_(c10::cuda::getStreamFromPool(false, dev_index())),
        wstream_(c10::cuda::getStreamFromPool(false, dev_index())),
        astream_(c10::cuda::getStreamFromPool(true, dev_index())),  // activations first
        dstream_(c10::cuda::getStreamFromPool(false, dev_index())) {
    // Exact-size pinned staging for everything that leaves the GPU (offloaded checkpoints, sent
    // activations and gradients): cudaHostAlloc per distinct size, reused every step.
    staging_ = staging_pool::create(
        name_ + "/pinned",
        [](size_t n) {
          void* p = nullptr;
          LP_CUDA_CHECK(cudaHostAlloc(&p, n, cudaHostAllocPortable));
          return p;
        },
        [](void* p) { cudaFreeHost(p); });
  }

  ~cuda_device() override {
    // Engines first: a queued copy may still use the streams, the staging pool or registered memory.
    for (copy_engine* e : {&wup_, &up_, &down_}) e->stop();
    detach_weight_arena();
    std::lock_guard lock(mu_);
    for (const void* p : registered_) cudaHostUnregister(const_cast<void*>(p));
  }

  const std::string& name() const override { return name_; }
  memory_arena& arena() override { return arena_; }
  copy_engine& weight_upload() override { return wup_; }
  copy_engine& upload() override { return up_; }
  copy_engine& download() override { return down_; }
  int compute_threads() const override { return threads_; }
  c10::Device torch_device() const override { return c10::Device(c10::DeviceType::CUDA, dev_index()); }

  // Host (pinned staging) -> device on the activation stream, which has priority over weights.
  at::Tensor copy_in(const at::Tensor& host) override {
    c10::cuda::CUDAGuard guard(dev_index());
    c10::cuda::CUDAStreamGuard sg(astream_);
    auto out = host.to(torch_device(), /*non_blocking=*/true);
    astream_.synchronize();
    out.record_stream(compute_);  // used on the compute stream from now on
    return out;
  }

  // Device -> exact-size pinned block, after the compute that produced the tensor.
  at::Tensor copy_out(const at::Tensor& on_device) override {
    c10::cuda::CUDAGuard guard(dev_index());
    after_compute(dstream_);
    c10::cuda::CUDAStreamGuard sg(dstream_);  // (a contiguous() copy, if any, runs there too)
    const at::Tensor src = on_device.contiguous();
    const size_t bytes = src.numel() * src.element_size();
    auto block = staging_->acquire(bytes);
    LP_CUDA_CHECK(cudaMemcpyAsync(block.get(), src.data_ptr(), bytes, cudaMemcpyDeviceToHost, dstream_.stream()));
    dstream_.synchronize();
    return at::from_blob(block.get(), src.sizes(), [block](void*) {}, src.options().device(at::kCPU).pinned_memory(true));
  }

  // Peer transport (runs on `from`'s download engine): one device-to-device copy, no host bounce.
  at::Tensor copy_from_peer(compute_device& from_dev, const at::Tensor& src) override {
    auto& from = dynamic_cast<cuda_device&>(from_dev);
    c10::cuda::CUDAGuard guard(from.dev_index());
    from.after_compute(from.dstream_);
    c10::cuda::CUDAStreamGuard sg(from.dstream_);
    const at::Tensor s = src.contiguous();
    at::Tensor dst;
    {
      c10::cuda::CUDAGuard here(dev_index());
      dst = at::empty(s.sizes(), s.options().device(torch_device()));
    }
    const size_t bytes = s.numel() * s.element_size();
    if (from.gpu_ == gpu_)
      LP_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), s.data_ptr(), bytes, cudaMemcpyDeviceToDevice, from.dstream_.stream()));
    else
      LP_CUDA_CHECK(cudaMemcpyPeerAsync(dst.data_ptr(), gpu_, s.data_ptr(), from.gpu_, bytes, from.dstream_.stream()));
    from.dstream_.synchronize();
    dst.record_stream(compute_);
    return dst;
  }

  void enter_compute_thread() override {
    c10::cuda::set_device(dev_index());
    c10::cuda::setCurrentCUDAStream(compute_);
    at::set_num_threads(threads_);
  }

  int gpu() const override { return gpu_; }

#ifdef LORAPIPE_HAS_NCCL
  void attach_nccl(std::shared_ptr<cuda::nccl_comms> comms, int rank) {
    comms_ = std::move(comms);
    rank_ = rank;
  }

  // After the compute that produced `t`, on the download stream; the caching allocator keeps `t`'s
  // memory until the send is done (record_stream). No host wait: the receiver may post later.
  void nccl_send(int peer, const at::Tensor& t) override {
    if (!comms_) return compute_device::nccl_send(peer, t);
    c10::cuda::CUDAGuard guard(dev_index());
    const at::Tensor s = t.contiguous();  // on the compute stream, before the event below
    after_compute(dstream_);
    LP_NCCL_CHECK(ncclSend(s.data_ptr(), s.numel() * s.element_size(), ncclUint8, peer, comms_->rank(rank_), dstream_.stream()));
    s.record_stream(dstream_);
  }

  // Into a fresh tensor on the activation stream; the compute stream waits for it by event.
  at::Tensor nccl_recv(int peer, at::IntArrayRef sizes, at::ScalarType dtype) override {
    if (!comms_) return compute_device::nccl_recv(peer, sizes, dtype);
    c10::cuda::CUDAGuard guard(dev_index());
    auto out = at::empty(sizes, at::TensorOptions().dtype(dtype).device(torch_device()));  // on the compute stream
    after_compute(astream_);  // its memory may have been used by compute just before
    LP_NCCL_CHECK(ncclRecv(out.data_ptr(), out.numel() * out.element_size(), ncclUint8, peer, comms_->rank(rank_), astream_.stream()));
    at::cuda::CUDAEvent received;
    received.record(astream_);
    received.block(compute_);
    out.record_stream(astream_);
    return out;
  }
#endif

 protected:
  std::shared_ptr<void> allocate_region(size_t bytes) override {
    auto b = std::make_shared<cuda::device_buffer>(gpu_, bytes);
    return std::shared_ptr<void>(b, b->data());
  }

  // A block released to the arena may still be read by kernels already queued on the compute
  // stream: the fence marks that point, and the next upload into the arena waits for it.
  void weights_released() override {
    c10::cuda::CUDAGuard guard(dev_index());
    std::lock_guard lock(fence_mu_);
    release_fence_.record(compute_);
  }
  void weight_upload_begin() override {
    c10::cuda::set_device(dev_index());
    std::lock_guard lock(fence_mu_);
    release_fence_.block(wstream_);  // no-op before the first release
  }
  void copy_weights_to(void* dst, const at::Tensor& host) override {
    pin(host);
    LP_CUDA_CHECK(cudaMemcpyAsync(dst, host.data_ptr(), host.numel() * host.element_size(), cudaMemcpyHostToDevice, wstream_.stream()));
  }
  void weight_upload_end() override { wstream_.synchronize(); }

 private:
  c10::DeviceIndex dev_index() const { return static_cast<c10::DeviceIndex>(gpu_); }

  // Makes `s` wait for everything queued on the compute stream so far.
  void after_compute(const c10::cuda::CUDAStream& s) {
    at::cuda::CUDAEvent produced;
    produced.record(compute_);
    produced.block(s);
  }

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
  std::mutex mu_, fence_mu_;
  std::set<const void*> registered_;
  at::cuda::CUDAEvent release_fence_;
#ifdef LORAPIPE_HAS_NCCL
  std::shared_ptr<cuda::nccl_comms> comms_;
  int rank_ = -1;
#endif
};

}  // namespace

bool cuda_peer_access(int from_gpu, int to_gpu) {
  if (from_gpu == to_gpu) return true;
  int ok = 0;
  if (cudaDeviceCanAccessPeer(&ok, to_gpu, from_gpu) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (ok == 0) return false;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(to_gpu));
  const cudaError_t e = cudaDeviceEnablePeerAccess(from_gpu, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled || e == cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  (void)cudaGetLastError();
  return false;
}

status enable_cuda_nccl(const std::vector<compute_device*>& devices) {
#ifdef LORAPIPE_HAS_NCCL
  std::vector<cuda_device*> cd;
  std::vector<int> gpus;
  for (auto* d : devices) {
    auto* c = dynamic_cast<cuda_device*>(d);
    if (c == nullptr) return make_error("parallel.transport: nccl: {} is not a CUDA device", d->name());
    for (int g : gpus)
      if (g == c->gpu()) return make_error("parallel.transport: nccl: GPU {} appears twice (NCCL needs one rank per GPU)", g);
    cd.push_back(c);
    gpus.push_back(c->gpu());
  }
  auto comms = std::make_shared<cuda::nccl_comms>(gpus);
  for (size_t i = 0; i < cd.size(); ++i) cd[i]->attach_nccl(comms, static_cast<int>(i));
  return ok_status();
#else
  (void)devices;
  return make_error("parallel.transport: nccl: this build has no NCCL");
#endif
}

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
