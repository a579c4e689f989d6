#!/usr/bin/env bash
# Renders resources/icons/lorapipe.svg into the hicolor PNG sizes the packages install
# (resources/icons/hicolor/<N>x<N>/apps/lorapipe.png). Run after changing the SVG; needs rsvg-convert
# (Debian: librsvg2-bin). The PNGs are committed so that building a package needs no SVG renderer.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for n in 16 22 24 32 48 64 128 256 512; do
  out="$root/resources/icons/hicolor/${n}x${n}/apps"
  mkdir -p "$out"
  rsvg-convert -w "$n" -h "$n" "$root/resources/icons/lorapipe.svg" -o "$out/lorapipe.png"
done
