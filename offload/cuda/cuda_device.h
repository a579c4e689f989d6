// CUDA pipeline device: a compute stream plus separate weight-upload, activation-upload and download
// streams (each driven by its own copy-engine thread), a capacity-limited arena sized from the GPU's
// free memory (or offload.device_memory_mb), frozen host weights registered as pinned memory in place
// (cudaHostRegister: exact size, no copy), and pinned staging for activations. A copy is ordered
// after the compute that produced its source by an event recorded on the compute stream.
#pragma once

#include <memory>

#include "core/base/result.h"
#include "offload/device.h"

namespace lorapipe {

// index: position in the pipeline; gpu: CUDA device ordinal (several pipeline devices may share one).
result<std::unique_ptr<compute_device>> make_cuda_device(int index, int gpu, const cpu_device_options& o);
// Whether `to_gpu` can read/write `from_gpu`'s memory directly (enables it when possible; the same
// GPU always can).
bool cuda_peer_access(int from_gpu, int to_gpu);
// enable_nccl() for CUDA devices (see device.h).
status enable_cuda_nccl(const std::vector<compute_device*>& devices);

}  // namespace lorapipe
