#!/usr/bin/env bash
# The installable package, end to end (ctest `package_tests`): builds the .deb from the build tree
# with packaging/package.sh, extracts it with `dpkg-deb -x` into a temporary root, and checks that
#   - the files are where the layout says, RUNPATHs name only $ORIGIN, man pages and docs are there;
#   - every library the executables and the bundled libraries need is bundled or owned by a Debian
#     package the .deb's Depends names;
#   - the .desktop file and the AppStream metainfo validate, *.lorapipe.json files get the project
#     MIME type and open with lorapipe (GIO, as file managers ask), the icon exists in hicolor;
#   - from the extracted root, with the build tree, .venv and the CUDA toolkit hidden (a private
#     mount namespace) and no LD_LIBRARY_PATH: `lorapipe-cli --version`, a 20-step fine-tune of
#     stories260K, greedy generation with the adapter (equal to the build tree's), the run database
#     under $HOME's XDG data folder, the GUI offscreen opening the example project and quitting;
#     every library loaded comes from the package or the system, and nothing is written into the
#     installed tree;
#   - lintian reports no error (its output is printed; LORAPIPE_LINTIAN=full|ci|0, see below).
# Usage: check_package.sh BUILD_DIR SOURCE_DIR SHARED_DATA. Prints the time of each part.
set -euo pipefail
build="$(cd "$1" && pwd)"
src="$(cd "$2" && pwd)"
data="$(cd "$3" && pwd)"
work="$(mktemp -d -p "${TMPDIR:-/tmp}" lorapipe-pkg.XXXXXX)"  # ~6 GB while it runs: package, staging, extracted root
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
t_last=$(date +%s)
lap() { local now; now=$(date +%s); echo "[$((now - t_last)) s] $*"; t_last=$now; }

# --- build and extract -------------------------------------------------------------------------
# LORAPIPE_PACKAGE_DEB=FILE checks an existing package instead of building one.
if [ -n "${LORAPIPE_PACKAGE_DEB:-}" ]; then
  deb="$LORAPIPE_PACKAGE_DEB"
else
  LORAPIPE_SKIP_BUILD=1 LORAPIPE_PACKAGE_FORMATS=DEB LORAPIPE_BUILD_DIR="$build" LORAPIPE_PACKAGE_DIR="$work/out" \
    bash "$src/packaging/package.sh"
  deb=$(ls "$work"/out/lorapipe_*_amd64.deb)
fi
lap "package built: $(basename "$deb"), $(du -m "$deb" | cut -f1) MiB, Installed-Size $(($(dpkg-deb -f "$deb" Installed-Size) / 1024)) MiB"
root="$work/root"
dpkg-deb -x "$deb" "$root"
lap "extracted with dpkg-deb -x"

# --- layout --------------------------------------------------------------------------------------
for f in usr/bin/lorapipe usr/bin/lorapipe-cli usr/lib/lorapipe/bin/lorapipe usr/lib/lorapipe/bin/lorapipe-cli \
         usr/lib/lorapipe/lib/libtorch_cpu.so usr/lib/lorapipe/lib/libcudart.so.13 usr/lib/lorapipe/lib/libcaffe2_nvrtc.so \
         usr/share/applications/io.github.lorapipe.lorapipe.desktop usr/share/metainfo/io.github.lorapipe.lorapipe.metainfo.xml \
         usr/share/mime/packages/lorapipe.xml usr/share/icons/hicolor/scalable/apps/lorapipe.svg \
         usr/share/icons/hicolor/48x48/apps/lorapipe.png usr/share/icons/hicolor/256x256/apps/lorapipe.png \
         usr/share/man/man1/lorapipe-cli.1.gz usr/share/man/man1/lorapipe.1.gz usr/share/doc/lorapipe/copyright \
         usr/share/doc/lorapipe/changelog.gz usr/share/lorapipe/examples/stories260K-shakespeare.lorapipe.json \
         usr/share/lorapipe/licenses/lorapipe/COPYING usr/share/lorapipe/licenses/torch; do
  [ -e "$root/$f" ] || fail "the package lacks /$f"
