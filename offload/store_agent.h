// A TCPStore client on a thread of its own, every request waited for with a deadline. A c10d
// TCPStore client blocks in recv without any timeout when the server stops answering (a SIGSTOPped
// or frozen rank 0, a cut network): check(), a wait's cancellation and get() never return. The
// process group's failure bookkeeping and progress reports go through this agent so that such a
// rank 0 costs a caller seconds, never forever.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

namespace c10d {
class TCPStore;
}

namespace lorapipe {

class store_agent {
 public:
  // The connection (to host:port, with `timeout` for connecting and for the store's own waits) is
  // made on first use and made again after an error; a request unanswered after 2 x timeout + 1 s
  // leaves the agent stuck until that request is answered after all (if ever).
  store_agent(std::string host, uint16_t port, std::chrono::milliseconds timeout);
  ~store_agent();  // joins the thread, or lets it go when stuck (it holds what it uses)
  store_agent(const store_agent&) = delete;
  store_agent& operator=(const store_agent&) = delete;

  // job(store) on the agent's thread. Throws std::runtime_error past the deadline (and at once while
  // stuck); rethrows what the job threw. The job must own what it captures: it may outlive the call.
  void run(std::function<void(c10d::TCPStore&)> job);
  template <class R>
  R get(std::function<R(c10d::TCPStore&)> f) {
    auto out = std::make_shared<std::optional<R>>();
    run([out, f = std::move(f)](c10d::TCPStore& s) { *out = f(s); });
    return std::move(**out);
  }

 private:
  struct state;
  std::shared_ptr<state> s_;
  std::thread thread_;
};

}  // namespace lorapipe
