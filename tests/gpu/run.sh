#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a GPU (prepared so a short loan of one suffices):
# builds with CUDA, runs the `gpu` ctest label (CUDA device pieces, weight arena + release fence,
# pinned staging, peer copy, pipeline steps on cuda:0,0 and, with two GPUs, cuda:0,1 over peer and
# NCCL; the CUDA probe and layer profiler; two processes on cuda:0,0 over Gloo and, with two GPUs,
# on cuda:0,1 over NCCL, each against one process: tests/gpu/dist_gpu_test.py), then a short pipeline fine-tune of stories260K on two
# pipeline devices of GPU 0 through the CLI, and `plan --profile` on them. Output goes to $OUT (if set).
#
# Two ways to get the build's dependencies:
# - a machine with network: packaging/setup.sh (skipped when LORAPIPE_SKIP_SETUP=1);
# - a bare lent machine with CUDA, CMake, Ninja and a PyTorch but no network: LORAPIPE_GPU_KIT=.gpukit,
#   made here by tests/gpu/make_kit.sh (Debian -dev packages unpacked, the test model and text), and
#   the PyTorch of the `python3` on PATH. Only gpu_tests and lorapipe-cli are built (no GUI).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${OUT:-$root/build/gpu-run}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
kit="${LORAPIPE_GPU_KIT:-}"
if [ -n "$kit" ]; then
  kit="$(cd "$root" && cd "$kit" && pwd)"
  build="${LORAPIPE_BUILD_DIR:-$root/build-gpu}"
  usr="$kit/root/usr"
  for pc in "$usr"/lib/x86_64-linux-gnu/pkgconfig/*.pc "$usr"/share/pkgconfig/*.pc; do
    sed -i "s|^prefix=/usr\$|prefix=$usr|" "$pc"
  done
  export LD_LIBRARY_PATH="$usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PKG_CONFIG_PATH="$usr/lib/x86_64-linux-gnu/pkgconfig:$usr/share/pkgconfig"
  pyprefix="$(python3 -c 'import sys; print(sys.prefix)')"
  torchcm="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee "$out/torch.txt"
  # The example project reads ../shared/data beside the checkout.
  [ -e "$root/../shared/data" ] || { mkdir -p "$root/../shared" && ln -sfn "$kit/data" "$root/../shared/data"; }
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  pkgc="$(command -v pkg-config || echo "$usr/bin/pkgconf")"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLORAPIPE_WITH_CUDA=ON -DLORAPIPE_BUILD_GUI=OFF \
    -DLORAPIPE_VENV="$pyprefix" -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_PREFIX_PATH="$usr;$torchcm" \
    -DOPENSSL_ROOT_DIR="$usr" -DPKG_CONFIG_EXECUTABLE="$pkgc" -DLORAPIPE_TEST_DATA="$kit/data" \
    -DTORCH_CUDA_ARCH_LIST="9.0" > "$out/configure.txt" 2>&1 || { tail -40 "$out/configure.txt"; exit 1; }
  cmake --build "$build" -j "$(nproc)" --target gpu_tests lorapipe-cli -- -k 0 > "$out/build.txt" 2>&1 \
    || { grep -E "error|Error" "$out/build.txt" | head -40; }
else
  build="${LORAPIPE_BUILD_DIR:-$root/build}"
  [ "${LORAPIPE_SKIP_SETUP:-0}" = 1 ] || bash "$root/packaging/setup.sh"
  LORAPIPE_WITH_CUDA=ON bash "$root/packaging/build.sh" 2>&1 | tail -5
fi
cd "$build" || exit 1
timeout 300 ctest -L gpu --output-on-failure -V > "$out/gpu_tests.txt" 2>&1; echo "gpu ctest rc=$?"
grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|tests passed|PASSED|FAILED" "$out/gpu_tests.txt" | head -40
LORAPIPE_DB=/tmp/lorapipe-gpu-runs.db timeout 180 ./app/lorapipe-cli train "$root/resources/examples/stories260K-shakespeare.json" --steps 30 \
  --output /tmp/lorapipe-gpu-run --devices cuda:0,0 --schedule round-robin > "$out/train.txt" 2>&1; echo "train rc=$?"
tail -8 "$out/train.txt"
# The layer profile on the GPU and the plan that charges it.
XDG_CACHE_HOME=/tmp/lorapipe-gpu-cache timeout 120 ./app/lorapipe-cli plan "$root/resources/examples/stories260K-shakespeare.json" \
  --devices cuda:0,0 --profile > "$out/plan_profile.txt" 2>&1; echo "plan rc=$?"
head -40 "$out/plan_profile.txt"
