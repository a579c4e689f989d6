// NCCL communicators for the pipeline's CUDA devices (one process; the nccl transport makes one
// two-rank set per link direction): RAII over ncclCommInitAll/ncclCommDestroy, ncclCommAbort on failure, and LP_NCCL_CHECK, which throws device_error naming
// the call. Used by the nccl transport's stream-ordered send/recv (cuda_device.cpp).
#pragma once

#include <nccl.h>

#include <mutex>
#include <vector>

#include "core/base/errors.h"

namespace lorapipe::cuda {

[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* what, const char* file, int line);

class nccl_comms {
 public:
  explicit nccl_comms(const std::vector<int>& gpus);  // rank i on GPU gpus[i]; GPUs must be distinct
  ~nccl_comms();
  nccl_comms(const nccl_comms&) = delete;
  nccl_comms& operator=(const nccl_comms&) = delete;
  ncclComm_t rank(int i) const {  // nullptr once aborted
    std::lock_guard lock(mu_);
    return comms_.at(static_cast<size_t>(i));
  }
  // ncclCommAbort on every rank (once; later calls do nothing): pending operations end with an error.
  void abort();

 private:
  std::vector<ncclComm_t> comms_;
  mutable std::mutex mu_;
};

}  // namespace lorapipe::cuda

#define LP_NCCL_CHECK(call)                                                                          \
  do {                                                                                               \
    ncclResult_t lp_r_ = (call);                                                                     \
    if (lp_r_ != ncclSuccess) ::lorapipe::cuda::throw_nccl_error(lp_r_, #call, __FILE__, __LINE__); \
  } while (0)
