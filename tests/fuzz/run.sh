#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + libFuzzer) and runs each for a bounded time
# from a seed corpus of real files. Usage: run.sh BUILD_DIR SHARED_DATA [SECONDS_PER_TARGET]
# Exit 0: no crash, leak, timeout or sanitizer report; otherwise the reproducer is left in BUILD_DIR/fuzz.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$1/fuzz"; out="$(cd "$1/fuzz" && pwd)"; data="$2"; secs="${3:-${LORAPIPE_FUZZ_SECONDS:-20}}"
cxx="${LORAPIPE_FUZZ_CXX:-clang++}"
if ! command -v "$cxx" >/dev/null; then echo "fuzz: $cxx not found (packaging/setup.sh installs clang)"; exit 1; fi
mkdir -p "$out"
flags=(-std=c++17 -O1 -g -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -DFMT_HEADER_ONLY=1
       -I"$root" $(pkg-config --cflags sentencepiece libpcre2-8 libutf8proc))
libs=($(pkg-config --libs sentencepiece libpcre2-8 libutf8proc libcrypto) -lpthread)
srcs=(base/safetensors base/file_io base/hash base/device_spec project/llama_config project/project text/tokenizer text/tokenizer_hf text/tokenizer_tiktoken text/text_unicode text/jinja_parse text/jinja_eval text/jinja_value text/chat_template
      data/instruct_dataset data/dataset project/lora_target)
# Objects once (in parallel), then one binary for every target.
pids=()
for s in "${srcs[@]}"; do
  o="$out/${s//\//_}.o"
  if [ ! -f "$o" ] || [ "$root/core/$s.cpp" -nt "$o" ]; then
    "$cxx" "${flags[@]}" -c "$root/core/$s.cpp" -o "$o" & pids+=($!)
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do sleep 0.2; done
done
for p in "${pids[@]}"; do wait "$p"; done
objs=(); for s in "${srcs[@]}"; do objs+=("$out/${s//\//_}.o"); done

names=(tokenizer_json jsonl_reader chat_template project_json safetensors)
seeds=("$root/tests/fixtures/tokenizers/tok512-metaspace/tokenizer.json $root/tests/fixtures/tokenizers/tok512-legacy/tokenizer.json"
       "$data/instruct/quiz_chat.jsonl $data/instruct/quiz_alpaca.jsonl"
       "$root/tests/fixtures/chat/llama3.jinja $root/tests/fixtures/chat/mistral.jinja $root/tests/fixtures/chat/llama31.jinja"
       "$root/resources/examples/stories260K-shakespeare.json $root/resources/examples/stories260K-quiz-chat.json"
       "$data/models/stories260K/hf-bf16/model.safetensors")
status=0
# One binary for every target (one compile and link instead of five); LORAPIPE_FUZZ_TARGET picks.
"$cxx" "${flags[@]}" -fsanitize=fuzzer "$root/tests/fuzz/fuzz_targets.cpp" "${objs[@]}" "${libs[@]}" -o "$out/fuzz_parsers"
for i in "${!names[@]}"; do
  n="${names[$i]}"; t=$((i + 1))
  corpus="$out/corpus_$n"; mkdir -p "$corpus"
  for f in ${seeds[$i]}; do [ -f "$f" ] && head -c 8192 "$f" > "$corpus/seed_$(basename "$f")"; done
  echo "fuzz_$n (LORAPIPE_FUZZ_TARGET=$t): ${secs}s"
  if ! (cd "$out" && LORAPIPE_FUZZ_TARGET=$t ASAN_OPTIONS=detect_leaks=1 ./fuzz_parsers "$corpus" -max_total_time="$secs" -max_len=16384 \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>"$out/fuzz_$n.log"); then
    echo "fuzz_$n FAILED (see $out/fuzz_$n.log; LORAPIPE_FUZZ_TARGET=$t $out/fuzz_parsers CRASH_FILE reproduces it):"
    tail -40 "$out/fuzz_$n.log"; status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$out/fuzz_$n.log" | tail -2 || true
  fi
done
exit $status