done
ls "$root"/usr/lib/lorapipe/lib/libnvrtc-builtins.so.* >/dev/null || fail "the package lacks NVRTC's builtins"
[ "$(readlink "$root/usr/bin/lorapipe-cli")" = "../lib/lorapipe/bin/lorapipe-cli" ] || fail "/usr/bin/lorapipe-cli is not a relative link"
# A licence folder for every bundled NVIDIA component and for LibTorch.
for comp in cublas cuda_runtime cuda_nvrtc cufft cusparse cusparselt nccl_cu13 nvshmem_cu13 cudnn_cu13 cufile cuda_cupti; do
  ls "$root/usr/share/lorapipe/licenses/nvidia_$comp"/* >/dev/null 2>&1 || fail "no licence text for nvidia_$comp"
done
zcat "$root/usr/share/man/man1/lorapipe-cli.1.gz" | grep -q '^\.SS generate' || fail "the man page lacks the generate subcommand"
elfs=()
while IFS= read -r f; do
  if head -c 4 "$f" | grep -q $'\x7fELF'; then elfs+=("$f"); fi
done < <(find "$root/usr/lib/lorapipe" -type f)
# Every RPATH/RUNPATH entry, with $ORIGIN resolved, must stay inside the package's folder (an
# entry pointing elsewhere is searched first; an empty one means the current directory).
libdir="$root/usr/lib/lorapipe"
for f in "${elfs[@]}"; do
  rp=$(readelf -d "$f" | sed -n 's/.*R\(UN\)\{0,1\}PATH.*\[\(.*\)\]/\2/p')
  [ -n "$rp" ] || continue
  IFS=: read -r -a entries <<< "$rp:"
  for p in "${entries[@]}"; do
    if [ -z "$p" ]; then
      # cuSPARSELt ships RUNPATH "$ORIGIN:" (NVIDIA's, left unmodified); its NEEDED libraries are glibc's
      # and libgcc's, loaded before it, so the empty entry is never searched.
      [[ "$(basename "$f")" == libcusparseLt.so* ]] && continue
      fail "$(basename "$f") has an empty RPATH entry (the current directory)"
    fi
    resolved="${p//\$\{ORIGIN\}/$(dirname "$f")}"
    resolved=$(realpath -m "${resolved//\$ORIGIN/$(dirname "$f")}")
    [[ "$resolved" == "$libdir"* ]] || fail "$(basename "$f") has RPATH entry $p, outside the package ($resolved)"
  done
done
[ "$(readelf -d "$root/usr/lib/lorapipe/bin/lorapipe-cli" | sed -n 's/.*RUNPATH.*\[\(.*\)\]/\1/p')" = '$ORIGIN/../lib' ] ||
  fail "lorapipe-cli's RUNPATH is not \$ORIGIN/../lib"
lap "layout: ${#elfs[@]} ELF files, RUNPATHs relative"

# --- dependencies: bundled, or owned by a package the .deb depends on ------------------------------
depends=" $(dpkg-deb -f "$deb" Depends | sed 's/([^)]*)//g; s/,/ /g') "
/sbin/ldconfig -p >/dev/null || fail "/sbin/ldconfig -p failed"
declare -A owner_of
missing=0
for f in "${elfs[@]}"; do
  for lib in $(readelf -d "$f" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'); do
    [ -e "$root/usr/lib/lorapipe/lib/$lib" ] && continue
    # The NVIDIA driver's library: there when a GPU is (from the driver installer or non-free
    # packages), never a dependency; only libcaffe2_nvrtc (loaded on a GPU) links it.
    [ "$lib" = libcuda.so.1 ] && continue
    if [ -z "${owner_of[$lib]+x}" ]; then
      path=$(/sbin/ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ {print $NF}' | head -1 || true)
      pkg=""
      if [ -n "$path" ]; then
        pkg=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null | head -1 | cut -d: -f1 || true)
        [ -n "$pkg" ] || pkg=$(dpkg -S "$path" 2>/dev/null | head -1 | cut -d: -f1 || true)
      fi
      owner_of[$lib]="${pkg:-?}"
    fi
    pkg="${owner_of[$lib]}"
    if [[ "$depends" != *" $pkg "* ]]; then
      echo "  $(basename "$f") needs $lib, from package '${pkg}', which Depends does not name" >&2
      missing=1
    fi
  done
done
[ "$missing" = 0 ] || fail "Depends is incomplete"
lap "dependencies: every needed system library is in Depends (${#owner_of[@]} libraries: $(printf '%s\n' "${owner_of[@]}" | sort -u | tr '\n' ' '))"

# --- desktop integration -------------------------------------------------------------------------
desktop-file-validate "$root/usr/share/applications/io.github.lorapipe.lorapipe.desktop"
appstreamcli validate --no-net "$root/usr/share/metainfo/io.github.lorapipe.lorapipe.metainfo.xml"
update-mime-database "$root/usr/share/mime" >/dev/null 2>&1
update-desktop-database "$root/usr/share/applications" 2>/dev/null || true
mkdir -p "$work/files"
echo '{"schema_version": 2}' > "$work/files/my.lorapipe.json"
echo '{"other": 1}' > "$work/files/plain.json"
# TryExec=lorapipe: GIO lists the application only when lorapipe is on PATH, as /usr/bin is once installed.
gio_env=(env -i HOME="$work/giohome" PATH="$root/usr/bin:/usr/bin:/bin" XDG_DATA_HOME="$work/giohome/share" XDG_DATA_DIRS="$root/usr/share:/usr/share")
type=$("${gio_env[@]}" gio info -a standard::content-type "$work/files/my.lorapipe.json" | sed -n 's/.*standard::content-type: //p')
[ "$type" = application/x-lorapipe-project ] || fail "*.lorapipe.json has content type '$type'"
other=$("${gio_env[@]}" gio info -a standard::content-type "$work/files/plain.json" | sed -n 's/.*standard::content-type: //p')
[ "$other" = application/json ] || fail "a plain .json file became '$other'"
apps=$("${gio_env[@]}" gio mime application/x-lorapipe-project)
echo "$apps" | grep -q "io.github.lorapipe.lorapipe.desktop" || fail "no application opens application/x-lorapipe-project: $apps"
[ "$(sed -n 's/^Icon=//p' "$root/usr/share/applications/io.github.lorapipe.lorapipe.desktop")" = lorapipe ] || fail "Icon= is not lorapipe"
lap "desktop: .desktop and metainfo valid, *.lorapipe.json -> $type -> $(echo "$apps" | head -1)"

# --- run from the extracted root -------------------------------------------------------------------
home="$work/home"
mkdir -p "$home/projects"
project="$home/projects/shakespeare.lorapipe.json"
python3 - "$root/usr/share/lorapipe/examples/stories260K-shakespeare.lorapipe.json" "$project" "$data" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p["model"]["path"] = sys.argv[3] + "/models/stories260K/hf"
p["data"]["train"] = sys.argv[3] + "/text/tinyshakespeare.txt"
p["run"]["output_dir"] = "runs/shakespeare"
p["run"]["eval_interval"] = 10
json.dump(p, open(sys.argv[2], "w"), indent=2)
PY
prompt="Once upon a time"
# The build tree's answer, for comparison (run before hiding it), on an adapter trained by the package.
touch "$work/before-run"
runner="$work/run-installed.sh"
cat > "$runner" <<EOF
#!/usr/bin/env bash
# Runs inside the private mount namespace: the build tree, .venv and /usr/local/cuda are empty here.
set -euo pipefail
for d in "$build" "$src/.venv" /usr/local/cuda; do
  [ -d "\$d" ] && mount --bind "$work/empty" "\$d"
done
[ -z "\$(ls -A "$build")" ] || { echo "FAIL: the build tree is still visible"; exit 1; }
cd "$home"
export HOME="$home" PATH=/usr/bin:/bin QT_QPA_PLATFORM=offscreen LC_ALL=C.UTF-8
unset LD_LIBRARY_PATH XDG_DATA_HOME LORAPIPE_DB LORAPIPE_CLI
cli="$root/usr/bin/lorapipe-cli"
LD_DEBUG=libs timeout 120 "\$cli" --version > "$work/version.txt" 2> "$work/ld-version.txt"
timeout 600 "\$cli" train "$project" --steps 20 > "$work/train.out" 2> "$work/train.err"
timeout 300 "\$cli" generate --model "$data/models/stories260K/hf" --adapter "$home/projects/runs/shakespeare/adapter" \
  --prompt "$prompt" --max-new-tokens 24 --temperature 0 > "$work/generate.txt"
timeout 120 "\$cli" runs list --json > "$work/runs.json"
LD_DEBUG=libs timeout 300 "$root/usr/bin/lorapipe" --screenshots "$work/shots" "$project" > "$work/gui.out" 2> "$work/ld-gui.txt"
EOF
mkdir -p "$work/empty"
if unshare -m --propagation private true 2>/dev/null; then
  env -u LD_LIBRARY_PATH unshare -m --propagation private bash "$runner" || { tail -20 "$work"/train.err "$work"/gui.out 2>/dev/null; fail "the installed programs failed"; }
  hidden="build tree, .venv and /usr/local/cuda hidden"
else
  # No mount namespace here: the LD_DEBUG check below still proves where every library came from.
  sed -i 's/^  \[ -d "\$d" \] && mount.*/  :/; /the build tree is still visible/d' "$runner"
  env -u LD_LIBRARY_PATH bash "$runner" || { tail -20 "$work"/train.err "$work"/gui.out 2>/dev/null; fail "the installed programs failed"; }
  hidden="no mount namespace: nothing hidden, libraries checked with LD_DEBUG"
