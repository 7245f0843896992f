#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan + libFuzzer) in
# build-fuzz and runs each for STRATA_FUZZ_SECONDS (default 20) over a copy of its seed
# corpus (tests/fuzz/corpus/<name>; inputs it finds go to build-fuzz/corpus/<name>).
#   scripts/fuzz.sh                        every target, 20 s each (what scripts/test.sh runs)
#   STRATA_FUZZ_SECONDS=600 scripts/fuzz.sh config   one target, 10 minutes
# Exit status: 0 when no target crashed, leaked, hung or failed a check; else 1 (the
# reproducer is build-fuzz/crash-*; rerun it with build-fuzz/bin/fuzz_<name> FILE).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${STRATA_FUZZ_BUILD_DIR:-build-fuzz}
secs=${STRATA_FUZZ_SECONDS:-20}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config nvme_bench_json bytes safetensors checkpoint_manifest peer_address)

for cc in clang clang++; do
  command -v "$cc" >/dev/null || { echo "fuzz: $cc not found (scripts/setup.sh installs clang)" >&2; exit 1; }
done
mkdir -p "$build"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DSTRATA_FUZZ=ON \
  -DSTRATA_TORCH=OFF -DSTRATA_PYTHON=OFF -DSTRATA_TESTS=OFF -DSTRATA_BENCH=OFF \
  -DSTRATA_CUDA=OFF -DBUILD_SHARED_LIBS=OFF >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j "${STRATA_JOBS:-2}" --target strata_fuzz_all || exit 1

rc=0
for t in "${targets[@]}"; do
  bin=$build/bin/fuzz_$t
  [ -x "$bin" ] || { echo "fuzz: no target fuzz_$t" >&2; rc=1; continue; }
  mkdir -p "$build/corpus/$t"
  log=$build/fuzz_$t.log
  (cd "$build" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     "bin/fuzz_$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
     "corpus/$t" "../tests/fuzz/corpus/$t") >"$log" 2>&1
  status=$?
  runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$')
  cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -n 1)
  if [ "$status" -eq 0 ]; then
    echo "fuzz: fuzz_$t: ${runs:-?} inputs in ${secs} s, ${cov:-cov: ?}, 0 crashes, 0 leaks, 0 timeouts"
  else
    echo "fuzz: fuzz_$t FAILED (exit $status); log $log:"
    grep -E "ERROR|SUMMARY|Test unit written|==[0-9]+==" "$log" | head -n 20
    rc=1
  fi
done
exit $rc
