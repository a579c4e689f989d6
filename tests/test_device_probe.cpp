// The device inventory and probe (offload/device_probe.h, core/engine/device_inventory.h) on CPU
// virtual devices: timed copies bounded by the throttle, a copy engine that hangs is reported within
// the deadline (the watchdog) and one that fails is reported, the JSON form round-trips, the
// fingerprint follows the static facts, the cache is reused and refreshed, sysfs PCIe parsing (link,
// NUMA node, the bridges above a GPU, the link's maximum and the copy rate it gives), the copy rates
// GPUs are planned with when nothing measured them now (a cached probe, else PCIe), the cross mapping
// of GPUs behind shared switches.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/base/errors.h"
#include "core/engine/device_inventory.h"
#include "offload/device.h"
#include "offload/device_probe.h"

using namespace lorapipe;

namespace {

struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    path = std::filesystem::temp_directory_path() / ("lorapipe_probe_" + std::to_string(::getpid()) + "_" +
                                                     std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::filesystem::create_directories(path);
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
};

std::vector<std::unique_ptr<cpu_device>> cpu_devices(int n, const cpu_device_options& o) {
  std::vector<std::unique_ptr<cpu_device>> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_unique<cpu_device>(i, o));
  return out;
}
std::vector<compute_device*> raw(const std::vector<std::unique_ptr<cpu_device>>& devs) {
  std::vector<compute_device*> out;
  for (const auto& d : devs) out.push_back(d.get());
  return out;
}

// A gate a copy hook blocks on until the test opens it (a copy engine that hangs).
struct gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  void wait() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return open; });
  }
  void release() {
    {
      std::lock_guard lock(mu);
      open = true;
    }
    cv.notify_all();
  }
};

}  // namespace

TEST(DeviceProbe, MeasuresThrottledCopiesAloneAndTogether) {
  cpu_device_options o;
  o.copy_bytes_per_s = 0.25e9;
  o.capacity_bytes = size_t{64} << 20;
  o.speed = {1, 0.5};
  const auto devs = cpu_devices(2, o);
  device_inventory inv = describe_inventory(raw(devs));
  ASSERT_EQ(inv.devices.size(), 2u);
  EXPECT_EQ(inv.devices[1].kind, "cpu");
  EXPECT_EQ(inv.devices[1].capacity_bytes, size_t{64} << 20);
  EXPECT_EQ(inv.devices[1].speed, 0.5);
  EXPECT_EQ(inv.devices[1].copy_limit_bytes_per_s, 0.25e9);
  EXPECT_EQ(inv.fingerprint.size(), 64u);
  ASSERT_EQ(inv.links.size(), 2u);
  EXPECT_TRUE(inv.links[0].direct);
  probe_options po;
  po.bytes = size_t{2} << 20;
  measure_inventory(inv, raw(devs), po);
  ASSERT_TRUE(inv.ok()) << inv.devices[0].error << inv.devices[1].error;
  for (const auto& d : inv.devices)
    for (double r : {d.h2d_bytes_per_s, d.d2h_bytes_per_s, d.h2d_concurrent_bytes_per_s, d.d2h_concurrent_bytes_per_s}) {
      EXPECT_LE(r, 0.25e9 * 1.02) << d.name;  // the throttle is a floor on each copy's time
      EXPECT_GT(r, 0.25e9 * 0.2) << d.name;   // wide: the machine may be busy
    }
  for (const auto& l : inv.links) EXPECT_GT(l.bytes_per_s, 0) << l.from << "->" << l.to;
  EXPECT_TRUE(inv.measured);
  EXPECT_FALSE(inv.when.empty());
  EXPECT_NE(inventory_text(inv).find("cpu:1: CPU virtual device, 1 thread(s), speed x0.5, copies throttled to 0.25 GB/s"), std::string::npos)
      << inventory_text(inv);
  // JSON round trip.
  auto back = inventory_from_json(inventory_to_json(inv));
  ASSERT_TRUE(back.ok()) << back.message();
  EXPECT_EQ(inventory_to_json(*back), inventory_to_json(inv));
  EXPECT_FALSE(inventory_from_json("{\"fingerprint\": \"x\"}").ok());
  // The fingerprint follows the static facts.
  EXPECT_EQ(describe_inventory(raw(devs)).fingerprint, inv.fingerprint);
  o.capacity_bytes = size_t{32} << 20;
  EXPECT_NE(describe_inventory(raw(cpu_devices(2, o))).fingerprint, inv.fingerprint);
}

