// The project's layer profile with its cache: see compute_profile.h.
#include "core/engine/compute_profile.h"

#include <cmath>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/base/device_spec.h"
#include "core/base/file_io.h"
#include "core/base/hash.h"
#include "core/engine/build_info.h"
#include "core/engine/device_inventory.h"
#include "offload/device_probe.h"

namespace lorapipe {

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(shape_times, rows, seq_len, layer_forward_s, layer_forward_nograd_s, layer_backward_s, embed_s,
                                   head_forward_s, head_backward_s)
void to_json(nlohmann::json& j, const measured_compute& m) {
  j = static_cast<const shape_times&>(m);
  j["second"] = m.second;
}
// `second` may be missing: a profile cached before it was measured still loads (charged in
// proportion to FLOPs).
void from_json(const nlohmann::json& j, measured_compute& m) {
  static_cast<shape_times&>(m) = j.get<shape_times>();
  m.second = j.contains("second") ? j.at("second").get<shape_times>() : shape_times{};
}
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(layer_profile, compute, device, dtype, warmup, repeats, seconds, weight_bytes_per_layer,
                                   graph_bytes_per_token, graph_bytes_per_token_model)

namespace {

constexpr int profile_format = 2;  // 2: the graph bytes measured

std::string host_processor() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 1);
  return "unknown processor";
}

// The profiled device as the key sees it: what stays the same from run to run.
result<nlohmann::json> profiled_device_facts(const project_config& cfg) {
  LP_TRY_ASSIGN(spec, parse_device_spec(cfg.parallel.devices));
  if (spec.gpus.empty())
    return nlohmann::json{{"kind", "cpu"}, {"threads", cfg.parallel.threads_per_device}, {"processor", host_processor()},
                          {"cores", std::thread::hardware_concurrency()}};
  probed_device d;
  LP_TRY(describe_gpu(spec.gpus[0], d));
  return nlohmann::json{{"kind", "cuda"}, {"gpu", d.gpu_name}, {"cc", fmt::format("{}.{}", d.cc_major, d.cc_minor)},
                        {"sms", d.sm_count}, {"total_bytes", d.total_bytes}};
}

// Sequences per micro-batch as the profiler measures them.
int64_t profiled_rows(const project_config& cfg) {
  const bool pipelined = cfg.parallel.schedule != "single" && device_count(cfg.parallel.devices) > 1;
  return std::max<int64_t>(1, cfg.run.batch_size / (pipelined ? std::max<int64_t>(1, cfg.parallel.micro_batches) : 1));
}

std::filesystem::path cache_dir_or_default(const std::filesystem::path& dir) { return dir.empty() ? default_probe_cache_dir() : dir; }

}  // namespace

result<std::string> layer_profile_key(const project_config& cfg, const llama_config& mc) {
  LP_TRY_ASSIGN(device, profiled_device_facts(cfg));
  const nlohmann::json j = {{"format", profile_format},
                            {"model", {{"type", mc.model_type}, {"layers", mc.num_layers}, {"hidden", mc.hidden_size},
                                       {"ffn", mc.intermediate_size}, {"heads", mc.num_heads}, {"kv_heads", mc.num_kv_heads},
                                       {"head_dim", mc.head_dim}, {"vocab", mc.vocab_size}, {"sliding_window", mc.sliding_window},
                                       {"sliding_layers", mc.sliding_layers}}},
                            {"dtype", cfg.model.dtype},
                            {"lora", {{"r", cfg.lora.r}, {"targets", fit_lora_targets(mc, cfg.lora.targets)}, {"dropout", cfg.lora.dropout}}},
                            {"libtorch", describe_build().libtorch},
                            {"device", device}};
  const std::string text = j.dump();
  return sha256_hex(text.data(), text.size());
}

std::string layer_profile_to_json(const layer_profile& p, const std::string& key) {
  nlohmann::json j = p;
  j["key"] = key;
  return j.dump(1) + "\n";
}

result<layer_profile> layer_profile_from_json(const std::string& text, const std::string& key) {
  try {
    const auto j = nlohmann::json::parse(text);
    if (j.value("key", std::string()) != key) return make_error("made for another model, shape or device");
    auto p = j.get<layer_profile>();
    if (p.compute.layer_forward_s.empty() || p.compute.layer_backward_s.size() != p.compute.layer_forward_s.size() ||
        p.compute.layer_forward_nograd_s.size() != p.compute.layer_forward_s.size())
      return make_error("incomplete profile");
    const auto& t = p.compute.second;  // a second shape that does not cover every layer is not used
    const size_t n = p.compute.layer_forward_s.size();
    if (t.rows <= 0 || t.seq_len <= 0 || t.layer_forward_s.size() != n || t.layer_forward_nograd_s.size() != n || t.layer_backward_s.size() != n)
      p.compute.second = {};
    return p;
  } catch (const std::exception& e) {
    return make_error("unreadable profile: {}", e.what());
  }
}

std::filesystem::path layer_profile_file(const std::filesystem::path& dir, const std::string& key, int64_t rows, int64_t seq_len) {
  return dir / fmt::format("layers-{}-{}x{}.json", key.substr(0, 16), rows, seq_len);
}

