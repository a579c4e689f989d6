// Project file parsing, validation and serialisation: see project.h.
#include "core/project/project.h"

#include "core/base/device_spec.h"
#include "core/base/hash.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <initializer_list>
#include <set>
#include <sstream>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "core/base/json_parse.h"

#include "core/project/llama_config.h"
#include "core/project/lora_target.h"
#include "core/base/safetensors.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path project_config::resolve(const std::string& p) const {
  if (p.empty()) return {};
  fs::path path(p);
  return path.is_absolute() || base_dir.empty() ? path : (base_dir / path).lexically_normal();
}

namespace {

const json* find_path(const json& root, const std::string& dotted) {
  const json* cur = &root;
  std::stringstream ss(dotted);
  std::string part;
  while (std::getline(ss, part, '.')) {
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(part);
    if (it == cur->end()) return nullptr;
    cur = &*it;
  }
  return cur;
}

template <class T>
std::string read_value(const json& v, T& out) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return "must be true or false";
    out = v.get<bool>();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    if (!v.is_number_integer()) return "must be an integer";
    out = v.get<int64_t>();
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) return "must be a number";
    out = v.get<double>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return "must be a string";
    out = v.get<std::string>();
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    if (!v.is_array()) return "must be a list of strings";
    std::vector<std::string> tmp;
    for (const auto& e : v) {
      if (!e.is_string()) return "must be a list of strings";
      tmp.push_back(e.get<std::string>());
    }
    out = tmp;
  }
  return {};
}

void collect_leaves(const json& j, const std::string& prefix, std::vector<std::string>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string p = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object()) collect_leaves(*it, p, out);
    else out.push_back(p);
  }
}

// Schema migrations, one step per version, applied to the JSON before it is read.
void migrate_1_to_2(json& j) {
  if (j.contains("parallel") && j["parallel"].is_object() && j["parallel"].contains("async_optimizer") &&
      (!j.contains("optimizer") || j["optimizer"].is_object())) {
    j["optimizer"]["asynchronous"] = j["parallel"]["async_optimizer"];
    j["parallel"].erase("async_optimizer");
  }
}

}  // namespace

result<project_config> parse_recorded_project(const std::string& text, const fs::path& project_file) {
  LP_TRY_ASSIGN(cfg, parse_project(text, project_file));
  const json j = parse_json_or_discarded(text);
  const json* par = j.is_object() ? find_path(j, "parallel") : nullptr;
  const bool has_par = par != nullptr && par->is_object();
  if (!(has_par && par->contains("partition"))) cfg.parallel.partition = "even";
  if (!(has_par && par->contains("backward_partition"))) cfg.parallel.backward_partition = "per-layer";
  return cfg;
}

result<project_config> parse_project(const std::string& text, const fs::path& project_file, int64_t* migrated_from) {
  const std::string label = project_file.string();
  json j = parse_json_or_discarded(text);
  if (j.is_discarded()) {
    // Re-parse with exceptions to get the position of the syntax error.
    try {
      auto reparsed = json::parse(text);
      (void)reparsed;
    } catch (const json::exception& e) {
      return make_error("{}: malformed JSON: {}", label, e.what());
    }
    return make_error("{}: malformed JSON", label);
  }
  if (!j.is_object()) return make_error("{}: the project must be a JSON object", label);
  project_config c;
  c.base_dir = project_file.parent_path();
  std::vector<std::string> problems;
  std::set<std::string> known;
  if (auto* v = find_path(j, "schema_version"); v != nullptr && v->is_number_integer()) {
    const int64_t version = v->get<int64_t>();
    if (version > project_schema_version)
      return make_error("{}: schema_version {} is newer than this build understands ({})", label, version, project_schema_version);
    if (version >= 1 && version < project_schema_version) {
      if (version < 2) migrate_1_to_2(j);
      j["schema_version"] = project_schema_version;
      if (migrated_from != nullptr) *migrated_from = version;
    }
  }
  visit_fields(c, [&](const char* path, auto& member, const char*) {
    known.insert(path);
    const json* v = find_path(j, path);
    if (v == nullptr || v->is_null()) return;
    auto err = read_value(*v, member);
    if (!err.empty()) problems.push_back(fmt::format("{}: {}", path, err));
  });
  std::vector<std::string> leaves;
  collect_leaves(j, "", leaves);
  for (const auto& l : leaves)
    if (!known.count(l))
      problems.push_back(l == "parallel.async_optimizer" ? fmt::format("{}: unknown field (schema_version 2 calls it optimizer.asynchronous)", l)
                                                         : fmt::format("{}: unknown field", l));
  if (!problems.empty()) return make_error("{}: {}", label, fmt::join(problems, fmt::format("\n{}: ", label)));
  return c;
}

