#!/usr/bin/env bash
# Set-up, configure, build and run every test (GoogleTest through ctest, then pytest).
#   scripts/test.sh                    everything (installs packages first: needs root/sudo)
#   STRATA_SKIP_SETUP=1 scripts/test.sh    skip the apt-get step
#   STRATA_BUILD_DIR=build-x            build directory (default: build)
#   STRATA_JOBS=N                       parallel build and test jobs (default: 2)
#   extra arguments are passed to cmake at configure time, e.g. -DSTRATA_CUDA=OFF
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=${STRATA_BUILD_DIR:-build}
jobs=${STRATA_JOBS:-2}

if [ "${STRATA_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh || { echo "test: set-up failed" >&2; exit 1; }
fi

echo "test: configuring $build"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" || exit 1
echo "test: building with $jobs jobs"
cmake --build "$build" -j "$jobs" || exit 1

echo "test: GoogleTest suites (ctest)"
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900)
ctest_rc=$?
# ctest counts skipped tests but does not say why: print each skip with its reason.
if [ -f "$build/Testing/Temporary/LastTest.log" ]; then
  awk '/: Skipped$/ {getline reason; r = reason} /^\[  SKIPPED \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+$/ && r != "" {print "SKIPPED " $4 ": " r; r = ""}' \
    "$build/Testing/Temporary/LastTest.log" | sort -u
fi

echo "test: Python tests (pytest)"
if [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import pytest' 2>/dev/null; then
  STRATA_BUILD_DIR="$root/$build" /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider tests/python
  pytest_rc=$?
else
  echo "test: /usr/bin/python3 has no pytest (install python3-pytest: scripts/setup.sh)" >&2
  pytest_rc=1
fi

if [ "$ctest_rc" -ne 0 ] || [ "$pytest_rc" -ne 0 ]; then
  echo "test: FAILED (ctest exit $ctest_rc, pytest exit $pytest_rc)"
  exit 1
fi
echo "test: all tests passed"
