// What the layers above need to know of a pipeline device without talking to it: its name and,
// for a CUDA device, the GPU ordinal (transport choice, plans, messages); how a GPU's memory is split
// between the pipeline devices on it; the cuBLAS workspaces a CUDA pipeline device holds outside its
// arena. Plain data, torch-free.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
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

// The cuBLAS workspace LibTorch allocates for each (thread, stream) that runs a matmul on a GPU, from
// its caching allocator (so outside the weight and activation arenas): CUBLAS_WORKSPACE_CONFIG when
// set (":SIZE:COUNT" pairs, SIZE in KiB; LibTorch sums SIZE x COUNT), else LibTorch's default of
// 32 MiB on compute capability 9 and newer (Hopper, Blackwell) and 4 MiB x 2 + 16 KiB x 8 before.
// cc_major 0 (unknown) plans with the larger default. `config`: the variable's value, or nullopt.
size_t cublas_workspace_bytes(int cc_major, const std::optional<std::string>& config);
// CUBLAS_WORKSPACE_CONFIG from the environment (nullopt when unset).
std::optional<std::string> cublas_workspace_config();

// Workspaces one CUDA pipeline device holds: one per thread that runs its matmuls on its compute
// stream (its worker, the autograd engine's thread of its GPU, and the thread that starts each
// step's backward). Measured on one H200: two pipeline devices on cuda:0,0 held 6 x 32 MiB beyond
// their arenas after the first step.
inline constexpr int cublas_workspaces_per_device = 3;

// Memory a pipeline device's compute libraries hold outside its arenas, as the memory plan charges it.
struct workspace_charge {
  size_t bytes = 0;   // each
  int count = 0;
};
// A CUDA pipeline device's (cc_major 0: unknown); none for a CPU virtual device (gpu < 0).
workspace_charge compute_workspaces(int gpu, int cc_major);

}  // namespace lorapipe
