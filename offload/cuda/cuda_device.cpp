// CUDA pipeline device: see cuda_device.h.
#include "offload/cuda/cuda_device.h"

#include <cctype>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "offload/cuda/cuda_check.h"
#include "offload/cuda/cuda_resources.h"
#ifdef LORAPIPE_HAS_NCCL
#include "offload/cuda/nccl_comm.h"
#include "offload/process_group.h"
#endif

namespace lorapipe {
namespace {

int compute_capability_major(int gpu) {
  int major = 0;
  LP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, gpu));
  return major;
}

class cuda_device final : public compute_device {
 public:
  cuda_device(int index, int gpu, size_t capacity, std::shared_ptr<pinned_registry> pinned, const cpu_device_options& o)
      : pinned_(std::move(pinned)),
        name_("cuda:" + std::to_string(gpu) + "#" + std::to_string(index)),
        gpu_(gpu),
        arena_(name_, capacity, 512, /*contiguous=*/false),
        wup_(name_ + "/h2d-weights"),
        up_(name_ + "/h2d"),
        down_(name_ + "/d2h"),
        threads_(o.compute_threads),
        compute_(c10::cuda::getStreamFromPool(false, dev_index())),
        wstream_(c10::cuda::getStreamFromPool(false, dev_index())),
        astream_(c10::cuda::getStreamFromPool(true, dev_index())),  // activations first
        dstream_(c10::cuda::getStreamFromPool(false, dev_index())),
        workspaces_(compute_workspaces(gpu, compute_capability_major(gpu))) {
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
    for (void* b : bounce_)
      if (b != nullptr) cudaFreeHost(b);
  }

  const std::string& name() const override { return name_; }
  memory_arena& arena() override { return arena_; }
  copy_engine& weight_upload() override { return wup_; }
  copy_engine& upload() override { return up_; }
  copy_engine& download() override { return down_; }
  int compute_threads() const override { return threads_; }
  std::optional<size_t> measured_gpu_peak_bytes() const override {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev_index());
    return static_cast<size_t>(stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak);
  }
  void reset_measured_peak() override { c10::cuda::CUDACachingAllocator::resetPeakStats(dev_index()); }
  workspace_charge library_workspaces() const override { return workspaces_; }
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
  // This device's end of link `peer`'s communicator (sender: rank 0, receiver: rank 1), with a stream
  // of its own: the stream runs the link's operations in the communicator's order and nothing else, so
  // a send waiting for its receive holds up neither other links nor the copies of offloads.
  void attach_nccl(int peer, bool sender, std::shared_ptr<cuda::nccl_comms> comms) {
    (sender ? send_links_ : recv_links_).insert_or_assign(peer, nccl_link{std::move(comms), c10::cuda::getStreamFromPool(false, dev_index())});
  }

  void abort_communication() override {
    for (auto* m : {&send_links_, &recv_links_})
      for (auto& [peer, l] : *m) l.comms->abort();
  }

  // After the compute that produced `t`, on the link's stream; the caching allocator keeps `t`'s
  // memory until the send is done (record_stream). No host wait: the receiver may post later.
  void nccl_send(int peer, const at::Tensor& t) override {
    auto it = send_links_.find(peer);
    if (it == send_links_.end()) return compute_device::nccl_send(peer, t);
    c10::cuda::CUDAGuard guard(dev_index());
    const at::Tensor s = t.contiguous();  // on the compute stream, before the event below
    const auto& stream = it->second.stream;
    after_compute(stream);
    it->second.comms->use(0, [&](ncclComm_t comm) {  // an abort waits until the call is enqueued
      if (comm == nullptr) throw device_error(fmt::format("{}: the NCCL link to {} was aborted", name_, peer));
      LP_NCCL_CHECK(ncclSend(s.data_ptr(), s.numel() * s.element_size(), ncclUint8, /*peer rank=*/1, comm, stream.stream()));
    });
    s.record_stream(stream);
  }

  // Into a fresh tensor on the link's stream; the compute stream waits for it by event.
  at::Tensor nccl_recv(int peer, at::IntArrayRef sizes, at::ScalarType dtype) override {
    auto it = recv_links_.find(peer);
    if (it == recv_links_.end()) return compute_device::nccl_recv(peer, sizes, dtype);
    c10::cuda::CUDAGuard guard(dev_index());
    auto out = at::empty(sizes, at::TensorOptions().dtype(dtype).device(torch_device()));  // on the compute stream
    const auto& stream = it->second.stream;
    after_compute(stream);  // its memory may have been used by compute just before
    it->second.comms->use(1, [&](ncclComm_t comm) {
      if (comm == nullptr) throw device_error(fmt::format("{}: the NCCL link from {} was aborted", name_, peer));
      LP_NCCL_CHECK(ncclRecv(out.data_ptr(), out.numel() * out.element_size(), ncclUint8, /*peer rank=*/0, comm, stream.stream()));
    });
    at::cuda::CUDAEvent received;
    received.record(stream);
    received.block(compute_);
    out.record_stream(stream);
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
    const size_t bytes = host.numel() * host.element_size();
    if (pinned_->acquire(host.storage().data(), host.storage().nbytes())) {
      LP_CUDA_CHECK(cudaMemcpyAsync(dst, host.data_ptr(), bytes, cudaMemcpyHostToDevice, wstream_.stream()));
      return;
    }
    // Beyond the pinned budget: through two pinned bounce buffers, one filling while the other copies.
    constexpr size_t chunk = size_t{32} << 20;
    for (size_t off = 0, k = 0; off < bytes; off += chunk, ++k) {
      const size_t n = std::min(chunk, bytes - off), b = k % 2;
      if (bounce_[b] == nullptr) LP_CUDA_CHECK(cudaHostAlloc(&bounce_[b], chunk, cudaHostAllocPortable));
      bounce_done_[b].synchronize();  // its previous copy has left the buffer (no-op before the first)
      std::memcpy(bounce_[b], static_cast<const char*>(host.data_ptr()) + off, n);
      LP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, bounce_[b], n, cudaMemcpyHostToDevice, wstream_.stream()));
      bounce_done_[b].record(wstream_);
    }
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

  std::shared_ptr<pinned_registry> pinned_;  // outlives every device of the pipeline that shares it
  std::string name_;
  int gpu_;
  memory_arena arena_;
  copy_engine wup_, up_, down_;
  int threads_;
  c10::cuda::CUDAStream compute_, wstream_, astream_, dstream_;
  workspace_charge workspaces_;
  std::mutex fence_mu_;
  void* bounce_[2] = {nullptr, nullptr};  // used on the weight-upload engine's thread only
  at::cuda::CUDAEvent bounce_done_[2];
  at::cuda::CUDAEvent release_fence_;
