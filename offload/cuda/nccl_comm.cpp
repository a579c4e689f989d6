// NCCL communicators: see nccl_comm.h.
#include "offload/cuda/nccl_comm.h"

#include <string>

namespace lorapipe::cuda {

void throw_nccl_error(ncclResult_t r, const char* what, const char* file, int line) {
  throw device_error(std::string("NCCL error ") + ncclGetErrorString(r) + " in " + what + " at " + file + ":" + std::to_string(line));
}

nccl_comms::nccl_comms(const std::vector<int>& gpus) : comms_(gpus.size(), nullptr) {
  LP_NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(gpus.size()), gpus.data()));
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
