#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a GPU (prepared so a short loan of one suffices):
# builds with CUDA (setup first unless LORAPIPE_SKIP_SETUP=1, e.g. when .venv and build/ came along),
# runs the `gpu` ctest label (CUDA device pieces, weight arena + release fence, pinned staging, peer
# copy, pipeline steps on cuda:0,0 and, with two GPUs, cuda:0,1 over peer and NCCL), then a short
# pipeline fine-tune of stories260K on two pipeline devices of GPU 0 through the CLI. Output is
# copied to $OUT (if set) for collection.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${OUT:-$root/build/gpu-run}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
[ "${LORAPIPE_SKIP_SETUP:-0}" = 1 ] || bash "$root/packaging/setup.sh"
LORAPIPE_WITH_CUDA=ON bash "$root/packaging/build.sh" 2>&1 | tail -5
cd "${LORAPIPE_BUILD_DIR:-$root/build}"
ctest -L gpu --output-on-failure -V 2>&1 | tee "$out/gpu_tests.txt"
LORAPIPE_DB="$out/runs.db" ./app/lorapipe-cli train "$root/resources/examples/stories260K-shakespeare.json" --steps 30 \
  --output "$out/run" --devices cuda:0,0 --schedule round-robin 2>&1 | tail -20 | tee "$out/train.txt"
# The layer profile on the GPU and the plan that charges it.
XDG_CACHE_HOME="$out/cache" ./app/lorapipe-cli plan "$root/resources/examples/stories260K-shakespeare.json" --devices cuda:0,0 \
  --profile 2>&1 | head -30 | tee "$out/plan_profile.txt"