fi
lap "installed programs ran ($hidden)"

grep -q "^lorapipe-cli (lorapipe) [0-9]" "$work/version.txt" || fail "--version: $(head -1 "$work/version.txt")"
grep -q "^LibTorch [0-9]" "$work/version.txt" && grep -q "^CUDA " "$work/version.txt" || fail "--version lacks LibTorch or CUDA: $(cat "$work/version.txt")"
for log in "$work/ld-version.txt" "$work/ld-gui.txt"; do
  bad=$(sed -n 's/.*calling init: //p' "$log" | sort -u | grep -v -e "^$root/" -e '^/lib/' -e '^/usr/lib/' -e '^/lib64/' || true)
  [ -z "$bad" ] || fail "libraries loaded from outside the package and the system: $bad"
  grep -qF "calling init: $root/usr/lib/lorapipe/bin/../lib/libtorch_cpu.so" "$log" || fail "libtorch_cpu was not loaded from the package"
done
[ -f "$home/projects/runs/shakespeare/adapter/adapter_model.safetensors" ] || fail "no adapter after training"
[ -f "$home/.local/share/lorapipe/runs.db" ] || fail "the run database is not in \$HOME/.local/share/lorapipe"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r and r[0]['status']=='completed', r" "$work/runs.json" || fail "the run is not completed"
grep -q "step 20" "$work/train.err" || grep -q '"step": *20' "$work/train.err" || fail "training did not reach step 20: $(tail -3 "$work/train.err")"
ref=$(timeout 300 "$build/app/lorapipe-cli" generate --model "$data/models/stories260K/hf" --adapter "$home/projects/runs/shakespeare/adapter" \
      --prompt "$prompt" --max-new-tokens 24 --temperature 0 2>/dev/null)