// The watchdog: a device whose copy engine hangs is reported when the deadline passes, the others
// are measured, and the probe returns.
TEST(DeviceProbe, WatchdogReportsAHungCopyEngineWithinTheDeadline) {
  auto g = std::make_shared<gate>();
  cpu_device_options ok_opts;
  cpu_device_options hang_opts;
  hang_opts.copy_fault = [g](const char* what) {
    if (std::string(what) == "copy_in") g->wait();
  };
  std::vector<std::unique_ptr<cpu_device>> devs;
  devs.push_back(std::make_unique<cpu_device>(0, ok_opts));
  devs.push_back(std::make_unique<cpu_device>(1, hang_opts));
  device_inventory inv = describe_inventory(raw(devs));
  probe_options po;
  po.bytes = size_t{1} << 20;
  po.deadline_s = 1.0;
  const auto t0 = std::chrono::steady_clock::now();
  measure_inventory(inv, raw(devs), po);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  g->release();  // the engine thread finishes its copy; the devices can then be destroyed
  EXPECT_LT(took, 5.0);  // a wide bound: the deadline is 1 s
  EXPECT_FALSE(inv.ok());
  EXPECT_TRUE(inv.devices[0].error.empty()) << inv.devices[0].error;
  EXPECT_GT(inv.devices[0].h2d_bytes_per_s, 0);
  EXPECT_GT(inv.devices[0].d2h_bytes_per_s, 0);
  EXPECT_NE(inv.devices[1].error.find("cpu:1: host->device copy of 1048576 bytes did not finish within the probe's deadline of 1 s"),
            std::string::npos)
      << inv.devices[1].error;
  EXPECT_EQ(hung_devices(inv), std::vector<int>{1});
  EXPECT_EQ(inv.devices[1].h2d_bytes_per_s, 0);
  EXPECT_FALSE(inv.complete);  // the concurrent and peer copies were not started after the deadline
  EXPECT_NE(inventory_text(inv).find("problem: cpu:1: host->device copy"), std::string::npos);
}

// A peer copy that hangs runs on the sender's engine into the receiver: both are reported as left
// with a copy in flight (neither may be destroyed while it runs).
TEST(DeviceProbe, AHungPeerCopyKeepsBothEndsAlive) {
  auto g = std::make_shared<gate>();
  cpu_device_options hang_opts;
  hang_opts.copy_fault = [g](const char* what) {
    if (std::string(what) == "copy_from_peer") g->wait();
  };
  std::vector<std::unique_ptr<cpu_device>> devs;
  devs.push_back(std::make_unique<cpu_device>(0, cpu_device_options{}));
  devs.push_back(std::make_unique<cpu_device>(1, hang_opts));
  device_inventory inv = describe_inventory(raw(devs));
  probe_options po;
  po.bytes = size_t{1} << 20;
  po.deadline_s = 1.0;
  measure_inventory(inv, raw(devs), po);
  g->release();
  EXPECT_GT(inv.devices[1].h2d_concurrent_bytes_per_s, 0);  // measured before the peer phase
  EXPECT_NE(inv.links[0].error.find("peer copy to cpu:1 did not finish"), std::string::npos) << inv.links[0].error;
  EXPECT_EQ(hung_devices(inv), (std::vector<int>{0, 1}));
  EXPECT_NE(inv.devices[1].error.find("a peer copy from cpu:0 into it is still in flight"), std::string::npos) << inv.devices[1].error;
}

TEST(DeviceProbe, AFailingCopyIsReportedNotThrown) {
  cpu_device_options o;
  o.copy_fault = [](const char* what) {
    if (std::string(what) == "copy_out") throw device_error("cpu:0: simulated transfer failure");
  };
  const auto devs = cpu_devices(1, o);
  device_inventory inv = describe_inventory(raw(devs));
  probe_options po;
  po.bytes = 4096;
  measure_inventory(inv, raw(devs), po);
  EXPECT_GT(inv.devices[0].h2d_bytes_per_s, 0);
  EXPECT_NE(inv.devices[0].error.find("device->host copy of 4096 bytes failed: cpu:0: simulated transfer failure"), std::string::npos)
      << inv.devices[0].error;
  EXPECT_TRUE(hung_devices(inv).empty());
}