result<profile_outcome> profile_project(const project_config& cfg, const llama_config& mc, const profile_request& req) {
  profile_outcome out;
  LP_TRY_ASSIGN(key, layer_profile_key(cfg, mc));
  out.key = key;
  const auto dir = cache_dir_or_default(req.cache_dir);
  out.cache_file = layer_profile_file(dir, key, profiled_rows(cfg), cfg.data.seq_len);
  if (!req.refresh) {
    auto text = read_text_file(out.cache_file);
    auto cached = text ? layer_profile_from_json(*text, key) : result<layer_profile>(text.err());
    if (cached) {
      out.profile = std::move(*cached);
      out.from_cache = true;
      return out;
    }
    out.cache_note = cached.message();
  }
  LP_TRY_ASSIGN(measured, profile_layers(cfg, mc, req.options));
  out.profile = std::move(measured);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (auto st = write_file_atomic(out.cache_file, layer_profile_to_json(out.profile, key)); !st)
    out.cache_note = "not cached, so later plans and train will not use it: " + st.message();
  else out.cache_note.clear();
  return out;
}

std::shared_ptr<const measured_compute> cached_layer_profile(const project_config& cfg, const llama_config& mc,
                                                             const std::filesystem::path& cache_dir) {
  auto key = layer_profile_key(cfg, mc);
  if (!key) return nullptr;
  const auto dir = cache_dir_or_default(cache_dir);
  const double want = static_cast<double>(profiled_rows(cfg) * cfg.data.seq_len);
  // This shape's profile, else the one of this model, LoRA and device nearest in tokens per
  // micro-batch (scaled by FLOPs).
  std::shared_ptr<const measured_compute> best;
  double best_gap = 0;
  const auto consider = [&](const std::filesystem::path& file) {
    auto text = read_text_file(file);
    auto p = text ? layer_profile_from_json(*text, *key) : result<layer_profile>(text.err());
    if (!p || static_cast<int64_t>(p->compute.layer_forward_s.size()) != mc.num_layers) return;
    const double gap = std::abs(std::log(static_cast<double>(p->compute.rows * p->compute.seq_len) / want));
    if (!best || gap < best_gap) best = std::make_shared<const measured_compute>(p->compute), best_gap = gap;
  };
  consider(layer_profile_file(dir, *key, profiled_rows(cfg), cfg.data.seq_len));
  if (best) return best;
  std::error_code ec;
  const std::string prefix = "layers-" + key->substr(0, 16) + "-";
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) consider(e.path());
  return best;
}

compute_rates project_compute_rates(const project_config& cfg, const llama_config& mc, const std::filesystem::path& cache_dir) {
  auto p = cached_layer_profile(cfg, mc, cache_dir);
  return p ? compute_rates(std::move(p)) : compute_rates(auto_schedule_gflops);
}

std::string layer_profile_text(const layer_profile& p) {
  const auto& c = p.compute;
  const auto ms = [](double s) { return fmt::format("{:.3f}", s * 1e3); };
  // Layers of one kind have one measurement: print each distinct one once.
  std::string layers;
  for (size_t l = 0; l < c.layer_forward_s.size(); ++l) {
    if (l > 0 && c.layer_forward_s[l] == c.layer_forward_s[l - 1] && c.layer_backward_s[l] == c.layer_backward_s[l - 1]) continue;
    size_t e = l;
    while (e + 1 < c.layer_forward_s.size() && c.layer_forward_s[e + 1] == c.layer_forward_s[l] && c.layer_backward_s[e + 1] == c.layer_backward_s[l]) ++e;
    layers += fmt::format("  layers {}-{}: forward {} ms ({} ms without autograd), backward {} ms\n", l, e, ms(c.layer_forward_s[l]),
                          ms(c.layer_forward_nograd_s[l]), ms(c.layer_backward_s[l]));
  }
  std::string second;
  if (const auto& t = c.second; t.rows > 0 && !t.layer_forward_s.empty() && !t.layer_forward_nograd_s.empty() && !t.layer_backward_s.empty())
    second = fmt::format("  at {} x {} tokens (other shapes are charged along the line between the two): layer 0 forward {} ms ({} ms "
                         "without autograd), backward {} ms; head forward {} ms, backward {} ms\n",
                         t.rows, t.seq_len, ms(t.layer_forward_s[0]), ms(t.layer_forward_nograd_s[0]), ms(t.layer_backward_s[0]),
                         ms(t.head_forward_s), ms(t.head_backward_s));
  return fmt::format("layer profile on {} ({}, {} x {} tokens per micro-batch; medians of {} rounds after {} warm-up; took {:.2f} s):\n{}"
                     "  embedding {} ms; head (final norm, LM head, loss) forward {} ms, backward {} ms\n{}"
                     "  per layer: weights {:.2f} MiB, autograd graph {:.2f} KiB per token measured ({:.2f} KiB in the memory plan, {:+.1f}%)\n",
                     p.device, p.dtype, c.rows, c.seq_len, p.repeats, p.warmup, p.seconds, layers, ms(c.embed_s), ms(c.head_forward_s),
                     ms(c.head_backward_s), second, p.weight_bytes_per_layer / 1048576.0, p.graph_bytes_per_token / 1024.0,
                     p.graph_bytes_per_token_model / 1024.0,
                     p.graph_bytes_per_token > 0 ? 100 * (p.graph_bytes_per_token_model / p.graph_bytes_per_token - 1) : 0.0);
}

}  // namespace lorapipe
