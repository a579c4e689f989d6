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

nccl_comms::~nccl_comms() {
  for (ncclComm_t c : comms_)
    if (c != nullptr) ncclCommDestroy(c);
}

}  // namespace lorapipe::cuda
