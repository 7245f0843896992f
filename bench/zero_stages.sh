#!/usr/bin/env bash
# Step time of ZeRO stages 1, 2 and 3 on strata-train's medium model, 2 gloo
# ranks under the venv's torchrun, one thread per rank, interleaved rounds, medians.
#   bench/zero_stages.sh [STEPS] [ROUNDS]       (defaults 24 and 3)
#   STRATA_BUILD_DIR=build  STRATA_PYTHON=.venv/bin/python  RANKS=2
# Every stage runs strata-train's default config with the optimizer states in host memory
# (offload_optimizer cpu), the parameters not offloaded (offload_param none: stages 1 and 2
# keep them on the device) and a device budget of 64 MiB (the CPU device's arena) for all
# three. A stage's step time is the median over rounds of the median over steps 5..STEPS of
# the elapsed time between consecutive steps (rank 0's metrics file). The collectives line
# is rank 0's engine statistics of the last round.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
steps=${1:-24}
rounds=${2:-3}
ranks=${RANKS:-2}
build=${STRATA_BUILD_DIR:-build}
py=${STRATA_PYTHON:-$root/.venv/bin/python}
bin=$build/bin/strata-train
torchrun=$(dirname "$py")/torchrun
[ -x "$bin" ] || { echo "zero_stages: no $bin (build first)" >&2; exit 1; }
[ -x "$torchrun" ] || { echo "zero_stages: no torchrun beside $py" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$bin" --model medium --print-config >"$tmp/default.json" 2>/dev/null || exit 1
for stage in 1 2 3; do
  "$py" "$root/scripts/stage_config.py" "$tmp/default.json" "$tmp/stage$stage.json" "$stage" || exit 1
done

port=$((29600 + RANDOM % 2000))
echo "zero_stages: strata-train --model medium, $ranks ranks, $steps steps, $rounds rounds (CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'))"
for round in $(seq 1 "$rounds"); do
  # Rotate the order so that no stage always runs first.
  case $((round % 3)) in
    1) order="1 2 3" ;;
    2) order="2 3 1" ;;
    0) order="3 1 2" ;;
  esac
  for stage in $order; do
    port=$((port + 1))
    OMP_NUM_THREADS=1 "$torchrun" --nproc_per_node "$ranks" --master_addr 127.0.0.1 \
      --master_port "$port" --no_python "$bin" --model medium --steps "$steps" --no-progress \
      --config "$tmp/stage$stage.json" --metrics "$tmp/m$stage.$round.csv" \
      >"$tmp/out$stage" 2>&1 || { echo "zero_stages: stage $stage failed:"; tail -n 20 "$tmp/out$stage"; exit 1; }
    t=$("$py" - "$tmp/m$stage.$round.csv" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
el = [float(r["elapsed_s"]) for r in rows]
d = [b - a for a, b in zip(el, el[1:])][3:]
print(f"{statistics.median(d):.4f}")
EOF
)
    echo "$t" >>"$tmp/t$stage"
    echo "zero_stages: round $round stage $stage: median step $t s"
  done
done
echo
printf "%-6s %-16s %s\n" stage "step (median s)" "collectives (rank 0, last round)"
for stage in 1 2 3; do
  med=$(sort -n "$tmp/t$stage" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  coll=$(grep -m1 "^collectives:" "$tmp/out$stage" | sed 's/^collectives: //')
  printf "%-6s %-16s %s\n" "$stage" "$med" "$coll"
done
