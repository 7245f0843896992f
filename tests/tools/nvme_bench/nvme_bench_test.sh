#!/usr/bin/env bash
# nvme_bench end to end: --quick prints the table and a snippet that strata-config
# accepts; --json, --plot and --snippet files; bad options exit 2 naming the option;
# SIGINT and SIGTERM leave the measured directory empty and exit non-zero.
#   nvme_bench_test.sh NVME_BENCH STRATA_CONFIG
set -u
bin=$(realpath "$1")
cfg=$(realpath "$2")
py=/usr/bin/python3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/nvme_bench_sh.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
pass=0
fail=0
check() {  # check NAME CONDITION...
  local name=$1
  shift
  if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAILED: $name"; fi
}
contains() { grep -qF -- "$2" "$1"; }
empty_dir() { [ -d "$1" ] && [ -z "$(ls -A "$1")" ]; }

# --- --quick in a fresh current directory (no --path): a private directory there. -----
mkdir "$tmp/work"
(cd "$tmp/work" && "$bin" --quick --json "$tmp/out.json" --plot "$tmp/out.svg" \
  --snippet "$tmp/snippet.json" >"$tmp/out" 2>"$tmp/err")
rc=$?
check "--quick exits 0 (stderr: $(tail -3 "$tmp/err" | tr '\n' ' '))" test $rc -eq 0
check "--quick: table header" contains "$tmp/out" "p99 us"
check "--quick: units stated" contains "$tmp/out" "GB/s = 10^9 bytes/s"
check "--quick: memory kind named" contains "$tmp/out" "memory:      hugepage asked; got"
check "--quick: engine named" contains "$tmp/out" "engine:"
check "--quick: best read" contains "$tmp/out" "best read:"
check "--quick: best write" contains "$tmp/out" "best write:"
check "--quick: snippet" contains "$tmp/out" '"nvme_read_bandwidth"'
check "--quick: nothing left in the current directory" empty_dir "$tmp/work"
check "--quick: progress on stderr" contains "$tmp/err" "nvme_bench: [8/8]"
rows=$(grep -cE '^(read|write) ' "$tmp/out")
check "--quick: 8 rows in the table (got $rows)" test "$rows" -eq 8

# The snippet, cut from stdout, merged into a config, validates as it is.
sed -n '/^config snippet/,/^}$/p' "$tmp/out" | tail -n +2 >"$tmp/snippet_stdout.json"
"$py" - "$tmp/snippet_stdout.json" "$tmp/config.json" <<'PY'
import json, sys
snippet = json.load(open(sys.argv[1]))
config = {"train_batch_size": 8}
config.update(snippet)
json.dump(config, open(sys.argv[2], "w"), indent=2)
PY
check "snippet from stdout is JSON" test $? -eq 0
"$cfg" validate "$tmp/config.json" >"$tmp/validated" 2>"$tmp/verr"
check "strata-config validate accepts the snippet ($(cat "$tmp/verr"))" test $? -eq 0
check "validated config keeps the block size" grep -q '"block_size": [0-9]' "$tmp/validated"
"$py" -c 'import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); sys.exit(a!=b)' \
  "$tmp/snippet_stdout.json" "$tmp/snippet.json"
check "--snippet file equals the printed snippet" test $? -eq 0

# --json: parses, every point has the keys.
"$py" - "$tmp/out.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
keys = ["mode", "block_size", "queue_depth", "threads", "memory", "gbps", "iops", "p50_us", "p99_us"]
assert len(j["points"]) == 8, len(j["points"])
for p in j["points"]:
    for k in keys:
        assert k in p, (k, p)
    assert p["mode"] in ("read", "write"), p
    assert p["gbps"] > 0 and p["iops"] > 0 and p["p99_us"] >= p["p50_us"] > 0, p
for k in ["machine", "settings", "best", "config_snippet", "units"]:
    assert k in j, k
assert j["settings"]["memory_obtained"], j["settings"]
assert j["settings"]["direct"] is True
PY
check "--json parses and has the keys" test $? -eq 0

