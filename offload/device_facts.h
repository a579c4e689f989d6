// What the layers above need to know of a pipeline device without talking to it: its name and,
// for a CUDA device, the GPU ordinal (transport choice, plans, messages); how a GPU's memory is split
// between the pipeline devices on it. Plain data, torch-free.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace lorapipe {

struct device_facts {
  std::string name;  // for messages: cpu:0, cuda:1#0, ...
  int gpu = -1;      // CUDA ordinal, -1 for a CPU virtual device
};

// The memory each pipeline device may use: `fraction` of its GPU's free memory, shared evenly by the
// pipeline devices on the same GPU ("cuda:0,0" gives each half, not 90% each). gpus: the ordinal of
// each pipeline device; free_bytes(g): free memory of GPU g.
template <class FreeBytes>
std::vector<size_t> split_gpu_memory(const std::vector<int>& gpus, const FreeBytes& free_bytes, double fraction) {
  std::map<int, size_t> sharing;
  for (int g : gpus) ++sharing[g];
  std::vector<size_t> out;
  for (int g : gpus)
    out.push_back(static_cast<size_t>(static_cast<double>(free_bytes(g)) * fraction) / sharing[g]);
  return out;
}

}  // namespace lorapipe
