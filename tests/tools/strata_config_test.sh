#!/usr/bin/env bash
# strata-config end to end: exit codes, messages, normalized output, docs/config.md.
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
check() {  # check NAME CONDITION...
  local name=$1
  shift
  if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAILED: $name"; fi
}
contains() { grep -qF -- "$2" "$1"; }

# A realistic ZeRO-3 NVMe config validates; the normalized document re-validates to itself.
"$bin" validate "$src/examples/configs/zero3_nvme_offload.json" --world-size 4 >"$tmp/n1.json" 2>"$tmp/err"
check "nvme example validates (exit 0)" test $? -eq 0
check "nvme example: derived accumulation" contains "$tmp/n1.json" '"gradient_accumulation_steps": 4'
check "nvme example: paths as a list" contains "$tmp/n1.json" '"/mnt/nvme1/strata"'
check "nvme example: block size in bytes" contains "$tmp/n1.json" '"block_size": 1048576'
"$bin" validate "$tmp/n1.json" --world-size 4 >"$tmp/n2.json"
check "normalized re-validates" test $? -eq 0
check "normalized round trip is stable" cmp -s "$tmp/n1.json" "$tmp/n2.json"
"$bin" validate "$src/examples/configs/zero3_cpu_offload.json" >/dev/null
check "cpu example validates" test $? -eq 0

# Bad files: exit 2 and every error named.
cat >"$tmp/bad.json" <<'JSON'
{
  "train_batch_size": 8,
  "zero_optimization": {"offload_optimizer": {"device": "nvme", "pinmemory": true}},
  "aio": {"queue_depth": 0}
}
JSON
"$bin" validate "$tmp/bad.json" >"$tmp/out" 2>"$tmp/err"
check "bad config exits 2" test $? -eq 2
check "bad config: nothing on stdout" test ! -s "$tmp/out"
check "bad config: suggestion" contains "$tmp/err" "zero_optimization.offload_optimizer.pinmemory: unknown key; did you mean pin_memory?"
check "bad config: range" contains "$tmp/err" "aio.queue_depth: 0 is out of range"
check "bad config: nvme_path required" contains "$tmp/err" "zero_optimization.offload_optimizer.nvme_path: required"
check "bad config: error count" contains "$tmp/err" "3 errors"
printf '{\n  "train_batch_size": 8,\n  "seed": 1,,\n}\n' >"$tmp/syntax.json"
"$bin" validate "$tmp/syntax.json" >/dev/null 2>"$tmp/err"
check "syntax error exits 2" test $? -eq 2
check "syntax error: line and column" contains "$tmp/err" "line 3, column 13"
"$bin" validate "$tmp/missing.json" >/dev/null 2>"$tmp/err"
check "missing file exits 2" test $? -eq 2
check "missing file named" contains "$tmp/err" "$tmp/missing.json"
"$bin" validate "$tmp/bad.json" --world-size 0 >/dev/null 2>"$tmp/err"
check "world size 0 refused" test $? -eq 2
"$bin" frobnicate >/dev/null 2>"$tmp/err"
check "unknown command exits 2" test $? -eq 2
check "unknown command named" contains "$tmp/err" 'unknown command "frobnicate"'

# defaults and docs/config.md.
"$bin" defaults >"$tmp/defaults"
check "defaults lists keys" contains "$tmp/defaults" "zero_optimization.offload_optimizer.pin_memory"
"$bin" defaults --markdown >"$tmp/config.md"
check "docs/config.md is generated from the code (regenerate: strata-config defaults --markdown > docs/config.md)" \
  cmp -s "$tmp/config.md" "$src/docs/config.md"

# topology.
"$bin" topology >"$tmp/topo"
check "topology exits 0" test $? -eq 0
check "topology names NUMA nodes" contains "$tmp/topo" "NUMA nodes:"

echo "strata-config: $pass passed, $fail failed"
test "$fail" -eq 0
