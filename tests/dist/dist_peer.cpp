// lorapipe_dist_peer: the other ranks of tests/dist/test_process_group.cpp, as separate processes.
// Usage: lorapipe_dist_peer MODE RANK WORLD PORT HASH TIMEOUT_MS
//   exchange: receive a float tensor from rank 0, send back 2x+rank, then a bfloat16 one unchanged;
//             all-reduce (rank+1); receive rank 0's broadcast; send it back.
//   ring:     send a tensor filled with its rank to rank+1, receive rank-1's, check it; all-reduce.
//   hang:     join, then sleep (the test kills it, or lets rank 0's receive time out).
//   relay:    rank r receives from rank r+1 (tag 1) and passes it on to rank r-1, reporting a failure
//             as the trainer does; the last rank hangs (a chain whose end the test stops or leaves).
//   relay-leave: as relay, but the last rank leaves the group at once, sending nothing.
// Exit: 0 done, 2 join refused (message on stderr), 3 a check failed, 4 a call failed.
#include <fmt/format.h>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "offload/process_group.h"

using namespace lorapipe;

namespace {
int fail(int code, const std::string& msg) {
  std::fprintf(stderr, "peer: %s\n", msg.c_str());
  return code;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) return fail(1, "usage: lorapipe_dist_peer MODE RANK WORLD PORT HASH TIMEOUT_MS");
  const std::string mode = argv[1];
  rendezvous_options o;
  o.rank = std::stoi(argv[2]);
  o.world = std::stoi(argv[3]);
  o.port = static_cast<uint16_t>(std::stoi(argv[4]));
  o.config_hash = argv[5];
  o.timeout = std::chrono::milliseconds(std::stoi(argv[6]));
  auto pg = process_group::join(o);
  if (!pg.ok()) return fail(2, pg.message());
  auto& g = **pg;
  const int r = g.rank(), w = g.world();
  if (mode == "hang" || (mode == "relay" && r == w - 1)) {  // after saying what it did last (the others' errors name it)
    g.report_context(fmt::format("hanging as asked (rank {})", r));
    g.report_done(0, fmt::format("cpu:{} completed F s0 m1", r));
    std::this_thread::sleep_for(std::chrono::hours(1));
    return 0;
  }
  if (mode == "relay-leave" && r == w - 1) {  // closes its process group normally, sending nothing
    g.report_context(fmt::format("leaving as asked (rank {})", r));
    g.report_done(0, fmt::format("cpu:{} completed F s0 m1", r));
    return 0;
  }
  if (mode == "relay" || mode == "relay-leave") {
    auto x = torch::empty({16});  // f32 [16]
    auto st = g.recv(x, r + 1, 1);
    if (st.ok()) st = g.send(x, r - 1, 1);
    if (!st.ok()) g.report_failure(st.message());
    return st.ok() ? 0 : fail(4, st.message());
  }
  if (mode == "exchange") {
    auto x = torch::empty({4, 1024});  // f32 [4,1024]
    if (auto s = g.recv(x, 0, 1); !s.ok()) return fail(4, s.message());
    if (auto s = g.send(x * 2 + r, 0, 2); !s.ok()) return fail(4, s.message());
    auto h = torch::empty({3, 5}, torch::kBFloat16);  // bf16 [3,5]
    if (auto s = g.recv(h, 0, 3); !s.ok()) return fail(4, s.message());
    if (auto s = g.send(h, 0, 4); !s.ok()) return fail(4, s.message());
  } else if (mode == "ring") {
    auto mine = torch::full({1000}, static_cast<float>(r));  // f32 [1000]
    auto theirs = torch::empty({1000});
    const int next = (r + 1) % w, prev = (r + w - 1) % w;
    auto sent = g.isend(mine, next, 7);  // every rank sends first: a blocking send would deadlock the ring
    if (!sent.ok()) return fail(4, sent.message());
    if (auto s = g.recv(theirs, prev, 7); !s.ok()) return fail(4, s.message());
    if (auto s = sent->wait(); !s.ok()) return fail(4, s.message());
    if (!torch::equal(theirs, torch::full({1000}, static_cast<float>(prev)))) return fail(3, "ring: wrong values from rank " + std::to_string(prev));
  } else {
    return fail(1, "unknown mode " + mode);
  }
  auto sum = torch::full({2}, static_cast<float>(r + 1));  // f32 [2]
  if (auto s = g.all_reduce_sum(sum); !s.ok()) return fail(4, s.message());
  if (sum[0].item<float>() != static_cast<float>(w * (w + 1) / 2)) return fail(3, "all-reduce: wrong sum");
  auto b = torch::zeros({6}, torch::kInt64);  // i64 [6]
  if (auto s = g.broadcast(b, 0); !s.ok()) return fail(4, s.message());
  if (mode == "exchange")
    if (auto s = g.send(b, 0, 5); !s.ok()) return fail(4, s.message());
  if (auto s = g.barrier(); !s.ok()) return fail(4, s.message());
  return 0;
}
