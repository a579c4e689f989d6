// lorapipe_dist_pipeline_peer: a rank other than 0 of tests/dist/test_dist_pipeline.cpp.
// Usage: lorapipe_dist_pipeline_peer DATA SCHEDULE DEVICES STEPS RANK WORLD PORT TIMEOUT_MS OUT [DIE_BEFORE_STEP|fail:STEP]
// Trains its share of the pipeline (pipeline_case.h) and writes the losses and the LoRA parameters
// of the layers it trained to OUT (torch::save). Exit 0 done, 2 join refused, 4 the run failed.
#include <cstdio>

#include "tests/dist/pipeline_case.h"
#include <torch/serialize.h>

using namespace lorapipe;

int main(int argc, char** argv) {
  if (argc != 10 && argc != 11) {
    std::fprintf(stderr, "usage: lorapipe_dist_pipeline_peer DATA SCHEDULE DEVICES STEPS RANK WORLD PORT TIMEOUT_MS OUT [DIE]\n");
    return 1;
  }
  at::set_num_threads(1);
  rendezvous_options o;
  o.rank = std::stoi(argv[5]);
  o.world = std::stoi(argv[6]);
  o.port = static_cast<uint16_t>(std::stoi(argv[7]));
  o.timeout = std::chrono::milliseconds(std::stoi(argv[8]));
  o.config_hash = std::string(argv[2]) + "/" + argv[3];
  auto g = process_group::join(o);
  if (!g.ok()) {
    std::fprintf(stderr, "peer: %s\n", g.message().c_str());
    return 2;
  }
  const std::string die = argc == 11 ? argv[10] : "-1";
  const bool fail = die.rfind("fail:", 0) == 0;
  auto r = dist_case::run(argv[1], argv[2], std::stoi(argv[3]), std::stoi(argv[4]), g->get(), std::stoi(fail ? die.substr(5) : die), fail);
  if (!r.ok()) {
    (*g)->report_failure(r.message());  // as run_rank does: the others' errors quote it
    std::fprintf(stderr, "peer: %s\n", r.message().c_str());
    return 4;
  }
  std::vector<at::Tensor> out{torch::tensor(r->losses, torch::kDouble), torch::tensor(r->norms, torch::kDouble),
                              torch::tensor(std::vector<int64_t>(r->layers.begin(), r->layers.end()), torch::kLong)};
  for (auto& p : r->lora) out.push_back(p);
  torch::save(out, argv[9]);
  return 0;
}
