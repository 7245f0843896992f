#!/usr/bin/env bash
# Set-up, configure, build and run every test (GoogleTest through ctest, then pytest, then
# the sanitizer builds' tests: scripts/sanitize.sh, then the fuzzers for 20 s each:
# scripts/fuzz.sh).
#   scripts/test.sh                    everything (installs packages first: needs root/sudo)
#   STRATA_SKIP_SETUP=1 scripts/test.sh    skip scripts/setup.sh (Debian packages and .venv)
#   STRATA_BUILD_DIR=build-x            build directory (default: build)
#   STRATA_JOBS=N                       parallel build and test jobs (default: 2)
#   STRATA_VENV=DIR                     the virtual environment (default: <repo>/.venv)
#   STRATA_FUZZ_SECONDS=N               seconds per fuzz target (default 20; 0 skips them)
#   STRATA_SANITIZE=0                   skip the ASan+UBSan and TSan runs (default: both)
#   extra arguments are passed to cmake at configure time, e.g. -DSTRATA_CUDA=OFF
# Each stage prints its wall time; the last line sums them up.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=${STRATA_BUILD_DIR:-build}
jobs=${STRATA_JOBS:-2}
venv=${STRATA_VENV:-$root/.venv}
py=$venv/bin/python

times=()
stage_start=0
begin() {
  stage_start=$(date +%s)
  echo "test: == $1"
}
end() {
  local t=$(($(date +%s) - stage_start))
  times+=("$1 ${t}s")
  echo "test: == $1 took ${t} s"
}
summary() { echo "test: stage times: ${times[*]}"; }

if [ "${STRATA_SKIP_SETUP:-0}" != 1 ]; then
  begin set-up
  bash scripts/setup.sh || { echo "test: set-up failed" >&2; exit 1; }
  end set-up
fi

begin configure
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSTRATA_PYTHON_EXECUTABLE="$py" "$@" || exit 1
end configure

begin build
echo "test: building with $jobs jobs"
cmake --build "$build" -j "$jobs" || exit 1
end build

begin ctest
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900)
ctest_rc=$?
# ctest counts skipped tests but does not say why: print each skip with its reason.
if [ -f "$build/Testing/Temporary/LastTest.log" ]; then
  awk '/: Skipped$/ {getline reason; r = reason} /^\[  SKIPPED \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+$/ && r != "" {print "SKIPPED " $4 ": " r; r = ""}' \
    "$build/Testing/Temporary/LastTest.log" | sort -u
fi
end ctest

begin pytest
rm -f "$build/pytest.log" "$build/pytest-delaying.log"
if "$py" -c 'import pytest' 2>/dev/null; then
  STRATA_BUILD_DIR="$root/$build" "$py" -m pytest -q -rfEs -p no:cacheprovider tests/python |
    tee "$build/pytest.log"
  pytest_rc=$?
  # The front end's engine tests again on the delaying CPU device (docs/engine/device.md, "The
  # device seam": every copy and event completes after a random delay) and with the state
  # store's relocating test mode (docs/engine/step.md, "The state store": every chunk of
  # optimizer state moves at every release and its old bytes become NaN; on NVMe every write
  # goes to a fresh slot and the slot it replaces becomes NaN on disk), with the NVMe
  # checkpoint resumes too.
  echo "test: Python engine tests on the delaying CPU device (STRATA_CPU_DEVICE_DELAY_SEED=17)" \
    "with the relocating state store (STRATA_TEST_RELOCATING_STORE=1)"
  STRATA_CPU_DEVICE_DELAY_SEED=17 STRATA_TEST_RELOCATING_STORE=1 \
    STRATA_BUILD_DIR="$root/$build" "$py" -m pytest -q -rfEs \
    -p no:cacheprovider tests/python/test_engine.py tests/python/test_transformers.py \
    tests/python/test_safetensors.py tests/python/test_huggingface.py tests/python/test_peft.py \
    tests/python/test_trainer.py \
    "tests/python/test_checkpoint.py::test_resume_in_a_new_process_is_bit_identical[1-bf16-nvme]" \
    "tests/python/test_checkpoint.py::test_resume_in_a_new_process_is_bit_identical[2-fp32-nvme]" \
    "tests/python/test_checkpoint.py::test_resume_in_a_new_process_is_bit_identical[2-fp16-nvme]" |
    tee "$build/pytest-delaying.log"
  async_rc=$?
  [ "$pytest_rc" -ne 0 ] || pytest_rc=$async_rc
else
  echo "test: $py has no pytest (scripts/setup.sh installs requirements.txt into the venv)" >&2
  pytest_rc=1
fi
end pytest

# ASan + UBSan over every torch-free test, TSan over the comm and engine-core tests
# (build-asan, build-tsan; scripts/sanitize.sh; STRATA_SANITIZE=0 skips).
begin sanitize
if [ "${STRATA_SANITIZE:-1}" != 0 ]; then
  scripts/sanitize.sh
  sanitize_rc=$?
else
  echo "test: STRATA_SANITIZE=0: sanitizer runs skipped"
  sanitize_rc=0
fi
end sanitize

# The parsers under libFuzzer with ASan + UBSan, 20 s per target (a clang build in
# build-fuzz; scripts/fuzz.sh; STRATA_FUZZ_SECONDS=0 skips).
begin fuzz
if [ "${STRATA_FUZZ_SECONDS:-20}" != 0 ]; then
  scripts/fuzz.sh
  fuzz_rc=$?
else
  echo "test: STRATA_FUZZ_SECONDS=0: fuzzers not run"
  fuzz_rc=0
fi
end fuzz

summary
# What failed, again at the end (the stages after it push a failure's lines far up):
# ctest's failed tests, pytest's FAILED/ERROR lines; the whole logs stay in the build folder.
if [ -s "$build/Testing/Temporary/LastTestsFailed.log" ] && [ "$ctest_rc" -ne 0 ]; then
  sed 's/^/test: ctest failed: /' "$build/Testing/Temporary/LastTestsFailed.log"
fi
for log in "$build/pytest.log" "$build/pytest-delaying.log"; do
  [ -f "$log" ] && grep -E '^(FAILED|ERROR) ' "$log" | sed "s|^|test: $(basename "$log" .log): |"
done
if [ "$ctest_rc" -ne 0 ] || [ "$pytest_rc" -ne 0 ] || [ "$sanitize_rc" -ne 0 ] ||
  [ "$fuzz_rc" -ne 0 ]; then
  echo "test: FAILED (ctest exit $ctest_rc, pytest exit $pytest_rc, sanitize exit $sanitize_rc," \
    "fuzz exit $fuzz_rc)"
  exit 1
fi
echo "test: all tests passed"
