// The layer profiler: on the device that will train (the project's first pipeline device, at speed 1),
// a few warm-up rounds, then per decoder layer its forward with and without autograd and its
// backward, the embedding, and the head's loss forward and backward (final norm, LM head, loss), for
// micro-batches of the project's shape and of a second, smaller one (half the rows, else half the
// sequence; measured in the same rounds) in its compute dtype, with its LoRA targets adapted. Layers
// of the same kind have the same shapes, so one layer of each kind (full or sliding-window
// attention) is measured with random weights (nothing is read from disk) and stands for all of its
// kind. The planner charges these times instead of FLOPs (compute_rates in cost_model.h); the cache
// and the key live in core/engine/compute_profile.h.
#pragma once

#include <cstdint>
#include <string>

#include "core/base/result.h"
#include "core/pipeline/cost_model.h"
#include "core/project/llama_config.h"
#include "core/project/project.h"

namespace lorapipe {

struct layer_profile {
  measured_compute compute;
  std::string device;        // what ran it, e.g. "cpu (1 thread)" or "cuda:0"
  std::string dtype;         // model.dtype
  int warmup = 0, repeats = 0;
  double seconds = 0;        // the profile's own wall time
  // Per layer: frozen weight bytes; autograd graph bytes per token, measured (what LibTorch's
  // allocator keeps allocated after a layer's forward, less its output; the mean over the layers)
  // and as the memory plan models them (stash_bytes_per_layer).
  double weight_bytes_per_layer = 0, graph_bytes_per_token = 0, graph_bytes_per_token_model = 0;
};

struct profile_options {
  int warmup = 2;               // rounds not counted, at least
  double warmup_seconds = 1.0;  // ... and more until they took this long (the allocator and caches settle)
  int repeats = 5;           // rounds whose medians are kept, at least
  double min_seconds = 1.0;  // ... and more (up to max_repeats) until the kept rounds took this long
  int max_repeats = 200;
};

// Measures the project's layers for micro-batches of run.batch_size / parallel.micro_batches
// sequences of data.seq_len tokens (compute), and at the second shape (compute.second). CPU devices run with parallel.threads_per_device threads.
result<layer_profile> profile_layers(const project_config& cfg, const llama_config& mc, const profile_options& o);

}  // namespace lorapipe