TEST(DeviceProbe, ReadsPcieLinkAndNumaNodeFromSysfs) {
  temp_dir t;
  const auto dev = t.path / "0000:01:00.0";
  std::filesystem::create_directories(dev);
  std::ofstream(dev / "current_link_speed") << "16.0 GT/s PCIe\n";
  std::ofstream(dev / "current_link_width") << "8\n";
  std::ofstream(dev / "numa_node") << "1\n";
  probed_device d;
  read_pci_link(t.path, "0000:01:00.0", d);
  EXPECT_EQ(d.pcie_gen, 4);
  EXPECT_EQ(d.pcie_width, 8);
  EXPECT_EQ(d.numa_node, 1);
  std::ofstream(dev / "current_link_speed") << "8.0 GT/s PCIe\n";
  read_pci_link(t.path, "0000:01:00.0", d);
  EXPECT_EQ(d.pcie_gen, 3);
  probed_device none;
  read_pci_link(t.path, "0000:02:00.0", none);
  EXPECT_EQ(none.pcie_gen, 0);
  EXPECT_EQ(none.numa_node, -1);
}

// The bridges above a GPU come from the path its sysfs entry links to: a GPU behind a switch has its
// root port and both switch ports; one on its own root port has that port only.
TEST(DeviceProbe, ReadsTheBridgesAboveAGpuFromSysfs) {
  temp_dir t;
  const auto tree = t.path / "devices" / "pci0000:00";
  const auto behind_switch = tree / "0000:00:01.0" / "0000:01:00.0" / "0000:02:08.0" / "0000:03:00.0";
  const auto own_port = tree / "0000:00:03.0" / "0000:05:00.0";
  std::filesystem::create_directories(behind_switch);
  std::filesystem::create_directories(own_port);
  std::filesystem::create_directories(t.path / "bus");
  std::filesystem::create_directory_symlink(behind_switch, t.path / "bus" / "0000:03:00.0");
  std::filesystem::create_directory_symlink(own_port, t.path / "bus" / "0000:05:00.0");
  probed_device a, b;
  read_pci_link(t.path / "bus", "0000:03:00.0", a);
  read_pci_link(t.path / "bus", "0000:05:00.0", b);
  EXPECT_EQ(a.upstream, (std::vector<std::string>{"0000:00:01.0", "0000:01:00.0", "0000:02:08.0"}));
  EXPECT_EQ(b.upstream, (std::vector<std::string>{"0000:00:03.0"}));
}

namespace {
// Four GPUs of which 0 and 1 sit behind one switch and 2 and 3 behind another (Mobius' servers),
// each copying at `together` x its alone rate when all copy at once.
device_inventory two_switches(double together) {
  device_inventory inv;
  const char* ports[] = {"0000:00:01.0", "0000:00:01.0", "0000:00:02.0", "0000:00:02.0"};
  for (int g = 0; g < 4; ++g) {
    probed_device d;
    d.name = "cuda:" + std::to_string(g) + "#" + std::to_string(g);
    d.kind = "cuda";
    d.gpu = g;
    d.upstream = {ports[g], fmt::format("0000:0{}:00.0", g / 2 + 1), fmt::format("0000:0{}:{:02x}.0", g / 2 + 3, 8 * (g % 2 + 1))};
    d.h2d_bytes_per_s = d.d2h_bytes_per_s = 12e9;
    d.h2d_concurrent_bytes_per_s = d.d2h_concurrent_bytes_per_s = 12e9 * together;
    inv.devices.push_back(d);
  }
  return inv;
}
}  // namespace

project_config on_devices(const std::string& spec) {
  project_config c;
  c.parallel.devices = spec;
  return c;
}

