// Resources the simulator divides among the work in flight on them (processor sharing): a host link
// several devices copy through (sim_costs::copy_link), the host's cores that CPU virtual devices
// compute on (sim_costs::host_compute_slots). Internal to schedule_sim.cpp; its own file so the
// sharing arithmetic can be read (and tested) apart from the instruction semantics.
//
// The host's cores (core_pool) are shared exactly, in time order: a device whose compute has joined
// the pool waits until the replay has advanced the pool past that compute's end. Links are not (a
// copy is booked when it is issued, and the device goes on): devices are simulated one after
// another, not in time order, so when a copy is booked the copies it will share with are not all
// known; simulate() replays the program instead, each copy charged the sharing it meets with every
// other on its link at the interval that one has in this pass once booked, else at the one it had
// in the previous pass (Gauss-Seidel), until no interval moves by more than a small fraction of the
// step. (The cores were settled that way once: with more devices than cores the passes oscillated
// between two states, 8 to 25% apart, to the last pass.)
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace lorapipe::sim_sharing {

using work_id = std::pair<int32_t, int32_t>;     // (device, instruction index): the work an instruction does
using resource_key = std::pair<int32_t, bool>;  // (link number, upload)

// When `work` seconds of service (at full rate), begun at s, are done on a resource that serves
// `capacity` pieces at full rate and divides it equally among more, beside the `others` (intervals).
double shared_end(double s, double work, double capacity, const std::vector<std::pair<double, double>>& others);

// The work on one shared resource and its intervals.
class shared_resource {
 public:
  explicit shared_resource(double capacity = 1) : capacity_(capacity) {}
  void set(const work_id& id, double start, double end);
  // When piece `id` (work seconds alone), begun at s, is done, sharing with the others booked.
  double end_of(const work_id& id, double s, double work) const;
  // More pieces in flight at once than run at full rate: sharing slowed something down.
  bool oversubscribed() const;
  const std::map<work_id, std::pair<double, double>>& intervals() const { return at_; }

 private:
  double capacity_;
  std::map<work_id, std::pair<double, double>> at_;             // piece -> [start, end)
  std::multimap<double, std::pair<double, work_id>> by_start_;  // start -> (end, piece)
  double longest_ = 0;
};

using resources = std::map<resource_key, shared_resource>;

// The host's cores as the replay advances in time (exact processor sharing, no passes): a compute
// joins at its start and, while more than `capacity` are in flight, all of them run at capacity /
// in-flight. The replay advances the pool only when no device can go on without a compute's end, so
// every compute that begins before another ends has joined by then.
class core_pool {
 public:
  explicit core_pool(double capacity) : capacity_(capacity) {}
  // Piece `id` of `work` seconds (alone) begins at `start` (at the pool's time if that has passed).
  void join(const work_id& id, double start, double work);
  // When piece `id` ends, once the pool has got that far.
  std::optional<double> end_of(const work_id& id) const;
  // To the next start or end of a piece; false when nothing is waiting or in flight.
  bool advance();

 private:
  double capacity_, now_ = 0;
  std::multimap<double, std::pair<work_id, double>> waiting_;  // start -> (piece, work)
  std::map<work_id, double> running_;                         // piece -> work left
  std::map<work_id, double> ended_;
  std::set<work_id> joined_;
};

inline constexpr int max_passes = 12;

bool any_oversubscribed(const resources& r);
// How far the end of any piece moved from one pass to the next (infinite if the pieces differ).
double largest_shift(const resources& before, const resources& after);

}  // namespace lorapipe::sim_sharing
