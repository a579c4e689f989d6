// CUDA pipeline device: a compute stream plus separate weight-upload, activation-upload and download
// streams (each driven by its own copy-engine thread), a capacity-limited arena sized from the GPU's
// free memory (or offload.device_memory_mb), frozen host weights registered as pinned memory in place
// (cudaHostRegister: exact size, no copy) within the pipeline's pinned budget and copied through a
// pinned bounce buffer beyond it, and pinned staging for activations. A copy is ordered
// after the compute that produced its source by an event recorded on the compute stream.
#pragma once

#include <memory>

#include "core/base/result.h"
#include "offload/device.h"
#include "offload/device_probe.h"
#include "offload/pinned_registry.h"

namespace lorapipe {

// index: position in the pipeline; gpu: CUDA device ordinal (several pipeline devices may share one).
// capacity: the memory this pipeline device may use (split_gpu_memory).
// pinned: the pipeline's registry of page-locked host weights (make_cuda_pinned_registry), shared by
// its devices.
result<std::unique_ptr<compute_device>> make_cuda_device(int index, int gpu, size_t capacity,
                                                         std::shared_ptr<pinned_registry> pinned, const cpu_device_options& o);
std::shared_ptr<pinned_registry> make_cuda_pinned_registry(size_t budget_bytes);
// Free memory of GPU `gpu` (cudaMemGetInfo); an error names a GPU that does not exist.
result<size_t> cuda_free_bytes(int gpu);
// The static facts of GPU `gpu` for the device probe (name, memory, SMs, compute capability, PCI bus
// id; PCIe link and NUMA node from sysfs).
status cuda_describe_gpu(int gpu, probed_device& d);
// cuda_version_info() of a CUDA build (device.h).
cuda_versions cuda_runtime_versions();
// Whether `to_gpu` can read/write `from_gpu`'s memory directly (enables it when possible; the same
// GPU always can).
bool cuda_peer_access(int from_gpu, int to_gpu);
// enable_nccl() for CUDA devices (see device.h).
status enable_cuda_nccl(const std::vector<compute_device*>& devices, const std::vector<std::pair<int32_t, int32_t>>& links,
                        process_group* group, const std::vector<int>& rank_of);

}  // namespace lorapipe