result<project_config> load_project(const fs::path& project_file, int64_t* migrated_from) {
  LP_TRY_ASSIGN(text, read_text_file(project_file));
  return parse_project(text, project_file, migrated_from);
}

status validate_project(const project_config& c) {
  std::vector<std::string> p;
  auto need = [&](bool ok, const char* field, const std::string& msg) {
    if (!ok) p.push_back(fmt::format("{}: {}", field, msg));
  };
  std::error_code ec;
  need(c.schema_version >= 1 && c.schema_version <= project_schema_version, "schema_version",
       fmt::format("must be between 1 and {}", project_schema_version));
  need(!c.model.path.empty(), "model.path", "is required");
  if (!c.model.path.empty()) need(fs::exists(c.resolve(c.model.path), ec), "model.path", fmt::format("{} does not exist", c.resolve(c.model.path).string()));
  auto dtype_ok = c.model.dtype == "float32" || c.model.dtype == "bfloat16" || c.model.dtype == "float16";
  need(dtype_ok, "model.dtype", "must be float32, bfloat16 or float16");
  if (!c.tokenizer.path.empty())
    need(fs::exists(c.resolve(c.tokenizer.path), ec), "tokenizer.path", fmt::format("{} does not exist", c.resolve(c.tokenizer.path).string()));
  need(!c.data.train.empty(), "data.train", "is required");
  if (!c.data.train.empty()) need(fs::is_regular_file(c.resolve(c.data.train), ec), "data.train", fmt::format("{} is not a file", c.resolve(c.data.train).string()));
  auto one_of = [](const std::string& v, std::initializer_list<const char*> options) {
    for (const char* o : options)
      if (v == o) return true;
    return false;
  };
  auto choice = [&](const std::string& v, const char* field) {
    const auto& options = field_choices(field);
    need(std::find(options.begin(), options.end(), v) != options.end(), field, fmt::format("must be one of {}", fmt::join(options, ", ")));
  };
  choice(c.data.format, "data.format");
  choice(c.data.train_on, "data.train_on");
  choice(c.data.truncation, "data.truncation");
  choice(c.data.on_error, "data.on_error");
  if (!one_of(c.data.chat_template, {"auto", "builtin"}))
    need(fs::is_regular_file(c.resolve(c.data.chat_template), ec), "data.chat_template",
         fmt::format("must be auto, builtin or a template file ({} does not exist)", c.resolve(c.data.chat_template).string()));
  need(c.data.seq_len >= 2 && c.data.seq_len <= 1 << 20, "data.seq_len", "must be between 2 and 1048576");
  need(c.data.val_fraction >= 0 && c.data.val_fraction < 1, "data.val_fraction", "must be in [0, 1)");
  need(c.lora.r >= 1, "lora.r", "must be at least 1");
  if (!c.model.path.empty() && fs::is_regular_file(c.resolve(c.model.path) / "config.json", ec)) {
    auto mc = load_llama_config(c.resolve(c.model.path) / "config.json");
    if (!mc) p.push_back(fmt::format("model.path: {}", mc.message()));
    else {
      need(c.lora.r <= mc->hidden_size, "lora.r", fmt::format("must be <= hidden_size ({})", mc->hidden_size));
      need(c.data.seq_len <= mc->context_length(), "data.seq_len",
           fmt::format("must be <= the model's context length ({})", mc->max_position_embeddings));
      const auto have = model_targets(*mc);
      std::vector<std::string> names;
      for (auto h : have) names.push_back(lora_target_name(h));
      for (const auto& t : c.lora.targets)
        if (auto lt = lora_target_from_name(t); lt && std::find(have.begin(), have.end(), *lt) == have.end())
          need(false, "lora.targets",
               fmt::format("'{}' is not a module of model_type '{}' (its modules: {})", t, mc->model_type, fmt::join(names, ", ")));
    }
  }
  need(c.lora.alpha > 0, "lora.alpha", "must be positive");
  need(c.lora.dropout >= 0 && c.lora.dropout < 1, "lora.dropout", "must be in [0, 1)");
  need(!c.lora.targets.empty(), "lora.targets", "must name at least one projection");
  std::set<std::string> seen;
  for (const auto& t : c.lora.targets) {
    need(lora_target_from_name(t).has_value(), "lora.targets", fmt::format("unknown projection '{}'", t));
    need(seen.insert(t).second, "lora.targets", fmt::format("'{}' listed twice", t));
  }
  if (!c.lora.init_adapter.empty())
    need(fs::is_regular_file(c.resolve(c.lora.init_adapter) / "adapter_config.json", ec), "lora.init_adapter",
         fmt::format("{} has no adapter_config.json", c.resolve(c.lora.init_adapter).string()));
  need(c.optimizer.lr > 0, "optimizer.lr", "must be positive");
  need(c.optimizer.weight_decay >= 0, "optimizer.weight_decay", "must be non-negative");
  need(c.optimizer.beta1 >= 0 && c.optimizer.beta1 < 1, "optimizer.beta1", "must be in [0, 1)");
  need(c.optimizer.beta2 >= 0 && c.optimizer.beta2 < 1, "optimizer.beta2", "must be in [0, 1)");
  need(c.optimizer.eps > 0, "optimizer.eps", "must be positive");
  need(c.optimizer.warmup_steps >= 0, "optimizer.warmup_steps", "must be non-negative");
  need(c.optimizer.min_lr_ratio >= 0 && c.optimizer.min_lr_ratio <= 1, "optimizer.min_lr_ratio", "must be in [0, 1]");
  need(c.optimizer.grad_clip >= 0, "optimizer.grad_clip", "must be non-negative");
  const int64_t n_dev = device_count(c.parallel.devices);
  need(n_dev >= 1 && n_dev <= 64, "parallel.devices", "must be cpu, cpu:N (N in 1..64) or cuda:I,J,...");
  // "auto" is a pipeline on several devices (the planner picks which), single on one.
  const bool is_auto = c.parallel.schedule == "auto";
  const bool pipelined = is_auto ? n_dev > 1 : c.parallel.schedule != "single";
  need(is_auto || c.parallel.schedule == "single" || c.parallel.schedule == "gpipe" || c.parallel.schedule == "1f1b" ||
           c.parallel.schedule == "interleaved" || c.parallel.schedule == "round-robin",
       "parallel.schedule", "must be auto, single, gpipe, 1f1b, interleaved or round-robin");
  need(pipelined || n_dev <= 1, "parallel.schedule", "single runs on one device; pick a pipeline schedule (or auto) for several");
  need(c.parallel.micro_batches >= 1, "parallel.micro_batches", "must be at least 1");
  need(!pipelined || is_auto || (c.parallel.micro_batches >= 1 && c.run.batch_size % c.parallel.micro_batches == 0), "parallel.micro_batches",
       fmt::format("must divide run.batch_size ({})", c.run.batch_size));
  need(!pipelined || c.run.grad_accum == 1, "run.grad_accum", "must be 1 with a pipeline schedule (use parallel.micro_batches)");
  need(c.parallel.virtual_stages >= 1, "parallel.virtual_stages", "must be at least 1");
  need(c.parallel.threads_per_device >= 1 && c.parallel.threads_per_device <= 256, "parallel.threads_per_device", "must be in 1..256");
  need(c.parallel.transport == "auto" || c.parallel.transport == "host" || c.parallel.transport == "peer" ||
           c.parallel.transport == "nccl",
       "parallel.transport", "must be auto, host, peer or nccl");
  if (auto sizes = partition_sizes(c); !sizes) p.push_back(sizes.message());
  else need(sizes->empty() || pipelined, "parallel.partition", "layer counts need a pipeline schedule on several devices");
  if (auto sizes = backward_partition_sizes(c); !sizes) p.push_back(sizes.message());
  else if (!sizes->empty() && c.parallel.schedule != "round-robin")
    p.push_back("parallel.backward_partition: layer counts need parallel.schedule round-robin (only it has backward stages of "
                "their own; auto and per-layer apply to any schedule)");
  else if (auto fwd = partition_sizes(c); !sizes->empty() && fwd && fwd->empty())
    p.push_back("parallel.backward_partition: layer counts need parallel.partition as layer counts too (the backward stages end "
                "where the forward tail begins)");
  if (auto speeds = device_speeds(c); !speeds) p.push_back(speeds.message());
  if (auto links = copy_links(c); !links) p.push_back(links.message());
  need(!c.offload.automatic || c.parallel.devices.rfind("cuda", 0) != 0 || n_dev <= 1 || c.offload.device_memory_mb > 0, "offload.auto",
       "on GPUs needs offload.device_memory_mb (the memory each GPU may use): the bound its choice must fit");
  // (On GPUs offload.copy_links is what the planner costs as shared links, recorded by a run from a
  // probe or the PCIe estimate; it never changes how a GPU copies.)
  need(c.offload.recompute_granularity == "stage" || c.offload.recompute_granularity == "layer", "offload.recompute_granularity",
       "must be stage or layer");
  need(!c.optimizer.asynchronous || pipelined, "optimizer.asynchronous", "needs a pipeline schedule (parallel.schedule)");
  need(c.offload.device_memory_mb >= 0, "offload.device_memory_mb", "must be non-negative");
  need(c.offload.pinned_memory_gb >= 0, "offload.pinned_memory_gb", "must be non-negative");
  need(c.offload.copy_gbps >= 0, "offload.copy_gbps", "must be non-negative");
  need(c.distributed.processes >= 1 && c.distributed.processes <= 64, "distributed.processes", "must be in 1..64");
  if (c.distributed.processes > 1) {
    need(pipelined && c.distributed.processes <= device_count(c.parallel.devices), "distributed.processes",
         fmt::format("{} processes need a pipeline schedule on at least as many devices (parallel.devices {})", c.distributed.processes,
                     c.parallel.devices));
    need(!c.optimizer.asynchronous, "distributed.processes", "cannot be combined with optimizer.asynchronous");
  }
  {
    const auto colon = c.distributed.rendezvous.rfind(':');
    const std::string port = colon == std::string::npos ? "" : c.distributed.rendezvous.substr(colon + 1);
    need(colon != std::string::npos && colon > 0 && !port.empty() && port.size() <= 5 &&
             std::all_of(port.begin(), port.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) && std::stoi(port) <= 65535,
         "distributed.rendezvous", "must be host:port (port 0..65535)");
  }
  need(c.distributed.timeout_s > 0 && c.distributed.timeout_s <= 86400, "distributed.timeout_s", "must be in (0, 86400]");
  need(c.run.steps >= 0, "run.steps", "must be non-negative");
  need(c.run.epochs >= 0 && c.run.epochs <= 1e6, "run.epochs", "must be between 0 and 1e6");
  need(c.run.batch_size >= 1, "run.batch_size", "must be at least 1");
  need(c.run.grad_accum >= 1, "run.grad_accum", "must be at least 1");
  need(c.run.eval_interval >= 0, "run.eval_interval", "must be non-negative");
  need(c.run.eval_batches >= 0, "run.eval_batches", "must be non-negative");
  need(c.run.threads >= 0 && c.run.threads <= 1024, "run.threads", "must be between 0 and 1024");
  need(!c.run.output_dir.empty(), "run.output_dir", "is required");
  need(c.run.sample_tokens >= 0, "run.sample_tokens", "must be non-negative");
  need(c.run.checkpoint_interval >= 0, "run.checkpoint_interval", "must be non-negative");
  need(c.run.keep_checkpoints >= 0, "run.keep_checkpoints", "must be non-negative");
  need(c.run.trace_interval >= 0, "run.trace_interval", "must be non-negative");
  if (!p.empty()) return error{fmt::format("{}", fmt::join(p, "\n"))};
  return ok_status();
}

