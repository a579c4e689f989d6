#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for building lorapipe: Debian packages and LibTorch.
# LibTorch comes from the PyPI `torch` wheel in a project-local venv (.venv); if that wheel
# cannot be had, the script falls back to Debian's libtorch-dev and says so.
# Idempotent: every step checks first and is quick when everything is already there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LORAPIPE_VENV:-$root/.venv}"
log() { echo "[setup] $*" >&2; }

sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"

debs=(build-essential cmake ninja-build pkg-config python3-venv
      qt6-base-dev qt6-charts-dev libqt6opengl6-dev qt6-svg-dev
      libsqlite3-dev libssl-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libgtest-dev
      libsentencepiece-dev libpcre2-dev libutf8proc-dev libgloo-dev xvfb xauth clang libclang-rt-14-dev)
# Building and checking the packages (packaging/package.sh, the package_tests test) also needs these.
if [ "${LORAPIPE_SETUP_PACKAGING:-0}" = 1 ]; then
  debs+=(help2man lintian desktop-file-utils appstream libglib2.0-bin shared-mime-info dpkg-dev)
fi
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "Debian packages: all present"
fi

# LibTorch from the PyPI wheel (CUDA-enabled) in the project venv.
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv"
  "$py" -m venv "$venv"
fi
if "$venv/bin/python" -c "import torch, numpy" 2>/dev/null; then
  log "torch present in venv: $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
else
  log "installing torch (PyPI wheel) into $venv"
  if ! "$venv/bin/pip" install -q --disable-pip-version-check "torch>=2.1,<3" numpy safetensors; then
    log "PyPI torch could not be installed; falling back to Debian libtorch-dev (CPU, 1.13)"
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends libtorch-dev python3-torch >/dev/null
    echo "debian" > "$venv/.lorapipe_torch_source"
  fi
fi
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "pypi" > "$venv/.lorapipe_torch_source"
  log "LibTorch source: PyPI torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
fi
