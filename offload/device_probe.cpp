// Device inventory and probe: see device_probe.h.
#include "offload/device_probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include "core/base/file_io.h"
#include "core/base/hash.h"
#include "offload/device.h"
#ifdef LORAPIPE_HAS_CUDA
#include "offload/cuda/cuda_device.h"
#endif

namespace lorapipe {

namespace {

using clock_type = std::chrono::steady_clock;
using json = nlohmann::json;

std::string static_facts(const device_inventory& inv) {
  json j = json::array();
  // What does not change from one probe to the next: a GPU's capacity follows its free memory and its
  // current PCIe link drops at idle, so neither is part of the key.
  for (const auto& d : inv.devices)
    j.push_back({d.name, d.kind, d.gpu >= 0 ? size_t{0} : d.capacity_bytes, d.threads, d.speed, d.copy_limit_bytes_per_s, d.gpu,
                 d.gpu_name, d.pci_bus_id, d.total_bytes, d.sm_count, d.cc_major, d.cc_minor, d.numa_node, d.upstream});
  for (const auto& l : inv.links) j.push_back({l.from, l.to, l.direct});
  const auto v = cuda_version_info();
  j.push_back({v.compiled, v.runtime, v.driver});
  return j.dump();
}

// One timed copy on a device's engine, watched against the probe's deadline.
struct timed_copy {
  std::shared_future<void> done;
  std::shared_ptr<clock_type::time_point> started = std::make_shared<clock_type::time_point>();
  std::shared_ptr<at::Tensor> result = std::make_shared<at::Tensor>();  // what a host->device copy made
};

// Submits `copy` (run on `engine`) for `bytes`: the start is taken when the engine begins it.
timed_copy submit_copy(copy_engine& engine, size_t bytes, std::function<void()> copy) {
  timed_copy t;
  t.done = engine.submit(bytes, [started = t.started, copy = std::move(copy)] {
    *started = clock_type::now();
    copy();
  });
  return t;
}

// Waits for `t` until `deadline`: bytes/s, or an error naming what did not finish.
result<double> finish(const timed_copy& t, size_t bytes, clock_type::time_point deadline, const std::string& what, double deadline_s) {
  if (t.done.wait_until(deadline) != std::future_status::ready)
    return make_error("{} did not finish within the probe's deadline of {:g} s (hung?)", what, deadline_s);
  try {
    t.done.get();
  } catch (const std::exception& e) {
    return make_error("{} failed: {}", what, e.what());
  }
  const double s = std::chrono::duration<double>(clock_type::now() - *t.started).count();
  return static_cast<double>(bytes) / std::max(s, 1e-9);
}

enum class direction { h2d, d2h };

// Holds each engine's next job until every engine is at it (or until `limit`), so copies timed
// "at once" start together: an engine that a busy host wakes late would otherwise find its link
// already taken and leave the others a share they never had to give up.
class start_gate {
 public:
  start_gate(size_t engines, clock_type::time_point limit) : waiting_(engines), limit_(limit) {}
  void arrive_and_wait() {
    std::unique_lock lock(mu_);
    if (waiting_ > 0 && --waiting_ == 0) cv_.notify_all();
    cv_.wait_until(lock, limit_, [&] { return waiting_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t waiting_;
  clock_type::time_point limit_;
};

copy_engine& engine_of(compute_device& d, direction dir) { return dir == direction::h2d ? d.upload() : d.download(); }

// The copy of one direction on device `d`: a host tensor in, or a device tensor out.
timed_copy start(compute_device& d, direction dir, const at::Tensor& host, const at::Tensor& on_device) {
  const size_t bytes = static_cast<size_t>(host.numel());
  if (dir == direction::h2d) {
    auto out = std::make_shared<at::Tensor>();
    auto t = submit_copy(engine_of(d, dir), bytes, [dev = &d, host, out] { *out = dev->copy_in(host); });
    t.result = out;
    return t;
  }
  return submit_copy(engine_of(d, dir), bytes, [dev = &d, on_device] { (void)dev->copy_out(on_device); });
}

struct probe_run {
  device_inventory& inv;
  const std::vector<compute_device*>& devs;
  const probe_options& o;
  clock_type::time_point deadline;
  at::Tensor host;                     // u8 [bytes]
  std::vector<at::Tensor> on_device;   // u8 [bytes] per device (empty when its upload failed)
  std::vector<bool> hung;

  bool usable(size_t i) const { return inv.devices[i].error.empty(); }
  // No measurement starts after the deadline (what is left is reported as not measured).
  // A copy starts only when it can finish in the time left at its device's throttle (twice over).
  bool may_start(double throttle_bytes_per_s = 0) {
    const double need = throttle_bytes_per_s > 0 ? 2.0 * static_cast<double>(o.bytes) / throttle_bytes_per_s : 0.0;
    if (clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(need)) < deadline) return true;
    inv.complete = false;
    return false;
  }
  double throttle(size_t i) const { return inv.devices[i].copy_limit_bytes_per_s; }
  void fail(size_t i, const std::string& m, bool in_flight) {
    inv.devices[i].error = inv.devices[i].name + ": " + m;
    if (in_flight) hung[i] = true;
  }

  // The fastest of o.repeats copies of `dir` on device i alone (a host->device copy leaves its
  // tensor in on_device[i], the source of the outgoing copies).
  double alone(size_t i, direction dir) {
    double best = 0;
    for (int r = 0; r < o.repeats && usable(i) && may_start(throttle(i)); ++r) {
      const auto what = fmt::format("{} copy of {} bytes", dir == direction::h2d ? "host->device" : "device->host", o.bytes);
      auto t = start(*devs[i], dir, host, on_device[i]);
      auto rate = finish(t, o.bytes, deadline, what, o.deadline_s);
      if (!rate) {
        fail(i, rate.message(), t.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready);
      } else {
        best = std::max(best, *rate);
        if (dir == direction::h2d) on_device[i] = *t.result;
      }
    }
    return best;
  }

  // Every usable device at once: each one's rate while the others copy too (each copy's end is
  // taken when it is seen done, polling every 100 us, not when the ones before it were waited for).
  void concurrent(direction dir) {
    double slowest = 0;
    for (size_t i = 0; i < devs.size(); ++i)
      if (usable(i) && throttle(i) > 0) slowest = slowest > 0 ? std::min(slowest, throttle(i)) : throttle(i);
    // Devices behind one shared link copy in turns: the slowest takes as much longer as its link
    // has devices copying at once.
    std::map<std::string, int> on_link;
    int sharing = 1;
    for (size_t i = 0; i < devs.size(); ++i)
      if (usable(i) && !inv.devices[i].upstream.empty()) sharing = std::max(sharing, ++on_link[inv.devices[i].upstream.front()]);
    if (!may_start(slowest / sharing)) return;
    std::vector<size_t> usable_devices;
    for (size_t i = 0; i < devs.size(); ++i)
      if (usable(i)) usable_devices.push_back(i);
    // The engines take their copies together, or each after a second from now at the latest.
    auto gate = std::make_shared<start_gate>(usable_devices.size(), std::min(deadline, clock_type::now() + std::chrono::seconds(1)));
    for (size_t i : usable_devices) (void)engine_of(*devs[i], dir).submit(0, [gate] { gate->arrive_and_wait(); });
    std::vector<std::pair<size_t, timed_copy>> running;
    for (size_t i : usable_devices) running.emplace_back(i, start(*devs[i], dir, host, on_device[i]));
    std::vector<bool> seen(running.size(), false);
    for (size_t left = running.size(); left > 0 && clock_type::now() < deadline;) {
      for (size_t k = 0; k < running.size(); ++k) {
        if (seen[k] || running[k].second.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
        seen[k] = true;
        --left;
        auto rate = finish(running[k].second, o.bytes, deadline, "concurrent copy", o.deadline_s);
        auto& d = inv.devices[running[k].first];
        if (!rate) fail(running[k].first, rate.message(), false);
        else (dir == direction::h2d ? d.h2d_concurrent_bytes_per_s : d.d2h_concurrent_bytes_per_s) = *rate;
      }
      if (left > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    for (size_t k = 0; k < running.size(); ++k)
      if (!seen[k] && running[k].second.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
        fail(running[k].first, fmt::format("concurrent copy did not finish within the probe's deadline of {:g} s (hung?)", o.deadline_s), true);
  }

  void peer(probed_link& l) {
    const auto from = static_cast<size_t>(l.from), to = static_cast<size_t>(l.to);
    if (!usable(from) || !usable(to) || !may_start(throttle(from))) return;
    auto t = submit_copy(devs[from]->download(), o.bytes,
                         [src = on_device[from], f = devs[from], d = devs[to]] { (void)d->copy_from_peer(*f, src); });
    auto rate = finish(t, o.bytes, deadline, fmt::format("peer copy to {}", inv.devices[to].name), o.deadline_s);
    if (rate) l.bytes_per_s = *rate;
    else {
      l.error = rate.message();
      // The copy runs on `from`'s engine into `to`: both stay alive while it may still run.
      const bool in_flight = t.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
      fail(from, rate.message(), in_flight);
      if (in_flight) fail(to, "a peer copy from " + inv.devices[from].name + " into it is still in flight", true);
    }
  }

  void run() {
    for (size_t i = 0; i < devs.size(); ++i) {
      if (!usable(i)) continue;
      inv.devices[i].h2d_bytes_per_s = alone(i, direction::h2d);
      if (!usable(i)) continue;
      inv.devices[i].d2h_bytes_per_s = alone(i, direction::d2h);
    }
    if (devs.size() > 1) {
      concurrent(direction::h2d);
      concurrent(direction::d2h);
    }
    if (o.peers)
      for (auto& l : inv.links)
        if (l.direct) peer(l);
  }
};

// The host side of the copies: pinned when a GPU is probed (training uploads from pinned memory).
at::Tensor probe_source(const std::vector<compute_device*>& devices, size_t bytes) {
  const bool gpu = std::any_of(devices.begin(), devices.end(), [](const compute_device* d) { return d->gpu() >= 0; });
  return at::zeros({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(gpu));  // u8 [bytes]
}

}  // namespace

bool device_inventory::ok() const {
  return std::all_of(devices.begin(), devices.end(), [](const probed_device& d) { return d.error.empty(); });
}

namespace {

std::string first_line(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string s;
  std::getline(in, s);
  return s;
}

// "16.0 GT/s PCIe" -> 4; 0 when unknown.
int pcie_generation(const std::string& speed) {
  const double gts = std::atof(speed.c_str());
  static const std::pair<double, int> gens[] = {{2.5, 1}, {5, 2}, {8, 3}, {16, 4}, {32, 5}, {64, 6}};
  for (const auto& [rate, gen] : gens)
    if (gts > 0 && std::abs(gts - rate) < 0.6) return gen;
  return 0;
}

// The lower of two known values (0 = unknown).
int lower_known(int a, int b) { return a > 0 && b > 0 ? std::min(a, b) : std::max(a, b); }

}  // namespace

void read_pci_link(const std::filesystem::path& root, const std::string& bus_id, probed_device& d) {
  const auto dir = root / bus_id;
  const std::string numa = first_line(dir / "numa_node");
  d.pcie_gen = pcie_generation(first_line(dir / "current_link_speed"));
  d.pcie_width = std::atoi(first_line(dir / "current_link_width").c_str());
  if (!numa.empty()) d.numa_node = std::atoi(numa.c_str());
  d.pcie_max_gen = pcie_generation(first_line(dir / "max_link_speed"));
  d.pcie_max_width = std::atoi(first_line(dir / "max_link_width").c_str());
  std::error_code ec;
  const auto real = std::filesystem::canonical(dir, ec);
  d.upstream.clear();
  if (ec) return;
  // The port above the device bounds what the link can train to (a root port or a switch's port).
  const auto port = real.parent_path();
  d.pcie_max_gen = lower_known(d.pcie_max_gen, pcie_generation(first_line(port / "max_link_speed")));
  d.pcie_max_width = lower_known(d.pcie_max_width, std::atoi(first_line(port / "max_link_width").c_str()));
  static const std::regex address("[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\\.[0-7]");
  for (const auto& part : real)
    if (std::regex_match(part.string(), address)) d.upstream.push_back(part.string());
  if (!d.upstream.empty()) d.upstream.pop_back();  // the device itself
}

pcie_link pcie_estimate_link(const probed_device& d) {
  return {d.pcie_max_gen > 0 ? d.pcie_max_gen : d.pcie_gen, d.pcie_width > 0 ? d.pcie_width : d.pcie_max_width};
}

double pcie_copy_estimate(const probed_device& d) {
  const auto [gen, width] = pcie_estimate_link(d);
  // GB/s per lane after line encoding: 8b/10b (gen1-2), 128b/130b (gen3-5), FLIT (gen6).
  static const double lane_gbs[] = {0, 0.25, 0.5, 0.985, 1.969, 3.938, 7.563};
  if (gen <= 0 || gen > 6 || width <= 0) return 0;
  return 0.8 * lane_gbs[gen] * width * 1e9;
}

status describe_gpu(int gpu, probed_device& d) {
#ifdef LORAPIPE_HAS_CUDA
  try {
    return cuda_describe_gpu(gpu, d);
  } catch (const std::exception& e) {
    return make_error("cuda:{}: {}", gpu, e.what());
  }
#else
  (void)d;
  return make_error("cuda:{}: this build has no CUDA", gpu);
#endif
}

device_inventory describe_inventory(const std::vector<compute_device*>& devices) {
  device_inventory inv;
  for (auto* dev : devices) {
    probed_device d;
    d.name = dev->name();
    d.gpu = dev->gpu();
    d.kind = d.gpu >= 0 ? "cuda" : "cpu";
    d.capacity_bytes = dev->arena().capacity();
    d.threads = dev->compute_threads();
    d.speed = dev->compute_speed();
    d.copy_limit_bytes_per_s = dev->upload().bytes_per_s();
    if (const std::string link = dev->shared_link_name(); !link.empty()) d.upstream = {link};
    if (d.gpu >= 0)
      if (auto st = describe_gpu(d.gpu, d); !st) d.error = d.name + ": " + st.message();
    inv.devices.push_back(std::move(d));
  }
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < devices.size(); ++j) {
      if (i == j) continue;
      const int gi = devices[i]->gpu(), gj = devices[j]->gpu();
      const bool direct = gi < 0 && gj < 0 ? true : gi >= 0 && gj >= 0 && gpu_peer_access(gi, gj);
      inv.links.push_back({static_cast<int>(i), static_cast<int>(j), direct, 0, {}});
    }
  const std::string facts = static_facts(inv);
  inv.fingerprint = sha256_hex(facts.data(), facts.size());
  return inv;
}

void measure_inventory(device_inventory& inv, const std::vector<compute_device*>& devices, const probe_options& o) {
  const auto t0 = clock_type::now();
  probe_run run{inv, devices, o, t0 + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(o.deadline_s)),
                probe_source(devices, o.bytes), std::vector<at::Tensor>(devices.size()),
                std::vector<bool>(devices.size(), false)};
  run.run();
  for (size_t i = 0; i < devices.size(); ++i)
    if (run.hung[i]) inv.devices[i].error += " [copy still in flight]";
  inv.measured = true;
  inv.probe_bytes = o.bytes;
  inv.probe_seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  inv.when = buf;
}

std::vector<int> hung_devices(const device_inventory& inv) {
  std::vector<int> out;
  for (size_t i = 0; i < inv.devices.size(); ++i)
    if (inv.devices[i].error.find("[copy still in flight]") != std::string::npos) out.push_back(static_cast<int>(i));
  return out;
}

// JSON by field name (nlohmann's macros: every field written; every field required when read, except
// a device's, which default: caches written before pcie_max_gen/width still load).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(probed_device, name, kind, capacity_bytes, threads, speed, copy_limit_bytes_per_s, gpu,
                                                gpu_name, pci_bus_id, total_bytes, free_bytes, sm_count, cc_major, cc_minor, pcie_gen,
                                                pcie_width, pcie_max_gen, pcie_max_width, numa_node, upstream, h2d_bytes_per_s, d2h_bytes_per_s,
                                                h2d_concurrent_bytes_per_s, d2h_concurrent_bytes_per_s, error)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(probed_link, from, to, direct, bytes_per_s, error)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(device_inventory, devices, links, fingerprint, measured, complete, probe_seconds, probe_bytes, when)

std::string inventory_to_json(const device_inventory& inv) { return json(inv).dump(2) + "\n"; }

result<device_inventory> inventory_from_json(const std::string& text) {
  try {
    return json::parse(text).get<device_inventory>();
  } catch (const std::exception& e) {
    return make_error("device inventory: {}", e.what());
  }
}

std::filesystem::path inventory_cache_file(const std::filesystem::path& dir, const std::string& fingerprint) {
  return dir / ("devices-" + fingerprint.substr(0, 16) + ".json");
}

result<device_inventory> load_cached_inventory(const std::filesystem::path& dir, const std::string& fingerprint) {
  const auto file = inventory_cache_file(dir, fingerprint);
  LP_TRY_ASSIGN(text, read_text_file(file));
  LP_TRY_ASSIGN(inv, inventory_from_json(text));
  if (inv.fingerprint != fingerprint) return make_error("{}: made for other devices", file.string());
  if (!inv.measured || !inv.complete || !inv.ok()) return make_error("{}: an incomplete probe (not reused)", file.string());
  return inv;
}

status save_cached_inventory(const std::filesystem::path& dir, const device_inventory& inv) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return make_error("{}: {}", dir.string(), ec.message());
  return write_file_atomic(inventory_cache_file(dir, inv.fingerprint), inventory_to_json(inv));
}

std::string inventory_text(const device_inventory& inv) {
  const auto gbs = [](double b) { return b > 0 ? fmt::format("{:.2f} GB/s", b / 1e9) : std::string("-"); };
  std::string out;
  for (const auto& d : inv.devices) {
    out += fmt::format("  {}: ", d.name);
    if (d.kind == "cuda")
      out += fmt::format("{} (sm_{}{}, {} SMs), {:.1f} of {:.1f} GiB free, PCIe gen {} x{} (up to gen {} x{}), NUMA node {}; ", d.gpu_name,
                         d.cc_major, d.cc_minor, d.sm_count, d.free_bytes / 1073741824.0, d.total_bytes / 1073741824.0, d.pcie_gen,
                         d.pcie_width, d.pcie_max_gen, d.pcie_max_width, d.numa_node);
    else
      out += fmt::format("CPU virtual device, {} thread(s), speed x{:g}, copies {}; ", d.threads, d.speed,
                         d.copy_limit_bytes_per_s > 0 ? fmt::format("throttled to {}", gbs(d.copy_limit_bytes_per_s)) : "unthrottled");
    out += fmt::format("host->device {} alone, {} all at once; device->host {} alone, {} all at once\n", gbs(d.h2d_bytes_per_s),
                       gbs(d.h2d_concurrent_bytes_per_s), gbs(d.d2h_bytes_per_s), gbs(d.d2h_concurrent_bytes_per_s));
    if (!d.upstream.empty()) out += fmt::format("    upstream: {}\n", fmt::join(d.upstream, " > "));
    if (!d.error.empty()) out += "    problem: " + d.error + "\n";
  }
  if (inv.measured && !inv.complete) out += "  (the probe reached its deadline: what is missing was not measured)\n";
  for (const auto& l : inv.links)
    out += fmt::format("  link {} -> {}: {}{}{}\n", inv.devices[static_cast<size_t>(l.from)].name, inv.devices[static_cast<size_t>(l.to)].name,
                       l.direct ? "direct" : "through the host", l.bytes_per_s > 0 ? ", peer copy " + gbs(l.bytes_per_s) : std::string(),
                       l.error.empty() ? std::string() : " (" + l.error + ")");
  return out;
}

}  // namespace lorapipe
