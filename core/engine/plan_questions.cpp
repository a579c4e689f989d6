// What-if, largest fit and writing the plan's choices: see plan_questions.h.
#include "core/engine/plan_questions.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/base/device_spec.h"
#include "core/base/file_io.h"
#include "core/engine/compute_profile.h"
#include "core/pipeline/cost_model.h"
#include "core/pipeline/partition_search.h"

namespace lorapipe {

namespace {

std::string mib(double bytes) { return fmt::format("{:.1f} MiB", bytes / 1048576.0); }

// "+1" / "-2" as a signed count; nullopt for anything else.
std::optional<int> device_delta(const std::string& v) {
  if (v.size() < 2 || (v[0] != '+' && v[0] != '-')) return std::nullopt;
  int n = 0;
  const auto [end, ec] = std::from_chars(v.data() + 1, v.data() + v.size(), n);
  if (ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
  return v[0] == '+' ? n : -n;
}

// parallel.devices with `delta` devices added (CPU: one more virtual device; CUDA: the next ordinal
// after the largest) or removed from the end.
result<std::string> shift_devices(const std::string& spec, int delta) {
  LP_TRY_ASSIGN(ds, parse_device_spec(spec));
  const int n = ds.count() + delta;
  if (n < 1) return make_error("devices: {} leaves no device of {}", delta, spec);
  if (ds.gpus.empty()) return n == 1 ? std::string("cpu") : fmt::format("cpu:{}", n);
  std::vector<int> g = ds.gpus;
  while (static_cast<int>(g.size()) > n) g.pop_back();
  while (static_cast<int>(g.size()) < n) g.push_back(*std::max_element(g.begin(), g.end()) + 1);
  return fmt::format("cuda:{}", fmt::join(g, ","));
}

// After a change of device count: settings per device of the old set no longer apply.
void refit_per_device(project_config& c, const project_config& before, const std::set<std::string>& given,
                      std::vector<what_if_change>& changes) {
  const int64_t n = device_count(c.parallel.devices);
  const bool stages_changed = n != device_count(before.parallel.devices) || c.parallel.schedule != before.parallel.schedule ||
                              c.parallel.virtual_stages != before.parallel.virtual_stages;
  if (stages_changed && !given.count("parallel.partition") && c.parallel.partition != "auto" && c.parallel.partition != "even") {
    changes.push_back({"parallel.partition", c.parallel.partition, "auto"});
    c.parallel.partition = "auto";
  }
  // Backward stages end where the forward tail begins; only round-robin has them.
  const bool tail_moved = c.parallel.partition != before.parallel.partition || c.parallel.schedule != "round-robin";
  if (tail_moved && !given.count("parallel.backward_partition") && c.parallel.backward_partition != "auto" &&
      c.parallel.backward_partition != "per-layer") {
    changes.push_back({"parallel.backward_partition", c.parallel.backward_partition, "auto"});
    c.parallel.backward_partition = "auto";
  }
  if (n != device_count(before.parallel.devices) && !given.count("parallel.device_speeds") && !c.parallel.device_speeds.empty()) {
    std::vector<std::string> s;
    std::stringstream ss(c.parallel.device_speeds);
    for (std::string x; std::getline(ss, x, ',');) s.push_back(x);
    s.resize(static_cast<size_t>(n), "1");
    const std::string after = fmt::format("{}", fmt::join(s, ","));
    changes.push_back({"parallel.device_speeds", c.parallel.device_speeds, after});
    c.parallel.device_speeds = after;
  }
  const bool to_gpus = c.parallel.devices.rfind("cuda", 0) == 0;
  if ((n != device_count(before.parallel.devices) || to_gpus) && !given.count("offload.copy_links") && !c.offload.copy_links.empty()) {
    // Cut, or an added device gets a link of its own (the lowest unused numbers); GPUs have no
    // modelled links.
    const auto given_links = copy_links(before);
    std::vector<int> links = given_links ? *given_links : std::vector<int>{};
    links.resize(std::min(links.size(), static_cast<size_t>(std::max<int64_t>(0, n))));
    for (int k = 0; static_cast<int64_t>(links.size()) < n && k < 64; ++k)
      if (std::find(links.begin(), links.end(), k) == links.end()) links.push_back(k);
    const std::string after = to_gpus ? "" : fmt::format("{}", fmt::join(links, ","));
    changes.push_back({"offload.copy_links", c.offload.copy_links, after});
    c.offload.copy_links = after;
  }
}

}  // namespace

plan_summary summarize_plan(const project_config& cfg, const plan_report& rep) {
  plan_summary s;
  s.schedule = rep.schedule;
  s.micro_batches = rep.prog.micro_batches;
  s.partition = partition_text(rep.partition.sizes);
  if (!rep.partition.backward_sizes.empty()) s.partition += " / backward " + partition_text(rep.partition.backward_sizes);
  s.devices = cfg.parallel.devices;
  s.step_s = rep.sim.makespan_s;
  s.tokens_per_s = s.step_s > 0 ? static_cast<double>(cfg.run.batch_size * cfg.data.seq_len) / s.step_s : 0;
  s.bubble_ratio = rep.sim.bubble_ratio;
  for (const auto& d : rep.memory.devices) s.peak_bytes.push_back(d.peak_bytes);
  s.host_bytes = rep.memory.host_bytes;
  s.refusal = rep.memory_refusal;
  return s;
}

std::string tokens_per_s_text(double t) { return t >= 100 ? fmt::format("{:.0f}", t) : fmt::format("{:.3g}", t); }

result<what_if_variant> apply_what_if(const project_config& cfg, const std::string& question) {
  what_if_variant v{cfg, {}};
  std::stringstream ss(question);
  std::set<std::string> given;
  for (std::string item; ss >> item;) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      return make_error("what-if '{}': expected field=value (e.g. seq_len=2048, devices=cpu:3, devices=+1, p2p=off)", item);
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    std::string field, text = value;
    if (key == "p2p") {
      if (value != "on" && value != "off") return make_error("p2p: '{}' must be on or off", value);
      field = "parallel.transport";
      text = value == "off" ? "host" : "peer";
    } else if (key == "devices" || key == "parallel.devices") {
      field = "parallel.devices";
      if (auto delta = device_delta(value)) {
        LP_TRY_ASSIGN(shifted, shift_devices(v.cfg.parallel.devices, *delta));
        text = shifted;
      }
    } else {
      field = key;
    }
    const project_config prior = v.cfg;
    LP_TRY_ASSIGN(path, set_project_field(v.cfg, field, text));
    given.insert(path);
    v.changes.push_back({path, project_field_text(prior, path), project_field_text(v.cfg, path)});
  }
  if (v.changes.empty()) return make_error("what-if: no setting given (e.g. seq_len=2048)");
  if (v.cfg.parallel.schedule == "auto")
    for (const auto& c : v.changes)
      if (c.field == "parallel.micro_batches")
        v.notes.push_back("parallel.schedule is auto: the planner chooses the micro-batch count (add schedule=NAME to hold it)");
  refit_per_device(v.cfg, cfg, given, v.changes);
  // A setting offload.auto would choose, asked about: held as asked (offload.auto off).
  for (const char* f : {"offload.stream_weights", "offload.activations", "offload.recompute", "offload.recompute_granularity"})
    if (given.count(f) && v.cfg.offload.automatic && !given.count("offload.auto")) {
      v.changes.push_back({"offload.auto", "true", "false"});
      v.cfg.offload.automatic = false;
    }
  LP_TRY(validate_project(v.cfg));
  return v;
}

what_if_answer what_if(const project_config& cfg, const plan_summary& base, const std::string& question, double gflops,
                       const device_inventory* probe, std::shared_ptr<const measured_compute> profile) {
  what_if_answer a;
  a.question = question;
  a.before = base;
  auto v = apply_what_if(cfg, question);
  if (!v) {
    a.error = v.message();
    return a;
  }
  a.changes = v->changes;
  a.notes = v->notes;
  const bool same_devices = v->cfg.parallel.devices == cfg.parallel.devices;
  // The plan's profile stands for the variant when it has the same key (model, dtype, LoRA, device);
  // otherwise the variant is planned as itself (its own cached profile, or FLOPs).
  bool same_key = false;
  if (profile) {
    auto mc = project_model_config(cfg);
    auto vmc = project_model_config(v->cfg);
    auto k = mc ? layer_profile_key(cfg, *mc) : result<std::string>(mc.err());
    auto vk = vmc ? layer_profile_key(v->cfg, *vmc) : result<std::string>(vmc.err());
    same_key = k && vk && *k == *vk;
  }
  // Other GPUs are not in the probe: their copies are costed at the rate the plan's were, not as free.
  project_config variant = v->cfg;
  if (!same_devices && variant.offload.copy_gbps <= 0 && variant.parallel.devices.rfind("cuda:", 0) == 0)
    variant.offload.copy_gbps = with_planning_copy_rates(cfg, probe).offload.copy_gbps;
  auto rep = make_plan(variant, gflops, same_devices ? probe : nullptr, same_key ? std::move(profile) : nullptr);
  if (!rep) {
    a.error = rep.message();
    return a;
  }
  a.after = summarize_plan(variant, *rep);
  return a;
}

std::string what_if_text(const what_if_answer& a) {
  std::string out = fmt::format("what if {}:\n", a.question);
  for (const auto& c : a.changes) out += fmt::format("  {}: {} -> {}\n", c.field, c.before.empty() ? "\"\"" : c.before, c.after);
  for (const auto& n : a.notes) out += "  note: " + n + "\n";
  if (!a.error.empty()) return out + "  cannot be planned: " + a.error + "\n";
  const auto& b = a.before;
  const auto& f = a.after;
  const auto pct = [](double x, double y) { return x > 0 ? fmt::format("{:+.1f}%", 100 * (y / x - 1)) : std::string("n/a"); };
  out += fmt::format("  plan: {} x{} on {} ({}) -> {} x{} on {} ({})\n", b.schedule, b.micro_batches, b.devices,
                     b.partition.empty() ? "one stage" : "layers " + b.partition, f.schedule, f.micro_batches, f.devices,
                     f.partition.empty() ? "one stage" : "layers " + f.partition);
  out += fmt::format("  step {:.4f} s -> {:.4f} s ({}), {} -> {} tokens/s ({}), bubble {:.3f} -> {:.3f}\n", b.step_s,
                     f.step_s, pct(b.step_s, f.step_s), tokens_per_s_text(b.tokens_per_s), tokens_per_s_text(f.tokens_per_s),
                     pct(b.tokens_per_s, f.tokens_per_s),
                     b.bubble_ratio, f.bubble_ratio);
  const auto peaks = [](const plan_summary& s) {
    std::vector<std::string> p;
    for (double x : s.peak_bytes) p.push_back(fmt::format("{:.1f}", x / 1048576.0));
    return fmt::format("{} MiB", fmt::join(p, " / "));
  };
  out += fmt::format("  peak per device {} -> {}; host {} -> {}\n", peaks(b), peaks(f), mib(b.host_bytes), mib(f.host_bytes));
  if (b.refusal.empty() != f.refusal.empty() || !f.refusal.empty())
    out += fmt::format("  {} -> {}\n", b.refusal.empty() ? "fits" : "does not fit", f.refusal.empty() ? "fits" : "does not fit: " + f.refusal);
  return out;
}

std::vector<what_if_answer> faster_offload_settings(const project_config& cfg, const plan_summary& base, double gflops,
                                                    const device_inventory* probe, std::shared_ptr<const measured_compute> profile) {
  std::vector<what_if_answer> out;
  if (base.schedule == "single" || !base.refusal.empty()) return out;
  const auto flip = [](bool b) { return b ? "off" : "on"; };
  std::vector<std::string> questions{fmt::format("offload.stream_weights={}", flip(cfg.offload.stream_weights)),
                                     fmt::format("offload.recompute={}", flip(cfg.offload.recompute))};
  if (cfg.offload.recompute) {
    questions.push_back(fmt::format("offload.activations={}", flip(cfg.offload.activations)));
    questions.push_back(fmt::format("offload.recompute_granularity={}", cfg.offload.recompute_granularity == "layer" ? "stage" : "layer"));
  }
  for (const auto& q : questions) {
    auto a = what_if(cfg, base, q, gflops, probe, profile);
    if (a.error.empty() && a.after.refusal.empty() && a.after.step_s < base.step_s * 0.99) out.push_back(std::move(a));
  }
  std::sort(out.begin(), out.end(), [](const what_if_answer& x, const what_if_answer& y) { return x.after.step_s < y.after.step_s; });
  return out;
}

device_order_answer plan_device_order(const project_config& cfg, const plan_report& given, double gflops, const device_inventory& probe) {
  device_order_answer a;
  a.order = cross_mapping(probe, cfg);
  if (a.order.setting.empty()) return a;
  const std::string candidate = a.order.setting;
  const auto keep = [&](const std::string& why) {
    a.order.setting.clear();
    a.order.why = fmt::format("{} would be the cross-mapped order, but {}", candidate, why);
    return a;
  };
  const project_config moved_cfg = with_device_order(cfg, a.order.order);
  const device_inventory moved_inv = with_device_order(probe, a.order.order);
  auto mapped = make_plan(moved_cfg, gflops, &moved_inv, given.measured);
  if (!mapped) return keep("it could not be planned: " + mapped.message());
  a.given_step_s = given.sim.makespan_s;
  a.mapped_step_s = mapped->sim.makespan_s;
  if (!mapped->memory_refusal.empty()) return keep("it does not fit: " + mapped->memory_refusal);
  if (a.mapped_step_s > 0.99 * a.given_step_s)
    return keep(fmt::format("the simulator predicts no gain from it ({:.4f} s a step against {:.4f} s as given)", a.mapped_step_s, a.given_step_s));
  a.order.why += fmt::format("; predicted step {:.4f} s against {:.4f} s as given ({:+.1f}%)", a.mapped_step_s, a.given_step_s,
                             100 * (a.mapped_step_s / a.given_step_s - 1));
  a.mapped_cfg = moved_cfg;
  a.mapped_plan = std::move(*mapped);
  return a;
}

std::vector<size_t> project_capacity(const project_config& cfg, const device_inventory* probe) {
  const int64_t n = std::max<int64_t>(1, device_count(cfg.parallel.devices));
  std::vector<size_t> cap(static_cast<size_t>(n), 0);
  const bool probed = probe != nullptr && probe->devices.size() == cap.size();
  const auto limit = static_cast<size_t>(std::max(0.0, cfg.offload.device_memory_mb) * 1048576.0);
  for (size_t d = 0; d < cap.size(); ++d) {
    // A CPU virtual device without offload.device_memory_mb has no bound (its probed "capacity" is
    // a stand-in): only a GPU's measured memory bounds a device.
    const size_t measured = probed && probe->devices[d].gpu >= 0 ? probe->devices[d].capacity_bytes : 0;
    cap[d] = measured > 0 && limit > 0 ? std::min(measured, limit) : std::max(measured, limit);  // the tighter of the two
  }
  return cap;
}

size_t smallest_capacity(const std::vector<size_t>& capacity) {
  size_t low = 0;
  for (size_t c : capacity)
    if (c > 0) low = low == 0 ? c : std::min(low, c);
  return low;
}

result<fit_limits> largest_fit(const project_config& cfg_in, const std::vector<size_t>& capacity) {
  fit_limits f;
  // The choices fit the capacities given (no GPU is read here: the GUI asks too).
  project_config bounded = cfg_in;
  if (bounded.offload.device_memory_mb <= 0) bounded.offload.device_memory_mb = static_cast<double>(smallest_capacity(capacity)) / 1048576.0;
  LP_TRY_ASSIGN(cfg, resolve_project_schedule(bounded, nullptr));
  cfg.offload.device_memory_mb = cfg_in.offload.device_memory_mb;
  f.rows_per_micro_batch = cfg.parallel.schedule == "single" ? cfg.run.batch_size : cfg.run.batch_size / cfg.parallel.micro_batches;
  if (cfg.parallel.schedule == "single") {
    f.note = "one device without a pipeline: its memory is not planned";
    return f;
  }
  f.bounded = std::any_of(capacity.begin(), capacity.end(), [](size_t c) { return c > 0; });
  if (!f.bounded) {
    f.note = "no device has a capacity (set offload.device_memory_mb, or plan --probe for CUDA devices)";
    return f;
  }
  LP_TRY_ASSIGN(mc, project_model_config(cfg));
  LP_TRY_ASSIGN(sizes, partition_sizes(cfg));
  LP_TRY_ASSIGN(backward, backward_partition_sizes(cfg));
  LP_TRY_ASSIGN(prog, partitioned_program(cfg, mc, sizes, backward));
  std::vector<size_t> cap = capacity;
  for (auto& c : cap)
    if (c == 0) c = std::numeric_limits<size_t>::max();
  std::vector<std::string> names(cap.size());
  const auto fits = [&](int64_t seq_len, int64_t rows) {
    project_config c = cfg;
    c.data.seq_len = seq_len;
    c.run.batch_size = rows * prog.micro_batches;
    const memory_plan plan = project_memory_plan(prog, mc, c, auto_schedule_gflops);
    return check_memory_plan(plan, cap, names).ok();
  };
  // The largest x in [1, hi] with ok(x), the plans growing with x; 0 when ok(1) fails. Doubling
  // from `from` (the project's value), then bisecting: few memory plans when the answer is near.
  const auto largest = [](int64_t from, int64_t hi, const auto& ok) {
    if (!ok(1)) return int64_t{0};
    int64_t lo = 1;
    from = std::clamp<int64_t>(from, 1, hi);
    if (ok(from)) {
      lo = from;
      while (lo < hi) {
        const int64_t next = std::min(hi, lo * 2);
        if (!ok(next)) {
          hi = next - 1;
          break;
        }
        lo = next;
      }
    } else {
      hi = from - 1;
    }
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (ok(mid)) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  };
  const int64_t context = mc.context_length();
  const int64_t seq_cap = context > 0 ? std::min<int64_t>(context, int64_t{1} << 22) : int64_t{1} << 22;
  const int64_t rows = f.rows_per_micro_batch;
  f.max_seq_len = largest(cfg.data.seq_len, seq_cap, [&](int64_t s) { return fits(s, rows); });
  f.seq_len_at_model_limit = f.max_seq_len == seq_cap && context > 0 && context <= seq_cap;
  f.max_rows_per_micro_batch = largest(rows, int64_t{1} << 16, [&](int64_t r) { return fits(cfg.data.seq_len, r); });
  if (f.max_seq_len == 0) f.note = "not even one token per sequence fits: the weights and LoRA state alone exceed a device";
  return f;
}

std::string fit_limits_text(const fit_limits& f, const project_config& cfg) {
  if (!f.bounded || f.max_seq_len == 0) return "largest fit: " + f.note + "\n";
  return fmt::format("largest fit with this schedule and partition: data.seq_len up to {}{} (at {} sequences per micro-batch); "
                     "up to {} sequences per micro-batch at data.seq_len {} (now {})\n",
                     f.max_seq_len, f.seq_len_at_model_limit ? " (the model's context length)" : "", f.rows_per_micro_batch,
                     f.max_rows_per_micro_batch, cfg.data.seq_len, f.rows_per_micro_batch);
}

project_config with_plan_choices(const project_config& cfg, const plan_report& rep) {
  project_config c = cfg;
  if (rep.offload_auto.weighed) {  // offload.auto's choice, held
    c.offload.automatic = false;
    c.offload.stream_weights = rep.stream_weights;
    c.offload.activations = rep.activations;
    c.offload.recompute = rep.recompute;
    c.offload.recompute_granularity = rep.recompute_granularity;
  }
  // On one device "auto" stays: it trains single there and still plans a pipeline when devices are added.
  if (rep.schedule != "single" || c.parallel.schedule != "auto") c.parallel.schedule = rep.schedule;
  if (rep.schedule != "single") {
    c.parallel.micro_batches = rep.prog.micro_batches;
    const std::string backward = backward_partition_text(rep.partition);
    const bool backward_counts = !rep.partition.backward_sizes.empty();  // which need the forward counts
    c.parallel.partition = rep.partition.how == "even" && !backward_counts ? std::string("even") : partition_text(rep.partition.sizes);
    if (!backward.empty()) c.parallel.backward_partition = backward;
    else if (auto counts = backward_partition_sizes(c); !counts || !counts->empty()) c.parallel.backward_partition = "auto";
  }
  return c;
}

status write_plan_choices(const std::filesystem::path& project_file, const project_config& planned, const plan_report& rep) {
  LP_TRY_ASSIGN(text, read_text_file(project_file));
  auto j = nlohmann::ordered_json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return make_error("{}: not a JSON object; nothing written", project_file.string());
  const project_config chosen = with_plan_choices(planned, rep);
  auto& par = j["parallel"];
  if (!par.is_object()) par = nlohmann::ordered_json::object();
  par["devices"] = chosen.parallel.devices;
  if (!chosen.parallel.device_speeds.empty()) par["device_speeds"] = chosen.parallel.device_speeds;
  par["schedule"] = chosen.parallel.schedule;
  if (rep.schedule == "single" && chosen.parallel.schedule == "auto") {
    // One device under auto: what an earlier pipeline plan wrote goes back to auto, so adding
    // devices plans them afresh (layer counts of another device count would not validate).
    for (const char* k : {"partition", "backward_partition"})
      if (par.contains(k)) par[k] = "auto";
  }
  if (rep.schedule != "single") {
    par["micro_batches"] = chosen.parallel.micro_batches;
    par["partition"] = chosen.parallel.partition;
    if (chosen.parallel.schedule == "round-robin" || par.contains("backward_partition"))
      par["backward_partition"] = chosen.parallel.backward_partition;
  }
  // (after the last use of `par`: a new top-level key may move it)
  if (!chosen.offload.copy_links.empty()) j["offload"]["copy_links"] = chosen.offload.copy_links;
  if (rep.offload_auto.weighed) {  // offload.auto's choice, kept as settings
    auto& off = j["offload"];
    off["stream_weights"] = chosen.offload.stream_weights;
    off["activations"] = chosen.offload.activations;
    off["recompute"] = chosen.offload.recompute;
    off["recompute_granularity"] = chosen.offload.recompute_granularity;
    off["auto"] = false;
  }
  const std::string out = j.dump(2) + "\n";
  // What is written must read back as a valid project (same folder, same relative paths).
  LP_TRY_ASSIGN(back, parse_project(out, project_file));
  LP_TRY(validate_project(back));
  return write_file_atomic(project_file, out);
}

}  // namespace lorapipe
