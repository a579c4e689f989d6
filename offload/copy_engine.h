// A copy engine: one thread that runs copy jobs in FIFO order, optionally throttled to a bandwidth
// (bytes/s) and a per-copy latency, so that host<->device traffic on CPU virtual devices takes
// realistic time and overlap with compute is real and measurable; engines may also share a link
// (GPUs behind one PCIe switch), whose bandwidth the copies going through it divide. Torch-free: a
// job is a callable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace lorapipe {

// A link several copy engines share, one direction: each reservation takes its turn at the link's
// bandwidth after those made before it, so engines copying at once divide the bandwidth and one
// copying alone has all of it. Thread-safe.
class shared_link {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  explicit shared_link(double bytes_per_s) : bytes_per_s_(bytes_per_s) {}
  // When `bytes` ready at `ready` are through the link (after everything reserved before).
  time_point reserve(size_t bytes, time_point ready);
  double bytes_per_s() const { return bytes_per_s_; }

 private:
  double bytes_per_s_;
  std::mutex mu_;
  time_point free_at_{};
};

class copy_engine {
 public:
  // link: shared with other engines (nullptr: a link of its own, the throttle only).
  copy_engine(std::string name, double bytes_per_s = 0, double latency_s = 0, std::shared_ptr<shared_link> link = nullptr);
  ~copy_engine();
  copy_engine(const copy_engine&) = delete;
  copy_engine& operator=(const copy_engine&) = delete;

  // Runs job() on the engine thread; the copy then takes at least bytes/bandwidth + latency, and
  // lasts until its turn on the shared link is through.
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
  void through_link(size_t bytes, std::chrono::steady_clock::time_point start);
  struct task {
    size_t bytes;
    std::function<void()> job;
    std::promise<void> done;
  };
  std::string name_;
  double bytes_per_s_, latency_s_;
  std::shared_ptr<shared_link> link_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<task> queue_;
  bool stop_ = false;
  double busy_s_ = 0;
  size_t bytes_ = 0;
  std::thread thread_;
};

}  // namespace lorapipe
