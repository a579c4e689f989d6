// CPU virtual devices: see device.h.
#include <charconv>
#include <sstream>

#include <ATen/Parallel.h>

#include "offload/device.h"
#ifdef LORAPIPE_HAS_CUDA
#include "offload/cuda/cuda_device.h"
#endif

namespace lorapipe {

cpu_device::cpu_device(int index, const cpu_device_options& o)
    : name_("cpu:" + std::to_string(index)),
      arena_(name_, o.capacity_bytes, 64, /*contiguous=*/false),
      wup_(name_ + "/h2d-weights", o.copy_bytes_per_s, o.copy_latency_s),
      up_(name_ + "/h2d", o.copy_bytes_per_s, o.copy_latency_s),
      down_(name_ + "/d2h", o.copy_bytes_per_s, o.copy_latency_s),
      threads_(o.compute_threads) {}

at::Tensor cpu_device::copy_in(const at::Tensor& host, bool) { return host.clone(); }
at::Tensor cpu_device::copy_out(const at::Tensor& on_device) { return on_device.clone(); }
void cpu_device::enter_compute_thread() { at::set_num_threads(threads_); }

result<std::vector<std::unique_ptr<compute_device>>> make_devices(const std::string& spec, const cpu_device_options& o) {
  int n = 1;
  if (spec == "cpu") {
    n = 1;
  } else if (spec.rfind("cpu:", 0) == 0) {
    const char* b = spec.data() + 4;
    auto [p, ec] = std::from_chars(b, spec.data() + spec.size(), n);
    if (ec != std::errc() || p != spec.data() + spec.size() || n < 1 || n > 64)
      return make_error("parallel.devices: '{}' should be cpu:N with N in 1..64", spec);
  } else if (spec.rfind("cuda:", 0) == 0) {
    std::vector<int> ids;
    std::stringstream ss(spec.substr(5));
    for (std::string item; std::getline(ss, item, ',');) {
      int id = -1;
      auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
      if (ec != std::errc() || p != item.data() + item.size() || id < 0)
        return make_error("parallel.devices: '{}' should be cuda:I,J,... with GPU indices", spec);
      ids.push_back(id);
    }
    if (ids.empty()) return make_error("parallel.devices: '{}' names no GPU", spec);
#ifdef LORAPIPE_HAS_CUDA
    std::vector<std::unique_ptr<compute_device>> out;
    for (size_t i = 0; i < ids.size(); ++i) {
      auto d = make_cuda_device(static_cast<int>(i), ids[i], o);
      if (!d) return d.err();
      out.push_back(std::move(*d));
    }
    return out;
#else
    return make_error("parallel.devices: '{}': this build has no CUDA support (configure with LORAPIPE_WITH_CUDA=ON)", spec);
#endif
  } else {
    return make_error("parallel.devices: '{}' is not a device list (cpu, cpu:N)", spec);
  }
  std::vector<std::unique_ptr<compute_device>> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_unique<cpu_device>(i, o));
  return out;
}

}  // namespace lorapipe
