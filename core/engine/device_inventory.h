// The project's devices probed for the planner: the inventory of offload/device_probe.h for the
// devices parallel.devices names, created with the project's settings, measured once and cached by
// fingerprint (same hardware and settings: the cached measurement is reused). What `plan --probe`
// prints and the GUI can show.
#pragma once

#include <filesystem>
#include <string>

#include "core/base/result.h"
#include "core/project/project.h"
#include "offload/device_probe.h"

namespace lorapipe {

struct probe_request {
  bool refresh = false;             // measure even when the cache has this fingerprint
  std::filesystem::path cache_dir;  // empty: default_probe_cache_dir()
  probe_options options;
};
struct probe_outcome {
  device_inventory inventory;
  bool from_cache = false;
  std::filesystem::path cache_file;
  std::string cache_note;  // why the cache was not used or not written (empty when it was)
};
// $XDG_CACHE_HOME/lorapipe, else ~/.cache/lorapipe.
std::filesystem::path default_probe_cache_dir();
// Devices a probe abandoned with a copy in flight are not destroyed (their engine thread may still
// be blocked in a driver); they are left behind deliberately, and reported in the inventory.
result<probe_outcome> probe_project_devices(const project_config& cfg, const probe_request& req);
// The project as the planner should cost it on the probed devices: offload.copy_gbps becomes the
// slowest copy rate measured with all devices copying at once (both directions), so the simulator's
// copies take what the hardware gives (CUDA devices otherwise plan with free copies). Unchanged
// when nothing was measured.
project_config with_probed_bandwidth(const project_config& cfg, const device_inventory& inv);

}  // namespace lorapipe
