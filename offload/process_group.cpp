// c10d behind process_group (see process_group.h). Compiled with USE_C10D_GLOO and Debian's Gloo
// headers (libgloo-dev), which are older than the Gloo inside LibTorch: so only c10d types are made
// here, and Gloo objects only through c10d's factories (tests/test_process_group.cpp checks the bytes).
#include "offload/process_group.h"
#include "offload/store_agent.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <cstdlib>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace lorapipe {

namespace {

std::string hash_key(int r) { return fmt::format("lorapipe/hash/{}", r); }
std::string seen_key(int r) { return fmt::format("lorapipe/seen/{}", r); }
std::string report_key(int r) { return fmt::format("lorapipe/report/{}", r); }
std::string host_key(int r) { return fmt::format("lorapipe/host/{}", r); }
std::string claim_key(int r) { return fmt::format("lorapipe/claim/{}", r); }
std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}
std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string text_of(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

bool is_loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost" || host == "::1"; }

// Waits for `keys` (one per rank), polling, so `watch` can end the wait early; on timeout the error
// lists the ranks whose key is missing.
status wait_for_ranks(c10d::Store& store, const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                      const char* what, const std::function<std::string()>& watch) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (store.check(keys)) return ok_status();
    if (watch)
      if (const std::string w = watch(); !w.empty()) return make_error("distributed: {} (waiting for every rank to {})", w, what);
    if (std::chrono::steady_clock::now() >= end) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    std::string missing;
    for (size_t r = 0; r < keys.size(); ++r) {
      bool present = false;
      try {
        present = store.check({keys[r]});
      } catch (const std::exception&) {
      }
      if (!present) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
    }
    return make_error("distributed: rank(s) {} did not {} within {} s", missing.empty() ? "?" : missing, what,
                      std::chrono::duration<double>(timeout).count());
  }
}

}  // namespace

struct process_group::work_handle {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor keep;  // the bytes being sent
  int peer = -1;
};

// This rank's progress report and the thread that publishes it (the newest text, coalesced).
struct progress_board {
  std::mutex mu;
  std::condition_variable cv;
  std::string context;
  std::map<int, std::string> done;  // by device position
  uint64_t version = 0;
  bool stop = false;
  std::thread publisher;

  std::string text() const {  // under mu: "step 8 of 12: cpu:1 completed B s1 m2; cpu:2 completed …"
    std::string devs;
    for (const auto& [pos, what] : done) devs += fmt::format("{}{}", devs.empty() ? "" : "; ", what);
    if (context.empty() || devs.empty()) return context + devs;
    return context + ": " + devs;
  }
  void start(std::function<void(const std::string&)> publish) {
    publisher = std::thread([this, publish = std::move(publish)] {
      uint64_t published = 0;
      std::unique_lock lock(mu);
      while (true) {
        cv.wait(lock, [&] { return stop || version != published; });
        if (stop) return;
        published = version;
        const std::string t = text();
        lock.unlock();
        try {
          publish(t);
        } catch (const std::exception&) {  // the store is gone (rank 0 died): the error reaches us elsewhere
        }
        lock.lock();
      }
    });
  }
  void update(const std::function<void()>& f) {
    {
      std::lock_guard lock(mu);
      f();
      ++version;
    }
    cv.notify_one();
  }
  void halt() {  // the publisher ends (after a set in flight); later updates stay here
    update([this] { stop = true; });
    if (publisher.joinable()) publisher.join();
  }
  ~progress_board() { halt(); }
};

struct process_group::impl {
  rendezvous_options o;
  uint16_t port = 0;
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  std::unique_ptr<std::atomic<uint64_t>[]> sent;  // bytes posted per peer
  std::vector<std::string> hosts;                 // per rank

  // Reports, and the failure bookkeeping (collective(), report_failure), go through a connection of
  // their own on a thread of its own with a short deadline: an unresponsive rank 0 costs seconds
  // there, not another distributed timeout or a recv that never returns (store_agent.h).
  std::unique_ptr<store_agent> agent;
  std::unique_ptr<progress_board> board;  // declared after the connections: its publisher stops before they go

