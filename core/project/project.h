// The project file: one typed config tree, serialised as JSON with a schema_version. Every field is
// declared once in visit_fields() with its path and documentation; parsing, unknown-field detection,
// serialisation, CLI overrides and the README field table all come from that one list.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

// 2: parallel.async_optimizer moved to optimizer.asynchronous; run.checkpoint_interval,
//    run.keep_checkpoints and run.database added. Older files are migrated when read.
inline constexpr int64_t project_schema_version = 2;

struct project_config {
  int64_t schema_version = project_schema_version;
  std::string name = "lorapipe-project";
  struct {
    std::string path;                 // HF folder or llama2.c .bin
    std::string dtype = "float32";    // compute dtype
  } model;
  struct {
    std::string path;  // empty: found in the model folder
  } tokenizer;
  struct {
    std::string train;               // corpus path
    std::string format = "auto";
    std::string chat_template = "auto";
    std::string train_on = "completion";
    bool packing = true;
    std::string truncation = "right";
    std::string on_error = "stop";
    bool on_disk = false;
    int64_t seq_len = 128;
    double val_fraction = 0.05;
    bool add_bos = true;
    bool add_eos = true;
  } data;
  struct {
    int64_t r = 8;
    double alpha = 16;
    double dropout = 0.0;
    std::vector<std::string> targets{"q_proj", "k_proj", "v_proj", "o_proj"};
    std::string init_adapter;  // continue from a saved PEFT adapter
  } lora;
  struct {
    double lr = 2e-3;
    double weight_decay = 0.0;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    int64_t warmup_steps = 20;
    double min_lr_ratio = 0.1;
    double grad_clip = 1.0;
    bool asynchronous = false;
  } optimizer;
  struct {
    std::string devices = "cpu";
    std::string schedule = "auto";
    int64_t micro_batches = 4;
    int64_t virtual_stages = 2;
    int64_t threads_per_device = 1;
    std::string transport = "auto";
    std::string partition = "auto";
    std::string backward_partition = "auto";  // round-robin's backward stages
    std::string device_speeds;
  } parallel;
  struct {
    bool stream_weights = true;
    bool activations = true;
    bool recompute = true;
    std::string recompute_granularity = "stage";
    double device_memory_mb = 0;
    double copy_gbps = 0;
    std::string copy_links;  // CPU virtual devices: the host link of each ("0,0,1,1"; empty = one each)
    double pinned_memory_gb = 0;
    bool automatic = false;  // offload.auto: the planner chooses the four settings above
  } offload;
  struct {
    int64_t processes = 1;                    // ranks of one pipeline (device positions split in blocks)
    std::string rendezvous = "127.0.0.1:0";   // host:port where rank 0 serves the rendezvous
    double timeout_s = 300;                   // every communication call and the rendezvous
  } distributed;
  struct {
    int64_t seed = 1234;
    int64_t steps = 200;
    double epochs = 0;
    int64_t batch_size = 8;
    int64_t grad_accum = 1;
    int64_t eval_interval = 50;
    int64_t eval_batches = 16;
    int64_t threads = 0;  // 0: all cores
    std::string output_dir = "runs/latest";
    std::string sample_prompt = "Once upon a time";
    int64_t sample_tokens = 48;
    bool save_merged = false;
    int64_t checkpoint_interval = 50;
    int64_t keep_checkpoints = 3;
    int64_t trace_interval = 50;
    std::string database;
  } run;

  std::filesystem::path base_dir;  // folder of the project file; relative paths resolve against it
  std::filesystem::path resolve(const std::string& p) const;
};

