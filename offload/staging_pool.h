// Exact-size staging pool for host memory that copies go through (pinned on CUDA devices: offloaded
// checkpoints, activations and gradients on their way between devices). A block is as large as
// asked, never rounded to a power of two; a released block waits in a free list for the next request
// of exactly that size (pipelines repeat the same shapes every step, so after the first step every
// request is a hit). Allocation is pluggable (cudaHostAlloc, or plain memory on CPU virtual devices).
// Torch-free and thread-safe.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace lorapipe {

struct staging_stats {
  size_t reserved_bytes = 0;  // held from the system (in use + cached)
  size_t in_use_bytes = 0;
  size_t peak_in_use_bytes = 0;
  size_t hits = 0, misses = 0;  // requests served from the free lists / by a new allocation
};

class staging_pool : public std::enable_shared_from_this<staging_pool> {
 public:
  using alloc_fn = std::function<void*(size_t)>;
  using free_fn = std::function<void(void*)>;
  // max_cached_bytes: released blocks beyond this much cached memory go back to the system.
  static std::shared_ptr<staging_pool> create(std::string name, alloc_fn alloc, free_fn free,
                                              size_t max_cached_bytes = size_t{1} << 40);
  ~staging_pool();
  staging_pool(const staging_pool&) = delete;
  staging_pool& operator=(const staging_pool&) = delete;

  // A block of exactly `bytes`; it returns to the pool when the last copy of the pointer is gone
  // (the pool outlives its blocks).
  std::shared_ptr<void> acquire(size_t bytes);
  staging_stats stats() const;
  void trim();  // return every cached block to the system
  const std::string& name() const { return name_; }

 private:
  staging_pool(std::string name, alloc_fn alloc, free_fn free, size_t max_cached);
  void give_back(void* p, size_t bytes);

  std::string name_;
  alloc_fn alloc_;
  free_fn free_;
  size_t max_cached_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> cached_;  // exact size -> free block
  size_t cached_bytes_ = 0;
  staging_stats st_;
};

}  // namespace lorapipe
