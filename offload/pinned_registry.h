// Page-locked host memory for streamed weights, under a budget. Uploading frozen weights from pinned
// memory is what makes PREFETCH fast, but page-locking a 30B model on a 64 GB desktop would lock
// nearly all of RAM. One registry per pipeline, shared by its devices (a second device finds what the
// first registered instead of registering it again or silently relying on it): each host buffer is
// registered once while the budget allows; acquire() says whether a buffer is pinned, and the device
// copies a buffer that is not through its pinned bounce buffer. Everything registered is released
// when the last device lets go of the registry (the host weights outlive the pipeline). Torch-free:
// registering is a callable (cudaHostRegister on CUDA).
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

namespace lorapipe {

class pinned_registry {
 public:
  // reg(p, n) page-locks [p, p+n): refused, pinned (unreg(p) undoes it), or already pinned by someone
  // else (counted, never unregistered here).
  enum class pin_result { refused, pinned, pinned_elsewhere };
  pinned_registry(size_t budget_bytes, std::function<pin_result(void*, size_t)> reg, std::function<void(void*)> unreg);
  ~pinned_registry();
  pinned_registry(const pinned_registry&) = delete;
  pinned_registry& operator=(const pinned_registry&) = delete;

  // True when [p, p+n) is (now) pinned; false when the budget or the system says no.
  bool acquire(const void* p, size_t n);
  size_t pinned_bytes() const;
  size_t budget_bytes() const { return budget_; }
  size_t refused() const;  // acquire() calls answered false

 private:
  size_t budget_;
  std::function<pin_result(void*, size_t)> reg_;
  std::function<void(void*)> unreg_;
  mutable std::mutex mu_;
  std::map<const void*, std::pair<size_t, bool>> pinned_;  // -> bytes, registered here
  size_t used_ = 0, refused_ = 0;
};

}  // namespace lorapipe
