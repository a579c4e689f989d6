// The project's devices probed for the planner: the inventory of offload/device_probe.h for the
// devices parallel.devices names, created with the project's settings, measured once and cached by
// fingerprint (same hardware and settings: the cached measurement is reused). What `plan --probe`
// prints and the GUI can show; the order of the GPUs that keeps neighbouring stages off a shared
// PCIe link (Mobius' cross mapping).
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

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
// The project's GPU devices as the planner's choices see them without `plan --probe`: what each
// will reserve (gpu_device_budgets: 90% of the GPU's free memory now, split between the devices on
// it), each GPU's static facts (describe_gpu: PCIe link, the bridges above it) and copy rates from
// fill_copy_rates (a cached probe of the same GPUs, else the PCIe estimate). Read by `train` and
// `plan` (never by the GUI, which keeps CUDA out of its process: a context there would hold GPU memory
// the training process needs). nullopt for CPU virtual devices, without CUDA, when unreadable, and
// over several processes (every rank must choose alike, and other hosts' GPUs are not seen here:
// set offload.device_memory_mb and offload.copy_gbps there). cache_dir empty: default_probe_cache_dir().
std::optional<device_inventory> gpu_planning_inventory(const project_config& cfg, const std::filesystem::path& cache_dir = {});
// Copy rates for GPUs nothing measured now: the newest probe in `cache_dir` of the same GPUs (same
// models at the same PCI addresses, in the same order; complete and without errors), whatever the
// other settings were; else each GPU's PCIe estimate (pcie_copy_estimate) alone, divided among the
// devices that share a link (the same GPU, or a bridge above them) for the rates all at once. Fills
// the devices' h2d/d2h rates and inv.rates_from; leaves them at 0 (free copies) when no GPU's link is
// known. Only for inventories of GPUs that were not measured.
void fill_copy_rates(device_inventory& inv, const std::filesystem::path& cache_dir);
// The project as the planner should cost it on the probed devices: offload.copy_gbps becomes the
// slowest copy rate measured with all devices copying at once (both directions), so the simulator's
// copies take what the hardware gives (without any rate, copies would be planned as free). Where devices
// share an upstream link that slows them (cross_mapping's groups), the links are costed instead:
// offload.copy_links numbers the groups (also on GPUs: the simulator then divides one link each way
// among their copies in flight) and offload.copy_gbps is the slowest rate measured alone. Unchanged when
// nothing was measured.
project_config with_probed_bandwidth(const project_config& cfg, const device_inventory& inv);
// The project as the planner's choices cost it: on GPUs whose copy rate the project leaves unstated
// (offload.copy_gbps 0), with the rates in `inv` (with_probed_bandwidth: a probe's, a cached probe's
// or the PCIe estimate); unchanged for CPU virtual devices, a stated rate, no rates, a probe with
// problems or incomplete (not what `train` will find cached), and several processes (whose ranks
// plan without reading GPUs). A run records the result (offload.copy_gbps: on GPUs the planning
// rate, never a throttle), so its memory plan and a resume cost copies alike.
project_config with_planning_copy_rates(const project_config& cfg, const device_inventory* inv);

// Mobius' cross mapping: which GPU runs each pipeline position. Neighbouring stages prefetch their
// weights at overlapping times, so they should not sit behind one upstream PCIe link. Two devices
// share a link when they are the same GPU or the PCI bridges above them (probed_device::upstream)
// have one in common; a group is the devices joined that way. Every order is scored with Mobius'
// sum over positions i < j of shared(i, j) / (j - i), shared being the size of their group when they
// share a link and 1 otherwise; the lowest score wins, the given order on ties. A group whose
// devices were measured to copy at least 90% as fast all at once as alone does not count as shared
// (sharing costs nothing there). Up to 8 devices (more keep their order); CPU virtual devices are
// reordered through their modelled links (offload.copy_links).
struct device_order {
  std::vector<int> order;                // order[k]: the device (position in parallel.devices) to run position k
  double score = 0, given_score = 0;     // of `order` and of the given order
  std::vector<std::vector<int>> groups;  // devices sharing an upstream link that costs (2 or more each)
  std::string setting;                   // "parallel.devices cuda:0,2,1,3" / "offload.copy_links 0,1,0,1"; empty when the given order is kept
  std::string why;                       // one line for `plan`
};
device_order cross_mapping(const device_inventory& inv, const project_config& cfg);
// The project with its devices in `order` (order[k]: the device that takes position k): the GPUs of
// parallel.devices, or for CPU virtual devices offload.copy_links; parallel.device_speeds follows.
project_config with_device_order(const project_config& cfg, const std::vector<int>& order);
// The inventory with its devices (and links) in `order`, for planning the reordered project.
device_inventory with_device_order(const device_inventory& inv, const std::vector<int>& order);
// Mobius' score of an order (positions -> devices) under `share[a][b]` (1 when a and b do not share).
double cross_mapping_score(const std::vector<int>& order, const std::vector<std::vector<double>>& share);

}  // namespace lorapipe
