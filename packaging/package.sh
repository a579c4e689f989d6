#!/usr/bin/env bash
# Builds the installable packages with CPack: lorapipe_<version>_amd64.deb and the relocatable
# lorapipe-<version>-linux-x86_64.tar.gz, into build/packages/ (LORAPIPE_PACKAGE_DIR). Sets up and
# builds first (packaging/setup.sh, packaging/build.sh) unless LORAPIPE_SKIP_BUILD=1.
#   LORAPIPE_PACKAGE_FORMATS="DEB;TGZ"   which CPack generators (CI builds only DEB)
#   LORAPIPE_DEB_COMPRESSION=gzip        the .deb's compression (gzip, xz, zstd)
# The packages bundle LibTorch and the NVIDIA libraries it loads (from the PyPI wheel in .venv),
# which makes them gigabytes; packaging/install.cmake says what goes in and where.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LORAPIPE_BUILD_DIR:-$root/build}"
out="${LORAPIPE_PACKAGE_DIR:-$build/packages}"
formats="${LORAPIPE_PACKAGE_FORMATS:-DEB;TGZ}"
log() { echo "[package] $*" >&2; }

if [ "${LORAPIPE_SKIP_BUILD:-0}" != 1 ]; then
  LORAPIPE_SETUP_PACKAGING=1 bash "$root/packaging/setup.sh"
  LORAPIPE_TARGETS="lorapipe-cli lorapipe lorapipe_man lorapipe_changelog" bash "$root/packaging/build.sh"
fi
[ -x "$build/app/lorapipe" ] && [ -x "$build/app/lorapipe-cli" ] || { log "no build in $build (run without LORAPIPE_SKIP_BUILD)"; exit 1; }
command -v help2man >/dev/null || { log "help2man is missing (packaging/setup.sh installs it)"; exit 1; }
cmake --build "$build" --target lorapipe_man lorapipe_changelog >/dev/null  # up to date with their sources

mkdir -p "$out"
trap 'rm -rf "$out/_CPack_Packages"' EXIT  # the staging copies: gigabytes, also when cpack fails
start=$(date +%s)
log "cpack -G '$formats' into $out"
(cd "$build" && cpack -G "$formats" -B "$out" >"$out/cpack.log" 2>&1) || { tail -30 "$out/cpack.log" >&2; exit 1; }
log "built in $(( $(date +%s) - start )) s:"
for f in "$out"/lorapipe*.deb "$out"/lorapipe*.tar.gz; do
  [ -f "$f" ] && log "  $f ($(du -h "$f" | cut -f1))"
done
exit 0
