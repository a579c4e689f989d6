// CPU virtual devices: see device.h.
#include <charconv>

#include "offload/device.h"

namespace lorapipe {

cpu_device::cpu_device(int index, const cpu_device_options& o)
    : name_("cpu:" + std::to_string(index)),
      arena_(name_, o.capacity_bytes, 64, /*contiguous=*/false),
      up_(name_ + "/h2d", o.copy_bytes_per_s, o.copy_latency_s),
      down_(name_ + "/d2h", o.copy_bytes_per_s, o.copy_latency_s),
      threads_(o.compute_threads) {}

result<std::vector<std::unique_ptr<compute_device>>> make_devices(const std::string& spec, const cpu_device_options& o) {
  int n = 1;
  if (spec == "cpu") {
    n = 1;
  } else if (spec.rfind("cpu:", 0) == 0) {
    const char* b = spec.data() + 4;
    auto [p, ec] = std::from_chars(b, spec.data() + spec.size(), n);
    if (ec != std::errc() || p != spec.data() + spec.size() || n < 1 || n > 64)
      return make_error("parallel.devices: '{}' should be cpu:N with N in 1..64", spec);
  } else if (spec.rfind("cuda", 0) == 0) {
    return make_error("parallel.devices: '{}': CUDA pipeline devices are not available in this build yet", spec);
  } else {
    return make_error("parallel.devices: '{}' is not a device list (cpu, cpu:N)", spec);
  }
  std::vector<std::unique_ptr<compute_device>> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_unique<cpu_device>(i, o));
  return out;
}

}  // namespace lorapipe