int64_t device_count(const std::string& spec) {
  auto d = parse_device_spec(spec);
  return d ? d->count() : 0;
}

namespace {
// "a,b,c" as numbers (spaces allowed), or nullopt when one is not a number.
std::optional<std::vector<double>> number_list(const std::string& text) {
  std::vector<double> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos) return std::nullopt;
    const std::string v = item.substr(b, e - b + 1);
    double x = 0;  // from_chars: the same in every locale (the GUI runs under the user's)
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec != std::errc() || end != v.data() + v.size() || !std::isfinite(x)) return std::nullopt;
    out.push_back(x);
  }
  if (out.size() != static_cast<size_t>(std::count(text.begin(), text.end(), ',')) + 1) return std::nullopt;  // "3,"
  return out;
}

// Layer counts like "3,2" in `field` (`what`: "stage" or "backward stage"); the two words that mean
// "no counts" give an empty list.
result<std::vector<int32_t>> layer_counts(const char* field, const std::string& p, const char* what, const char* word1, const char* word2,
                                          const char* example) {
  if (p == word1 || p == word2) return std::vector<int32_t>{};
  const auto list = number_list(p);
  std::vector<int32_t> out;
  if (list && !list->empty())
    for (double x : *list) {
      if (x < 1 || x > 1e6 || x != std::floor(x)) return make_error("{}: '{}': every {} needs a whole number of layers, at least 1", field, p, what);
      out.push_back(static_cast<int32_t>(x));
    }
  if (out.empty()) return make_error("{}: '{}' must be {}, {} or layer counts per {} like {}", field, p, word1, word2, what, example);
  return out;
}
}  // namespace

