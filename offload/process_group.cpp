// c10d behind process_group (see process_group.h). Compiled with USE_C10D_GLOO and Debian's Gloo
// headers (libgloo-dev), which are older than the Gloo inside LibTorch: so only c10d types are made
// here, and Gloo objects only through c10d's factories (tests/test_process_group.cpp checks the bytes).
#include "offload/process_group.h"
#include "offload/store_agent.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
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
std::string beat_key(int r) { return fmt::format("lorapipe/beat/{}", r); }
std::string waits_key(int r) { return fmt::format("lorapipe/waits/{}", r); }
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

// This rank's progress report and the thread that publishes it (the newest text, coalesced), the
// ranks its point-to-point calls wait on, and a heartbeat every beat_period while the rank lives.
constexpr auto beat_period = std::chrono::milliseconds(250);
struct progress_board {
  std::mutex mu;
  std::mutex join_mu;  // halt() joins the publisher under it
  std::condition_variable cv;
  std::string context;
  std::map<int, std::string> done;         // by device position
  std::map<uint64_t, std::pair<int, std::string>> waits;  // by call: (rank, "receive from rank 2 (tag 1)")
  uint64_t next_wait = 0;
  uint64_t version = 0;
  bool stop = false;
  bool store_gone = false;  // a publish failed: rank 0's store is gone or frozen, nothing more is sent
  std::thread publisher;

