// What the layers above know of a pipeline device without talking to it: the cuBLAS workspaces a CUDA
// device holds outside its arena (device_facts.h).
#include "offload/device_facts.h"

#include <cstdlib>
#include <regex>

namespace lorapipe {

size_t cublas_workspace_bytes(int cc_major, const std::optional<std::string>& config) {
  const size_t default_size = cc_major == 0 || cc_major >= 9 ? size_t{4096} * 8 * 1024 : size_t{4096} * 1024 * 2 + size_t{16} * 1024 * 8;
  if (!config) return default_size;
  static const std::regex pair(":([0-9]+):([0-9]+)");
  size_t total = 0;
  bool any = false;
  for (auto it = std::sregex_iterator(config->begin(), config->end(), pair); it != std::sregex_iterator(); ++it) {
    total += std::strtoull((*it)[1].str().c_str(), nullptr, 10) * std::strtoull((*it)[2].str().c_str(), nullptr, 10) * 1024;
    any = true;
  }
  return any ? total : default_size;  // LibTorch warns and keeps its default when it cannot parse it
}

std::optional<std::string> cublas_workspace_config() {
  const char* v = std::getenv("CUBLAS_WORKSPACE_CONFIG");  // NOLINT(concurrency-mt-unsafe): read, never set, here
  return v != nullptr ? std::optional<std::string>(v) : std::nullopt;
}

workspace_charge compute_workspaces(int gpu, int cc_major) {
  if (gpu < 0) return {};
  return {cublas_workspace_bytes(cc_major, cublas_workspace_config()), cublas_workspaces_per_device};
}

}  // namespace lorapipe