result<std::vector<int32_t>> partition_sizes(const project_config& c) {
  return layer_counts("parallel.partition", c.parallel.partition, "stage", "auto", "even", "3,2");
}

result<std::vector<int32_t>> backward_partition_sizes(const project_config& c) {
  return layer_counts("parallel.backward_partition", c.parallel.backward_partition, "backward stage", "auto", "per-layer", "2,2,1");
}

result<std::vector<double>> device_speeds(const project_config& c) {
  const int64_t n = std::max<int64_t>(1, device_count(c.parallel.devices));
  if (c.parallel.device_speeds.empty()) return std::vector<double>(static_cast<size_t>(n), 1.0);
  const auto list = number_list(c.parallel.device_speeds);
  if (!list || static_cast<int64_t>(list->size()) != n)
    return make_error("parallel.device_speeds: '{}' must list one speed per device ({} for {})", c.parallel.device_speeds, n,
                      c.parallel.devices);
  for (double x : *list)
    if (x < 0.01 || x > 100) return make_error("parallel.device_speeds: {} is out of range (0.01 .. 100)", x);
  return *list;
}

result<std::vector<int>> copy_links(const project_config& c) {
  const std::string& t = c.offload.copy_links;
  if (t.empty()) return std::vector<int>{};
  const int64_t n = std::max<int64_t>(1, device_count(c.parallel.devices));
  const auto list = number_list(t);
  if (!list || static_cast<int64_t>(list->size()) != n)
    return make_error("offload.copy_links: '{}' must give one link number per device ({} for {})", t, n, c.parallel.devices);
  if (c.offload.copy_gbps <= 0) return make_error("offload.copy_links: a shared link needs a bandwidth (offload.copy_gbps > 0)");
  std::vector<int> out;
  for (double x : *list) {
    if (x < 0 || x > 63 || x != std::floor(x)) return make_error("offload.copy_links: {} is not a link number (0 .. 63)", x);
    out.push_back(static_cast<int>(x));
  }
  return out;
}

