// Throttled FIFO copy engine: see copy_engine.h.
#include "offload/copy_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <thread>

namespace lorapipe {

uint64_t fluid_link::join(double bytes, double now) {
  advance(now);
  const uint64_t id = next_++;
  if (bytes > 0.5) left_[id] = bytes;
  return id;
}

void fluid_link::advance(double to) {
  double dt = to - at_;
  if (dt <= 0) return;
  at_ = to;
  if (!(bytes_per_s_ > 0 && std::isfinite(bytes_per_s_))) left_.clear();  // no limit: through at once
  while (dt > 0 && !left_.empty()) {
    const auto n = static_cast<double>(left_.size());
    double smallest = left_.begin()->second;
    for (const auto& [id, left] : left_) smallest = std::min(smallest, left);
    const double step = std::min(dt, smallest * n / bytes_per_s_);  // until the smallest is through
    const double each = bytes_per_s_ * step / n;
    for (auto it = left_.begin(); it != left_.end();) {
      it->second -= each;
      it = it->second <= 0.5 ? left_.erase(it) : std::next(it);
    }
    dt -= step;
  }
}

double fluid_link::end_of(uint64_t id) const {
  const auto mine = left_.find(id);
  if (mine == left_.end()) return at_;
  // Each transfer in flight passes min(its bytes, mine) before mine is through.
  double before = 0;
  for (const auto& [other, left] : left_) before += std::min(left, mine->second);
  return at_ + before / bytes_per_s_;
}

uint64_t shared_link::enter(size_t bytes) {
  std::lock_guard lock(mu_);
  return link_.join(static_cast<double>(bytes), seconds(std::chrono::steady_clock::now()));
}

void shared_link::leave(uint64_t id) {
  std::lock_guard lock(mu_);
  link_.leave(id);
}

void shared_link::wait_through(uint64_t id) {
  std::unique_lock lock(mu_);
  link_.advance(seconds(std::chrono::steady_clock::now()));
  while (!link_.through(id)) {
    // Another copy that joins meanwhile moves this end later: this one then wakes early and waits on.
    const auto until = origin_ + std::chrono::duration_cast<time_point::duration>(std::chrono::duration<double>(link_.end_of(id)));
    lock.unlock();
    std::this_thread::sleep_until(until);
    lock.lock();
    link_.advance(seconds(std::chrono::steady_clock::now()));
  }
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
    const bool on_link = link_ && link_->bytes_per_s() > 0 && std::isfinite(link_->bytes_per_s());
    const uint64_t transfer = on_link ? link_->enter(t.bytes) : 0;  // on the link from now, like a DMA
    try {
      // The job (and whatever it captured) is destroyed before the copy is reported done, so a
      // waiter that then frees memory sees no reference left behind on this thread.
      std::function<void()>(std::move(t.job))();
      const double want = latency_s_ + (bytes_per_s_ > 0 ? static_cast<double>(t.bytes) / bytes_per_s_ : 0.0);
      const auto until = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(want));
      if (on_link) link_->wait_through(transfer);
      std::this_thread::sleep_until(until);
      t.done.set_value();
    } catch (...) {
      if (on_link) link_->leave(transfer);  // a failed copy takes no more of the link
      t.done.set_exception(std::current_exception());
    }
    std::lock_guard lock(mu_);
    busy_s_ += std::chrono::duration<double>(clock::now() - start).count();
    bytes_ += t.bytes;
  }
}

}  // namespace lorapipe