// Calls f(path, member, doc) for every field, in file order.
template <class C, class F>
void visit_fields(C& c, F&& f) {
  f("schema_version", c.schema_version, "Project file format version (this build writes 2 and migrates 1).");
  f("name", c.name, "Free-form project name.");
  f("model.path", c.model.path, "Hugging Face Llama folder (config.json + safetensors) or a llama2.c .bin file.");
  f("model.dtype", c.model.dtype, "Compute dtype: float32, bfloat16 or float16.");
  f("tokenizer.path", c.tokenizer.path, "tokenizer.model file or folder; empty = look in the model folder.");
  f("data.train", c.data.train, "Training data: plain text (documents separated by blank lines) or JSONL (alpaca, chat, prompt/completion).");
  f("data.format", c.data.format, "auto (from the file), text, alpaca ({instruction, input, output}), chat ({messages}) or completion ({prompt, completion}).");
  f("data.chat_template", c.data.chat_template, "Chat template for alpaca/chat data: auto (tokenizer_config.json, else built-in), builtin, or a .jinja file.");
  f("data.train_on", c.data.train_on, "completion (loss on assistant/completion tokens only) or all.");
  f("data.packing", c.data.packing, "JSONL data: pack examples back to back into seq_len sequences (else one padded example per sequence).");
  f("data.truncation", c.data.truncation, "Examples longer than seq_len+1 tokens: right (keep the start), left (keep the end) or drop.");
  f("data.on_error", c.data.on_error, "Malformed JSONL record: stop (error naming the line) or skip (count and continue).");
  f("data.on_disk", c.data.on_disk, "JSONL data: keep the tokenised data in memory-mapped files under run.output_dir/data-cache (for data larger than RAM).");
  f("data.seq_len", c.data.seq_len, "Tokens per packed training sequence.");
  f("data.val_fraction", c.data.val_fraction, "Fraction of the token stream held out for validation (taken from the end).");
  f("data.add_bos", c.data.add_bos, "Start each document with BOS.");
  f("data.add_eos", c.data.add_eos, "End each document with EOS.");
  f("lora.r", c.lora.r, "LoRA rank.");
  f("lora.alpha", c.lora.alpha, "LoRA alpha; the update is scaled by alpha/r.");
  f("lora.dropout", c.lora.dropout, "Dropout on the LoRA input during training.");
  f("lora.targets", c.lora.targets, "Adapted projections: any of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj.");
  f("lora.init_adapter", c.lora.init_adapter, "Start from this PEFT adapter folder (its r, alpha and targets are used); empty = fresh LoRA.");
  f("optimizer.lr", c.optimizer.lr, "Peak learning rate (AdamW).");
  f("optimizer.weight_decay", c.optimizer.weight_decay, "Decoupled weight decay on LoRA parameters.");
  f("optimizer.beta1", c.optimizer.beta1, "AdamW beta1.");
  f("optimizer.beta2", c.optimizer.beta2, "AdamW beta2.");
  f("optimizer.eps", c.optimizer.eps, "AdamW epsilon.");
  f("optimizer.warmup_steps", c.optimizer.warmup_steps, "Linear warmup steps.");
  f("optimizer.min_lr_ratio", c.optimizer.min_lr_ratio, "Cosine decay floor as a fraction of the peak LR.");
  f("optimizer.grad_clip", c.optimizer.grad_clip, "Clip the global gradient norm to this value (0 = off).");
  f("optimizer.asynchronous", c.optimizer.asynchronous, "Pipelines: one-step-stale asynchronous AdamW (opt-in; changes the optimisation).");
  f("parallel.devices", c.parallel.devices, "Devices: cpu (one), cpu:N (N CPU virtual devices) or cuda:I,J,... (GPUs; CUDA builds).");
  f("parallel.schedule", c.parallel.schedule, "auto (the planner: single on one device, else the pipeline schedule and micro-batch count with the fastest predicted step), single (no pipeline), gpipe, 1f1b, interleaved or round-robin.");
  f("parallel.micro_batches", c.parallel.micro_batches, "Micro-batches per step in a pipeline (must divide run.batch_size; schedule auto chooses it).");
  f("parallel.virtual_stages", c.parallel.virtual_stages, "Interleaved 1F1B: stages per device.");
  f("parallel.threads_per_device", c.parallel.threads_per_device, "Compute threads of each CPU virtual device.");
  f("parallel.transport", c.parallel.transport,
    "How tensors cross between stages, chosen per link and logged: auto (peer copy where the GPUs allow it, else host-staged), "
    "host (through exact-size pinned host memory), peer (device to device), nccl (CUDA, distinct GPUs).");
  f("parallel.partition", c.parallel.partition,
    "Layers per stage: auto (the planner balances stages by their predicted time on each device's speed), even, or a list "
    "like 3,2 (one count per stage: devices stages, x virtual_stages for interleaved, the forward stages for round-robin, as many as you like).");
  f("parallel.backward_partition", c.parallel.backward_partition,
    "Round-robin: layers per backward stage, from layer 0 up to the fused tail (RoundPipe's asymmetric partition: a backward "
    "with recompute costs about 3x a forward, so its stages may hold fewer layers): auto (the planner chooses, with the "
    "forward stages when parallel.partition is auto too), per-layer (one layer each), or a list like 2,2,1.");
  f("parallel.device_speeds", c.parallel.device_speeds,
    "Relative compute speed of each device, like 1,0.5 (empty = all 1): CPU virtual devices run at it; the planner balances "
    "stages by it.");
  f("offload.stream_weights", c.offload.stream_weights, "Pipelines: upload frozen weights per stage and free them after use (else keep them resident).");
  f("offload.activations", c.offload.activations, "Pipelines: move stage-boundary checkpoints to host memory between forward and backward.");
  f("offload.recompute", c.offload.recompute, "Pipelines: recompute each stage before its backward (bound schedules; round-robin always does).");
  f("offload.recompute_granularity", c.offload.recompute_granularity, "stage (recompute a whole stage, then its backward) or layer (one layer at a time: less memory, more traffic).");
  f("offload.device_memory_mb", c.offload.device_memory_mb, "Memory capacity of each CPU virtual device in MiB (0 = unlimited).");
  f("offload.copy_gbps", c.offload.copy_gbps,
    "Throttle of each CPU virtual device's copy engines in GB/s (0 = unthrottled). On GPUs, never a throttle: the host<->device "
    "rate the planner costs copies at (0 = a cached probe of the GPUs, else an estimate from their PCIe links; a run records the rate used).");
  f("offload.copy_links", c.offload.copy_links,
    "CPU virtual devices: the host link each device copies through, one number per device like 0,0,1,1 (devices with the same "
    "number share one link of offload.copy_gbps each way, as GPUs behind one PCIe switch do, and a device's weight and "
    "activation uploads share its link too; empty = each copy engine throttled on its own).");
  f("offload.auto", c.offload.automatic,
    "Pipelines: let the planner choose stream_weights, activations, recompute and recompute_granularity (the fastest "
    "predicted step that fits offload.device_memory_mb, of the 10 combinations; a run records what it chose). On GPUs "
    "it needs offload.device_memory_mb.");
  f("offload.pinned_memory_gb", c.offload.pinned_memory_gb, "CUDA: host RAM in GB that streamed weights may page-lock (0 = half of RAM); weights beyond it go through a pinned bounce buffer.");
  f("distributed.processes", c.distributed.processes,
    "Processes that run the pipeline's devices (1 = all in this one); the device positions are split into contiguous blocks, "
    "one per process. Without --rank, lorapipe-cli train starts the other processes on this machine.");
  f("distributed.rendezvous", c.distributed.rendezvous,
    "host:port where process 0 serves the rendezvous (c10d TCPStore); port 0 picks a free one for processes started here.");
  f("distributed.timeout_s", c.distributed.timeout_s,
    "Seconds any process waits for another (rendezvous, activations, gradients, the gradient norm) before the run fails naming it.");
  f("run.seed", c.run.seed, "Seed for LoRA init, data order and dropout.");
  f("run.steps", c.run.steps, "Optimizer steps.");
  f("run.epochs", c.run.epochs, "Passes over the training data; when > 0 it sets the step count (ceil(epochs x sequences / (batch_size x grad_accum))) instead of run.steps.");
  f("run.batch_size", c.run.batch_size, "Sequences per micro-batch.");
  f("run.grad_accum", c.run.grad_accum, "Micro-batches accumulated per optimizer step.");
  f("run.eval_interval", c.run.eval_interval, "Validate every N steps (0 = only at start and end).");
  f("run.eval_batches", c.run.eval_batches, "Validation micro-batches per evaluation (0 = the whole split).");
  f("run.threads", c.run.threads, "LibTorch CPU threads (0 = all cores).");
  f("run.output_dir", c.run.output_dir, "Where the adapter (PEFT layout) and logs are written.");
  f("run.sample_prompt", c.run.sample_prompt, "Prompt for the samples generated before and after training.");
  f("run.sample_tokens", c.run.sample_tokens, "Tokens per sample (0 = no samples).");
  f("run.save_merged", c.run.save_merged, "Also write merged weights as an HF folder (output_dir/merged).");
  f("run.checkpoint_interval", c.run.checkpoint_interval, "Write a resumable checkpoint every N steps (0 = only at the end and on Ctrl-C); under output_dir/checkpoints/run-<id>.");
  f("run.keep_checkpoints", c.run.keep_checkpoints, "Keep the newest N checkpoints of a run (0 = keep all).");
  f("run.trace_interval", c.run.trace_interval, "Pipelines: report the measured per-device timeline of every Nth step next to the simulator's prediction (0 = never).");
  f("run.database", c.run.database, "Run database (SQLite); empty = $LORAPIPE_DB, else $XDG_DATA_HOME/lorapipe/runs.db (~/.local/share/lorapipe/runs.db).");
}

