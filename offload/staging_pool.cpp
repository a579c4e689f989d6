// Exact-size staging pool: see staging_pool.h.
#include "offload/staging_pool.h"

#include <algorithm>
#include <new>

namespace lorapipe {

std::shared_ptr<staging_pool> staging_pool::create(std::string name, alloc_fn alloc, free_fn free, size_t max_cached_bytes) {
  return std::shared_ptr<staging_pool>(new staging_pool(std::move(name), std::move(alloc), std::move(free), max_cached_bytes));
}

staging_pool::staging_pool(std::string name, alloc_fn alloc, free_fn free, size_t max_cached)
    : name_(std::move(name)), alloc_(std::move(alloc)), free_(std::move(free)), max_cached_(max_cached) {}

staging_pool::~staging_pool() { trim(); }

std::shared_ptr<void> staging_pool::acquire(size_t bytes) {
  const size_t n = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  {
    std::lock_guard lock(mu_);
    if (auto it = cached_.find(n); it != cached_.end()) {
      p = it->second;
      cached_.erase(it);
      cached_bytes_ -= n;
      ++st_.hits;
    } else {
      ++st_.misses;
    }
  }
  if (p == nullptr) {
    p = alloc_(n);  // outside the lock: cudaHostAlloc can take milliseconds
    if (p == nullptr) throw std::bad_alloc();
    std::lock_guard lock(mu_);
    st_.reserved_bytes += n;
  }
  {
    std::lock_guard lock(mu_);
    st_.in_use_bytes += n;
    st_.peak_in_use_bytes = std::max(st_.peak_in_use_bytes, st_.in_use_bytes);
  }
  auto keep = shared_from_this();  // blocks keep the pool (and its free function) alive
  return std::shared_ptr<void>(p, [keep, n](void* q) { keep->give_back(q, n); });
}

void staging_pool::give_back(void* p, size_t bytes) {
  std::unique_lock lock(mu_);
  st_.in_use_bytes -= bytes;
  if (cached_bytes_ + bytes <= max_cached_) {
    cached_.emplace(bytes, p);
    cached_bytes_ += bytes;
    return;
  }
  st_.reserved_bytes -= bytes;
  lock.unlock();
  free_(p);
}

staging_stats staging_pool::stats() const {
  std::lock_guard lock(mu_);
  return st_;
}

void staging_pool::trim() {
  std::multimap<size_t, void*> drop;
  {
    std::lock_guard lock(mu_);
    drop.swap(cached_);
    st_.reserved_bytes -= cached_bytes_;
    cached_bytes_ = 0;
  }
  for (auto& [n, p] : drop) free_(p);
}

}  // namespace lorapipe
