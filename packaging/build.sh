#!/usr/bin/env bash
# Configures and builds lorapipe into build/ (Ninja, Release). CUDA device code is compiled when nvcc
# exists (LORAPIPE_WITH_CUDA=ON); set LORAPIPE_WITH_CUDA=OFF to skip it. Extra CMake args pass through.
# LORAPIPE_TARGETS="lorapipe-cli ..." builds only those targets (the quickstart builds just the
# executables; the test command builds everything).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LORAPIPE_BUILD_DIR:-$root/build}"
cuda="${LORAPIPE_WITH_CUDA:-}"
if [ -z "$cuda" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then cuda=ON; else cuda=OFF; fi
fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLORAPIPE_WITH_CUDA="$cuda" "$@" >/dev/null
targets=()
for t in ${LORAPIPE_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
