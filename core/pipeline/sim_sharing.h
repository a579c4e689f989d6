// Resources the simulator divides among the work in flight on them (processor sharing): a host link
// several devices copy through (sim_costs::copy_link), the host's cores that CPU virtual devices
// compute on (sim_costs::host_compute_slots). Internal to schedule_sim.cpp; its own file so the
// sharing arithmetic can be read (and tested) apart from the instruction semantics.
//
// Devices are simulated one after another, not in time order, so when a piece of work is booked
// the work it will share with is not all known: simulate() replays the program instead, each piece
// charged the sharing it meets with every other piece on its resource at the interval that piece
// has in this pass once booked, else at the one it had in the previous pass (Gauss-Seidel), until
// no interval moves by more than a small fraction of the step.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace lorapipe::sim_sharing {

using work_id = std::pair<int32_t, int32_t>;     // (device, instruction index): the work an instruction does
using resource_key = std::pair<int32_t, bool>;  // (link number, upload); host_cores for the compute pool
inline constexpr resource_key host_cores{-1, false};

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

inline constexpr int max_passes = 12;

bool any_oversubscribed(const resources& r);
// How far the end of any piece moved from one pass to the next (infinite if the pieces differ).
double largest_shift(const resources& before, const resources& after);

}  // namespace lorapipe::sim_sharing
