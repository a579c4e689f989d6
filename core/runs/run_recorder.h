// Persists engine events of one run in the run database without slowing training: on_event only
// appends to a queue; a writer thread commits the queue in batched transactions (every
// flush_interval or when it grows large). sync() blocks until everything reported so far is
// committed (the trainer calls it before committing a checkpoint). A database failure is kept and
// returned by sync()/finish(), so the run stops at the next checkpoint instead of losing records.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "core/base/events.h"
#include "core/runs/run_store.h"

namespace lorapipe {

class run_recorder final : public observer {
 public:
  // The recorder uses `store` from its own thread until finish(); callers must not touch it meanwhile.
  // A commit refused because another process holds the database's write lock is retried (backing off up
  // to 2 s) for busy_patience before it counts as a failure: a multi-hour run does not stop because
  // someone held the database for a while.
  run_recorder(run_store& store, int64_t run_id, std::string dataset,
               std::chrono::milliseconds flush_interval = std::chrono::milliseconds(250),
               std::chrono::milliseconds busy_patience = std::chrono::minutes(10));
  ~run_recorder() override;
  run_recorder(const run_recorder&) = delete;
  run_recorder& operator=(const run_recorder&) = delete;

  void on_event(const engine_event& e) override;
  std::string sync() override;
  // Commits what is queued, stops the writer thread and returns the first database error ("" = none).
  std::string finish();
  int64_t transactions() const { return transactions_; }
  int64_t busy_retries() const { return busy_retries_; }

 private:
  void writer_loop();
  std::string commit(const run_batch& batch);  // "" or the error
  run_store& store_;
  int64_t run_;
  std::string dataset_;
  std::chrono::milliseconds interval_, busy_patience_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  run_batch queue_;
  uint64_t queued_seq_ = 0, committed_seq_ = 0;
  bool stop_ = false, urgent_ = false;
  std::string error_;
  int64_t transactions_ = 0;
  std::atomic<int64_t> busy_retries_{0};
  std::thread thread_;
};

// ISO 8601 UTC time with milliseconds.
std::string utc_now_iso();

}  // namespace lorapipe
