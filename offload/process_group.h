// Pipeline stages in several processes (one per GPU, or per host): the rendezvous and the calls that
// move activations, gradients and small collectives between them, over PyTorch's c10d (TCPStore for
// the rendezvous, ProcessGroupGloo for CPU tensors). No sockets are written here; LibTorch builds
// every Gloo object, this file only constructs c10d types.
//
// Rendezvous: rank 0 serves a TCPStore on host:port (port 0: any free port, read back with port());
// every rank publishes its project hash and waits for all the others', so a rank whose project
// differs is refused on every rank, naming it, before any communicator exists. Every call has the
// timeout given at the rendezvous; a peer that died or hangs turns into an error naming the rank
// (never a wait without end). Errors are values; c10d's exceptions stop here.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/base/result.h"

namespace lorapipe {

struct rendezvous_options {
  std::string host = "127.0.0.1";  // where rank 0 serves the store (the others connect there)
  uint16_t port = 0;               // rank 0: 0 picks a free port; others: rank 0's port
  int rank = 0;
  int world = 1;
  std::chrono::milliseconds timeout{60000};  // for the rendezvous and for every later call
  std::string config_hash;                   // the project's; every rank must bring the same
  // Rank 0: called once the store serves, with its port, before waiting for the others (a local
  // launcher starts the other ranks here, so port 0 needs no agreed number).
  std::function<void(uint16_t port)> on_listening;
  // Polled while waiting for the other ranks: a non-empty text (a launcher's "rank 1 exited with
  // status 1 before joining") ends the wait at once with that error instead of at the timeout.
  std::function<std::string()> watch;
};

class process_group {
 public:
  struct work_handle;
  // Blocks until every rank has arrived (or the timeout passed: the error names the missing ranks).
  static result<std::unique_ptr<process_group>> join(const rendezvous_options& o);
  ~process_group();
  process_group(const process_group&) = delete;
  process_group& operator=(const process_group&) = delete;

  int rank() const;
  int world() const;
  // Whether `rank` runs on this machine (host names exchanged at the rendezvous): processes on one
  // machine share its GPUs and its pinned-memory budget.
  bool same_host(int rank) const;
  uint16_t port() const;  // the store's port (what rank 0 tells the others)

  // Point to point, matched by (peer, tag) in order. Tensors are CPU tensors. A send completes only
  // once the receiver has posted the matching receive: isend posts it and returns at once (the
  // handle keeps the tensor alive; wait() before reusing its memory), send posts and waits.
  class pending_send;
  result<pending_send> isend(const at::Tensor& t, int to, int tag);
  status send(const at::Tensor& t, int to, int tag);
  status recv(at::Tensor& into, int from, int tag);  // into: allocated by the caller, filled
  // Collectives over all ranks, in place.
  status all_reduce_sum(at::Tensor& t);
  status broadcast(at::Tensor& t, int root);
  status barrier();

  // Bytes this process has posted to `peer` with send/isend so far (activations, gradients, checkpoints).
  uint64_t bytes_sent(int peer) const;

  // What this rank has done, for the others' errors should it die or hang: the context (set by the
  // trainer: "training step 8 of 12") and, per device position, the last instruction it completed.
  // A background thread publishes it to the store (never blocking the caller) with the ranks this
  // rank's calls wait on and a heartbeat every 0.25 s; a call that fails naming a rank appends that
  // rank's last report ("rank 1 last reported: step 8 of 12: cpu:1 completed B s1 m2; waiting:
  // receive from rank 2 (tag 5)"). A failed point-to-point call follows the waits from its peer to
  // the rank at the root and leads with it: "rank 2 does not respond (no heartbeat …)", "rank 2 is
  // alive and not waiting on another rank's send or receive …", "rank 2 failed: ", "rank 2 left the
  // group …" (closed without reporting a failure: the destructor says so), or ranks waiting on each other.
  void report_context(const std::string& context);
  void report_done(int position, const std::string& what);
  std::string last_report(int rank);  // "" when it reported nothing or the store is gone
  // This rank failed: "failed: <message>" becomes its report, written before returning (the process
  // may exit right after), so the others' errors carry the cause. Safe from any thread; the first
  // failure reported stands (later ones are its consequences).
  void report_failure(const std::string& message);

  // Small values through the store (metrics): set never blocks; get waits up to the timeout.
  status store_set(const std::string& key, const std::string& value);
  result<std::string> store_get(const std::string& key);

 private:
  struct impl;
  explicit process_group(std::unique_ptr<impl> p);
  std::unique_ptr<impl> p_;
};

class process_group::pending_send {
 public:
  pending_send(process_group* g, std::shared_ptr<work_handle> w, std::string what);
  status wait();  // until the receiver has the bytes, or the timeout (an error naming the peer)
  bool done() const;  // the receiver has the bytes (false while in flight, and after a failure: wait() reports it)

 private:
  process_group* g_;
  std::shared_ptr<work_handle> w_;
  std::string what_;
};

}  // namespace lorapipe
