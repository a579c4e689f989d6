// Probing a project's devices, with the cache: see device_inventory.h.
#include "core/engine/device_inventory.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/base/file_io.h"
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

std::optional<device_inventory> gpu_planning_inventory(const project_config& cfg, const std::filesystem::path& cache_dir) {
  if (cfg.distributed.processes > 1) return std::nullopt;  // every rank must choose alike, and other hosts' GPUs are not seen here
  auto budgets = gpu_device_budgets(cfg.parallel.devices);
  auto facts = describe_devices(cfg.parallel.devices);
  if (!budgets || !facts || budgets->empty() || budgets->size() != facts->size()) return std::nullopt;
  device_inventory inv;
  for (size_t i = 0; i < facts->size(); ++i) {
    probed_device d;
    if ((*facts)[i].gpu >= 0) (void)describe_gpu((*facts)[i].gpu, d);  // unknown facts stay unknown (an estimate of 0: free copies)
    d.name = (*facts)[i].name;
    d.kind = "cuda";
    d.gpu = (*facts)[i].gpu;
    d.capacity_bytes = (*budgets)[i];
    inv.devices.push_back(std::move(d));
  }
  fill_copy_rates(inv, cache_dir.empty() ? default_probe_cache_dir() : cache_dir);
  return inv;
}

double cross_mapping_score(const std::vector<int>& order, const std::vector<std::vector<double>>& share) {
  double score = 0;
  for (size_t i = 0; i < order.size(); ++i)
    for (size_t j = i + 1; j < order.size(); ++j)
      score += share[static_cast<size_t>(order[i])][static_cast<size_t>(order[j])] / static_cast<double>(j - i);
  return score;
}

namespace {

// Devices joined by a shared upstream link (same GPU, or a PCI bridge in common), as groups.
std::vector<std::vector<int>> link_groups(const device_inventory& inv) {
  const size_t n = inv.devices.size();
  std::vector<int> parent(n);
  std::iota(parent.begin(), parent.end(), 0);
  const auto find = [&](int x) {
    while (parent[static_cast<size_t>(x)] != x) x = parent[static_cast<size_t>(x)] = parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
    return x;
  };
  for (size_t a = 0; a < n; ++a)
    for (size_t b = a + 1; b < n; ++b) {
      const auto &da = inv.devices[a], &db = inv.devices[b];
      bool shared = da.gpu >= 0 && da.gpu == db.gpu;
      for (const auto& bridge : da.upstream)
        shared = shared || std::find(db.upstream.begin(), db.upstream.end(), bridge) != db.upstream.end();
      if (shared) parent[static_cast<size_t>(find(static_cast<int>(a)))] = find(static_cast<int>(b));
    }
  std::vector<std::vector<int>> by_root(n);
  for (size_t d = 0; d < n; ++d) by_root[static_cast<size_t>(find(static_cast<int>(d)))].push_back(static_cast<int>(d));
  std::vector<std::vector<int>> out;
  for (auto& g : by_root)
    if (g.size() > 1) out.push_back(std::move(g));
  return out;
}

// Sharing costs nothing when every device of the group copied at least 90% as fast all at once as
// alone (both directions measured); unmeasured devices count as slowed.
bool group_slows_copies(const device_inventory& inv, const std::vector<int>& group) {
  for (int d : group) {
    const auto& p = inv.devices[static_cast<size_t>(d)];
    const bool measured = p.h2d_bytes_per_s > 0 && p.h2d_concurrent_bytes_per_s > 0;
    if (!measured || p.h2d_concurrent_bytes_per_s < 0.9 * p.h2d_bytes_per_s ||
        (p.d2h_bytes_per_s > 0 && p.d2h_concurrent_bytes_per_s < 0.9 * p.d2h_bytes_per_s))
      return true;
  }
  return false;
}

std::string group_text(const device_inventory& inv, const std::vector<int>& g) {
  std::string out;
  for (int d : g) out += (out.empty() ? "" : ", ") + inv.devices[static_cast<size_t>(d)].name;
  return out;
}

}  // namespace

