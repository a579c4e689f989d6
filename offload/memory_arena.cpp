// Best-fit arena with coalescing free list: see memory_arena.h.
#include "offload/memory_arena.h"

#include <algorithm>
#include <cassert>

namespace lorapipe {

memory_arena::memory_arena(std::string name, size_t capacity, size_t alignment, bool contiguous)
    : name_(std::move(name)), capacity_(capacity), alignment_(std::max<size_t>(1, alignment)), contiguous_(contiguous) {
  if (capacity_ > 0) free_[0] = capacity_;
}

result<size_t> memory_arena::allocate(size_t bytes) {
  const size_t need = (std::max<size_t>(bytes, 1) + alignment_ - 1) / alignment_ * alignment_;
  std::lock_guard lock(mu_);
  if (!contiguous_) {
    if (in_use_ + need > capacity_)
      return make_error("{}: out of memory: {} bytes requested, {} of {} in use", name_, bytes, in_use_, capacity_);
    const size_t h = next_handle_++;
    used_[h] = need;
    in_use_ += need;
    peak_ = std::max(peak_, in_use_);
    return h;
  }
  // Best fit (smallest free range that holds the block, lowest offset on ties): stages of different
  // sizes alternating in a weight arena leave fewer holes than with first fit.
  auto it = free_.end();
  for (auto f = free_.begin(); f != free_.end(); ++f)
    if (f->second >= need && (it == free_.end() || f->second < it->second)) it = f;
  if (it != free_.end()) {
    const size_t off = it->first, rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_[off + need] = rest;
    used_[off] = need;
    in_use_ += need;
    peak_ = std::max(peak_, in_use_);
    high_water_ = std::max(high_water_, off + need);
    return off;
  }
  return make_error("{}: out of memory: {} bytes requested, {} of {} in use", name_, bytes, in_use_, capacity_);
}

void memory_arena::release(size_t offset) {
  std::lock_guard lock(mu_);
  auto it = used_.find(offset);
  assert(it != used_.end());
  if (it == used_.end()) return;
  size_t off = it->first, size = it->second;
  in_use_ -= size;
  used_.erase(it);
  if (!contiguous_) return;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += size;
      return;
    }
  }
  free_[off] = size;
}

size_t memory_arena::used() const {
  std::lock_guard lock(mu_);
  return in_use_;
}
size_t memory_arena::peak() const {
  std::lock_guard lock(mu_);
  return peak_;
}
size_t memory_arena::high_water() const {
  std::lock_guard lock(mu_);
  return contiguous_ ? high_water_ : peak_;
}
void memory_arena::reset_peak() {
  std::lock_guard lock(mu_);
  peak_ = in_use_;
}

block_layout layout_block(const std::vector<size_t>& sizes, size_t alignment) {
  block_layout b;
  for (size_t n : sizes) {
    const size_t at = (b.bytes + alignment - 1) / alignment * alignment;
    b.offsets.push_back(at);
    b.bytes = at + n;
  }
  return b;
}

}  // namespace lorapipe
