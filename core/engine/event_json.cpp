// Engine events as JSON: see event_json.h.
#include "core/engine/event_json.h"

#include <limits>
#include <optional>

#include <fmt/format.h>

namespace lorapipe {
using ojson = nlohmann::ordered_json;

namespace {

const char* level_name(log_event::level l) {
  switch (l) {
    case log_event::level::info: return "info";
    case log_event::level::warning: return "warning";
    case log_event::level::error: return "error";
  }
  return "?";
}

ojson trace_json(const std::vector<trace_entry>& v) {
  ojson a = ojson::array();
  for (const auto& t : v) a.push_back({{"device", t.device}, {"instr", t.instr}, {"start_s", t.start_s}, {"end_s", t.end_s}, {"bytes", t.bytes}});
  return a;
}

ojson fields(const run_started_event& e) {
  return {{"event", "run_started"}, {"model", e.model}, {"parameters", e.parameters}, {"lora_parameters", e.lora_parameters},
          {"train_sequences", e.train_sequences}, {"val_sequences", e.val_sequences}, {"total_steps", e.total_steps},
          {"tokens_per_step", e.tokens_per_step}, {"threads", e.threads}, {"run_id", e.run_id}, {"start_step", e.start_step},
          {"config", nlohmann::ordered_json::parse(e.config_json.empty() ? "null" : e.config_json, nullptr, false)},
          {"devices", e.devices}, {"output_dir", e.output_dir}, {"adapter_dir", e.adapter_dir},
          {"checkpoint_dir", e.checkpoint_dir}, {"database", e.database}};
}
ojson fields(const step_event& e) {
  return {{"event", "step"}, {"step", e.step}, {"total_steps", e.total_steps}, {"loss", e.loss}, {"lr", e.lr},
          {"grad_norm", e.grad_norm}, {"tokens_per_s", e.tokens_per_s}, {"elapsed_s", e.elapsed_s}, {"start_step", e.start_step},
          {"device_peak_bytes", e.device_peak_bytes}, {"process_peak_rss", e.process_peak_rss},
          {"bubble_ratio", e.bubble_ratio >= 0 ? ojson(e.bubble_ratio) : ojson(nullptr)}};
}
ojson fields(const eval_event& e) { return {{"event", "eval"}, {"step", e.step}, {"val_loss", e.val_loss}, {"tokens", e.tokens}}; }
ojson fields(const checkpoint_event& e) {
  return {{"event", "checkpoint"}, {"step", e.step}, {"path", e.path}, {"sha256", e.sha256}, {"bytes", e.bytes},
          {"removed_steps", e.removed_steps}};
}
ojson fields(const sample_event& e) { return {{"event", "sample"}, {"when", e.when}, {"prompt", e.prompt}, {"text", e.text}}; }
ojson fields(const log_event& e) { return {{"event", "log"}, {"level", level_name(e.lvl)}, {"message", e.message}}; }
ojson fields(const run_finished_event& e) {
  return {{"event", "run_finished"}, {"steps", e.steps}, {"first_val_loss", e.first_val_loss}, {"final_val_loss", e.final_val_loss},
          {"mean_tokens_per_s", e.mean_tokens_per_s}, {"adapter_dir", e.adapter_dir}, {"stopped_early", e.stopped_early},
          {"status", e.status}, {"error", e.error}};
}
ojson fields(const phase_event& e) {
  return {{"event", "phase"}, {"phase", phase_name(e.what)}, {"done", e.done}, {"total", e.total}, {"step", e.step}, {"detail", e.detail}};
}
ojson fields(const plan_event& e) {
  ojson stages = ojson::array(), arenas = ojson::array(), links = ojson::array();
  for (const auto& s : e.stages)
    stages.push_back({{"device", s.device}, {"first_layer", s.first_layer}, {"last_layer", s.last_layer}, {"has_embed", s.has_embed},
                      {"has_head", s.has_head}, {"weight_bytes", s.weight_bytes}});
  for (const auto& a : e.arenas)
    arenas.push_back({{"device", a.device}, {"bytes", a.bytes}, {"stages_at_once", a.stages_at_once}, {"slot_bytes", a.slot_bytes}});
  for (const auto& l : e.links) links.push_back({{"from", l.from}, {"to", l.to}, {"kind", l.kind}, {"reason", l.reason}});
  return {{"event", "plan"}, {"schedule", e.schedule}, {"micro_batches", e.micro_batches}, {"program", e.program},
          {"stages", stages}, {"weight_arenas", arenas}, {"transports", links}, {"simulated_step_s", e.simulated_step_s},
          {"bubble_ratio", e.bubble_ratio}};
}
ojson fields(const trace_event& e) {
  return {{"event", "trace"}, {"step", e.step}, {"measured_step_s", e.measured_step_s}, {"predicted_step_s", e.predicted_step_s},
          {"measured", trace_json(e.measured)}, {"predicted", trace_json(e.predicted)}};
}

}  // namespace

ojson event_to_json(const engine_event& ev) {
  ojson j = std::visit([](const auto& e) { return fields(e); }, ev);
  j["v"] = event_protocol_version;
  return j;
}

namespace {

constexpr double nan = std::numeric_limits<double>::quiet_NaN();

template <class T>
T get(const nlohmann::json& j, const char* key, T fallback = T{}) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    return fallback;
  }
}

