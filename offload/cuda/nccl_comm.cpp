// NCCL communicators: see nccl_comm.h.
#include "offload/cuda/nccl_comm.h"

#include <string>

#include <cuda_runtime.h>

#include "offload/cuda/cuda_check.h"

namespace lorapipe::cuda {

void throw_nccl_error(ncclResult_t r, const char* what, const char* file, int line) {
  throw device_error(std::string("NCCL error ") + ncclGetErrorString(r) + " in " + what + " at " + file + ":" + std::to_string(line));
}

nccl_comms::nccl_comms(const std::vector<int>& gpus) : comms_(gpus.size(), nullptr) {
  LP_NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(gpus.size()), gpus.data()));
}

nccl_comms::nccl_comms(int nranks, int rank, int gpu, const ncclUniqueId& id) : comms_(static_cast<size_t>(nranks), nullptr) {
  LP_CUDA_CHECK(cudaSetDevice(gpu));
  LP_NCCL_CHECK(ncclCommInitRank(&comms_.at(static_cast<size_t>(rank)), nranks, id, rank));
}

void nccl_comms::abort() {
  std::vector<ncclComm_t> live;
  {
    std::unique_lock lock(mu_);
    live.swap(comms_);
    comms_.assign(live.size(), nullptr);
  }
  for (ncclComm_t c : live)
    if (c != nullptr) ncclCommAbort(c);  // also frees it
}

nccl_comms::~nccl_comms() {
  for (ncclComm_t c : comms_)
    if (c != nullptr) ncclCommDestroy(c);
}

}  // namespace lorapipe::cuda