#ifdef LORAPIPE_HAS_NCCL
  struct nccl_link {
    std::shared_ptr<cuda::nccl_comms> comms;
    c10::cuda::CUDAStream stream;
  };
  std::map<int, nccl_link> send_links_, recv_links_;  // by peer device position
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

#ifdef LORAPIPE_HAS_NCCL
namespace {
// This process's end of link from -> to, whose other end runs in another process: a two-rank
// communicator (sender rank 0) from the sender's NCCL id, passed through the process group's store,
// connected by one tiny exchange.
status connect_remote_link(cuda_device& here, bool sender, int32_t from, int32_t to, int peer_rank, process_group& group) {
  const std::string key = fmt::format("nccl-id/{}-{}", from, to), ready = fmt::format("nccl-ready/{}-{}", from, to);
  ncclUniqueId id;
  // ncclCommInitRank blocks until both ends call it, with no time limit: each end first waits (up to
  // the group's timeout) for word that the other is at this very link, so a peer that failed or died
  // earlier turns into an error naming it.
  if (sender) {
    LP_NCCL_CHECK(ncclGetUniqueId(&id));
    LP_TRY(group.store_set(key, std::string(reinterpret_cast<const char*>(&id), sizeof id)));
    if (auto r = group.store_get(ready); !r)
      return make_error("parallel.transport: nccl: link {} -> {}: rank {} never reached it: {}", from, to, peer_rank, r.message());
  } else {
    auto got = group.store_get(key);  // waits up to the group's timeout
    if (!got) return make_error("parallel.transport: nccl: link {} -> {}: no NCCL id from rank {}: {}", from, to, peer_rank, got.message());
    if (got->size() != sizeof id) return make_error("parallel.transport: nccl: link {} -> {}: malformed NCCL id", from, to);
    std::memcpy(&id, got->data(), sizeof id);
    LP_TRY(group.store_set(ready, "1"));
  }
  const int me = sender ? 0 : 1;
  auto comms = std::make_shared<cuda::nccl_comms>(2, me, here.gpu(), id);
  {
    cuda::device_buffer buf(here.gpu(), 64);
    comms->use(me, [&](ncclComm_t c) {
      if (sender) {
        LP_NCCL_CHECK(ncclSend(buf.data(), 64, ncclUint8, 1, c, nullptr));
      } else {
        LP_NCCL_CHECK(ncclRecv(buf.data(), 64, ncclUint8, 0, c, nullptr));
      }
    });
    LP_CUDA_CHECK(cudaSetDevice(here.gpu()));
    LP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  here.attach_nccl(sender ? to : from, sender, comms);
  return ok_status();
}
}  // namespace
#endif

status enable_cuda_nccl(const std::vector<compute_device*>& devices, const std::vector<std::pair<int32_t, int32_t>>& links,
                        process_group* group, const std::vector<int>& rank_of) {
#ifdef LORAPIPE_HAS_NCCL
  std::vector<cuda_device*> cd;  // null: a device of another process
  std::vector<int> gpus;
  for (size_t i = 0; i < devices.size(); ++i) {
    auto* d = devices[i];
    if (d == nullptr) {
      if (group == nullptr || rank_of.size() != devices.size())
        return make_error("parallel.transport: nccl: device {} is missing and no process runs it", i);
      cd.push_back(nullptr);
      gpus.push_back(-1);
      continue;
    }
    auto* c = dynamic_cast<cuda_device*>(d);
    if (c == nullptr) return make_error("parallel.transport: nccl: {} is not a CUDA device", d->name());
    for (int g : gpus)
      if (g == c->gpu()) return make_error("parallel.transport: nccl: GPU {} appears twice (NCCL needs one rank per GPU)", g);
    cd.push_back(c);
    gpus.push_back(c->gpu());
  }
  for (const auto& [from, to] : links) {
    if (from < 0 || to < 0 || from >= static_cast<int32_t>(cd.size()) || to >= static_cast<int32_t>(cd.size()))
      return make_error("parallel.transport: nccl: link {} -> {} names a device that does not exist", from, to);
    cuda_device *a = cd[static_cast<size_t>(from)], *b = cd[static_cast<size_t>(to)];
    if (a == nullptr && b == nullptr) continue;  // between two other processes
    if (a == nullptr || b == nullptr) {
      try {
        LP_TRY(connect_remote_link(a != nullptr ? *a : *b, a != nullptr, from, to, rank_of[static_cast<size_t>(a != nullptr ? to : from)],
                                   *group));
      } catch (const std::exception& e) {
        return make_error("parallel.transport: nccl: link {} -> {} to another process: {}", from, to, e.what());
      }
      continue;
    }
    const int g_from = gpus[static_cast<size_t>(from)], g_to = gpus[static_cast<size_t>(to)];
    auto comms = std::make_shared<cuda::nccl_comms>(std::vector<int>{g_from, g_to});
    {  // NCCL connects on a communicator's first operation, which may block the host: one tiny
       // exchange now (both ranks from this thread, in one group), not inside the first step
      cuda::device_buffer a(g_from, 64), b(g_to, 64);
      LP_NCCL_CHECK(ncclGroupStart());
      LP_NCCL_CHECK(ncclSend(a.data(), 64, ncclUint8, 1, comms->rank(0), nullptr));
      LP_NCCL_CHECK(ncclRecv(b.data(), 64, ncclUint8, 0, comms->rank(1), nullptr));
      LP_NCCL_CHECK(ncclGroupEnd());
      for (int g : {g_from, g_to}) {
        LP_CUDA_CHECK(cudaSetDevice(g));
        LP_CUDA_CHECK(cudaDeviceSynchronize());
      }
    }
    cd[static_cast<size_t>(from)]->attach_nccl(to, true, comms);
    cd[static_cast<size_t>(to)]->attach_nccl(from, false, comms);
  }
  return ok_status();
#else
  (void)devices;
  (void)links;
  (void)group;
  (void)rank_of;
  return make_error("parallel.transport: nccl: this build has no NCCL");
#endif
}

result<size_t> cuda_free_bytes(int gpu) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  if (gpu >= count) return make_error("parallel.devices: cuda:{} does not exist ({} GPUs visible)", gpu, count);
  size_t free_b = 0, total_b = 0;
  LP_CUDA_CHECK(cudaSetDevice(gpu));
  LP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return free_b;
}

