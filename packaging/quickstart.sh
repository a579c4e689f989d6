#!/usr/bin/env bash
# The main job for a newcomer: set up, build, and run a real LoRA fine-tune of stories260K on Tiny
# Shakespeare (progress, loss, tokens/s, samples before and after). Pass another project file to
# train something else: bash packaging/quickstart.sh my-project.json
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/packaging/setup.sh"
LORAPIPE_TARGETS="lorapipe-cli lorapipe" bash "$root/packaging/build.sh"  # the executables only; tests build with test.sh
project="${1:-$root/resources/examples/stories260K-shakespeare.json}"
exec "${LORAPIPE_BUILD_DIR:-$root/build}/app/lorapipe-cli" train "$project"