[ "$(cat "$work/generate.txt")" = "$ref" ] || fail "generation differs from the build tree's: '$(cat "$work/generate.txt")' vs '$ref'"
for page in project data plan train runs try; do
  [ -s "$work/shots/$page.png" ] || fail "the GUI did not render its $page page"
done
written=$(find "$root" -newer "$work/before-run" | head -5)
[ -z "$written" ] || fail "the programs wrote into the installed tree: $written"
echo "  --version: $(tr '\n' ';' < "$work/version.txt")"
echo "  generated: $(cat "$work/generate.txt")"
lap "checks of the installed run: adapter, run database, generation equal to the build tree's, GUI pages"

# --- lintian -------------------------------------------------------------------------------------
# LORAPIPE_LINTIAN=full runs every check (about 4 minutes here); the default leaves out the three that
# read every byte of the 2.3 GB of bundled LibTorch and NVIDIA binaries (spelling of their strings,
# their hardening flags, file contents), which takes it to about 1.5 minutes; 0 skips lintian.
mode="${LORAPIPE_LINTIAN:-ci}"
if [ "$mode" != 0 ]; then
  command -v lintian >/dev/null || fail "lintian is missing (packaging/setup.sh installs it)"
  skip=()
  [ "$mode" = full ] || skip=(--dont-check-part binaries/spelling,binaries/hardening,files/contents)
  rc=0
  timeout 900 lintian --tag-display-limit 0 "${skip[@]}" "$deb" > "$work/lintian.txt" 2>&1 || rc=$?
  (grep -v "^running with root privileges" "$work/lintian.txt" || true) | sed 's/^/  lintian: /'
  [ "$rc" -le 1 ] || fail "lintian did not run to the end (exit $rc)"  # 1 = it found errors
  ! grep -q "^E: " "$work/lintian.txt" || fail "lintian reports errors"
  lap "lintian ($mode): $(grep -c '^E: ' "$work/lintian.txt" || true) errors, $(grep -c '^W: ' "$work/lintian.txt" || true) warnings"
fi
echo "package_tests: ok"