std::string project_to_json(const project_config& c) {
  json j = json::object();
  visit_fields(const_cast<project_config&>(c), [&](const char* path, auto& member, const char*) {
    json* node = &j;
    std::stringstream ss(path);
    for (std::string part; std::getline(ss, part, '.');) node = &(*node)[part];
    *node = member;
  });
  return j.dump(2) + "\n";
}

project_config with_absolute_paths(const project_config& c) {
  project_config a = c;
  auto abs = [&](std::string& p) {
    if (!p.empty()) p = fs::absolute(c.resolve(p)).lexically_normal().string();
  };
  abs(a.model.path);
  abs(a.tokenizer.path);
  abs(a.data.train);
  if (a.data.chat_template != "auto" && a.data.chat_template != "builtin") abs(a.data.chat_template);
  abs(a.lora.init_adapter);
  abs(a.run.output_dir);
  abs(a.run.database);
  return a;
}

namespace {

std::string field_unit(std::string_view path) {
  static const std::pair<std::string_view, std::string_view> units[] = {
      {"data.seq_len", "tokens"},          {"offload.device_memory_mb", "MiB"}, {"offload.copy_gbps", "GB/s"},
      {"offload.pinned_memory_gb", "GB"},  {"run.steps", "steps"},              {"run.epochs", "epochs"},
      {"run.batch_size", "sequences"},     {"run.eval_interval", "steps"},      {"run.eval_batches", "batches"},
      {"run.sample_tokens", "tokens"},     {"run.checkpoint_interval", "steps"}, {"run.trace_interval", "steps"},
      {"optimizer.warmup_steps", "steps"}, {"run.keep_checkpoints", "checkpoints"}, {"parallel.micro_batches", "micro-batches"},
      {"run.grad_accum", "micro-batches"}, {"run.threads", "threads"},          {"parallel.threads_per_device", "threads"}};
  for (const auto& [p, u] : units)
    if (p == path) return std::string(u);
  return {};
}

template <class T>
const char* field_type() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_integral_v<T>) return "integer";
  else if constexpr (std::is_floating_point_v<T>) return "number";
  else if constexpr (std::is_same_v<T, std::string>) return "string";
  else return "list";
}

}  // namespace

