// Per-link transport choice: see transport.h.
#include "core/pipeline/transport.h"

#include <algorithm>

#include <map>
#include <set>
#include <tuple>
#include <utility>

#include <fmt/format.h>

namespace lorapipe {

namespace {
// NCCL pairs the i-th send of a link with the i-th receive: the order of SENDs on `from` must be the
// order of the matching RECVs on `to`. Tensors are identified by (activation|gradient, layer
// boundary, micro-batch).
status check_nccl(const program& p, const std::vector<device_facts>& devices, bool nccl, const std::vector<int>& rank_of) {
  if (!nccl) return make_error("parallel.transport: nccl: this build has no NCCL (a CUDA build with NCCL is needed)");
  std::set<std::pair<int, int>> gpus;  // (process, GPU)
  for (size_t i = 0; i < devices.size(); ++i) {
    const auto& d = devices[i];
    if (d.gpu < 0) return make_error("parallel.transport: nccl: {} is not a GPU", d.name);
    const int rank = i < rank_of.size() ? rank_of[i] : 0;
    if (!gpus.insert({rank, d.gpu}).second)
      return make_error("parallel.transport: nccl: GPU {} appears twice{} (NCCL needs one rank per GPU)", d.gpu,
                        rank_of.empty() ? "" : fmt::format(" in process {}", rank));
  }
  using key = std::tuple<char, int32_t, int32_t>;
  std::map<std::pair<int32_t, int32_t>, std::vector<key>> sent, received;
  for (size_t d = 0; d < p.devices.size(); ++d)
    for (const auto& in : p.devices[d]) {
      const int32_t me = static_cast<int32_t>(d);
      if (in.peer < 0 || in.peer >= static_cast<int32_t>(devices.size())) continue;  // reported by the caller
      const bool is_send = in.kind == op::send_act || in.kind == op::send_grad;
      if (!is_send && in.kind != op::recv_act && in.kind != op::recv_grad) continue;
      const auto msg = message_of(p, in);
      if (is_send) sent[{me, in.peer}].emplace_back(msg.kind, msg.boundary, in.micro);
      else received[{in.peer, me}].emplace_back(msg.kind, msg.boundary, in.micro);
    }
  auto describe = [](const key& k) {
    return fmt::format("the {} at layer {} of micro-batch {}", std::get<0>(k) == 'A' ? "activation" : "gradient", std::get<1>(k),
                       std::get<2>(k));
  };
  for (const auto& [link, keys] : sent) {
    const auto& got = received[link];
    for (size_t i = 0; i < keys.size(); ++i)
      if (i >= got.size() || got[i] != keys[i])
        return make_error("parallel.transport: nccl: {} -> {}: send {} is {}, but the receiver's receive {} expects {}",
                          devices[link.first].name, devices[link.second].name, i + 1, describe(keys[i]), i + 1,
                          i < got.size() ? describe(got[i]) : std::string("nothing"));
  }
  return ok_status();
}
}  // namespace

const char* transport_name(transport_kind k) {
  switch (k) {
    case transport_kind::host_staged:
      return "host-staged";
    case transport_kind::peer:
      return "peer";
    case transport_kind::nccl:
      return "nccl";
  }
  return "?";
}

std::vector<int> rank_of_positions(int64_t devices, int world) {
  std::vector<int> out;
  for (int64_t d = 0; d < devices; ++d) out.push_back(static_cast<int>(d * world / devices));
  return out;
}

result<std::vector<link_transport>> choose_transports(const program& p, const std::vector<device_facts>& devices,
                                                      const std::string& preference,
                                                      const std::function<bool(int, int)>& peer_access, bool nccl,
                                                      const std::vector<int>& rank_of) {
  if (preference != "auto" && preference != "host" && preference != "peer" && preference != "nccl")
    return make_error("parallel.transport: '{}' must be auto, host, peer or nccl", preference);
  if (devices.size() != p.devices.size())
    return make_error("transports: program for {} devices, {} given", p.devices.size(), devices.size());
  if (preference == "nccl") LP_TRY(check_nccl(p, devices, nccl, rank_of));
  std::set<std::pair<int32_t, int32_t>> links;
  for (size_t d = 0; d < p.devices.size(); ++d)
    for (const auto& in : p.devices[d])
      if ((in.kind == op::send_act || in.kind == op::send_grad) && in.peer >= 0 && in.peer != static_cast<int32_t>(d))
        links.insert({static_cast<int32_t>(d), in.peer});
  std::vector<link_transport> out;
  for (const auto& [a, b] : links) {
    if (b < 0 || b >= static_cast<int32_t>(devices.size())) return make_error("transports: SEND to device {} of {}", b, devices.size());
    const auto& fa = devices[a];
    const auto& fb = devices[b];
    link_transport l{a, b, transport_kind::host_staged, ""};
    const bool gpus = fa.gpu >= 0 && fb.gpu >= 0;
    const bool cpus = fa.gpu < 0 && fb.gpu < 0;
    if (!gpus && !cpus) return make_error("transports: {} -> {} mixes a CPU virtual device with a GPU", fa.name, fb.name);
    const bool across = !rank_of.empty() && rank_of.at(static_cast<size_t>(a)) != rank_of.at(static_cast<size_t>(b));
    if (preference == "host") {
      l.reason = "parallel.transport = host";
    } else if (across && preference != "nccl") {
      if (preference == "peer")
        return make_error("parallel.transport: peer: {} -> {} crosses processes {} -> {} (host or nccl can)", fa.name, fb.name,
                          rank_of[static_cast<size_t>(a)], rank_of[static_cast<size_t>(b)]);
      l.reason = fmt::format("another process (rank {} -> {}): through host memory and Gloo", rank_of[static_cast<size_t>(a)],
                             rank_of[static_cast<size_t>(b)]);
    } else if (preference == "nccl") {
      l.kind = transport_kind::nccl;
      l.reason = "parallel.transport = nccl";
    } else if (cpus) {
      if (preference == "peer") {
        l.kind = transport_kind::peer;
        l.reason = "CPU virtual devices: one direct copy, no host bounce";
      } else {
        l.reason = "CPU virtual devices model PCIe without P2P; parallel.transport = peer models a direct link";
      }
    } else if (fa.gpu == fb.gpu) {
      l.kind = transport_kind::peer;
      l.reason = fmt::format("same GPU {}: device-to-device copy", fa.gpu);
    } else if (peer_access && peer_access(fa.gpu, fb.gpu)) {
      l.kind = transport_kind::peer;
      l.reason = fmt::format("P2P access from GPU {} to GPU {}", fb.gpu, fa.gpu);
    } else if (preference == "peer") {
      return make_error("parallel.transport: peer: GPU {} cannot access GPU {} directly ({} -> {}); use auto or host", fb.gpu, fa.gpu,
                        fa.name, fb.name);
    } else {
      l.reason = fmt::format("no P2P access between GPU {} and GPU {} (usual without NVLink on GeForce cards)", fa.gpu, fb.gpu);
    }
    out.push_back(std::move(l));
  }
  return out;
}

std::string describe_transports(const std::vector<link_transport>& links, const std::vector<device_facts>& devices) {
  if (links.empty()) return "no links";
  std::string s;
  for (const auto& l : links) {
    if (!s.empty()) s += "; ";
    s += fmt::format("{} -> {} {} ({})", devices[l.from].name, devices[l.to].name, transport_name(l.kind), l.reason);
  }
  return s;
}

std::vector<std::pair<int32_t, int32_t>> nccl_links(const std::vector<link_transport>& links) {
  std::vector<std::pair<int32_t, int32_t>> out;
  for (const auto& l : links)
    if (l.kind == transport_kind::nccl) out.emplace_back(l.from, l.to);
  return out;
}

std::vector<std::pair<int32_t, int32_t>> peer_links(const std::vector<link_transport>& links) {
  std::vector<std::pair<int32_t, int32_t>> out;
  for (const auto& l : links)
    if (l.kind == transport_kind::peer) out.emplace_back(l.from, l.to);
  return out;
}

}  // namespace lorapipe
