#!/bin/sh
# The README's C++ quick start (examples/quickstart.cc) trains: one process, then two ranks
# under torchrun (the project venv's torchrun).
#   quickstart_test.sh <one|torchrun> <path to strata-quickstart>
set -u
mode=${1:?usage: quickstart_test.sh <one|torchrun> <strata-quickstart>}
bin=${2:?usage: quickstart_test.sh <one|torchrun> <strata-quickstart>}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
case "$mode" in
  one)
    OMP_NUM_THREADS=1 "$bin" 60 >"$out" 2>&1
    rc=$?
    expected="1 rank(s), 60 steps"
    ;;
  torchrun)
    . "$(dirname "$0")/../lib/torchrun.sh"  # $torchrun and $port: the venv's torchrun
    OMP_NUM_THREADS=1 timeout 300 $torchrun --nproc_per_node 2 \
      --master_addr 127.0.0.1 --master_port "$port" --no_python "$bin" 60 >"$out" 2>&1
    rc=$?
    expected="2 rank(s), 60 steps"
    ;;
  *)
    echo "unknown mode $mode"
    exit 2
    ;;
esac
cat "$out"
[ "$rc" -eq 0 ] || { echo "FAIL: exit status $rc"; exit 1; }
grep -q "$expected" "$out" || { echo "FAIL: no \"$expected\" in the output"; exit 1; }
grep -q "optimizer: 60 steps" "$out" || { echo "FAIL: the engine did not apply 60 steps"; exit 1; }
echo "PASS: quickstart $mode"