std::vector<trace_entry> trace_from(const nlohmann::json& a) {
  std::vector<trace_entry> out;
  if (!a.is_array()) return out;
  for (const auto& t : a)
    out.push_back({get<int32_t>(t, "device"), get<std::string>(t, "instr"), get<double>(t, "start_s"), get<double>(t, "end_s"),
                   get<int64_t>(t, "bytes")});
  return out;
}

std::optional<phase> phase_from(const std::string& name) {
  for (phase p : {phase::loading_model, phase::tokenizing, phase::building_pipeline, phase::evaluating, phase::sampling,
                  phase::checkpointing, phase::saving_adapter, phase::exporting})
    if (name == phase_name(p)) return p;
  return std::nullopt;
}

engine_event plan_from(const nlohmann::json& j) {
  plan_event e{get<std::string>(j, "schedule"), get<int32_t>(j, "micro_batches"), get<std::string>(j, "program"), {}, {}, {},
               get<double>(j, "simulated_step_s"), get<double>(j, "bubble_ratio")};
  for (const auto& s : j.value("stages", nlohmann::json::array()))
    e.stages.push_back({get<int32_t>(s, "device"), get<int32_t>(s, "first_layer"), get<int32_t>(s, "last_layer"),
                        get<bool>(s, "has_embed"), get<bool>(s, "has_head"), get<int64_t>(s, "weight_bytes")});
  for (const auto& a : j.value("weight_arenas", nlohmann::json::array()))
    e.arenas.push_back({get<std::string>(a, "device"), get<int64_t>(a, "bytes"), get<int32_t>(a, "stages_at_once"),
                        get<int64_t>(a, "slot_bytes")});
  for (const auto& l : j.value("transports", nlohmann::json::array()))
    e.links.push_back({get<int32_t>(l, "from"), get<int32_t>(l, "to"), get<std::string>(l, "kind"), get<std::string>(l, "reason")});
  return e;
}

engine_event started_from(const nlohmann::json& j) {
  run_started_event e;
  e.model = get<std::string>(j, "model");
  e.parameters = get<int64_t>(j, "parameters");
  e.lora_parameters = get<int64_t>(j, "lora_parameters");
  e.train_sequences = get<int64_t>(j, "train_sequences");
  e.val_sequences = get<int64_t>(j, "val_sequences");
  e.total_steps = get<int64_t>(j, "total_steps");
  e.tokens_per_step = get<int64_t>(j, "tokens_per_step");
  e.threads = get<int>(j, "threads");
  e.run_id = get<int64_t>(j, "run_id");
  e.start_step = get<int64_t>(j, "start_step");
  if (auto it = j.find("config"); it != j.end() && !it->is_null()) e.config_json = it->dump();
  e.devices = get<std::vector<std::string>>(j, "devices");
  e.output_dir = get<std::string>(j, "output_dir");
  e.adapter_dir = get<std::string>(j, "adapter_dir");
  e.checkpoint_dir = get<std::string>(j, "checkpoint_dir");
  e.database = get<std::string>(j, "database");
  return e;
}

