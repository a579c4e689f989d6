// Throttled FIFO copy engine: see copy_engine.h.
#include "offload/copy_engine.h"

#include <algorithm>
#include <chrono>

namespace lorapipe {

shared_link::time_point shared_link::reserve(size_t bytes, time_point ready) {
  const auto take = std::chrono::duration_cast<time_point::duration>(
      std::chrono::duration<double>(bytes_per_s_ > 0 ? static_cast<double>(bytes) / bytes_per_s_ : 0.0));
  std::lock_guard lock(mu_);
  free_at_ = std::max(free_at_, ready) + take;
  return free_at_;
}

copy_engine::copy_engine(std::string name, double bytes_per_s, double latency_s, std::shared_ptr<shared_link> link)
    : name_(std::move(name)), bytes_per_s_(bytes_per_s), latency_s_(latency_s), link_(std::move(link)), thread_([this] { run(); }) {}

copy_engine::~copy_engine() { stop(); }

void copy_engine::stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_future<void> copy_engine::submit(size_t bytes, std::function<void()> job) {
  task t{bytes, std::move(job), {}};
  auto f = t.done.get_future().share();
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(t));
  }
  cv_.notify_one();
  return f;
}

double copy_engine::busy_seconds() const {
  std::lock_guard lock(mu_);
  return busy_s_;
}

size_t copy_engine::bytes_copied() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

// The link's bandwidth is shared fairly: a copy takes its turns about a millisecond of link time at
// a time, each turn ready when its previous one ends, so engines copying at once interleave (and
// end together) while one copying alone runs at the full rate without drift.
void copy_engine::through_link(size_t bytes, std::chrono::steady_clock::time_point start) {
  const size_t turn = std::max<size_t>(size_t{64} << 10, static_cast<size_t>(link_->bytes_per_s() * 1e-3));
  auto ready = start;
  for (size_t left = bytes; left > 0;) {
    const size_t n = std::min(left, turn);
    ready = link_->reserve(n, ready);
    std::this_thread::sleep_until(ready);
    left -= n;
  }
}

void copy_engine::run() {
  using clock = std::chrono::steady_clock;
  for (;;) {
    task t;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop requested and nothing left
      t = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto start = clock::now();
    try {
      // The job (and whatever it captured) is destroyed before the copy is reported done, so a
      // waiter that then frees memory sees no reference left behind on this thread.
      std::function<void()>(std::move(t.job))();
      const double want = latency_s_ + (bytes_per_s_ > 0 ? static_cast<double>(t.bytes) / bytes_per_s_ : 0.0);
      const auto until = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(want));
      if (link_ && link_->bytes_per_s() > 0) through_link(t.bytes, start);
      std::this_thread::sleep_until(until);
      t.done.set_value();
    } catch (...) {
      t.done.set_exception(std::current_exception());
    }
    std::lock_guard lock(mu_);
    busy_s_ += std::chrono::duration<double>(clock::now() - start).count();
    bytes_ += t.bytes;
  }
}

}  // namespace lorapipe