// Parses project JSON text; reports every problem at once ("field: problem", one per line). Files
// with an older schema_version are migrated (`migrated_from`, when given, receives that version).
result<project_config> parse_project(const std::string& json_text, const std::filesystem::path& project_file,
                                     int64_t* migrated_from = nullptr);
result<project_config> load_project(const std::filesystem::path& project_file, int64_t* migrated_from = nullptr);
// The configuration a run recorded (parse_project), with the fields newer than the run set to what it
// trained: parallel.partition even, parallel.backward_partition per-layer (runs record their choices
// since those fields exist). What resume and evaluation of a stored run read.
result<project_config> parse_recorded_project(const std::string& json_text, const std::filesystem::path& project_file);
// Semantic checks that need the file system (paths exist, values in range); all problems at once.
status validate_project(const project_config& c);
std::string project_to_json(const project_config& c);
// The same config with every path made absolute (a run's config snapshot works from anywhere).
project_config with_absolute_paths(const project_config& c);
// Hex sha256 of the config snapshot that defines a run's results (paths absolute, the output and
// database locations and the distributed section excluded): two runs with the same hash compute the
// same thing.
std::string config_hash(const project_config& cfg);
// Number of devices in a parallel.devices spec ("cpu", "cpu:N", "cuda:I,J,..."); 0 when malformed.
int64_t device_count(const std::string& spec);
// parallel.partition as layer counts per stage (empty for auto and even), or an error naming the field.
result<std::vector<int32_t>> partition_sizes(const project_config& c);
// parallel.backward_partition as layer counts per backward stage (empty for auto and per-layer), or
// an error naming the field.
result<std::vector<int32_t>> backward_partition_sizes(const project_config& c);
// parallel.device_speeds for each of the project's devices (1 where not given), or an error naming the field.
result<std::vector<double>> device_speeds(const project_config& c);
// offload.copy_links as one link number per device (empty when not given), or an error naming the
// field (validate_project also refuses it on GPUs, whose links the planner takes from a probe).
result<std::vector<int>> copy_links(const project_config& c);
// One setting given as text ("data.seq_len" or an unambiguous last part such as "seq_len", and a
// value as typed on a command line: true/false/on/off, numbers, comma-separated lists) applied to
// `c`; errors name the field. The resolved path is returned.
result<std::string> set_project_field(project_config& c, const std::string& field, const std::string& value);
// A field's current value as text (the form set_project_field reads); empty for an unknown path.
std::string project_field_text(const project_config& c, const std::string& path);
// One field as a front-end shows it (the CLI's `init --fields` table, the GUI's project form),
// all from visit_fields() plus the unit and choice tables in project.cpp.
struct project_field {
  std::string path, doc;
  std::string type;                  // bool, integer, number, string or list (of strings)
  std::string default_json;          // the default value as JSON
  std::string unit;                  // e.g. "MiB", "GB/s", "tokens"; empty when unitless
  std::vector<std::string> choices;  // the values a string field may take (empty: free text)
  bool is_path = false;              // a file or folder (resolved against the project file)
  bool is_folder = false;            // ... and a folder rather than a file
};
std::vector<project_field> project_fields();
// The values a string field may take (empty: free text); validation checks against the same list.
const std::vector<std::string>& field_choices(std::string_view path);
// Markdown table of all fields with defaults, units and documentation.
std::string project_field_table();

}  // namespace lorapipe
