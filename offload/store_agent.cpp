// The store agent: see store_agent.h.
#include "offload/store_agent.h"

#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <stdexcept>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace lorapipe {

struct store_agent::state {
  std::string host;
  uint16_t port = 0;
  std::chrono::milliseconds timeout{0};
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> jobs;  // under mu
  bool stop = false;                       // under mu
  std::atomic<bool> stuck{false};
  c10::intrusive_ptr<c10d::TCPStore> store;  // the agent's thread only

  void loop() {
    while (true) {
      std::function<void()> job;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || !jobs.empty(); });
        if (jobs.empty()) return;  // stopping, nothing left
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      job();
    }
  }
  c10d::TCPStore& connection() {
    if (!store) {
      c10d::TCPStoreOptions so;
      so.port = port;
      so.isServer = false;
      so.waitWorkers = false;
      so.useLibUV = false;
      so.timeout = timeout;
      store = c10::make_intrusive<c10d::TCPStore>(host, so);
    }
    return *store;
  }
};

store_agent::store_agent(std::string host, uint16_t port, std::chrono::milliseconds timeout) : s_(std::make_shared<state>()) {
  s_->host = std::move(host);
  s_->port = port;
  s_->timeout = timeout;
  thread_ = std::thread([s = s_] { s->loop(); });
}

store_agent::~store_agent() {
  {
    std::lock_guard lock(s_->mu);
    s_->stop = true;
  }
  s_->cv.notify_one();
  if (s_->stuck) thread_.detach();  // blocked in a recv that may never return; it keeps s_ alive
  else thread_.join();
}

void store_agent::run(std::function<void(c10d::TCPStore&)> job) {
  if (s_->stuck) throw std::runtime_error(fmt::format("the rendezvous store at {}:{} stopped answering", s_->host, s_->port));
  auto done = std::make_shared<std::promise<void>>();
  auto answered = done->get_future();
  {
    std::lock_guard lock(s_->mu);
    s_->jobs.push_back([s = s_.get(), job = std::move(job), done] {  // s: the thread's own reference keeps it
      try {
        job(s->connection());
        done->set_value();
      } catch (...) {
        s->store.reset();  // a fresh connection next time (this one may be out of step)
        done->set_exception(std::current_exception());
      }
      s->stuck = false;  // answered after all (a late answer: the jobs behind it run in order)
    });
  }
  s_->cv.notify_one();
  // The deadline covers a job queued behind another (each may reconnect, then ask): 2 x timeout + 1 s.
  const auto deadline = 2 * s_->timeout + std::chrono::seconds(1);
  if (answered.wait_for(deadline) != std::future_status::ready) {
    s_->stuck = true;
    throw std::runtime_error(fmt::format("the rendezvous store at {}:{} did not answer within {:.1f} s", s_->host, s_->port,
                                         std::chrono::duration<double>(deadline).count()));
  }
  answered.get();
}

}  // namespace lorapipe