  std::string last_report(int r) const {
    try {
      return agent->get<std::string>([k = report_key(r)](c10d::TCPStore& s) { return s.check({k}) ? text_of(s.get(k)) : std::string(); });
    } catch (const std::exception&) {
      return "";
    }
  }
  // "rank 1 last reported: …; rank 2 …" for the peers named that reported anything; `before`
  // and `after` around it unless it is empty.
  std::string reports_of(const std::vector<int>& peers, const char* before = " (", const char* after = ")") const {
    std::string out;
    for (int r : peers) {
      if (r < 0 || r >= o.world || r == o.rank) continue;
      const std::string t = last_report(r);
      if (!t.empty()) out += fmt::format("{}rank {} last reported: {}", out.empty() ? "" : "; ", r, t);
    }
    return out.empty() ? "" : before + out + after;
  }
  status failed(const std::string& what, const std::exception& e, int peer = -1) const {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);  // c10d appends a C++ trace
    return make_error("distributed: rank {}: {} failed: {}{}", o.rank, what, msg, reports_of({peer}));
  }
  status wait(const std::string& what, c10d::Work& w, int peer = -1) const {
    try {
      if (!w.wait(o.timeout))
        return make_error("distributed: rank {}: {} timed out after {} s{}", o.rank, what, o.timeout.count() / 1000.0, reports_of({peer}));
      return ok_status();
    } catch (const std::exception& e) {
      return failed(what, e, peer);
    }
  }
  // Runs one c10d call and waits for it; exceptions become errors naming `what` (and the peer's report).
  template <class F>
  status run(const std::string& what, F&& make_work, int peer = -1) {
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = make_work();
    } catch (const std::exception& e) {
      return failed(what, e, peer);
    }
    return wait(what, *w, peer);
  }

  // A collective over every rank; when it fails, the ranks that are gone are named: each survivor
  // leaves word in the store under the collective's number (the same on every rank), and the ranks
  // with no word after a short grace are the dead or hung ones (rank 0's death: the store is gone).
  uint64_t collectives = 0;
  template <class F>
  status collective(const std::string& what, F&& make_work) {
    const uint64_t n = collectives++;
    auto st = run(what, std::forward<F>(make_work));
    if (st.ok() || o.world <= 1) return st;
    std::string gone;
    try {
      const auto key = [n](int r) { return fmt::format("lorapipe/failed/{}/{}", n, r); };
      agent->run([k = key(o.rank)](c10d::TCPStore& s) { s.set(k, bytes_of("1")); });
      const auto end = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(o.timeout, std::chrono::milliseconds(3000));
      std::vector<int> missing;
      do {
        missing.clear();
        for (int r = 0; r < o.world; ++r)
          if (r != o.rank && !agent->get<bool>([k = key(r)](c10d::TCPStore& s) { return s.check({k}); })) missing.push_back(r);
        if (missing.empty()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      } while (std::chrono::steady_clock::now() < end);
      for (int r : missing) gone += fmt::format("{}{}", gone.empty() ? "" : ", ", r);
      if (!gone.empty())
        gone = missing.size() == 1 ? fmt::format("rank {} is gone (no word from it after the failure{}): ", gone, reports_of(missing, "; ", ""))
                                   : fmt::format("ranks {} are gone (no word from them after the failure{}): ", gone, reports_of(missing, "; ", ""));
    } catch (const std::exception&) {
      gone = o.rank == 0 ? "" : "rank 0 is gone (its rendezvous store does not answer): ";
    }
    std::string msg = st.message();
    const std::string prefix = "distributed: ";
    if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
    return make_error("{}{}{}", prefix, gone, msg);
  }
};

