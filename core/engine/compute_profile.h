// The project's layer profile (core/train/layer_profile.h), measured once and cached by what it
// depends on: a key of the model's shapes, the compute dtype, the LoRA rank, targets and dropout,
// the LibTorch version and the profiled device (its static facts without free memory or link
// state; CPU devices: threads per device and the host's processor), and the micro-batch shape
// (sequences x tokens) in the file name. When the cache has a profile for the project's key (its
// shape's, else the one nearest in tokens per micro-batch, scaled by FLOPs), the planner charges its
// times instead of FLOPs: `plan`, schedule and partition `auto`, and so the trainer (nothing is
// measured at launch). `plan --profile` measures it.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "core/base/result.h"
#include "core/pipeline/cost_model.h"
#include "core/project/llama_config.h"
#include "core/project/project.h"
#include "core/train/layer_profile.h"

namespace lorapipe {

// Hex sha256 of everything the profile depends on but the micro-batch shape.
result<std::string> layer_profile_key(const project_config& cfg, const llama_config& mc);

std::string layer_profile_to_json(const layer_profile& p, const std::string& key);
// The profile in a cache file, refused when it was made for another key.
result<layer_profile> layer_profile_from_json(const std::string& text, const std::string& key);
std::filesystem::path layer_profile_file(const std::filesystem::path& dir, const std::string& key, int64_t rows, int64_t seq_len);

struct profile_request {
  bool refresh = false;             // measure even when the cache has it
  std::filesystem::path cache_dir;  // empty: default_probe_cache_dir()
  profile_options options;
};
struct profile_outcome {
  layer_profile profile;
  std::string key;
  bool from_cache = false;
  std::filesystem::path cache_file;
  std::string cache_note;  // why the cache was not read or written (empty when it was)
};
// The cached profile of the project's shape, or a new measurement written to the cache.
result<profile_outcome> profile_project(const project_config& cfg, const llama_config& mc, const profile_request& req);

// The cached profile for the project's key: its shape's, else the nearest shape's; null when none
// (nothing is measured here).
std::shared_ptr<const measured_compute> cached_layer_profile(const project_config& cfg, const llama_config& mc,
                                                             const std::filesystem::path& cache_dir = {});
// What the planner charges for the project's compute: cached_layer_profile when there is one, else
// FLOPs at auto_schedule_gflops.
compute_rates project_compute_rates(const project_config& cfg, const llama_config& mc, const std::filesystem::path& cache_dir = {});

// Per layer forward (with / without autograd) and backward, embedding, head, in milliseconds.
std::string layer_profile_text(const layer_profile& p);

}  // namespace lorapipe
