// Engine events as JSON: see event_json.h.
#include "core/engine/event_json.h"

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

}  // namespace lorapipe
