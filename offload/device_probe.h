// Device inventory and probe: what each pipeline device is (CPU virtual device: capacity, threads,
// copy throttle, speed factor; CUDA device: name, memory total and free, SMs, compute capability,
// PCIe generation and width, NUMA node), which devices reach each other directly (P2P matrix), and
// timed copies: host->device and device->host per device alone and all at once, and peer copies.
// A watchdog bounds the timed copies: a device whose copy errors or does not finish by the deadline
// is reported and left alone, never waited on (describing the devices runs before, unbounded). The result is a plain value with a fingerprint of the
// static facts (the cache key), serialisable to JSON. Used by `plan --probe` and the planner.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

class compute_device;

struct probed_device {
  std::string name;  // cpu:0, cuda:1#0
  std::string kind;  // cpu or cuda
  size_t capacity_bytes = 0;  // what the pipeline device may use (its arena)
  // CPU virtual devices
  int threads = 0;
  double speed = 1;                   // relative compute speed (parallel.device_speeds)
  double copy_limit_bytes_per_s = 0;  // copy engine throttle (0 = none)
  // CUDA devices (gpu >= 0)
  int gpu = -1;
  std::string gpu_name, pci_bus_id;
  size_t total_bytes = 0, free_bytes = 0;
  int sm_count = 0, cc_major = 0, cc_minor = 0;
  int pcie_gen = 0, pcie_width = 0;  // current link (0 = unknown); a GPU drops it while idle
  int pcie_max_gen = 0, pcie_max_width = 0;  // the most the link supports: the lower of the device's and its port's maximum (0 = unknown)
  int numa_node = -1;
  // What lies between the host and the device, outermost first: for a GPU the PCI bridges (its root
  // port, then any switch ports), for a CPU virtual device its modelled copy link (offload.copy_links).
  // Devices with an entry in common share that upstream link. Empty when unknown or not shared.
  std::vector<std::string> upstream;
  // Measured (bytes/s; 0 = not measured): each device alone, then all devices at once.
  double h2d_bytes_per_s = 0, d2h_bytes_per_s = 0;
  double h2d_concurrent_bytes_per_s = 0, d2h_concurrent_bytes_per_s = 0;
  std::string error;  // why a measurement failed or was abandoned (the device is then not measured further)
};

struct probed_link {
  int from = 0, to = 0;  // device positions
  bool direct = false;   // P2P access (CUDA), or CPU virtual devices (a modelled direct link)
  double bytes_per_s = 0;  // a peer copy from -> to, measured (0 = not measured)
  std::string error;
};

struct device_inventory {
  std::vector<probed_device> devices;
  std::vector<probed_link> links;  // every ordered pair of distinct devices
  std::string fingerprint;         // sha256 of the static facts: same hardware and settings, same key
  bool measured = false;
  bool complete = true;            // false: the deadline passed before every measurement had started
  double probe_seconds = 0;
  size_t probe_bytes = 0;
  std::string when;                // UTC time of the measurement, ISO 8601
  // Where the copy rates of an inventory that was not measured now came from (a cached probe, the
  // PCIe estimate: fill_copy_rates); empty otherwise. Not serialised.
  std::string rates_from;
  bool ok() const;                 // every device without error
};

struct probe_options {
  size_t bytes = size_t{64} << 20;  // per copy
  int repeats = 2;                  // per measurement (the fastest counts)
  double deadline_s = 20;           // the whole probe; what is not done by then is reported
  bool peers = true;                // time peer copies between devices with direct access
};

// A GPU's static facts (name, memory, SMs, compute capability, PCIe, NUMA) without creating a
// pipeline device; an error in builds without CUDA.
status describe_gpu(int gpu, probed_device& d);
// The static facts of the devices (no copies) and their fingerprint.
device_inventory describe_inventory(const std::vector<compute_device*>& devices);
// Times the copies into `inv` (made by describe_inventory from the same devices) within
// o.deadline_s. A device whose copy fails or does not finish in time gets `error` and is skipped
// from then on; a copy still running on it at the deadline keeps running on its engine, so the
// caller must not destroy that device (hung_devices() lists them).
void measure_inventory(device_inventory& inv, const std::vector<compute_device*>& devices, const probe_options& o);
// Positions of devices the probe abandoned with a copy still in flight.
std::vector<int> hung_devices(const device_inventory& inv);

// PCIe link of a PCI device from sysfs (`root` = /sys/bus/pci/devices): generation from
// current_link_speed ("16.0 GT/s PCIe" -> 4), width from current_link_width, NUMA node; zeros / -1
// when unknown; the bridges above it from the path its entry links to
// (.../pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0: three bridges); the link's
// maximum from max_link_speed / max_link_width of the device and of the bridge directly above it
// (a gen4 GPU in a gen3 slot trains to gen3), the lower of each.
void read_pci_link(const std::filesystem::path& root, const std::string& bus_id, probed_device& d);
// What pinned copies between the host and a GPU are expected to reach over its PCIe link when
// nothing was measured, in bytes/s: 80% of the link's rate after line encoding, at its maximum
// generation (a GPU drops the current one while idle) and its current width (what the link trained
// to: a riser or a shared slot can give fewer lanes than either end has; the maximum when unknown):
// gen3 x16 12.6 GB/s, gen4 x16 25.2 GB/s, gen4 x8 12.6 GB/s. 0 when the link is unknown.
double pcie_copy_estimate(const probed_device& d);
// The generation and width that estimate is made at ({0, 0} parts when unknown).
struct pcie_link { int gen = 0, width = 0; };
pcie_link pcie_estimate_link(const probed_device& d);

std::string inventory_to_json(const device_inventory& inv);
result<device_inventory> inventory_from_json(const std::string& text);
// The cache: dir/devices-<fingerprint>.json. load: the cached measurement for this fingerprint, or an
// error (missing, unreadable, another fingerprint).
std::filesystem::path inventory_cache_file(const std::filesystem::path& dir, const std::string& fingerprint);
result<device_inventory> load_cached_inventory(const std::filesystem::path& dir, const std::string& fingerprint);
status save_cached_inventory(const std::filesystem::path& dir, const device_inventory& inv);
// Devices and links as text, one line each (plan --probe).
std::string inventory_text(const device_inventory& inv);

}  // namespace lorapipe