const std::vector<std::string>& field_choices(std::string_view path) {
  static const std::vector<std::pair<std::string_view, std::vector<std::string>>> choices = {
      {"model.dtype", {"float32", "bfloat16", "float16"}},
      {"data.format", {"auto", "text", "alpaca", "chat", "completion"}},
      {"data.train_on", {"completion", "all"}},
      {"data.truncation", {"right", "left", "drop"}},
      {"data.on_error", {"stop", "skip"}},
      {"parallel.schedule", {"auto", "single", "gpipe", "1f1b", "interleaved", "round-robin"}},
      {"parallel.transport", {"auto", "host", "peer", "nccl"}},
      {"offload.recompute_granularity", {"stage", "layer"}}};
  static const std::vector<std::string> none;
  for (const auto& [p, c] : choices)
    if (p == path) return c;
  return none;
}

std::vector<project_field> project_fields() {
  static const std::set<std::string_view> folders = {"run.output_dir", "lora.init_adapter"};
  static const std::set<std::string_view> files = {"model.path", "tokenizer.path", "data.train", "data.chat_template", "run.database"};
  project_config c;
  std::vector<project_field> out;
  visit_fields(c, [&](const char* path, auto& member, const char* doc) {
    using T = std::decay_t<decltype(member)>;
    project_field f{path, doc, field_type<T>(), json(member).dump(), field_unit(path), field_choices(path)};
    f.is_folder = folders.count(path) > 0;
    f.is_path = f.is_folder || files.count(path) > 0;
    out.push_back(std::move(f));
  });
  return out;
}

