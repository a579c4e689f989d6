// The parallel.devices spec: see device_spec.h.
#include "core/base/device_spec.h"

#include <charconv>
#include <sstream>

namespace lorapipe {

result<device_spec> parse_device_spec(const std::string& spec) {
  device_spec out;
  if (spec == "cpu") {
    out.cpus = 1;
  } else if (spec.rfind("cpu:", 0) == 0) {
    const char* b = spec.data() + 4;
    auto [p, ec] = std::from_chars(b, spec.data() + spec.size(), out.cpus);
    if (ec != std::errc() || p != spec.data() + spec.size() || out.cpus < 1 || out.cpus > 64)
      return make_error("parallel.devices: '{}' should be cpu:N with N in 1..64", spec);
  } else if (spec.rfind("cuda:", 0) == 0) {
    if (spec.back() == ',') return make_error("parallel.devices: '{}' should be cuda:I,J,... with GPU indices", spec);
    std::stringstream ss(spec.substr(5));
    for (std::string item; std::getline(ss, item, ',');) {
      int id = -1;
      auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
      if (ec != std::errc() || p != item.data() + item.size() || id < 0)
        return make_error("parallel.devices: '{}' should be cuda:I,J,... with GPU indices", spec);
      out.gpus.push_back(id);
    }
    if (out.gpus.empty()) return make_error("parallel.devices: '{}' names no GPU", spec);
  } else {
    return make_error("parallel.devices: '{}' is not a device list (cpu, cpu:N, cuda:I,J,...)", spec);
  }
  return out;
}

}  // namespace lorapipe
