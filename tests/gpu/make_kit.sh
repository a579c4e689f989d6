#!/usr/bin/env bash
# Prepares .gpukit/ (git-ignored) for a lent GPU machine that has CUDA, CMake, Ninja and a PyTorch
# with its headers but no network and none of our Debian libraries: the Debian -dev packages the build
# needs, unpacked (headers, .so, CMake and pkg-config files; about 17 MiB), and the stories260K model
# and Tiny Shakespeare the GPU tests and the example project read. tests/gpu/run.sh uses it when
# LORAPIPE_GPU_KIT points at it (the device tool carries it with `carry: [".gpukit"]`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
kit="$root/.gpukit"
data="${LORAPIPE_TEST_DATA:-$root/../shared/data}"
grep -qx '/.gpukit/' "$root/.git/info/exclude" 2>/dev/null || echo /.gpukit/ >> "$root/.git/info/exclude"
rm -rf "$kit" && mkdir -p "$kit/debs" "$kit/root" "$kit/data/models" "$kit/data/text"
(cd "$kit/debs" && apt-get download nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libsentencepiece-dev \
  libsentencepiece0 libprotobuf-lite32 libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libsqlite3-dev \
  libsqlite3-0 libssl-dev libssl3 libgtest-dev libgmock-dev libgloo-dev pkgconf pkgconf-bin libpkgconf3 >/dev/null)
for f in "$kit"/debs/*.deb; do dpkg -x "$f" "$kit/root"; done
rm -rf "$kit/debs" "$kit"/root/usr/share/{doc,man,lintian}
lib="$kit/root/usr/lib/x86_64-linux-gnu"
rm -rf "$lib"/{libcrypto.a,libssl.a,libsqlite3.a,libutf8proc.a,libpcre2-8.a,engines-3,ossl-modules} \
  "$lib"/libpcre2-{16,32,posix}*
cp -r "$data/models/stories260K" "$kit/data/models/"
cp "$data/text/tinyshakespeare.txt" "$kit/data/text/"
du -sh "$kit"
