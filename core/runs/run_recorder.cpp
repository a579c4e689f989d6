// Batched, off-thread persistence of engine events: see run_recorder.h.
#include "core/runs/run_recorder.h"

#include <algorithm>
#include <ctime>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/base/errors.h"

namespace lorapipe {

std::string utc_now_iso() {
  const auto now = std::chrono::system_clock::now();
  const auto t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, ms);
}

run_recorder::run_recorder(run_store& store, int64_t run_id, std::string dataset, std::chrono::milliseconds flush_interval,
                           std::chrono::milliseconds busy_patience)
    : store_(store), run_(run_id), dataset_(std::move(dataset)), interval_(flush_interval), busy_patience_(busy_patience) {
  thread_ = std::thread([this] { writer_loop(); });
}

run_recorder::~run_recorder() { finish(); }

void run_recorder::on_event(const engine_event& ev) {
  std::lock_guard lock(mu_);
  std::visit(
      [&](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, step_event>) {
          metric_row m{e.step, e.loss, e.lr, e.grad_norm, e.tokens_per_s, e.elapsed_s, "", std::nullopt};
          nlohmann::json mem = {{"process_rss", e.process_peak_rss}};
          if (!e.device_peak_bytes.empty()) mem["devices"] = e.device_peak_bytes;
          m.memory_json = mem.dump();
          if (e.bubble_ratio >= 0) m.bubble_ratio = e.bubble_ratio;
          queue_.metrics.push_back(std::move(m));
        } else if constexpr (std::is_same_v<T, eval_event>) {
          queue_.evals.push_back({e.step, "val", dataset_, e.val_loss, e.tokens});
        } else if constexpr (std::is_same_v<T, checkpoint_event>) {
          queue_.checkpoints.push_back({e.step, e.path, e.sha256, e.bytes, {}});
          for (int64_t s : e.removed_steps) queue_.removed_checkpoints.push_back(s);
          urgent_ = true;
        } else if constexpr (std::is_same_v<T, log_event>) {
          const char* lvl = e.lvl == log_event::level::info ? "info" : e.lvl == log_event::level::warning ? "warning" : "error";
          queue_.events.push_back({0, utc_now_iso(), lvl, e.message});
        } else if constexpr (std::is_same_v<T, sample_event>) {
          queue_.events.push_back({0, utc_now_iso(), "info", fmt::format("sample {} training: \"{}\" ->{}", e.when, e.prompt, e.text)});
        } else if constexpr (std::is_same_v<T, run_finished_event>) {
          urgent_ = true;
        } else if constexpr (std::is_same_v<T, run_started_event>) {
          queue_.total_steps = e.total_steps;  // run.epochs decides it only once the data is loaded
        }  // phases, plans and traces are for the front-end, not the database
      },
      ev);
  ++queued_seq_;
  if (urgent_ || queue_.metrics.size() >= 512) cv_.notify_one();
}

std::string run_recorder::sync() {
  std::unique_lock lock(mu_);
  const uint64_t want = queued_seq_;
  urgent_ = true;
  cv_.notify_one();
  done_cv_.wait(lock, [&] { return committed_seq_ >= want || !error_.empty() || !thread_.joinable(); });
  return error_;
}

std::string run_recorder::finish() {
  {
    std::lock_guard lock(mu_);
    if (!thread_.joinable()) return error_;
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
  return error_;
}

std::string run_recorder::commit(const run_batch& batch) {
  const auto give_up = std::chrono::steady_clock::now() + busy_patience_;
  auto wait = std::chrono::milliseconds(50);
  for (;;) {
    try {
      store_.write(run_, batch);  // one transaction: a refused one left nothing behind
      return "";
    } catch (const database_error& e) {
      if (!e.locked() || std::chrono::steady_clock::now() + wait > give_up) return e.what();
    }
    ++busy_retries_;
    std::this_thread::sleep_for(wait);
    wait = std::min(wait * 2, std::chrono::milliseconds(2000));
  }
}

void run_recorder::writer_loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait_for(lock, interval_, [&] { return stop_ || urgent_; });
    if (queue_.empty() && queued_seq_ == committed_seq_) {
      done_cv_.notify_all();
      if (stop_) return;
      urgent_ = false;
      continue;
    }
    run_batch batch;
    std::swap(batch, queue_);
    const uint64_t seq = queued_seq_;
    urgent_ = false;
    lock.unlock();
    const std::string err = commit(batch);
    lock.lock();
    ++transactions_;
    if (!err.empty() && error_.empty()) error_ = err;
    committed_seq_ = seq;
    done_cv_.notify_all();
    if (stop_ && queue_.empty()) return;
  }
}

}  // namespace lorapipe
