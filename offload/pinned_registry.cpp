// Budgeted page-locked host memory: see pinned_registry.h.
#include "offload/pinned_registry.h"

namespace lorapipe {

pinned_registry::pinned_registry(size_t budget_bytes, std::function<pin_result(void*, size_t)> reg, std::function<void(void*)> unreg)
    : budget_(budget_bytes), reg_(std::move(reg)), unreg_(std::move(unreg)) {}

pinned_registry::~pinned_registry() {
  for (const auto& [p, entry] : pinned_)
    if (entry.second) unreg_(const_cast<void*>(p));
}

bool pinned_registry::acquire(const void* p, size_t n) {
  std::lock_guard lock(mu_);
  if (n == 0 || pinned_.count(p)) return true;
  const pin_result r = used_ + n > budget_ ? pin_result::refused : reg_(const_cast<void*>(p), n);
  if (r == pin_result::refused) {
    ++refused_;
    return false;
  }
  pinned_[p] = {n, r == pin_result::pinned};
  used_ += n;
  return true;
}

size_t pinned_registry::pinned_bytes() const {
  std::lock_guard lock(mu_);
  return used_;
}

size_t pinned_registry::refused() const {
  std::lock_guard lock(mu_);
  return refused_;
}

}  // namespace lorapipe
