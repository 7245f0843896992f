#!/usr/bin/env bash
# Smoke test of bench/host_step_bench (tiny sizes): every step mode runs with the
# accumulators zeroed and left in place, and only the lazy rows left chunks in place.
set -euo pipefail
bench="$1"
out="$("$bench" --params 256K --groups 4 --steps 2 --rounds 1 2>&1)"
echo "$out"
for mode in inside pipelined early; do
  zeroed=$(echo "$out" | awk -v m="$mode" '$1 == m && $2 == "zeroed" && $3 != "/" { print $6 }')
  lazy=$(echo "$out" | awk -v m="$mode" '$1 == m && $2 == "lazy" { print $6 }')
  [ "$zeroed" = "0" ] || { echo "FAIL: $mode, zeroed: '$zeroed' chunks left in place"; exit 1; }
  [ -n "$lazy" ] && [ "$lazy" -gt 0 ] || { echo "FAIL: $mode, lazy: '$lazy' chunks left"; exit 1; }
  echo "$out" | grep -q "^$mode *zeroed / lazy: iter" || { echo "FAIL: no ratio for $mode"; exit 1; }
done
echo "PASS"