project_config with_probed_bandwidth(const project_config& cfg, const device_inventory& inv) {
  // Devices behind a shared link that slows their copies: the links are costed as such
  // (offload.copy_links, one number per group) at the rate each device copies alone; without any,
  // copies are costed at the slowest rate measured with every device copying.
  std::vector<std::vector<int>> costly;
  for (auto& g : link_groups(inv))
    if (group_slows_copies(inv, g)) costly.push_back(std::move(g));
  double slowest = 0;
  for (const auto& d : inv.devices) {
    const bool alone = !costly.empty() || inv.devices.size() == 1;
    for (double r : {alone ? d.h2d_bytes_per_s : d.h2d_concurrent_bytes_per_s, alone ? d.d2h_bytes_per_s : d.d2h_concurrent_bytes_per_s})
      if (r > 0) slowest = slowest > 0 ? std::min(slowest, r) : r;
  }
  project_config out = cfg;
  if (slowest > 0) out.offload.copy_gbps = slowest / 1e9;
  if (!costly.empty()) {
    std::vector<int> link(inv.devices.size(), -1);
    for (size_t g = 0; g < costly.size(); ++g)
      for (int d : costly[g]) link[static_cast<size_t>(d)] = static_cast<int>(g);
    int fresh = static_cast<int>(costly.size());
    for (int& l : link)
      if (l < 0) l = fresh++;
    out.offload.copy_links = fmt::format("{}", fmt::join(link, ","));
  }
  return out;
}

namespace {

// The newest complete probe without errors in `dir` of the same GPUs as `inv`, in the same order.
std::optional<device_inventory> cached_probe_of(const device_inventory& inv, const std::filesystem::path& dir) {
  const auto same_gpus = [&](const device_inventory& c) {
    if (c.devices.size() != inv.devices.size()) return false;
    for (size_t i = 0; i < c.devices.size(); ++i) {
      const auto &a = c.devices[i], &b = inv.devices[i];
      if (a.gpu != b.gpu || a.pci_bus_id.empty() || a.pci_bus_id != b.pci_bus_id || a.gpu_name != b.gpu_name) return false;
    }
    return true;
  };
  std::optional<device_inventory> best;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (file.rfind("devices-", 0) != 0 || it->path().extension() != ".json") continue;
    auto text = read_text_file(it->path());
    auto c = text ? inventory_from_json(*text) : result<device_inventory>(make_error("unreadable"));
    if (!c || !c->measured || !c->complete || !c->ok() || !same_gpus(*c)) continue;
    if (!best || c->when > best->when) best = std::move(*c);  // ISO 8601 UTC: text order is time order
  }
  return best;
}

}  // namespace

void fill_copy_rates(device_inventory& inv, const std::filesystem::path& cache_dir) {
  if (inv.devices.empty() || inv.measured) return;
  if (auto cached = cached_probe_of(inv, cache_dir)) {
    for (size_t i = 0; i < inv.devices.size(); ++i) {
      auto &d = inv.devices[i];
      const auto& c = cached->devices[i];
      d.h2d_bytes_per_s = c.h2d_bytes_per_s, d.d2h_bytes_per_s = c.d2h_bytes_per_s;
      d.h2d_concurrent_bytes_per_s = c.h2d_concurrent_bytes_per_s, d.d2h_concurrent_bytes_per_s = c.d2h_concurrent_bytes_per_s;
    }
    inv.rates_from = fmt::format("measured by the probe of {} (cached in {})", cached->when, cache_dir.string());
    return;
  }
  // Devices sharing a link split it when all copy at once.
  std::vector<size_t> sharing(inv.devices.size(), 1);
  for (const auto& g : link_groups(inv))
    for (int d : g) sharing[static_cast<size_t>(d)] = g.size();
  std::vector<std::string> links;
  for (size_t i = 0; i < inv.devices.size(); ++i) {
    auto& d = inv.devices[i];
    const double alone = pcie_copy_estimate(d);
    d.h2d_bytes_per_s = d.d2h_bytes_per_s = alone;
    d.h2d_concurrent_bytes_per_s = d.d2h_concurrent_bytes_per_s = alone / static_cast<double>(sharing[i]);
    const auto link = pcie_estimate_link(d);
    links.push_back(alone > 0 ? fmt::format("{} gen {} x{}", d.name, link.gen, link.width) : d.name + " unknown");
  }
  const bool any = std::any_of(inv.devices.begin(), inv.devices.end(), [](const probed_device& d) { return d.h2d_bytes_per_s > 0; });
  if (any) inv.rates_from = fmt::format("estimated from the PCIe links ({}; plan --probe measures them)", fmt::join(links, ", "));
}

