// Probing a project's devices, with the cache: see device_inventory.h.
#include "core/engine/device_inventory.h"

#include <algorithm>
#include <cstdlib>

#include "core/train/pipeline_setup.h"
#include "offload/device.h"

namespace lorapipe {

std::filesystem::path default_probe_cache_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x == '/') return std::filesystem::path(x) / "lorapipe";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') return std::filesystem::path(h) / ".cache" / "lorapipe";
  return std::filesystem::temp_directory_path() / "lorapipe-cache";
}

result<probe_outcome> probe_project_devices(const project_config& cfg, const probe_request& req) {
  LP_TRY_ASSIGN(opts, device_options_of(cfg));
  LP_TRY_ASSIGN(devs, make_devices(cfg.parallel.devices, opts));
  std::vector<compute_device*> raw;
  for (auto& d : devs) raw.push_back(d.get());
  probe_outcome out;
  out.inventory = describe_inventory(raw);
  const auto dir = req.cache_dir.empty() ? default_probe_cache_dir() : req.cache_dir;
  out.cache_file = inventory_cache_file(dir, out.inventory.fingerprint);
  if (!req.refresh) {
    if (auto cached = load_cached_inventory(dir, out.inventory.fingerprint)) {
      out.inventory = std::move(*cached);
      out.from_cache = true;
      return out;
    } else {
      out.cache_note = cached.message();
    }
  }
  measure_inventory(out.inventory, raw, req.options);
  for (int i : hung_devices(out.inventory)) (void)devs[static_cast<size_t>(i)].release();  // left behind: see the header
  if (out.inventory.ok() && out.inventory.complete) {
    if (auto st = save_cached_inventory(dir, out.inventory); !st) out.cache_note = st.message();
    else out.cache_note.clear();
  } else {
    out.cache_note = "not cached: the probe found problems";
  }
  return out;
}

project_config with_probed_bandwidth(const project_config& cfg, const device_inventory& inv) {
  double slowest = 0;
  for (const auto& d : inv.devices)
    for (double r : {d.h2d_concurrent_bytes_per_s, d.d2h_concurrent_bytes_per_s, inv.devices.size() == 1 ? d.h2d_bytes_per_s : 0.0,
                     inv.devices.size() == 1 ? d.d2h_bytes_per_s : 0.0})
      if (r > 0) slowest = slowest > 0 ? std::min(slowest, r) : r;
  project_config out = cfg;
  if (slowest > 0) out.offload.copy_gbps = slowest / 1e9;
  return out;
}

}  // namespace lorapipe