std::string project_field_table() {
  std::string out = "| field | default | unit | meaning |\n|---|---|---|---|\n";
  for (const auto& f : project_fields()) {
    std::string doc = f.doc;
    if (!f.choices.empty()) doc += fmt::format(" One of: {}.", fmt::join(f.choices, ", "));
    out += fmt::format("| `{}` | `{}` | {} | {} |\n", f.path, f.default_json, f.unit, doc);
  }
  return out;
}

std::string config_hash(const project_config& cfg) {
  project_config c = with_absolute_paths(cfg);
  c.run.output_dir.clear();
  c.run.database.clear();
  // Fields added after schema 2 leave the hash of older runs alone (their checkpoints still resume).
  json j = json::parse(project_to_json(c));
  // A run records the layer counts it chose, so "auto" and "even" appear only where the partition
  // does not matter (one device) or where runs older than the field trained the even partition.
  if (c.parallel.partition == "auto" || c.parallel.partition == "even") j["parallel"].erase("partition");
  // Runs before the field trained one layer per backward stage.
  if (c.parallel.backward_partition == "auto" || c.parallel.backward_partition == "per-layer") j["parallel"].erase("backward_partition");
  if (c.parallel.device_speeds.empty()) j["parallel"].erase("device_speeds");
  if (c.offload.copy_links.empty()) j["offload"].erase("copy_links");
  if (!c.offload.automatic) j["offload"].erase("auto");
  // How many processes run the pipeline, and where they meet, does not change what it computes (a
  // run resumes with another process count; every rank of one run brings the same hash).
  j.erase("distributed");
  const std::string text = j.dump(2) + "\n";
  return sha256_hex(text.data(), text.size());
}

namespace {

// The full path of a field given in full or by an unambiguous trailing part ("seq_len").
result<std::string> resolve_field_path(const std::string& field) {
  std::vector<std::string> matches;
  for (const auto& f : project_fields()) {
    if (f.path == field) return f.path;
    if (f.path.size() > field.size() && f.path.compare(f.path.size() - field.size(), field.size(), field) == 0 &&
        f.path[f.path.size() - field.size() - 1] == '.')
      matches.push_back(f.path);
  }
  if (matches.size() == 1) return matches.front();
  if (matches.empty()) return make_error("{}: no such project field (lorapipe-cli init --fields lists them)", field);
  return make_error("{}: ambiguous, say which: {}", field, fmt::join(matches, ", "));
}

template <class T>
std::string parse_setting(const std::string& text, T& out) {
  if constexpr (std::is_same_v<T, bool>) {
    if (text == "true" || text == "on" || text == "yes" || text == "1") out = true;
    else if (text == "false" || text == "off" || text == "no" || text == "0") out = false;
    else return "must be true or false (on/off)";
  } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
    T v{};
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size() || text.empty())
      return std::is_same_v<T, int64_t> ? "must be an integer" : "must be a number";
    out = v;
  } else if constexpr (std::is_same_v<T, std::string>) {
    out = text;
  } else {
    std::vector<std::string> items;
    std::stringstream ss(text);
    for (std::string item; std::getline(ss, item, ',');)
      if (!item.empty()) items.push_back(item);
    out = items;
  }
  return {};
}

}  // namespace

result<std::string> set_project_field(project_config& c, const std::string& field, const std::string& value) {
  LP_TRY_ASSIGN(path, resolve_field_path(field));
  std::string err;
  visit_fields(c, [&](const char* p, auto& member, const char*) {
    if (path == p) err = parse_setting(value, member);
  });
  if (!err.empty()) return make_error("{}: '{}' {}", path, value, err);
  return path;
}

std::string project_field_text(const project_config& c, const std::string& path) {
  std::string out;
  visit_fields(const_cast<project_config&>(c), [&](const char* p, auto& member, const char*) {
    if (path != p) return;
    using T = std::decay_t<decltype(member)>;
    if constexpr (std::is_same_v<T, bool>) out = member ? "true" : "false";
    else if constexpr (std::is_same_v<T, std::string>) out = member;
    else if constexpr (std::is_same_v<T, std::vector<std::string>>) out = fmt::format("{}", fmt::join(member, ","));
    else out = json(member).dump();
  });
  return out;
}

}  // namespace lorapipe