project_config with_planning_copy_rates(const project_config& cfg, const device_inventory* inv) {
  if (cfg.offload.copy_gbps > 0 || inv == nullptr || inv->devices.empty() || cfg.distributed.processes > 1) return cfg;
  if (inv->measured && (!inv->ok() || !inv->complete)) return cfg;  // `train` would not find it cached
  if (static_cast<int64_t>(inv->devices.size()) != device_count(cfg.parallel.devices)) return cfg;
  const auto gpu = [](const probed_device& d) { return d.gpu >= 0; };
  const auto rated = [](const probed_device& d) { return d.h2d_bytes_per_s > 0 || d.d2h_bytes_per_s > 0; };
  if (!std::all_of(inv->devices.begin(), inv->devices.end(), gpu) || !std::any_of(inv->devices.begin(), inv->devices.end(), rated)) return cfg;
  return with_probed_bandwidth(cfg, *inv);  // (a device of unknown rate is costed as the slowest known)
}

project_config with_device_order(const project_config& cfg, const std::vector<int>& order) {
  project_config out = cfg;
  const auto permuted = [&](const std::string& list) {
    std::vector<std::string> items, moved;
    std::stringstream ss(list);
    for (std::string x; std::getline(ss, x, ',');) items.push_back(x);
    if (items.size() != order.size()) return list;
    for (int d : order) moved.push_back(items[static_cast<size_t>(d)]);
    return fmt::format("{}", fmt::join(moved, ","));
  };
  if (cfg.parallel.devices.rfind("cuda:", 0) == 0) out.parallel.devices = "cuda:" + permuted(cfg.parallel.devices.substr(5));
  if (!cfg.offload.copy_links.empty()) out.offload.copy_links = permuted(cfg.offload.copy_links);
  if (!cfg.parallel.device_speeds.empty()) out.parallel.device_speeds = permuted(cfg.parallel.device_speeds);
  return out;
}

device_inventory with_device_order(const device_inventory& inv, const std::vector<int>& order) {
  device_inventory out = inv;
  if (order.size() != inv.devices.size()) return out;
  std::vector<int> position(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    out.devices[k] = inv.devices[static_cast<size_t>(order[k])];
    position[static_cast<size_t>(order[k])] = static_cast<int>(k);
  }
  for (auto& l : out.links) {
    l.from = position[static_cast<size_t>(l.from)];
    l.to = position[static_cast<size_t>(l.to)];
  }
  return out;
}

device_order cross_mapping(const device_inventory& inv, const project_config& cfg) {
  device_order out;
  const size_t n = inv.devices.size();
  out.order.resize(n);
  std::iota(out.order.begin(), out.order.end(), 0);
  if (n < 3 || static_cast<int64_t>(n) != device_count(cfg.parallel.devices)) {
    out.why = n < 3 ? "fewer than three devices: every order is the same to the links" : "the probe is of other devices";
    return out;
  }
  std::vector<std::vector<double>> share(n, std::vector<double>(n, 1.0));
  std::vector<std::string> quiet;
  for (auto& g : link_groups(inv)) {
    if (!group_slows_copies(inv, g)) {
      quiet.push_back(group_text(inv, g));
      continue;
    }
    for (int a : g)
      for (int b : g)
        if (a != b) share[static_cast<size_t>(a)][static_cast<size_t>(b)] = static_cast<double>(g.size());
    out.groups.push_back(std::move(g));
  }
  out.given_score = out.score = cross_mapping_score(out.order, share);
  std::vector<int> perm = out.order;
  while (n <= 8 && std::next_permutation(perm.begin(), perm.end())) {  // 8! = 40320 orders at most
    const double s = cross_mapping_score(perm, share);
    if (s < out.score - 1e-9) {
      out.score = s;
      out.order = perm;
    }
  }
  std::string shared;
  for (const auto& g : out.groups) shared += (shared.empty() ? "" : "; ") + group_text(inv, g);
  if (out.groups.empty()) {
    out.why = quiet.empty() ? "no two devices share an upstream link" : "devices sharing a link copy as fast together as alone (" + quiet.front() + ")";
    return out;
  }
  if (n > 8) {
    out.why = fmt::format("{} devices: more than 8 orders are not searched; the given order is kept ({} share links)", n, shared);
    return out;
  }
  if (out.score >= out.given_score - 1e-9) {
    out.why = fmt::format("the given order already keeps neighbouring stages apart on shared links ({}; score {:.2f})", shared, out.score);
    return out;
  }
  const project_config moved = with_device_order(cfg, out.order);
  out.setting = moved.parallel.devices != cfg.parallel.devices ? "parallel.devices " + moved.parallel.devices
                                                                : "offload.copy_links " + moved.offload.copy_links;
  out.why = fmt::format("{} puts neighbouring stages behind different upstream links ({} share one; Mobius score {:.2f} -> {:.2f})",
                        out.setting, shared, out.given_score, out.score);
  return out;
}

}  // namespace lorapipe
