// NCCL communicators for the pipeline's CUDA devices (the nccl transport makes one two-rank set per
// link direction: both ranks here for a link inside this process, one for a link to another process): RAII over ncclCommInitAll/ncclCommDestroy, ncclCommAbort on failure, and LP_NCCL_CHECK, which throws device_error naming
// the call. Used by the nccl transport's stream-ordered send/recv (cuda_device.cpp).
#pragma once

#include <nccl.h>

#include <mutex>
#include <shared_mutex>
#include <vector>

#include "core/base/errors.h"

namespace lorapipe::cuda {

[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* what, const char* file, int line);

class nccl_comms {
 public:
  explicit nccl_comms(const std::vector<int>& gpus);  // rank i on GPU gpus[i]; GPUs must be distinct
  // This process's rank of a communicator whose other ranks live in other processes (id from
  // ncclGetUniqueId in one of them, passed on by the caller); rank(r) is null for the others'.
  nccl_comms(int nranks, int rank, int gpu, const ncclUniqueId& id);
  ~nccl_comms();
  nccl_comms(const nccl_comms&) = delete;
  nccl_comms& operator=(const nccl_comms&) = delete;
  ncclComm_t rank(int i) const { return comms_.at(static_cast<size_t>(i)); }  // not while abort() may run: use()
  // Runs fn(rank i's communicator, or nullptr once aborted) while abort() cannot free it (calls that
  // enqueue work; they return before the transfer happens).
  template <class Fn>
  void use(int i, Fn&& fn) const {
    std::shared_lock lock(mu_);
    fn(comms_.at(static_cast<size_t>(i)));
  }
  // ncclCommAbort on every rank (once; later calls do nothing): enqueued operations end with an error.
  void abort();

 private:
  std::vector<ncclComm_t> comms_;
  mutable std::shared_mutex mu_;
};

}  // namespace lorapipe::cuda

#define LP_NCCL_CHECK(call)                                                                          \
  do {                                                                                               \
    ncclResult_t lp_r_ = (call);                                                                     \
    if (lp_r_ != ncclSuccess) ::lorapipe::cuda::throw_nccl_error(lp_r_, #call, __FILE__, __LINE__); \
  } while (0)
