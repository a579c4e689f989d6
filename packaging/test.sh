#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (ctest). GPU tests (label `gpu`) skip without a GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/packaging/setup.sh"
bash "$root/packaging/build.sh"
cd "${LORAPIPE_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 1800 "$@"
