// The parallel.devices spec: "cpu" (one), "cpu:N" (N CPU virtual devices, 1..64) or "cuda:I,J,..."
// (those GPU ordinals, one pipeline device each; an ordinal may repeat). One parser for project
// validation and for the device factory.
#pragma once

#include <string>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

struct device_spec {
  int cpus = 0;
  std::vector<int> gpus;
  int count() const { return cpus + static_cast<int>(gpus.size()); }
};
// Errors name the field: "parallel.devices: ...".
result<device_spec> parse_device_spec(const std::string& spec);

}  // namespace lorapipe
