// A copy engine: one thread that runs copy jobs in FIFO order, optionally throttled to a bandwidth
// (bytes/s) and a per-copy latency, so that host<->device traffic on CPU virtual devices takes
// realistic time and overlap with compute is real and measurable. Torch-free: a job is a callable.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

namespace lorapipe {

class copy_engine {
 public:
  copy_engine(std::string name, double bytes_per_s = 0, double latency_s = 0);
  ~copy_engine();
  copy_engine(const copy_engine&) = delete;
  copy_engine& operator=(const copy_engine&) = delete;

  // Runs job() on the engine thread; the copy then takes at least bytes/bandwidth + latency.
  // An exception thrown by the job is delivered through the future.
  std::shared_future<void> submit(size_t bytes, std::function<void()> job);
  // Runs what is queued, then joins the thread (idempotent; the destructor calls it). Devices call it
  // first in their destructors, before anything a queued copy may touch goes away.
  void stop();
  double busy_seconds() const;
  size_t bytes_copied() const;
  const std::string& name() const { return name_; }
  double bytes_per_s() const { return bytes_per_s_; }  // the throttle (0 = none)

 private:
  void run();
  struct task {
    size_t bytes;
    std::function<void()> job;
    std::promise<void> done;
  };
  std::string name_;
  double bytes_per_s_, latency_s_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<task> queue_;
  bool stop_ = false;
  double busy_s_ = 0;
  size_t bytes_ = 0;
  std::thread thread_;
};

}  // namespace lorapipe
