// A capacity-limited arena of exact-size blocks (no power-of-two rounding): the bookkeeping behind a
// device weight arena, a pinned host arena, or a CPU virtual device's memory. Allocation beyond the
// capacity fails the way a GPU OOM does. Tracks current and peak use. Thread-safe.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

class memory_arena {
 public:
  // contiguous: blocks get real offsets in one range (best fit, so fragmentation can still cause OOM, as in
  // a preallocated GPU arena); otherwise only the total is limited (CPU virtual devices, whose tensors
  // are separate host allocations) and the "offset" is just a handle.
  memory_arena(std::string name, size_t capacity, size_t alignment = 256, bool contiguous = true);
  // Offset of a block of exactly `bytes` (rounded up to the alignment); error when it does not fit.
  result<size_t> allocate(size_t bytes);
  void release(size_t offset);
  size_t capacity() const { return capacity_; }
  size_t alignment() const { return alignment_; }
  size_t used() const;
  size_t peak() const;
  void reset_peak();
  // Contiguous arenas: the highest end offset ever allocated (the size a preallocated region needs
  // for the allocations seen so far); otherwise the peak.
  size_t high_water() const;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  size_t capacity_, alignment_;
  bool contiguous_;
  size_t next_handle_ = 0;
  mutable std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> size, coalesced
  std::map<size_t, size_t> used_;  // offset -> size
  size_t in_use_ = 0, peak_ = 0, high_water_ = 0;
};

// One block holding pieces of `sizes` bytes back to back, each starting at a multiple of
// `alignment` (the layout of a stage's weights in a weight arena; exact, no power-of-two rounding).
struct block_layout {
  std::vector<size_t> offsets;
  size_t bytes = 0;  // end of the last piece
};
inline constexpr size_t weight_alignment = 256;  // every weight tensor in a weight arena starts at a multiple of this

block_layout layout_block(const std::vector<size_t>& sizes, size_t alignment);

}  // namespace lorapipe
