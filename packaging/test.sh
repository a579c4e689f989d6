#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (ctest). GPU tests (label `gpu`) skip without a GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LORAPIPE_SETUP_PACKAGING=1 bash "$root/packaging/setup.sh"  # with the packaging tools: package_tests builds the .deb
# Test-only: transformers and PEFT make the model-family fixtures and check lorapipe's adapters.
venv="${LORAPIPE_VENV:-$root/.venv}"
if ! "$venv/bin/python" -c "import transformers, peft" 2>/dev/null; then
  echo "[test] installing transformers and peft (test oracles) into $venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "transformers>=5.0,<6" "peft>=0.17,<1"
fi
bash "$root/packaging/build.sh"
cd "${LORAPIPE_BUILD_DIR:-$root/build}"
rc=0
ctest --output-on-failure --timeout 1800 "$@" || rc=$?
if [ "$rc" -ne 0 ] && [ -f Testing/Temporary/LastTest.log ]; then
  # The failed assertions again, last: a CI log cut in the middle still ends with them.
  echo "[test] failed assertions (from $(pwd)/Testing/Temporary/LastTest.log):" >&2
  grep -a -A6 -E ': Failure$|^FAIL' Testing/Temporary/LastTest.log | cut -c1-300 | tail -n 40 >&2 || true
fi
exit "$rc"
