// CPU virtual devices: see device.h.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <sstream>

#include <fmt/format.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "core/base/device_spec.h"
#include "offload/device.h"
#ifdef LORAPIPE_HAS_CUDA
#include "offload/cuda/cuda_device.h"
#endif

namespace lorapipe {

namespace {
std::shared_ptr<shared_link> link_of(const std::vector<std::shared_ptr<shared_link>>& links, int index) {
  return static_cast<size_t>(index) < links.size() ? links[static_cast<size_t>(index)] : nullptr;
}
}  // namespace

cpu_device::cpu_device(int index, const cpu_device_options& o)
    : name_("cpu:" + std::to_string(index)),
      arena_(name_, o.capacity_bytes, 64, /*contiguous=*/false),
      wup_(name_ + "/h2d-weights", o.copy_bytes_per_s, o.copy_latency_s, link_of(o.h2d_link, index)),
      up_(name_ + "/h2d", o.copy_bytes_per_s, o.copy_latency_s, link_of(o.h2d_link, index)),
      down_(name_ + "/d2h", o.copy_bytes_per_s, o.copy_latency_s, link_of(o.d2h_link, index)),
      threads_(o.compute_threads),
      fault_(o.copy_fault) {
  if (static_cast<size_t>(index) < o.copy_link.size() && link_of(o.h2d_link, index))
    link_ = "copy link " + std::to_string(o.copy_link[static_cast<size_t>(index)]);
  // Speeds are relative: the fastest device runs at the host's speed, the others idle to match.
  if (static_cast<size_t>(index) < o.speed.size() && o.speed[static_cast<size_t>(index)] > 0) {
    speed_ = o.speed[static_cast<size_t>(index)];
    const double fastest = *std::max_element(o.speed.begin(), o.speed.end());
    idle_per_busy_ = fastest / speed_ - 1;
  }
  staging_ = staging_pool::create(name_ + "/staging", [](size_t n) { return std::malloc(n); }, [](void* p) { std::free(p); });
}

cpu_device::~cpu_device() {
  for (copy_engine* e : {&wup_, &up_, &down_}) e->stop();  // queued copies may still use the arenas
  detach_weight_arena();
}

at::Tensor cpu_device::copy_in(const at::Tensor& host) {
  if (fault_) fault_("copy_in");
  return host.clone();
}

at::Tensor cpu_device::copy_out(const at::Tensor& on_device) {
  if (fault_) fault_("copy_out");
  const at::Tensor src = on_device.contiguous();
  const size_t bytes = src.numel() * src.element_size();
  auto block = staging_->acquire(bytes);
  if (bytes > 0) std::memcpy(block.get(), src.data_ptr(), bytes);
  return at::from_blob(block.get(), src.sizes(), [block](void*) {}, src.options());
}

at::Tensor cpu_device::copy_from_peer(compute_device&, const at::Tensor& src) {
  if (fault_) fault_("copy_from_peer");
  return src.clone();
}

void cpu_device::enter_compute_thread() { at::set_num_threads(threads_); }

void cpu_device::pace_compute(double busy_s) {
  if (idle_per_busy_ > 0 && busy_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(busy_s * idle_per_busy_));
}

std::shared_ptr<void> cpu_device::allocate_region(size_t bytes) {
  const size_t n = (bytes + weight_alignment - 1) / weight_alignment * weight_alignment;
  void* p = std::aligned_alloc(weight_alignment, n);
  if (p == nullptr) throw std::bad_alloc();
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

void cpu_device::copy_weights_to(void* dst, const at::Tensor& host) {
  std::memcpy(dst, host.data_ptr(), host.numel() * host.element_size());
}

bool gpu_peer_access(int from, int to) {
#ifdef LORAPIPE_HAS_CUDA
  return cuda_peer_access(from, to);
#else
  (void)from;
  (void)to;
  return false;
#endif
}

cuda_versions cuda_version_info() {
#ifdef LORAPIPE_HAS_CUDA
  return cuda_runtime_versions();
#else
  return {};
#endif
}

bool nccl_available() {
#ifdef LORAPIPE_HAS_NCCL
  return true;
#else
  return false;
#endif
}

status enable_nccl(const std::vector<compute_device*>& devices, const std::vector<std::pair<int32_t, int32_t>>& links,
                   process_group* group, const std::vector<int>& rank_of) {
#ifdef LORAPIPE_HAS_NCCL
  return enable_cuda_nccl(devices, links, group, rank_of);
#else
  (void)devices;
  (void)links;
  (void)group;
  (void)rank_of;
  return make_error("parallel.transport: nccl: this build has no NCCL (configure with LORAPIPE_WITH_CUDA=ON)");
#endif
}


result<std::vector<size_t>> gpu_device_budgets(const std::string& spec) {
  LP_TRY_ASSIGN(ds, parse_device_spec(spec));
  if (ds.gpus.empty()) return std::vector<size_t>{};
#ifdef LORAPIPE_HAS_CUDA
  std::map<int, size_t> free_b;
  for (int g : ds.gpus)
    if (!free_b.count(g)) {
      LP_TRY_ASSIGN(f, cuda_free_bytes(g));
      free_b[g] = f;
    }
  return split_gpu_memory(ds.gpus, [&](int g) { return free_b.at(g); }, 0.9);
#else
  return std::vector<size_t>{};
#endif
}

result<std::vector<device_facts>> describe_devices(const std::string& spec) {
  LP_TRY_ASSIGN(ds, parse_device_spec(spec));
  std::vector<device_facts> out;
  for (int i = 0; i < ds.cpus; ++i) out.push_back({"cpu:" + std::to_string(i), -1});
  for (size_t i = 0; i < ds.gpus.size(); ++i) out.push_back({fmt::format("cuda:{}#{}", ds.gpus[i], i), ds.gpus[i]});
  return out;
}

result<std::vector<std::unique_ptr<compute_device>>> make_devices(const std::string& spec, const cpu_device_options& o,
                                                                  const std::vector<bool>& here, const std::vector<bool>& on_this_host) {
  LP_TRY_ASSIGN(ds, parse_device_spec(spec));
  const size_t n = ds.gpus.empty() ? static_cast<size_t>(ds.cpus) : ds.gpus.size();
  for (const auto* flags : {&here, &on_this_host})
    if (!flags->empty() && flags->size() != n) return make_error("parallel.devices: '{}' names {} devices, {} flags given", spec, n, flags->size());
  auto wanted = [&](size_t i) { return here.empty() || here[i]; };
  auto sharing = [&](size_t i) { return on_this_host.empty() ? wanted(i) : on_this_host[i] || wanted(i); };
  std::vector<std::unique_ptr<compute_device>> out;
  if (!ds.gpus.empty()) {
#ifdef LORAPIPE_HAS_CUDA
    std::vector<int> local;  // the GPUs of this machine's positions, in any process (memory is split among those)
    std::vector<size_t> slot(n, 0);
    std::map<int, size_t> free_b;
    for (size_t i = 0; i < n; ++i) {
      if (!sharing(i)) continue;
      slot[i] = local.size();
      local.push_back(ds.gpus[i]);
      if (free_b.count(ds.gpus[i])) continue;
      LP_TRY_ASSIGN(f, cuda_free_bytes(ds.gpus[i]));
      free_b[ds.gpus[i]] = f;
    }
    // 90% of each GPU's free memory, split between the pipeline devices on it (an explicit capacity,
    // from tests, applies to each device as given).
    auto budget = split_gpu_memory(local, [&](int g) { return free_b.at(g); }, 0.9);
    const size_t ram = static_cast<size_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    auto pinned = make_cuda_pinned_registry(o.pinned_budget_bytes > 0 ? o.pinned_budget_bytes : ram / 2);
    for (size_t i = 0; i < n; ++i) {
      if (!wanted(i)) {
        out.push_back(nullptr);
        continue;
      }
      const size_t capacity = o.capacity_bytes < (size_t{1} << 40) ? o.capacity_bytes : budget[slot[i]];
      auto d = make_cuda_device(static_cast<int>(i), ds.gpus[i], capacity, pinned, o);
      if (!d) return d.err();
      out.push_back(std::move(*d));
    }
    return out;
#else
    return make_error("parallel.devices: '{}': this build has no CUDA support (configure with LORAPIPE_WITH_CUDA=ON)", spec);
#endif
  }
  cpu_device_options with_links = o;  // devices numbered alike share one link each way
  if (!o.copy_link.empty()) {
    if (o.copy_link.size() != n) return make_error("offload.copy_links: {} link numbers for {} devices", o.copy_link.size(), n);
    std::map<int, std::pair<std::shared_ptr<shared_link>, std::shared_ptr<shared_link>>> links;
    with_links.h2d_link.clear();
    with_links.d2h_link.clear();
    for (int l : o.copy_link) {
      auto& pair = links[l];
      if (!pair.first) pair = {std::make_shared<shared_link>(o.copy_bytes_per_s), std::make_shared<shared_link>(o.copy_bytes_per_s)};
      with_links.h2d_link.push_back(pair.first);
      with_links.d2h_link.push_back(pair.second);
    }
  }
  for (size_t i = 0; i < n; ++i) out.push_back(wanted(i) ? std::make_unique<cpu_device>(static_cast<int>(i), with_links) : nullptr);
  return out;
}

}  // namespace lorapipe
