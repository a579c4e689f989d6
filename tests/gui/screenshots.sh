#!/usr/bin/env bash
# Renders every page of the desktop GUI under Xvfb at 1280x800 with real trained runs loaded and
# writes PNG screenshots (the README shows them):
#   tests/gui/screenshots.sh [BUILD_DIR] [OUT_DIR]      (defaults: build, resources/screenshots)
# Trains two short runs of stories260K on the quiz chat data (one device, then a 2-device 1F1B pipeline
# on CPU virtual devices, shown on the Train page) into a throwaway run database, then starts `lorapipe --screenshots`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$(realpath "${1:-$root/build}")"
out="$(realpath -m "${2:-$root/resources/screenshots}")"
data="$(realpath "${LORAPIPE_TEST_DATA:-$root/../shared/data}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export XDG_CONFIG_HOME="$work/config" XDG_STATE_HOME="$work/state" XDG_DATA_HOME="$work/data"
cat > "$work/quiz.lorapipe.json" <<JSON
{
  "schema_version": 2,
  "name": "stories260K quiz chat",
  "model": {"path": "$data/models/stories260K/hf"},
  "data": {"train": "$data/instruct/quiz_chat.jsonl", "seq_len": 128, "val_fraction": 0.1},
  "lora": {"targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
  "optimizer": {"lr": 0.003},
  "parallel": {"devices": "cpu:2", "schedule": "1f1b", "micro_batches": 4},
  "run": {"steps": 300, "batch_size": 8, "eval_interval": 50, "eval_batches": 0, "output_dir": "$work/out1",
          "database": "$work/runs.db", "sample_prompt": "What is the capital of France?", "sample_tokens": 16,
          "trace_interval": 50}
}
JSON
cli="$build/app/lorapipe-cli"
"$cli" train "$work/quiz.lorapipe.json" --devices cpu --schedule single --steps 200 --output "$work/out1" 2> "$work/run1.log" \
  || { tail "$work/run1.log"; exit 1; }
"$cli" train "$work/quiz.lorapipe.json" --output "$work/out2" 2> "$work/run2.log" || { tail "$work/run2.log"; exit 1; }
mkdir -p "$out"
command -v xvfb-run >/dev/null || { echo "xvfb-run is missing (apt install xvfb xauth)" >&2; exit 1; }
xvfb-run -a -s "-screen 0 1280x800x24" "$build/app/lorapipe" --screenshots "$out" --run 2 "$work/quiz.lorapipe.json"
ls -l "$out"