# --plot: well-formed XML with an svg root, lines and labels.
"$py" - "$tmp/out.svg" <<'PY'
import sys, xml.dom.minidom
doc = xml.dom.minidom.parse(sys.argv[1])
root = doc.documentElement
assert root.tagName == "svg", root.tagName
assert root.getAttribute("xmlns") == "http://www.w3.org/2000/svg"
assert len(doc.getElementsByTagName("polyline")) == 4  # 2 block sizes x 2 modes
texts = " ".join(t.firstChild.data for t in doc.getElementsByTagName("text") if t.firstChild)
for word in ("read", "write", "queue depth", "GB/s", "128 KiB", "1 MiB"):
    assert word in texts, word
PY
check "--plot writes a well-formed SVG" test $? -eq 0

# --buffered says the page cache is in play.
mkdir "$tmp/buf"
"$bin" --quick --buffered --path "$tmp/buf" --mode read --block-size 1M --queue-depth 4 \
  --no-progress >"$tmp/bout" 2>"$tmp/berr"
check "--buffered exits 0 ($(tail -2 "$tmp/berr" | tr '\n' ' '))" test $? -eq 0
check "--buffered: page cache noted" contains "$tmp/bout" "page cache is in play"
check "--buffered: directory empty" empty_dir "$tmp/buf"

# --help, --version.
"$bin" --help >"$tmp/help"
check "--help exits 0" test $? -eq 0
check "--help lists --queue-depth" contains "$tmp/help" "--queue-depth"
"$bin" --version >"$tmp/ver"
check "--version exits 0" test $? -eq 0
check "--version names the tool" contains "$tmp/ver" "nvme_bench"

# --- bad options: exit 2, the option named, nothing on stdout, nothing created. --------
bad() {  # bad OPTION-TEXT-EXPECTED ARGS...
  local want=$1
  shift
  "$bin" "$@" >"$tmp/bout" 2>"$tmp/berr"
  local rc=$?
  check "bad '$*' exits 2 (got $rc)" test $rc -eq 2
  check "bad '$*' names $want ($(head -1 "$tmp/berr"))" contains "$tmp/berr" "$want"
  check "bad '$*' prints nothing on stdout" test ! -s "$tmp/bout"
}
mkdir "$tmp/bad"
cd "$tmp/bad" || exit 1
bad "--queue-depth" --queue-depth 0
bad "--queue-depth" --queue-depth 4,x
bad "--block-size" --block-size 1000
bad "--block-size" --block-size 1M,,2M
bad "--mode" --mode reed
bad "--memory" --memory gpu
bad "--size" --size lots
bad "--size" --size 4K
bad "--threads" --threads 0
bad "--rounds" --rounds x
bad "--engine" --engine libaio
bad "--backlog" --backlog -1
bad "--backlog" --backlog some
bad "--path" --path "$tmp/does-not-exist"
bad "given twice" --path "$tmp/bad" --path "$tmp/bad/."
bad "--buffered" --direct --buffered
bad "frobnicate" --frobnicate
cd "$tmp" || exit 1
check "bad options created nothing" empty_dir "$tmp/bad"

# --- interrupted: SIGINT and SIGTERM leave the directory empty, exit 128+N. ------------
interrupt() {  # interrupt SIGNAL EXPECTED-RC
  local sig=$1 want=$2 dir="$tmp/sig-$1"
  mkdir "$dir"
  "$bin" --path "$dir" --size 256MiB --seconds 30 --rounds 3 --no-progress \
    >"$tmp/sout" 2>"$tmp/serr" &
  local pid=$!
  pids+=("$pid")
  local seen=0
  for _ in $(seq 1 300); do  # up to 30 s for the data file to appear
    if compgen -G "$dir/nvme_bench.*/data" >/dev/null; then seen=1; break; fi
    sleep 0.1
  done
  check "$sig: the data file appeared" test $seen -eq 1
  sleep 0.5
  kill "-$sig" "$pid"
  wait "$pid"
  local rc=$?
  check "$sig: exit status $want (got $rc; $(tail -2 "$tmp/serr" | tr '\n' ' '))" test $rc -eq "$want"
  check "$sig: directory left empty ($(ls -A "$dir" 2>&1 | tr '\n' ' '))" empty_dir "$dir"
  check "$sig: says it was interrupted" contains "$tmp/serr" "interrupted"
}
interrupt INT 130
interrupt TERM 143

echo "nvme_bench: $pass passed, $fail failed"
test "$fail" -eq 0
