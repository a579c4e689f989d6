// lorapipe-cli: the headless front end and its one option table. Subcommands: train, resume, eval,
// runs list|show|compare (cli_train.cpp, cli_runs.cpp), generate, tokenize, export, init, validate,
// plan, data inspect.
// Results go to stdout, logs and progress to stderr. Every failure is one clear message and exit 1.
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <iostream>
#include <optional>
#include <sstream>
#include <iterator>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <fmt/format.h>

#include "app/cli_data.h"
#include "app/cli_plan.h"
#include "app/cli_printer.h"
#include "app/cli_runs.h"
#include "core/base/cancel.h"
#include "core/base/file_io.h"
#include "core/engine/build_info.h"
#include "core/engine/model_session.h"
#include "core/engine/device_inventory.h"
#include "core/engine/plan_report.h"
#include "core/project/llama_config.h"
#include "core/project/project.h"

namespace fs = std::filesystem;
using namespace lorapipe;

namespace {

cancel_token g_stop;  // requested by SIGINT/SIGTERM; the only process-wide state (signal handlers need one)
extern "C" void on_sigint(int) {
  if (g_stop.requested()) std::_Exit(130);  // second Ctrl-C: leave now
  g_stop.request();
}

struct generate_args {
  std::string model, adapter, tokenizer, prompt, dtype = "float32";
  int64_t max_new_tokens = 64;
  double temperature = 0.0, top_p = 1.0;
  uint64_t seed = 0;
  int64_t threads = 0;
  bool no_bos = false;
  bool chat = false;
  bool json = false;
  std::string system, prompt_ids;
};

int cmd_generate(const generate_args& a) {
  auto m = model_session::open({a.model, a.adapter, a.tokenizer, a.dtype, a.threads});
  if (!m) return cli_fail(m.message());
  generate_request req{a.prompt, a.chat, a.system, !a.no_bos, a.max_new_tokens, a.temperature, a.top_p, a.seed, {}};
  if (!a.prompt_ids.empty()) {
    std::istringstream in(a.prompt_ids);
    for (std::string tok; std::getline(in, tok, ',');) {
      try {
        size_t used = 0;
        req.prompt_ids.push_back(std::stoi(tok, &used));
        if (used != tok.size()) throw std::invalid_argument(tok);
      } catch (const std::exception&) {
        return cli_fail(fmt::format("--prompt-ids: '{}' is not an integer (expected e.g. 1,450,32)", tok));
      }
    }
  }
  auto g = m->generate(req);
  if (!g) return cli_fail(g.message());
  if (a.json) {  // ids so continuations compare token by token, whatever bytes they decode to
    nlohmann::json j{{"prompt_ids", g->prompt_ids}, {"ids", g->ids}, {"text", g->text},
                     {"stop", g->stopped_at_eos ? "eos" : "length"}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::cout << g->text << std::endl;
  }
  return 0;
}

int cmd_tokenize(const std::string& tokenizer_path, bool as_json) {
  std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  auto ids = tokenize_text(tokenizer_path, text);
  if (!ids) return cli_fail(ids.message());
  std::cout << (as_json ? fmt::format("[{}]", fmt::join(*ids, ",")) : fmt::format("{}", fmt::join(*ids, " "))) << "\n";
  return 0;
}

int cmd_export(const std::string& model, const std::string& adapter, const std::string& out, const std::string& format,
               const std::string& dtype) {
  null_observer quiet;
  auto st = export_adapter(model, adapter, out, format, dtype, quiet);
  if (!st) return cli_fail(st.message());
  std::fputs((format == "peft" ? fmt::format("PEFT adapter written to {}\n", out) : fmt::format("merged weights written to {}\n", out)).c_str(),
             stderr);
  return 0;
}

int cmd_init(const std::string& path, const std::string& model, const std::string& data, bool force) {
  project_config c;
  // Paths given on the command line are relative to the shell; store them absolute.
  c.model.path = model.empty() ? model : fs::absolute(model).lexically_normal().string();
  c.data.train = data.empty() ? data : fs::absolute(data).lexically_normal().string();
  std::error_code ec;
  if (!model.empty() && fs::is_regular_file(fs::path(model) / "config.json", ec))
    if (auto mc = load_llama_config(fs::path(model) / "config.json"))  // Phi-3: qkv_proj, not q/k/v
      c.lora.targets = fit_lora_targets(*mc, c.lora.targets);
  const auto text = project_to_json(c);
  if (path.empty() || path == "-") {
    std::cout << text;
    return 0;
  }
  if (fs::exists(path, ec) && !force) return cli_fail(fmt::format("{} exists (use --force to overwrite)", path));
  auto st = write_file_atomic(path, text);
  if (!st) return cli_fail(st.message());
  std::fputs(fmt::format("wrote {}\n", path).c_str(), stderr);
  return 0;
}

int cmd_validate(const std::string& path) {
  auto p = load_project(path);
  if (!p) return cli_fail(p.message());
  auto st = validate_project(*p);
  if (!st) {
    std::fputs(fmt::format("error: {} is not valid:\n{}\n", path, st.message()).c_str(), stderr);
    return 1;
  }
  std::fputs(fmt::format("{}: ok\n", path).c_str(), stderr);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lorapipe-cli: LoRA fine-tuning of Llama models (headless)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", [] { return build_info_text(describe_build(), "lorapipe-cli"); }, "Print the lorapipe, LibTorch and CUDA versions and exit");

  train_args ta;
  auto* train = app.add_subcommand("train", "Fine-tune with LoRA as described by a project file");
  train->add_option("project", ta.project, "Project file (JSON)")->required();
  train->add_option("--steps", ta.steps, "Override run.steps");
  train->add_option("--output", ta.output, "Override run.output_dir");
  train->add_option("--devices", ta.devices, "Override parallel.devices (cpu)");
  train->add_option("--schedule", ta.schedule, "Override parallel.schedule (auto, single, gpipe, 1f1b, interleaved, round-robin)");
  train->add_option("--transport", ta.transport, "Override parallel.transport (auto, host, peer, nccl)");
  train->add_option("--threads", ta.threads, "Override run.threads");
  train->add_flag("--json", ta.json, "Print events as JSON lines on stderr");
  train->add_option("--db", ta.db, "Run database (default: run.database, $LORAPIPE_DB or the XDG data dir)");
  train->add_option("--processes", ta.processes, "Override distributed.processes: run the pipeline's devices in N processes "
                                                 "(without --rank, the others are started on this machine)");
  train->add_option("--rank", ta.rank, "This process's rank in a run over several processes (1..N-1 join rank 0; "
                                       "0 serves the rendezvous and waits for ranks started by hand)");
  train->add_option("--rendezvous", ta.rendezvous, "Override distributed.rendezvous (host:port of rank 0)");
  train->add_option("--resume-from", ta.resume_from, "Ranks other than 0: the checkpoint folder rank 0 continues from")->group("");

  resume_args ra;
  auto* resume = app.add_subcommand("resume", "Continue an interrupted or crashed run from its newest checkpoint");
  resume->add_option("run", ra.run, "Run id (lorapipe-cli runs list)")->required()->check(CLI::PositiveNumber);
  resume->add_option("--checkpoint", ra.checkpoint, "Continue from the checkpoint at this step instead of the newest");
  resume->add_option("--processes", ra.processes, "Continue over this many processes (1 = one process; the checkpoint fits any count)")
      ->check(CLI::Range(1, 64));
  resume->add_option("--rendezvous", ra.rendezvous,
                     "Several machines: serve the rendezvous at HOST:PORT and start no ranks here; start the others by hand "
                     "(train p.json --rank R --rendezvous HOST:PORT; they need no checkpoint)");
  resume->add_option("--db", ra.db, "Run database");
  resume->add_flag("--json", ra.json, "Print events as JSON lines on stderr");

  eval_args ea;
  auto* eval = app.add_subcommand("eval", "Perplexity of a model (+ adapter) on a project's validation split or a data file");
  eval->add_option("project", ea.project, "Project file (model, tokenizer and data settings)");
  eval->add_option("--run", ea.run, "Evaluate this run's adapter with its configuration and record the result")->check(CLI::PositiveNumber);
  eval->add_option("--adapter", ea.adapter, "PEFT adapter folder (default with --run: the run's adapter; else none)");
  eval->add_option("--data", ea.data, "Evaluate on this whole file instead of the validation split");
  eval->add_option("--db", ea.db, "Run database");
  eval->add_flag("--json", ea.json, "Machine-readable output");

  std::string runs_db;
  int64_t runs_limit = 50, show_id = 0, cmp_a = 0, cmp_b = 0;
  bool runs_json = false;
  auto* runs = app.add_subcommand("runs", "The run database: list, show, compare");
  runs->require_subcommand(1);
  runs->add_option("--db", runs_db, "Run database")->configurable();
  auto* runs_list = runs->add_subcommand("list", "Recorded runs, newest first");
  runs_list->add_option("--limit", runs_limit, "At most this many")->check(CLI::PositiveNumber);
  auto* runs_show = runs->add_subcommand("show", "One run: status, config hash, hardware, metric summary, checkpoints");
  runs_show->add_option("run", show_id, "Run id")->required();
  auto* runs_cmp = runs->add_subcommand("compare", "Two runs: config differences and metric summaries side by side");
  runs_cmp->add_option("a", cmp_a, "Run id")->required();
  runs_cmp->add_option("b", cmp_b, "Run id")->required();
  for (auto* sc : {runs_list, runs_show, runs_cmp}) {
    sc->add_flag("--json", runs_json, "Machine-readable output");
    sc->add_option("--db", runs_db, "Run database");
  }

  generate_args ga;
  auto* gen = app.add_subcommand("generate", "Generate text (stdout: the continuation only)");
  gen->add_option("--model", ga.model, "HF folder or llama2.c .bin")->required();
  gen->add_option("--adapter", ga.adapter, "PEFT adapter folder");
  gen->add_option("--tokenizer", ga.tokenizer, "Tokenizer (default: found next to the model)");
  auto* prompt_opt = gen->add_option("--prompt", ga.prompt, "Prompt text");
  gen->add_option("--prompt-ids", ga.prompt_ids, "The prompt as comma-separated token ids (no template, no BOS)")->excludes(prompt_opt);
  gen->add_flag("--json", ga.json, "Print {prompt_ids, ids, text, stop} as one JSON object");
  gen->add_option("--max-new-tokens", ga.max_new_tokens, "Tokens to generate")->required()->check(CLI::NonNegativeNumber);
  gen->add_option("--temperature", ga.temperature, "0 = greedy")->check(CLI::NonNegativeNumber);
  gen->add_option("--top-p", ga.top_p, "Nucleus sampling mass")->check(CLI::Range(0.0, 1.0));
  gen->add_option("--seed", ga.seed, "Sampling seed");
  gen->add_option("--dtype", ga.dtype, "Compute dtype: float32, bfloat16, float16");
  gen->add_option("--threads", ga.threads, "CPU threads (0 = all)");
  gen->add_flag("--no-bos", ga.no_bos, "Do not prepend BOS to the prompt");
  gen->add_flag("--chat", ga.chat, "Send the prompt as a user message through the chat template");
  gen->add_option("--system", ga.system, "With --chat: a system message");

  std::string tok_path;
  bool tok_json = false;
  auto* tokz = app.add_subcommand("tokenize", "Tokenize stdin; prints ids (no BOS/EOS)");
  tokz->add_option("--tokenizer", tok_path, "tokenizer.json, tokenizer.model or a model folder")->required();
  tokz->add_flag("--json", tok_json, "Print a JSON list");

  std::string ex_model, ex_adapter, ex_out, ex_dtype = "float32";
  auto* exp = app.add_subcommand("export", "Merge an adapter into the base weights and write an HF folder");
  int64_t ex_run = 0;
  std::string ex_format = "merged", ex_db;
  exp->add_option("--model", ex_model, "Base model");
  exp->add_option("--adapter", ex_adapter, "PEFT adapter folder");
  exp->add_option("--run", ex_run, "Export this run's adapter (model and adapter from the run database)")->check(CLI::PositiveNumber);
  exp->add_option("--format", ex_format, "merged (HF folder with W + scale*B*A) or peft (the adapter folder)")
      ->check(CLI::IsMember({"merged", "peft"}));
  exp->add_option("--db", ex_db, "Run database (with --run)");
  exp->add_option("--output", ex_out, "Output folder")->required();
  exp->add_option("--dtype", ex_dtype, "dtype of the merged weights");

  std::string init_path, init_model, init_data;
  bool init_force = false, init_fields = false;
  auto* init = app.add_subcommand("init", "Write a project file with defaults");
  init->add_option("project", init_path, "Where to write it (default: stdout)");
  init->add_option("--model", init_model, "model.path");
  init->add_option("--data", init_data, "data.train");
  init->add_flag("--force", init_force, "Overwrite an existing file");
  init->add_flag("--fields", init_fields, "Print the documented field table (Markdown) instead");

  plan_args pa;
  bool plan_probe = false, plan_reprobe = false;
  auto* plan = app.add_subcommand("plan", "Show the pipeline program, its simulated step time, bubbles and memory");
  plan->add_option("project", pa.project, "Project file")->required();
  plan->add_option("--gflops", pa.gflops, "Assumed compute throughput per device (GFLOP/s)")->check(CLI::PositiveNumber);
  plan->add_flag("--json", pa.json, "Machine-readable output");
  plan->add_flag("--probe", plan_probe, "Probe the devices (memory, PCIe, timed copies alone and all at once, peer copies; cached by "
                 "fingerprint) and cost copies at the measured bandwidth");
  plan->add_flag("--reprobe", plan_reprobe, "As --probe, measuring again even when the cache has these devices");
  bool plan_profile = false, plan_reprofile = false;
  plan->add_flag("--profile", plan_profile, "Profile the layers on the first device (forward, backward, embedding, head at the project's "
                 "micro-batch shape; cached) and plan with the measured times: later plans and train's auto use the cached profile");
  plan->add_flag("--reprofile", plan_reprofile, "As --profile, measuring again even when the cache has this profile");
  plan->add_flag("--grid", pa.grid, "Print the device-by-time grid of the program");
  plan->add_option("--devices", pa.devices, "Override parallel.devices (as train does)");
  plan->add_option("--schedule", pa.schedule, "Override parallel.schedule (auto, single, gpipe, 1f1b, interleaved, round-robin)");
  plan->add_option("--what-if", pa.what_if,
                   "Plan again with settings changed and print the difference, e.g. \"seq_len=2048\", \"devices=cpu:3\", "
                   "\"devices=+1\", \"p2p=off\", \"micro_batches=8 offload.stream_weights=off\" (repeatable)");
  plan->add_flag("--write", pa.write, "Store the plan's choices (parallel.devices, schedule, micro_batches, partition, backward_partition) in the project file");

  std::string data_path;
  int64_t data_examples = 3;
  bool data_json = false;
  auto* data = app.add_subcommand("data", "Dataset tools");
  data->require_subcommand(1);
  auto* inspect = data->add_subcommand("inspect", "Statistics and rendered examples (trained tokens marked) of a project's data");
  inspect->add_option("project", data_path, "Project file")->required();
  inspect->add_option("--examples", data_examples, "Examples to show")->check(CLI::NonNegativeNumber);
  inspect->add_flag("--json", data_json, "Machine-readable output");

  std::string val_path;
  auto* val = app.add_subcommand("validate", "Check a project file and report every problem");
  val->add_option("project", val_path, "Project file")->required();

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train || *resume) {  // Ctrl-C, or a scheduler's SIGTERM: checkpoint, then exit 130
      std::signal(SIGINT, on_sigint);
      std::signal(SIGTERM, on_sigint);
    }
    if (*train) return cmd_train(ta, g_stop);
    if (*resume) return cmd_resume(ra, g_stop);
    if (*eval) return cmd_eval(ea);
    if (*runs_list) return cmd_runs_list(runs_db, runs_limit, runs_json);
    if (*runs_show) return cmd_runs_show(runs_db, show_id, runs_json);
    if (*runs_cmp) return cmd_runs_compare(runs_db, cmp_a, cmp_b, runs_json);
    if (*gen) return cmd_generate(ga);
    if (*tokz) return cmd_tokenize(tok_path, tok_json);
    if (*exp && ex_run > 0) {
      auto src = run_export_sources(ex_db, ex_run);
      if (!src) return cli_fail(src.message());
      ex_model = src->first;
      ex_adapter = src->second;
    }
    if (*exp && (ex_model.empty() || ex_adapter.empty())) return cli_fail("export needs --run ID, or --model and --adapter");
    if (*exp) return cmd_export(ex_model, ex_adapter, ex_out, ex_format, ex_dtype);
    if (*init && init_fields) {
      std::cout << project_field_table();
      return 0;
    }
    if (*init) return cmd_init(init_path, init_model, init_data, init_force);
    if (*val) return cmd_validate(val_path);
    if (*inspect) {
      auto report = data_inspect_report(data_path, data_examples, data_json, !data_json && isatty(STDOUT_FILENO) != 0);
      if (!report) return cli_fail(report.message());
      std::cout << *report;
      return 0;
    }
    if (*plan) {
      pa.probe = plan_reprobe ? 2 : plan_probe ? 1 : 0;
      pa.profile = plan_reprofile ? 2 : plan_profile ? 1 : 0;
      return cmd_plan(pa);
    }
  } catch (const std::exception& e) {  // the engine returns errors as values; this is the last resort
    return cli_fail(e.what());
  }
  return 0;
}
