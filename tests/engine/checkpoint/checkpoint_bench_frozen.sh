#!/usr/bin/env bash
# Smoke test of bench/checkpoint_bench --frozen (tiny sizes): it runs, saves and loads the
# three layouts (format 1, format 2, frozen values left out), and prints a median for each,
# the format-2 rank file smaller than format 1's and the left-out one smaller still.
set -euo pipefail
bench="$1"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
out="$("$bench" --dir "$dir" --params 64K --frozen 1M --rounds 1 2>&1)"
echo "$out"
[ "$(echo "$out" | grep -c '^median')" -eq 3 ] || { echo "FAIL: three medians expected"; exit 1; }
bytes() { echo "$out" | grep "^median *$1" | awk '{for (i = 1; i <= NF; ++i) if ($i ~ /iB$/) { print $(i-1), $i; exit } }'; }
echo "rank files: format 1 $(bytes 'fp32'), format 2 $(bytes 'bf16'), left out $(bytes 'left')"
to_kib() { awk -v n="$1" -v u="$2" 'BEGIN { m = (u == "MiB") ? 1024 : (u == "GiB") ? 1048576 : 1; print n * m }'; }
f1=$(to_kib $(bytes 'fp32')); f2=$(to_kib $(bytes 'bf16')); f3=$(to_kib $(bytes 'left'))
awk -v a="$f1" -v b="$f2" -v c="$f3" 'BEGIN { exit !(a > b && b > c) }' ||
  { echo "FAIL: expected format 1 > format 2 > left out"; exit 1; }
echo "PASS"
