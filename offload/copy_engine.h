// A copy engine: one thread that runs copy jobs in FIFO order, optionally throttled to a bandwidth
// (bytes/s) and a per-copy latency, so that host<->device traffic on CPU virtual devices takes
// realistic time and overlap with compute is real and measurable; engines may also share a link
// (GPUs behind one PCIe switch), whose bandwidth the copies going through it divide. Torch-free: a
// job is a callable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace lorapipe {

// The arithmetic of a link whose bandwidth the transfers in flight divide equally (processor
// sharing, as the simulator charges shared links), in seconds from any origin. Not thread-safe.
class fluid_link {
 public:
  explicit fluid_link(double bytes_per_s) : bytes_per_s_(bytes_per_s) {}
  // Advances to `now` and lets `bytes` in. Returns its id.
  uint64_t join(double bytes, double now);
  // Takes `id` off the link (through or not).
  void leave(uint64_t id) { left_.erase(id); }
  // Moves every transfer on to `to` (earlier times are ignored); those through leave.
  void advance(double to);
  bool through(uint64_t id) const { return left_.find(id) == left_.end(); }
  // When `id` is through if nothing else joins (now if it is).
  double end_of(uint64_t id) const;
  size_t in_flight() const { return left_.size(); }
  double bytes_per_s() const { return bytes_per_s_; }

 private:
  double bytes_per_s_;
  std::map<uint64_t, double> left_;  // bytes still to pass, per transfer in flight
  uint64_t next_ = 0;
  double at_ = 0;  // the time left_ describes
};

// A link several copy engines share, one direction: its bandwidth is divided equally among the
// copies in flight (fluid_link), so copies on it at once end together however late their threads
// wake, and one copying alone has all of it. A copy is on the link from when its engine starts it
// (like a DMA), whatever the engine's thread does meanwhile (a CPU device's memcpy). Thread-safe.
class shared_link {
 public:
  explicit shared_link(double bytes_per_s) : link_(bytes_per_s) {}
  // Puts `bytes` on the link now; the id is for wait_through or leave.
  uint64_t enter(size_t bytes);
  // Blocks until `id` is through.
  void wait_through(uint64_t id);
  void leave(uint64_t id);
  double bytes_per_s() const { return link_.bytes_per_s(); }

 private:
  using time_point = std::chrono::steady_clock::time_point;
  double seconds(time_point t) const { return std::chrono::duration<double>(t - origin_).count(); }
  const time_point origin_ = std::chrono::steady_clock::now();
  std::mutex mu_;
  fluid_link link_;
};

class copy_engine {
 public:
  // link: shared with other engines (nullptr: a link of its own, the throttle only).
  copy_engine(std::string name, double bytes_per_s = 0, double latency_s = 0, std::shared_ptr<shared_link> link = nullptr);
  ~copy_engine();
  copy_engine(const copy_engine&) = delete;
  copy_engine& operator=(const copy_engine&) = delete;

  // Runs job() on the engine thread; the copy then takes at least bytes/bandwidth + latency, and
  // lasts until its bytes are through the shared link.
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