  std::string text() const {  // under mu: "step 8 of 12: cpu:1 completed B s1 m2; cpu:2 completed …; waiting: receive from rank 2 (tag 1)"
    std::string devs;
    for (const auto& [pos, what] : done) devs += fmt::format("{}{}", devs.empty() ? "" : "; ", what);
    std::string out = context.empty() || devs.empty() ? context + devs : context + ": " + devs;
    for (const auto& [id, w] : waits) out += fmt::format("{}waiting: {}", out.empty() ? "" : "; ", w.second);
    return out;
  }
  std::string waited_ranks() const {  // under mu: "2,3"
    std::string out;
    for (const auto& [id, w] : waits) out += fmt::format("{}{}", out.empty() ? "" : ",", w.first);
    return out;
  }
  using publish_fn = std::function<void(const std::string& text, const std::string& waited)>;
  void start(publish_fn publish, std::function<void()> beat) {
    publisher = std::thread([this, publish = std::move(publish), beat = std::move(beat)] {
      uint64_t published = 0;
      auto next_beat = std::chrono::steady_clock::now();
      std::unique_lock lock(mu);
      while (true) {
        cv.wait_until(lock, next_beat, [&] { return stop || version != published; });
        if (stop) return;
        std::optional<std::pair<std::string, std::string>> t;
        if (version != published) t.emplace(text(), waited_ranks());
        published = version;
        const bool due = std::chrono::steady_clock::now() >= next_beat;
        if (due) next_beat = std::chrono::steady_clock::now() + beat_period;
        lock.unlock();
        try {
          if (t) publish(t->first, t->second);
          if (due) beat();
        } catch (const std::exception&) {  // the store is gone (rank 0 died): the error reaches us elsewhere.
          lock.lock();                     // Each try would cost a reconnect's seconds (and hold halt()).
          store_gone = true;
          return;
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
  void halt() {  // the publisher ends (after a set in flight); later updates stay here. Any thread, any number of times.
    update([this] { stop = true; });
    std::lock_guard joining(join_mu);  // two threads joining one std::thread at once is undefined
    if (publisher.joinable()) publisher.join();
  }
  ~progress_board() { halt(); }
};

// A point-to-point call waiting on `rank`, on the board while it waits. A call that fails stays
// there: the others' diagnosis then follows this rank to the one it was waiting on.
class waiting_on {
 public:
  waiting_on(progress_board& b, int rank, std::string what) : b_(b) {
    b_.update([&] { b_.waits[id_ = b_.next_wait++] = {rank, std::move(what)}; });
  }
  void succeeded() { b_.update([&] { b_.waits.erase(id_); }); }

 private:
  progress_board& b_;
  uint64_t id_ = 0;
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
  std::atomic<bool> failure_reported{false};  // by report_failure, on any thread

  // The last report and waits, now (the publisher stopped first: nothing older lands after them).
  void publish_final(const std::string& text) {
    board->halt();
    std::string waited;
    {
      std::lock_guard lock(board->mu);
      if (board->store_gone) return;
      waited = board->waited_ranks();
    }
    try {  // the check answers only after the store has taken the set (one connection, in order); the
           // short-timeout connection, so an unresponsive rank 0 costs seconds here
      agent->run([k = report_key(o.rank), w = waits_key(o.rank), waited, text](c10d::TCPStore& s) {
        s.set(w, bytes_of(waited));
        s.set(k, bytes_of(text));
        (void)s.check({k});
      });
    } catch (const std::exception&) {  // rank 0's store is gone: nobody is left to tell
    }
  }

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
  // Why a point-to-point call with `peer` failed, when the cause may lie further along: from the
  // peer, the ranks each one's calls wait on are followed (the waits every rank publishes) to the
  // first that is not waiting on another rank. Liveness is judged from the heartbeats over up to
  // beat_grace. The culprit is the first rank on the way that does not beat (killed, stopped, cut
  // off) and reported no failure, or one alive and waiting on nobody (stuck or slow in its own work),
  // or one that failed while waiting on nobody; ranks that wait on each other are a deadlock.
  // Returns the lead of the error ("rank 2 does not respond …: ", or "" when nothing is known) and
  // the ranks visited, whose reports the error quotes.
  static constexpr auto beat_grace = std::chrono::milliseconds(2000);
  struct diagnosis {
    std::string lead;
    std::vector<int> chain;
  };
  diagnosis diagnose(int peer) const {
    diagnosis d;
    d.chain.push_back(peer);
    if (peer < 0 || peer >= o.world || peer == o.rank) return d;
    const size_t n = static_cast<size_t>(o.world);
    std::vector<bool> alive(n, false);
    const auto waited = [&](int r) {  // "2,3" -> {2, 3}; malformed entries are skipped
      std::vector<int> out;
      const std::string t = agent->get<std::string>([k = waits_key(r)](c10d::TCPStore& s) { return s.check({k}) ? text_of(s.get(k)) : std::string(); });
      for (size_t at = 0; at <= t.size();) {
        const size_t comma = std::min(t.find(',', at), t.size());
        int v = -1;
        if (std::from_chars(t.data() + at, t.data() + comma, v).ec == std::errc() && v >= 0 && v < o.world) out.push_back(v);
        at = comma + 1;
      }
      return out;
    };
    try {
      const auto beats = [&](int r) { return agent->get<int64_t>([k = beat_key(r)](c10d::TCPStore& s) { return s.add(k, 0); }); };
      std::vector<int64_t> first(n, 0);
      alive[static_cast<size_t>(o.rank)] = true;
      for (int r = 0; r < o.world; ++r)
        if (r != o.rank) first[static_cast<size_t>(r)] = beats(r);
      const auto end = std::chrono::steady_clock::now() + beat_grace;
      while (std::count(alive.begin(), alive.end(), false) > 0 && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(beat_period / 2);
        for (int r = 0; r < o.world; ++r)
          if (!alive[static_cast<size_t>(r)]) alive[static_cast<size_t>(r)] = beats(r) != first[static_cast<size_t>(r)];
      }
      const double grace_s = std::chrono::duration<double>(beat_grace).count();
      const auto failed = [&](int r) { return last_report(r).rfind("failed:", 0) == 0; };
      const auto left = [&](int r) { return !alive[static_cast<size_t>(r)] && last_report(r).rfind("left the group", 0) == 0; };
      const auto seen = [&](int r) { return r == o.rank || std::find(d.chain.begin(), d.chain.end(), r) != d.chain.end(); };
      const auto quiet = [&](int r) { return !alive[static_cast<size_t>(r)] && !failed(r); };  // includes those that left
      for (int x = peer;;) {
        if (left(x)) {
          d.lead = fmt::format("rank {} left the group without reporting a failure (it finished its program, or ended by an exception; "
                               "a rank still waiting on it means the programs do not match): ", x);
          break;
        }
        if (quiet(x)) {
          d.lead = fmt::format("rank {} does not respond (no heartbeat for {:.1f} s: killed, stopped or cut off): ", x, grace_s);
          break;
        }
        std::vector<int> next = waited(x);
        // Follow a rank that does not respond first, then one not seen yet.
        std::stable_partition(next.begin(), next.end(), [&](int r) { return quiet(r); });
        // A rank that failed waiting on another (its waits are those of its last moment) failed
        // because of it, most likely: that one is followed. Otherwise its own error (quoted) says why.
        if (failed(x)) {
          const auto q = std::find_if(next.begin(), next.end(), [&](int r) { return !seen(r); });
          if (q == next.end()) {
            d.lead = fmt::format("rank {} failed: ", x);
            break;
          }
          d.chain.push_back(*q);
          x = *q;
          continue;
        }
        if (next.empty()) {
          d.lead = fmt::format("rank {} is alive and not waiting on another rank's send or receive (stuck or slow in its own work, or in a "
                               "collective): ", x);
          break;
        }
        const auto fresh = std::find_if(next.begin(), next.end(), [&](int r) { return !seen(r); });
        if (fresh == next.end()) {
          const int y = next.front();
          if (y == o.rank) {
            d.lead = fmt::format("rank {} waits on rank {} in turn (a deadlock, or a device thread or copy of rank {} is stuck): ", x, o.rank,
                                 o.rank);
          } else {
            std::string ranks;
            for (int r : d.chain) ranks += fmt::format("{}, ", r);
            d.lead = fmt::format("ranks {}{} wait on each other (a deadlock: their programs may not match): ", ranks, y);
          }
          break;
        }
        d.chain.push_back(*fresh);
        x = *fresh;
      }
    } catch (const std::exception&) {  // a store call failed or missed its deadline
      if (o.rank != 0) d.lead = "rank 0 does not respond (its rendezvous store does not answer): ";
    }
    return d;
  }
  // The error of a point-to-point call with `peer` (diagnosed) or of a collective (peer -1).
  status call_error(const std::string& text, int peer) const {
    if (peer < 0) return make_error("distributed: rank {}: {}", o.rank, text);
    const diagnosis d = diagnose(peer);
    return make_error("distributed: {}rank {}: {}{}", d.lead, o.rank, text, reports_of(d.chain));
  }
  status failed(const std::string& what, const std::exception& e, int peer = -1) const {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);  // c10d appends a C++ trace
    return call_error(fmt::format("{} failed: {}", what, msg), peer);
  }
  // Waits for a call; one with `peer` stands on the board as waiting on it meanwhile (`on`: since
  // before it was posted, as a post to a closed connection fails at once).
  status wait(const std::string& what, c10d::Work& w, int peer = -1, std::optional<waiting_on> on = std::nullopt) const {
    if (peer >= 0 && !on) on.emplace(*board, peer, what);
    try {
      if (!w.wait(o.timeout)) return call_error(fmt::format("{} timed out after {} s", what, o.timeout.count() / 1000.0), peer);
      if (on) on->succeeded();
      return ok_status();
    } catch (const std::exception& e) {
      return failed(what, e, peer);
    }
  }
  // Runs one c10d call and waits for it; exceptions become errors naming `what` (and the peer's report).
  template <class F>
  status run(const std::string& what, F&& make_work, int peer = -1) {
    std::optional<waiting_on> on;
    if (peer >= 0) on.emplace(*board, peer, what);
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = make_work();
    } catch (const std::exception& e) {
      return failed(what, e, peer);
    }
    return wait(what, *w, peer, std::move(on));
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
  p->board->start(
      [agent = p->agent.get(), r = o.rank](const std::string& text, const std::string& waited) {
        agent->run([k = report_key(r), w = waits_key(r), text, waited](c10d::TCPStore& s) {
          s.set(w, bytes_of(waited));
          s.set(k, bytes_of(text));
        });
      },
      [agent = p->agent.get(), k = beat_key(o.rank)] { agent->run([k](c10d::TCPStore& s) { s.add(k, 1); }); });
  return std::unique_ptr<process_group>(new process_group(std::move(p)));
}

process_group::process_group(std::unique_ptr<impl> p) : p_(std::move(p)) {}
// Leaving without a failure reported says so, with what it did last: a rank still waiting on this
// one is then told it left (finished, or ended by an exception), not that it stopped responding.
process_group::~process_group() {
  if (p_ != nullptr && !p_->failure_reported) {
    std::string text;
    {
      std::lock_guard lock(p_->board->mu);
      text = p_->board->text();
    }
    p_->publish_final(text.empty() ? "left the group" : "left the group after: " + text);
  }
}
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
  waiting_on posting(*p_->board, to, what);  // pending_send::wait stands there again while it waits
  try {
    std::vector<at::Tensor> v{w->keep};
    w->peer = to;
    w->work = p_->pg->send(v, to, tag);
    posting.succeeded();
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
  if (p_->failure_reported.exchange(true)) return;  // the first failure stands: later ones follow from it
  std::string text = "failed: " + message;
  if (text.size() > 2000) text.resize(2000);
  p_->publish_final(text);  // now, not by the publisher: the process may exit next
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
