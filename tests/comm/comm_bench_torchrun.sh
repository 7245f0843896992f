#!/bin/sh
# Smoke test: starts bin/comm_bench through torchrun with 2 ranks (Gloo, loopback), small
# sizes, every result checked; once in fp32 and once in bf16 from 3 elements up (a total
# not divisible by the world size, and Gloo's fp32 reduction of bf16).
# usage: comm_bench_torchrun.sh <path to comm_bench>
# torchrun is the project venv's (tests/lib/torchrun.sh).
set -u
bench=${1:?usage: comm_bench_torchrun.sh <path to comm_bench>}
. "$(dirname "$0")/../lib/torchrun.sh"  # $torchrun and $port: the venv's torchrun
export OMP_NUM_THREADS=1  # one thread per rank
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run() {
  echo "+ torchrun --nproc_per_node 2 ... $bench $*"
  timeout 400 $torchrun --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port "$port" --no_python "$bench" --backend gloo --iters 3 --warmup 1 \
    --timeout 60 "$@" >"$log" 2>&1
  rc=$?
  cat "$log"
  if [ $rc -ne 0 ]; then
    echo "FAILED: comm_bench under torchrun exited with $rc"
    exit 1
  fi
  for want in "world size 2" "all_gather (" "reduce_scatter (" "all_reduce (" \
              "every result checked: ok"; do
    if ! grep -qF "$want" "$log"; then
      echo "FAILED: the output lacks '$want'"
      exit 1
    fi
  done
  if grep -q "FAILED" "$log"; then
    echo "FAILED: a check failed"
    exit 1
  fi
}

run --dtype fp32 --min-bytes 1KiB --max-bytes 256KiB
run --dtype bf16 --min-bytes 6 --max-bytes 3KiB

# The checker itself: a corrupted result must fail the run (one process, no torchrun).
echo "+ $bench --corrupt (must fail)"
env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT \
  "$bench" --corrupt --max-bytes 4KiB --iters 2 --warmup 0 >"$log" 2>&1
rc=$?
cat "$log"
if [ $rc -ne 1 ] || ! grep -q "check(s) FAILED" "$log"; then
  echo "FAILED: comm_bench --corrupt exited with $rc instead of failing its checks"
  exit 1
fi
echo "PASSED"