engine_event step_from(const nlohmann::json& j) {
  step_event e;
  e.step = get<int64_t>(j, "step");
  e.total_steps = get<int64_t>(j, "total_steps");
  e.loss = get<double>(j, "loss", nan);  // JSON writes a NaN or infinite loss as null
  e.lr = get<double>(j, "lr");
  e.grad_norm = get<double>(j, "grad_norm", nan);
  e.tokens_per_s = get<double>(j, "tokens_per_s");
  e.elapsed_s = get<double>(j, "elapsed_s");
  e.start_step = get<int64_t>(j, "start_step");
  e.device_peak_bytes = get<std::vector<int64_t>>(j, "device_peak_bytes");
  e.process_peak_rss = get<int64_t>(j, "process_peak_rss");
  e.bubble_ratio = get<double>(j, "bubble_ratio", -1.0);
  return e;
}

result<engine_event> event_from(const nlohmann::json& j) {
  const auto kind = get<std::string>(j, "event");
  if (kind == "run_started") return started_from(j);
  if (kind == "step") return step_from(j);
  if (kind == "eval") return engine_event{eval_event{get<int64_t>(j, "step"), get<double>(j, "val_loss", nan), get<int64_t>(j, "tokens")}};
  if (kind == "checkpoint")
    return engine_event{checkpoint_event{get<int64_t>(j, "step"), get<std::string>(j, "path"), get<std::string>(j, "sha256"),
                                         get<int64_t>(j, "bytes"), get<std::vector<int64_t>>(j, "removed_steps")}};
  if (kind == "sample")
    return engine_event{sample_event{get<std::string>(j, "when"), get<std::string>(j, "prompt"), get<std::string>(j, "text")}};
  if (kind == "log") {
    const auto lvl = get<std::string>(j, "level");
    return engine_event{log_event{lvl == "error" ? log_event::level::error : lvl == "warning" ? log_event::level::warning : log_event::level::info,
                                  get<std::string>(j, "message")}};
  }
  if (kind == "run_finished")
    return engine_event{run_finished_event{get<int64_t>(j, "steps"), get<double>(j, "first_val_loss"), get<double>(j, "final_val_loss"),
                                           get<double>(j, "mean_tokens_per_s"), get<std::string>(j, "adapter_dir"),
                                           get<bool>(j, "stopped_early"), get<std::string>(j, "status"), get<std::string>(j, "error")}};
  if (kind == "phase") {
    auto p = phase_from(get<std::string>(j, "phase"));
    if (!p) return error(fmt::format("unknown phase '{}'", get<std::string>(j, "phase")));
    return engine_event{phase_event{*p, get<int64_t>(j, "done"), get<int64_t>(j, "total"), get<int64_t>(j, "step"), get<std::string>(j, "detail")}};
  }
  if (kind == "plan") return plan_from(j);
  if (kind == "trace")
    return engine_event{trace_event{get<int64_t>(j, "step"), trace_from(j.value("measured", nlohmann::json())),
                                    trace_from(j.value("predicted", nlohmann::json())), get<double>(j, "measured_step_s"),
                                    get<double>(j, "predicted_step_s")}};
  return error(kind.empty() ? std::string("no \"event\" field") : fmt::format("unknown event '{}'", kind));
}

}  // namespace

result<engine_event> event_from_json(const std::string& line) {
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return error("not a JSON object");
  if (get<int>(j, "v", 0) > event_protocol_version)
    return error(fmt::format("event protocol version {} is newer than this build's {}", get<int>(j, "v", 0), event_protocol_version));
  return event_from(j);
}

}  // namespace lorapipe