status cuda_describe_gpu(int gpu, probed_device& d) {
  LP_TRY_ASSIGN(free_b, cuda_free_bytes(gpu));
  cudaDeviceProp prop{};
  LP_CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu));
  char bus[32] = {0};
  LP_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, gpu));
  d.gpu_name = prop.name;
  d.total_bytes = prop.totalGlobalMem;
  d.free_bytes = free_b;
  d.sm_count = prop.multiProcessorCount;
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  d.pci_bus_id = bus;
  for (auto& ch : d.pci_bus_id) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  read_pci_link("/sys/bus/pci/devices", d.pci_bus_id, d);
  return ok_status();
}

cuda_versions cuda_runtime_versions() {
  cuda_versions v;
  cuda::versions(&v.compiled, &v.runtime, &v.driver);
  return v;
}

result<std::unique_ptr<compute_device>> make_cuda_device(int index, int gpu, size_t capacity,
                                                         std::shared_ptr<pinned_registry> pinned, const cpu_device_options& o) {
  if (auto f = cuda_free_bytes(gpu); !f) return f.err();
  // The decoder has no convolutions and attention runs on the flash / memory-efficient kernels, so
  // cuDNN is switched off: its ~850 MB of engine libraries are then never loaded, and the packages
  // ship only the libcudnn.so.9 that libtorch_cuda links (packaging/install.cmake).
  at::globalContext().setUserEnabledCuDNN(false);
  at::globalContext().setSDPUseCuDNN(false);
  return std::unique_ptr<compute_device>(std::make_unique<cuda_device>(index, gpu, capacity, std::move(pinned), o));
}

std::shared_ptr<pinned_registry> make_cuda_pinned_registry(size_t budget_bytes) {
  using pin_result = pinned_registry::pin_result;
  return std::make_shared<pinned_registry>(
      budget_bytes,
      [](void* p, size_t n) {
        const cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterPortable);
        if (e == cudaSuccess) return pin_result::pinned;
        (void)cudaGetLastError();
        return e == cudaErrorHostMemoryAlreadyRegistered ? pin_result::pinned_elsewhere : pin_result::refused;
      },
      [](void* p) { cudaHostUnregister(p); });
}

}  // namespace lorapipe
