// What the layers above need to know of a pipeline device without talking to it: its name and,
// for a CUDA device, the GPU ordinal (transport choice, plans, messages). Plain data, torch-free.
#pragma once

#include <string>

namespace lorapipe {

struct device_facts {
  std::string name;  // for messages: cpu:0, cuda:1#0, ...
  int gpu = -1;      // CUDA ordinal, -1 for a CPU virtual device
};

}  // namespace lorapipe
