// Transports between pipeline stages, chosen per link (a pair of devices a SEND goes across) before
// anything runs, with the reason, so the choice is explicit and logged:
//   host-staged: download into exact-size pinned host memory on the sender, upload on the receiver
//                (works everywhere; what GeForce cards without P2P get);
//   peer:        one device-to-device copy (cudaMemcpyPeerAsync with P2P access, a plain copy when
//                two pipeline devices share a GPU; on CPU virtual devices one copy-engine transfer);
//   nccl:        ncclSend/ncclRecv on the devices' copy streams (opt-in; CUDA devices on distinct
//                GPUs; NCCL matches sends and receives of a link in order, so the program must
//                send in the order the other side receives: checked here).
// Torch-free: the device facts come in as plain data.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/base/result.h"
#include "core/pipeline/schedule.h"
#include "offload/device_facts.h"

namespace lorapipe {

enum class transport_kind { host_staged, peer, nccl };
const char* transport_name(transport_kind k);

struct link_transport {
  int32_t from = 0, to = 0;
  transport_kind kind = transport_kind::host_staged;
  std::string reason;
};

// Several processes: device position d runs in rank d * world / devices (contiguous blocks).
std::vector<int> rank_of_positions(int64_t devices, int world);

// preference: "auto", "host", "peer" or "nccl" (parallel.transport). peer_access(a, b): GPU b can
// access GPU a's memory; nccl: the build has NCCL. Every link of the program gets one entry; a
// preference a link cannot have is an error naming the link. rank_of (several processes: the rank
// of each device position): NCCL needs distinct GPUs only within a process (two machines may both
// use their GPU 0).
result<std::vector<link_transport>> choose_transports(const program& p, const std::vector<device_facts>& devices,
                                                      const std::string& preference,
                                                      const std::function<bool(int, int)>& peer_access, bool nccl = false,
                                                      const std::vector<int>& rank_of = {});
// The (from, to) pairs whose link is nccl: the simulator's rendezvous links (sim_costs). The executor
// gives each of them its own two-rank communicator (one per direction), so a link's FIFO holds only
// its sender's sends and its receiver's receives.
std::vector<std::pair<int32_t, int32_t>> nccl_links(const std::vector<link_transport>& links);
// The (from, to) pairs that copy device to device (sim_costs::direct).
std::vector<std::pair<int32_t, int32_t>> peer_links(const std::vector<link_transport>& links);

// "0->1 peer (same GPU); 1->0 host-staged (...)" for the log.
std::string describe_transports(const std::vector<link_transport>& links, const std::vector<device_facts>& devices);

}  // namespace lorapipe