result<std::unique_ptr<process_group>> process_group::join(const rendezvous_options& o) {
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
    return make_error("distributed: rank {} is outside a world of {} process(es)", o.rank, o.world);
  auto p = std::make_unique<impl>();
  p->o = o;
  try {
    c10d::TCPStoreOptions so;
    so.port = o.port;
    so.isServer = o.rank == 0;
    so.waitWorkers = false;  // the hash exchange below waits, and names who is missing
    so.timeout = o.timeout;
    so.useLibUV = false;     // plain sockets server: no dependency on how the wheel built libuv
    p->store = c10::make_intrusive<c10d::TCPStore>(o.host, so);
    p->port = p->store->getPort();
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    return make_error("distributed: rank {} could not {} the rendezvous at {}:{}: {}", o.rank,
                      o.rank == 0 ? "serve" : "reach", o.host, o.port, msg);
  }
  // Every rank brings its project hash; all compare, so a differing rank is refused everywhere.
  if (o.rank == 0 && o.on_listening) o.on_listening(p->port);
  std::vector<std::string> hashes(static_cast<size_t>(o.world)), seen(static_cast<size_t>(o.world));
  for (int r = 0; r < o.world; ++r) hashes[static_cast<size_t>(r)] = hash_key(r), seen[static_cast<size_t>(r)] = seen_key(r);
  std::vector<std::string> theirs;
  try {
    // Each rank number is taken once: a second process started as the same rank is refused here.
    if (p->store->add(claim_key(o.rank), 1) != 1)
      return make_error("distributed: another process already joined the rendezvous at {}:{} as rank {} (or an earlier start of "
                        "this one: restart rank 0 too); give each process its own --rank", o.host, p->port, o.rank);
    p->store->set(host_key(o.rank), bytes_of(this_host()));  // before the hash: present once the hash is
    p->store->set(hash_key(o.rank), bytes_of(fmt::format("{} {}", o.world, o.config_hash)));  // the world size compared too
    LP_TRY(wait_for_ranks(*p->store, hashes, o.timeout, "arrive at the rendezvous", o.watch));
    for (int r = 0; r < o.world; ++r) theirs.push_back(text_of(p->store->get(hash_key(r))));
    for (int r = 0; r < o.world; ++r) p->hosts.push_back(text_of(p->store->get(host_key(r))));
    p->store->set(seen_key(o.rank), bytes_of("1"));
    if (o.rank == 0) (void)wait_for_ranks(*p->store, seen, o.timeout, "read the project hashes", o.watch);  // before the server may go
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    return make_error("distributed: rank {}: the rendezvous at {}:{} failed: {}", o.rank, o.host, p->port, msg);
  }
  // "WORLD HASH" per rank.
  const auto world_of = [](const std::string& s) { return s.substr(0, s.find(' ')); };
  const auto hash_of = [](const std::string& s) { return s.substr(std::min(s.size(), s.find(' ') + 1)); };
  for (int r = 1; r < o.world; ++r) {
    const std::string& t = theirs[static_cast<size_t>(r)];
    if (world_of(t) != world_of(theirs[0]))
      return make_error("distributed: rank {} was started for {} processes, rank 0 for {}; every process must be given the same "
                        "distributed.processes", r, world_of(t), world_of(theirs[0]));
    if (hash_of(t) != hash_of(theirs[0]))
      return make_error("distributed: rank {} runs another project than rank 0 (config hash {} vs {}); every process must "
                        "run the same project file and settings",
                        r, hash_of(t).substr(0, 16), hash_of(theirs[0]).substr(0, 16));
  }
  try {
    auto opts = c10d::ProcessGroupGloo::Options::create(o.timeout);
    // Where this rank listens for the others: the loopback for a rendezvous on it, the interface
    // named by GLOO_SOCKET_IFNAME (as PyTorch reads it), else the address this host's name resolves to.
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    opts->devices.push_back(is_loopback(o.host)                   ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                            : ifname != nullptr && *ifname != 0 ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                                                : c10d::ProcessGroupGloo::createDefaultDevice());
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("lorapipe/gloo", p->store);
    p->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, o.rank, o.world, opts);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    return make_error("distributed: rank {}: connecting the {} processes failed: {}", o.rank, o.world, msg);
  }
  p->sent = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(o.world));
  p->board = std::make_unique<progress_board>();
  // Reports go over the short-timeout connection too: in order with report_failure's, and a slow
  // rank 0 holds the publisher (not a training thread) for seconds at most.
  p->agent = std::make_unique<store_agent>(o.host, p->port, std::min<std::chrono::milliseconds>(o.timeout, std::chrono::milliseconds(2000)));
  p->board->start([agent = p->agent.get(), k = report_key(o.rank)](const std::string& t) {
    agent->run([k, t](c10d::TCPStore& s) { s.set(k, bytes_of(t)); });
  });
  return std::unique_ptr<process_group>(new process_group(std::move(p)));
}

process_group::process_group(std::unique_ptr<impl> p) : p_(std::move(p)) {}
process_group::~process_group() = default;
int process_group::rank() const { return p_->o.rank; }
int process_group::world() const { return p_->o.world; }
bool process_group::same_host(int rank) const {
  return rank >= 0 && rank < static_cast<int>(p_->hosts.size()) && p_->hosts[static_cast<size_t>(rank)] == p_->hosts[static_cast<size_t>(p_->o.rank)];
}
uint16_t process_group::port() const { return p_->port; }

