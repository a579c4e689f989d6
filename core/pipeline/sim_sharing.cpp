// Processor sharing for the simulator's shared links and host cores: see sim_sharing.h.
#include "core/pipeline/sim_sharing.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace lorapipe::sim_sharing {

double shared_end(double s, double work, double capacity, const std::vector<std::pair<double, double>>& others) {
  std::vector<std::pair<double, int>> change;  // (time, +1 / -1 pieces in flight besides this one)
  int k = 0;
  for (const auto& [a, b] : others) {
    if (b <= s) continue;
    if (a <= s) ++k;
    else change.push_back({a, +1});
    change.push_back({b, -1});
  }
  std::sort(change.begin(), change.end());
  const auto rate = [capacity](int besides) { return std::min(1.0, capacity / (1 + besides)); };
  double t = s, left = work;
  for (const auto& [x, delta] : change) {
    const double done = (x - t) * rate(k);
    if (done >= left) break;
    left -= done;
    t = x;
    k += delta;
  }
  return t + left / rate(k);
}

void shared_resource::set(const work_id& id, double start, double end) {
  if (auto it = at_.find(id); it != at_.end())
    for (auto [j, hi] = by_start_.equal_range(it->second.first); j != hi; ++j)
      if (j->second.second == id) {
        by_start_.erase(j);
        break;
      }
  at_[id] = {start, end};
  by_start_.emplace(start, std::make_pair(end, id));
  longest_ = std::max(longest_, end - start);
}

double shared_resource::end_of(const work_id& id, double s, double work) const {
  if (!std::isfinite(s) || !std::isfinite(work)) return s + work;
  std::vector<std::pair<double, double>> others;
  // Pieces begun before s - longest ended by s; only those begun before this one ends matter.
  const auto within = [&](double until) {
    others.clear();
    for (auto it = by_start_.lower_bound(s - longest_ * (1 + 1e-12)); it != by_start_.end() && it->first < until; ++it)
      if (it->second.first > s && it->second.second != id) others.emplace_back(it->first, it->second.first);
    return shared_end(s, work, capacity_, others);
  };
  double horizon = std::max(work, 1e-12) * 2;
  for (int doubling = 0; doubling < 48; ++doubling, horizon *= 2)
    if (const double end = within(s + horizon); end <= s + horizon) return end;
  return within(std::numeric_limits<double>::infinity());
}

bool shared_resource::oversubscribed() const {
  std::vector<std::pair<double, int>> change;  // ends sort before starts at the same time
  change.reserve(2 * at_.size());
  for (const auto& [id, ab] : at_)
    if (ab.second > ab.first) {
      change.push_back({ab.first, +1});
      change.push_back({ab.second, -1});
    }
  std::sort(change.begin(), change.end());
  int k = 0;
  for (const auto& [t, delta] : change)
    if ((k += delta) > capacity_) return true;
  return false;
}

void core_pool::join(const work_id& id, double start, double work) {
  if (joined_.insert(id).second) waiting_.emplace(std::max(start, now_), std::make_pair(id, work));  // once (a blocked device asks again)
}

std::optional<double> core_pool::end_of(const work_id& id) const {
  const auto it = ended_.find(id);
  return it == ended_.end() ? std::nullopt : std::optional<double>(it->second);
}

bool core_pool::advance() {
  if (running_.empty() && waiting_.empty()) return false;
  const double rate = running_.empty() ? 1.0 : std::min(1.0, capacity_ / static_cast<double>(running_.size()));
  double least = std::numeric_limits<double>::infinity();  // the least work left: the next end
  for (const auto& [id, left] : running_) least = std::min(least, left);
  const double next_end = now_ + least / rate;
  const double next_start = waiting_.empty() ? std::numeric_limits<double>::infinity() : waiting_.begin()->first;
  const bool ends = next_end <= next_start;
  const double t = ends ? next_end : next_start;
  const double served = ends ? least : (t - now_) * rate;  // each piece in flight got this much done
  for (auto it = running_.begin(); it != running_.end();) {
    // The pieces with the least work left end now, whatever the rounding of t - now_ (at large t the
    // difference can lose the work of a short piece, and the pool would stand still).
    if (ends && it->second <= least * (1 + 1e-9)) {
      ended_[it->first] = t;
      it = running_.erase(it);
    } else {
      it->second = std::max(0.0, it->second - served);
      ++it;
    }
  }
  now_ = t;
  while (!waiting_.empty() && waiting_.begin()->first <= now_) {
    const auto [id, work] = waiting_.begin()->second;
    waiting_.erase(waiting_.begin());
    if (work > 0) running_[id] = work;
    else ended_[id] = now_;
  }
  return true;
}

bool any_oversubscribed(const resources& r) {
  return std::any_of(r.begin(), r.end(), [](const auto& f) { return f.second.oversubscribed(); });
}

double largest_shift(const resources& before, const resources& after) {
  double most = 0;
  for (const auto& [key, now] : after) {
    const auto was = before.find(key);
    for (const auto& [id, ab] : now.intervals()) {
      if (was == before.end()) return std::numeric_limits<double>::infinity();
      const auto& old = was->second.intervals();
      const auto it = old.find(id);
      if (it == old.end()) return std::numeric_limits<double>::infinity();
      most = std::max(most, std::abs(ab.second - it->second.second));
    }
  }
  return most;
}

}  // namespace lorapipe::sim_sharing
