// Throttled FIFO copy engine: see copy_engine.h.
#include "offload/copy_engine.h"

#include <chrono>

namespace lorapipe {

copy_engine::copy_engine(std::string name, double bytes_per_s, double latency_s)
    : name_(std::move(name)), bytes_per_s_(bytes_per_s), latency_s_(latency_s), thread_([this] { run(); }) {}

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
      std::this_thread::sleep_until(start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(want)));
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