// Mobius' cross mapping: neighbouring pipeline positions go to GPUs behind different switches (the
// best of all 24 orders by brute force here), unless sharing was measured to cost nothing or there
// are fewer than three GPUs; device speeds follow their devices.
TEST(DeviceProbe, CrossMappingKeepsNeighboursOffASharedSwitch) {
  const device_inventory inv = two_switches(0.5);
  const device_order o = cross_mapping(inv, on_devices("cuda:0,1,2,3"));
  ASSERT_EQ(o.groups.size(), 2u);
  EXPECT_EQ(o.groups[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(o.groups[1], (std::vector<int>{2, 3}));
  ASSERT_EQ(o.order.size(), 4u);
  for (size_t k = 0; k + 1 < 4; ++k) EXPECT_NE(o.order[k] / 2, o.order[k + 1] / 2) << "positions " << k << ", " << k + 1;
  EXPECT_NEAR(o.given_score, 2 + 2 + 1 + 0.5 + 0.5 + 1.0 / 3, 1e-9);
  EXPECT_LT(o.score, o.given_score);
  std::vector<std::vector<double>> share(4, std::vector<double>(4, 1.0));
  for (size_t a = 0; a < 4; ++a)
    for (size_t b = 0; b < 4; ++b)
      if (a != b && a / 2 == b / 2) share[a][b] = 2;
  std::vector<int> perm{0, 1, 2, 3};
  double best = cross_mapping_score(perm, share);
  while (std::next_permutation(perm.begin(), perm.end())) best = std::min(best, cross_mapping_score(perm, share));
  EXPECT_NEAR(o.score, best, 1e-9);
  std::string gpus;
  for (size_t k = 0; k < 4; ++k) gpus += (k ? "," : "") + std::to_string(o.order[k]);
  EXPECT_EQ(o.setting, "parallel.devices cuda:" + gpus);
  EXPECT_NE(o.why.find("Mobius score"), std::string::npos) << o.why;
  // The ordinals of the spec move, and the speeds with them.
  project_config named = on_devices("cuda:4,5,6,7");
  named.parallel.device_speeds = "1,0.5,0.25,2";
  const project_config moved = with_device_order(named, cross_mapping(inv, named).order);
  const double speed_of[] = {1, 0.5, 0.25, 2};
  std::string want_gpus, want_speeds;
  for (size_t k = 0; k < 4; ++k) {
    want_gpus += fmt::format("{}{}", k ? "," : "", 4 + o.order[k]);
    want_speeds += fmt::format("{}{:g}", k ? "," : "", speed_of[o.order[k]]);
  }
  EXPECT_EQ(moved.parallel.devices, "cuda:" + want_gpus);
  EXPECT_EQ(moved.parallel.device_speeds, want_speeds);
  // An order that already alternates is kept.
  device_inventory alternating = inv;
  std::swap(alternating.devices[1], alternating.devices[2]);
  const device_order kept = cross_mapping(alternating, on_devices("cuda:0,2,1,3"));
  EXPECT_TRUE(kept.setting.empty()) << kept.why;
  EXPECT_DOUBLE_EQ(kept.score, kept.given_score);
  // Measured: copies as fast together as alone, so the switches cost nothing.
  const device_order free_links = cross_mapping(two_switches(0.95), on_devices("cuda:0,1,2,3"));
  EXPECT_TRUE(free_links.setting.empty());
  EXPECT_TRUE(free_links.groups.empty());
  // Two GPUs: nothing to reorder.
  device_inventory pair = inv;
  pair.devices.resize(2);
  EXPECT_TRUE(cross_mapping(pair, on_devices("cuda:0,1")).setting.empty());
  // Pipeline devices on one GPU share everything.
  device_inventory same = two_switches(0.5);
  for (auto& d : same.devices) d.upstream.clear();
  same.devices[1].gpu = 0;
  const device_order repeated = cross_mapping(same, on_devices("cuda:0,0,2,3"));
  ASSERT_EQ(repeated.groups.size(), 1u);
  EXPECT_FALSE(repeated.setting.empty());
  for (size_t k = 0; k + 1 < 4; ++k) EXPECT_NE(repeated.order[k] + repeated.order[k + 1], 1) << "positions " << k << ", " << k + 1;
}

// CPU virtual devices sharing modelled links (offload.copy_links 0,0,1,1): the probe measures what
// the links give (each device alone at the throttle; two on one link about half of it when all copy
// at once), reports the links, and the cross mapping from that measurement moves the links so that
// neighbouring positions do not share one.
TEST(DeviceProbe, SharedCopyLinksAreMeasuredAndCrossMapped) {
  temp_dir t;
  project_config cfg = on_devices("cpu:4");
  cfg.offload.copy_gbps = 0.25;
  cfg.offload.copy_links = "0,0,1,1";
  probe_request req;
  req.cache_dir = t.path;
  req.options.bytes = size_t{16} << 20;  // 67 ms a copy: the partner engine's late start is small beside it
  req.options.peers = false;
  auto out = probe_project_devices(cfg, req);
  ASSERT_TRUE(out.ok()) << out.message();
  const auto& inv = out->inventory;
  ASSERT_EQ(inv.devices.size(), 4u);
  for (size_t d = 0; d < 4; ++d) {
    const auto& p = inv.devices[d];
    EXPECT_EQ(p.upstream, (std::vector<std::string>{"copy link " + std::to_string(d / 2)})) << d;
    EXPECT_NEAR(p.h2d_bytes_per_s, 0.25e9, 0.05e9) << d;
    EXPECT_LT(p.h2d_concurrent_bytes_per_s, 0.75 * p.h2d_bytes_per_s) << d << ": two devices on one link copy at once";
  }
  const device_order o = cross_mapping(inv, cfg);
  ASSERT_EQ(o.groups.size(), 2u) << o.why;
  ASSERT_FALSE(o.setting.empty()) << o.why;
  const project_config moved = with_device_order(cfg, o.order);
  EXPECT_EQ(o.setting, "offload.copy_links " + moved.offload.copy_links);
  EXPECT_EQ(moved.parallel.devices, "cpu:4");
  for (size_t k = 0; k + 1 < 7; k += 2) EXPECT_NE(moved.offload.copy_links[k], moved.offload.copy_links[k + 2]) << moved.offload.copy_links;
  EXPECT_TRUE(copy_links(moved).ok()) << copy_links(moved).message();
  // Without shared links nothing is grouped.
  project_config own = cfg;
  own.offload.copy_links.clear();
  auto plain = probe_project_devices(own, req);
  ASSERT_TRUE(plain.ok()) << plain.message();
  for (const auto& p : plain->inventory.devices) EXPECT_TRUE(p.upstream.empty());
  EXPECT_TRUE(cross_mapping(plain->inventory, own).groups.empty());
}

// The project-level probe: measured once, then reused from the cache for the same devices and
// settings, measured again on request or when the settings change; the plan costs copies at it.
TEST(DeviceProbe, ProjectProbeIsCachedByFingerprint) {
  temp_dir t;
  project_config cfg;
  cfg.parallel.devices = "cpu:2";
  cfg.offload.copy_gbps = 0.5;
  probe_request req;
  req.cache_dir = t.path;
  req.options.bytes = size_t{1} << 20;
  auto first = probe_project_devices(cfg, req);
  ASSERT_TRUE(first.ok()) << first.message();
  EXPECT_FALSE(first->from_cache);
  EXPECT_TRUE(first->cache_note.empty()) << first->cache_note;
  EXPECT_TRUE(std::filesystem::exists(first->cache_file));
  auto second = probe_project_devices(cfg, req);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->from_cache);
  EXPECT_EQ(inventory_to_json(second->inventory), inventory_to_json(first->inventory));
  req.refresh = true;
  EXPECT_FALSE(probe_project_devices(cfg, req)->from_cache);
  req.refresh = false;
  cfg.offload.copy_gbps = 1.0;  // other settings: another fingerprint
  auto other = probe_project_devices(cfg, req);
  ASSERT_TRUE(other.ok()) << other.message();
  EXPECT_FALSE(other->from_cache);
  EXPECT_NE(other->inventory.fingerprint, first->inventory.fingerprint);
  project_config unthrottled_plan = cfg;
  unthrottled_plan.offload.copy_gbps = 0;  // what the measurement replaces (CUDA projects plan copies as free)
  const project_config planned = with_probed_bandwidth(unthrottled_plan, other->inventory);
  EXPECT_GT(planned.offload.copy_gbps, 0.2);
  EXPECT_LE(planned.offload.copy_gbps, 1.0 * 1.02);  // devices throttled to 1 GB/s
  // A cache file made for other devices is not used.
  std::filesystem::copy_file(first->cache_file, inventory_cache_file(t.path, other->inventory.fingerprint),
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_FALSE(load_cached_inventory(t.path, other->inventory.fingerprint).ok());
}

// A link's maximum is the lower of the device's and its port's (a gen4 GPU in a gen3 slot trains to
// gen3); a GPU idling at gen1 is estimated at its maximum generation and the width it trained to,
// and the estimate is 80% of the encoded rate: gen3 x16 12.6 GB/s, gen4 x16 25.2 GB/s.
TEST(DeviceProbe, PcieMaximumIsTheLowerOfDeviceAndPortAndSetsTheEstimate) {
  temp_dir t;
  const auto port = t.path / "devices" / "pci0000:00" / "0000:00:01.0";
  const auto gpu = port / "0000:01:00.0";
  std::filesystem::create_directories(gpu);
  std::filesystem::create_directories(t.path / "bus");
  std::filesystem::create_directory_symlink(gpu, t.path / "bus" / "0000:01:00.0");
  const auto write = [](const std::filesystem::path& f, const char* text) { std::ofstream(f) << text << "\n"; };
  write(gpu / "current_link_speed", "2.5 GT/s PCIe");  // idle
  write(gpu / "current_link_width", "16");
  write(gpu / "max_link_speed", "16.0 GT/s PCIe");
  write(gpu / "max_link_width", "16");
  write(port / "max_link_speed", "8.0 GT/s PCIe");
  write(port / "max_link_width", "16");
  probed_device d;
  read_pci_link(t.path / "bus", "0000:01:00.0", d);
  EXPECT_EQ(d.pcie_gen, 1);
  EXPECT_EQ(d.pcie_max_gen, 3);
  EXPECT_EQ(d.pcie_max_width, 16);
  EXPECT_NEAR(pcie_copy_estimate(d), 0.8 * 0.985 * 16 * 1e9, 1e6);
  write(port / "max_link_speed", "16.0 GT/s PCIe");
  write(port / "max_link_width", "8");  // an x16 card in an x8 slot
  write(gpu / "current_link_width", "8");
  read_pci_link(t.path / "bus", "0000:01:00.0", d);
  EXPECT_EQ(d.pcie_max_gen, 4);
  EXPECT_EQ(d.pcie_max_width, 8);
  EXPECT_NEAR(pcie_copy_estimate(d), 0.8 * 1.969 * 8 * 1e9, 1e6);
  write(port / "max_link_width", "16");  // both ends x16, trained to x4 (a riser): the lanes it has
  write(gpu / "current_link_width", "4");
  read_pci_link(t.path / "bus", "0000:01:00.0", d);
  EXPECT_EQ(d.pcie_max_width, 16);
  EXPECT_NEAR(pcie_copy_estimate(d), 0.8 * 1.969 * 4 * 1e9, 1e6);
  write(gpu / "current_link_width", "16");
  std::filesystem::remove(port / "max_link_speed");  // a port that does not say: the device's own
  std::filesystem::remove(port / "max_link_width");
  read_pci_link(t.path / "bus", "0000:01:00.0", d);
  EXPECT_EQ(d.pcie_max_gen, 4);
  EXPECT_EQ(d.pcie_max_width, 16);
  EXPECT_NEAR(pcie_copy_estimate(d) / 1e9, 25.2, 0.01);
  std::filesystem::remove(gpu / "max_link_speed");  // the device does not say: its port's bound
  write(port / "max_link_speed", "8.0 GT/s PCIe");
  read_pci_link(t.path / "bus", "0000:01:00.0", d);
  EXPECT_EQ(d.pcie_max_gen, 3);
  EXPECT_EQ(d.upstream, std::vector<std::string>{"0000:00:01.0"});
  probed_device max_only;  // no current width known: the maximum
  max_only.pcie_max_gen = 4, max_only.pcie_max_width = 8;
  EXPECT_NEAR(pcie_copy_estimate(max_only), 0.8 * 1.969 * 8 * 1e9, 1e6);
  probed_device current_only;  // no maximum known: the current link
  current_only.pcie_gen = 3, current_only.pcie_width = 4;
  EXPECT_NEAR(pcie_copy_estimate(current_only), 0.8 * 0.985 * 4 * 1e9, 1e6);
  EXPECT_EQ(pcie_copy_estimate(probed_device{}), 0);
  // A cache written before the maximum was recorded still loads (the new fields default).
  device_inventory inv;
  inv.devices.push_back(d);
  auto j = nlohmann::json::parse(inventory_to_json(inv));
  j["devices"][0].erase("pcie_max_gen");
  j["devices"][0].erase("pcie_max_width");
  auto old = inventory_from_json(j.dump());
  ASSERT_TRUE(old.ok()) << old.message();
  EXPECT_EQ(old->devices[0].pcie_max_gen, 0);
  EXPECT_EQ(old->devices[0].pcie_gen, 1);
}

namespace {
// Two GPUs as gpu_planning_inventory describes them (nothing measured): at their PCI addresses,
// with their links' maximum.
device_inventory two_described_gpus() {
  device_inventory inv;
  for (int g = 0; g < 2; ++g) {
    probed_device d;
    d.name = fmt::format("cuda:{}#{}", g, g);
    d.kind = "cuda";
    d.gpu = g;
    d.gpu_name = "NVIDIA GeForce RTX 4090";
    d.pci_bus_id = fmt::format("0000:0{}:00.0", g + 1);
    d.upstream = {fmt::format("0000:00:0{}.0", g + 1)};  // each on its own root port
    d.pcie_max_gen = 4, d.pcie_max_width = g == 0 ? 16 : 8;
    inv.devices.push_back(d);
  }
  return inv;
}

// A probe of `gpus` as `plan --probe` caches it, measured at `when` copying at `alone` and `together`.
device_inventory probe_of(device_inventory gpus, const std::string& when, double alone, double together) {
  gpus.measured = true;
  gpus.when = when;
  gpus.fingerprint = "fp-" + when;  // another fingerprint per probe (other settings): any of them serves
  for (auto& d : gpus.devices) {
    d.h2d_bytes_per_s = d.d2h_bytes_per_s = alone;
    d.h2d_concurrent_bytes_per_s = d.d2h_concurrent_bytes_per_s = together;
  }
  return gpus;
}
}  // namespace

// GPUs nothing measured now are planned with copy rates: the newest cached probe of the same GPUs
// (another probe, of other GPUs or with problems, is ignored), else the PCIe estimate, split among
// devices that share a link; the planner costs them (with_planning_copy_rates) only on GPUs whose
// project states no rate.
TEST(DeviceProbe, UnmeasuredGpusArePlannedAtACachedProbeElseThePcieEstimate) {
  temp_dir t;
  device_inventory est = two_described_gpus();
  fill_copy_rates(est, t.path);  // an empty cache
  EXPECT_NEAR(est.devices[0].h2d_bytes_per_s / 1e9, 25.2, 0.01);
  EXPECT_NEAR(est.devices[1].d2h_bytes_per_s / 1e9, 12.6, 0.01);
  EXPECT_EQ(est.devices[1].h2d_concurrent_bytes_per_s, est.devices[1].h2d_bytes_per_s);  // own root ports: nothing shared
  EXPECT_NE(est.rates_from.find("estimated from the PCIe links (cuda:0#0 gen 4 x16, cuda:1#1 gen 4 x8"), std::string::npos) << est.rates_from;
  project_config cfg;
  cfg.parallel.devices = "cuda:0,1";
  EXPECT_NEAR(with_planning_copy_rates(cfg, &est).offload.copy_gbps, 12.6, 0.01);  // the slowest
  EXPECT_TRUE(with_planning_copy_rates(cfg, &est).offload.copy_links.empty());
  project_config stated = cfg;
  stated.offload.copy_gbps = 3;  // the project's own rate wins
  EXPECT_EQ(with_planning_copy_rates(stated, &est).offload.copy_gbps, 3);
  EXPECT_EQ(with_planning_copy_rates(cfg, nullptr).offload.copy_gbps, 0);
  project_config three = cfg;
  three.parallel.devices = "cuda:0,1,2";  // an inventory of other devices
  EXPECT_EQ(with_planning_copy_rates(three, &est).offload.copy_gbps, 0);
  device_inventory cpu = est;
  for (auto& d : cpu.devices) d.gpu = -1;  // CPU virtual devices: their throttle is offload.copy_gbps itself
  EXPECT_EQ(with_planning_copy_rates(cfg, &cpu).offload.copy_gbps, 0);
  device_inventory unknown = two_described_gpus();
  for (auto& d : unknown.devices) d.pcie_max_gen = 0;
  fill_copy_rates(unknown, t.path);
  EXPECT_EQ(unknown.rates_from, "");
  EXPECT_EQ(with_planning_copy_rates(cfg, &unknown).offload.copy_gbps, 0);  // nothing known: copies stay free

  // Two pipeline devices on one GPU share its link: half each at once, and the link is costed as shared.
  device_inventory same = two_described_gpus();
  same.devices[1].gpu = 0, same.devices[1].pci_bus_id = same.devices[0].pci_bus_id, same.devices[1].upstream = same.devices[0].upstream;
  same.devices[1].pcie_max_width = 16;
  fill_copy_rates(same, t.path);
  EXPECT_NEAR(same.devices[1].h2d_concurrent_bytes_per_s / 1e9, 12.6, 0.01);
  project_config on_one = cfg;
  on_one.parallel.devices = "cuda:0,0";
  EXPECT_EQ(with_planning_copy_rates(on_one, &same).offload.copy_links, "0,0");
  EXPECT_NEAR(with_planning_copy_rates(on_one, &same).offload.copy_gbps, 25.2, 0.01);

  // Cached probes: the newest of the same GPUs is used, whatever its fingerprint.
  ASSERT_TRUE(save_cached_inventory(t.path, probe_of(two_described_gpus(), "2026-11-01T10:00:00Z", 9e9, 8e9)).ok());
  ASSERT_TRUE(save_cached_inventory(t.path, probe_of(two_described_gpus(), "2026-12-01T10:00:00Z", 11e9, 10e9)).ok());
  device_inventory moved = two_described_gpus();
  moved.devices[1].pci_bus_id = "0000:0a:00.0";  // the card in another slot
  ASSERT_TRUE(save_cached_inventory(t.path, probe_of(moved, "2026-12-05T10:00:00Z", 20e9, 20e9)).ok());
  device_inventory failed = probe_of(two_described_gpus(), "2026-12-06T10:00:00Z", 30e9, 30e9);
  failed.devices[0].error = "cuda:0#0: copy failed";
  ASSERT_TRUE(save_cached_inventory(t.path, failed).ok());
  device_inventory cached = two_described_gpus();
  fill_copy_rates(cached, t.path);
  EXPECT_EQ(cached.devices[0].h2d_bytes_per_s, 11e9);
  EXPECT_EQ(cached.devices[1].d2h_concurrent_bytes_per_s, 10e9);
  EXPECT_NE(cached.rates_from.find("the probe of 2026-12-01T10:00:00Z"), std::string::npos) << cached.rates_from;
  EXPECT_NEAR(with_planning_copy_rates(cfg, &cached).offload.copy_gbps, 10, 1e-9);  // the slowest all at once
  device_inventory incomplete = probe_of(two_described_gpus(), "2026-12-07T10:00:00Z", 40e9, 40e9);
  incomplete.complete = false;  // the probe's deadline passed: not reused
  ASSERT_TRUE(save_cached_inventory(t.path, incomplete).ok());
  device_inventory unmeasured = probe_of(two_described_gpus(), "2026-12-07T11:00:00Z", 50e9, 50e9);
  unmeasured.measured = false;
  ASSERT_TRUE(save_cached_inventory(t.path, unmeasured).ok());
  device_inventory other_model = probe_of(two_described_gpus(), "2026-12-07T12:00:00Z", 60e9, 60e9);
  other_model.devices[0].gpu_name = "NVIDIA GeForce RTX 3090";  // the card swapped at the same address
  ASSERT_TRUE(save_cached_inventory(t.path, other_model).ok());
  std::ofstream(t.path / "devices-corrupt.json") << "{ not json";
  device_inventory newest = two_described_gpus();
  fill_copy_rates(newest, t.path);
  EXPECT_EQ(newest.devices[0].h2d_bytes_per_s, 11e9) << newest.rates_from;  // still the 2026-12-01 probe
  // A probe `plan --probe` just made with problems costs no choice (train would not find it cached).
  device_inventory troubled = probe_of(two_described_gpus(), "now", 5e9, 5e9);
  troubled.devices[1].error = "cuda:1#1: copy failed";
  EXPECT_EQ(with_planning_copy_rates(cfg, &troubled).offload.copy_gbps, 0);
  troubled.devices[1].error.clear();
  EXPECT_NEAR(with_planning_copy_rates(cfg, &troubled).offload.copy_gbps, 5, 1e-9);
  device_inventory missing_dir = two_described_gpus();
  fill_copy_rates(missing_dir, t.path / "no such directory");
  EXPECT_NEAR(missing_dir.devices[0].h2d_bytes_per_s / 1e9, 25.2, 0.01);
  device_inventory other_order = two_described_gpus();
  std::swap(other_order.devices[0], other_order.devices[1]);  // cuda:1,0: not the probe's order
  fill_copy_rates(other_order, t.path);
  EXPECT_NE(other_order.rates_from.find("estimated"), std::string::npos) << other_order.rates_from;
}
