// CUDA runtime error checking: LP_CUDA_CHECK throws device_error (out_of_memory_error for OOM)
// naming the call, file and line. Caught at the engine boundary like every device failure.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/base/errors.h"

namespace lorapipe::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line);

}  // namespace lorapipe::cuda

#define LP_CUDA_CHECK(call)                                                            \
  do {                                                                                 \
    cudaError_t lp_e_ = (call);                                                        \
    if (lp_e_ != cudaSuccess) ::lorapipe::cuda::throw_cuda_error(lp_e_, #call, __FILE__, __LINE__); \
  } while (0)