result<process_group::pending_send> process_group::isend(const at::Tensor& t, int to, int tag) {
  auto w = std::make_shared<work_handle>();
  w->keep = t.contiguous();
  std::string what = fmt::format("send to rank {} (tag {})", to, tag);
  try {
    std::vector<at::Tensor> v{w->keep};
    w->peer = to;
    w->work = p_->pg->send(v, to, tag);
    if (to >= 0 && to < p_->o.world) p_->sent[static_cast<size_t>(to)] += w->keep.numel() * w->keep.element_size();
  } catch (const std::exception& e) {
    return p_->failed(what, e, to).err();
  }
  return pending_send(this, std::move(w), std::move(what));
}

uint64_t process_group::bytes_sent(int peer) const {
  return peer >= 0 && peer < p_->o.world ? p_->sent[static_cast<size_t>(peer)].load() : 0;
}

status process_group::send(const at::Tensor& t, int to, int tag) {
  LP_TRY_ASSIGN(s, isend(t, to, tag));
  return s.wait();
}

process_group::pending_send::pending_send(process_group* g, std::shared_ptr<work_handle> w, std::string what)
    : g_(g), w_(std::move(w)), what_(std::move(what)) {}

status process_group::pending_send::wait() { return g_->p_->wait(what_, *w_->work, w_->peer); }

bool process_group::pending_send::done() const {
  try {
    return w_->work->isCompleted() && w_->work->isSuccess();
  } catch (const std::exception&) {
    return false;  // wait() reports it
  }
}

status process_group::recv(at::Tensor& into, int from, int tag) {
  if (!into.is_contiguous()) return make_error("distributed: recv into a non-contiguous tensor");
  std::vector<at::Tensor> v{into};
  return p_->run(fmt::format("receive from rank {} (tag {})", from, tag), [&] { return p_->pg->recv(v, from, tag); }, from);
}

status process_group::all_reduce_sum(at::Tensor& t) {
  std::vector<at::Tensor> v{t};
  return p_->collective(fmt::format("all-reduce over {} ranks", p_->o.world), [&] { return p_->pg->allreduce(v); });
}

status process_group::broadcast(at::Tensor& t, int root) {
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  return p_->collective(fmt::format("broadcast from rank {}", root), [&] { return p_->pg->broadcast(v, bo); });
}

status process_group::barrier() {
  return p_->collective(fmt::format("barrier of {} ranks", p_->o.world), [&] { return p_->pg->barrier(); });
}

void process_group::report_context(const std::string& context) {
  p_->board->update([&] {  // a new context: what was completed before belongs to the old one
    p_->board->context = context;
    p_->board->done.clear();
  });
}

void process_group::report_done(int position, const std::string& what) {
  p_->board->update([&] { p_->board->done[position] = what; });
}

std::string process_group::last_report(int rank) { return p_->last_report(rank); }

void process_group::report_failure(const std::string& message) {
  std::string text = "failed: " + message;
  if (text.size() > 2000) text.resize(2000);
  p_->board->halt();  // no older report can land after this one (the publisher's last set has returned)
  try {  // now, not by the publisher: the process may exit next. The check answers only after the
         // store has taken the set (one connection, in order); the short-timeout one, so an
         // unresponsive rank 0 costs seconds here, not another distributed timeout.
    p_->agent->run([k = report_key(p_->o.rank), text](c10d::TCPStore& s) {
      s.set(k, bytes_of(text));
      (void)s.check({k});
    });
  } catch (const std::exception&) {  // rank 0's store is gone: nobody is left to tell
  }
}

status process_group::store_set(const std::string& key, const std::string& value) {
  try {
    p_->store->set("lorapipe/user/" + key, bytes_of(value));
    return ok_status();
  } catch (const std::exception& e) {
    return make_error("distributed: rank {}: store set {}: {}", p_->o.rank, key, e.what());
  }
}

result<std::string> process_group::store_get(const std::string& key) {
  try {
    return text_of(p_->store->get("lorapipe/user/" + key));
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    return make_error("distributed: rank {}: store get {}: {}", p_->o.rank, key, msg);
  }
}


}  // namespace lorapipe
