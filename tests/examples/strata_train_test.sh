#!/bin/sh
# Tests of the main job, strata-train (examples/, docs/strata-train.md).
#   strata_train_test.sh <case> <path to strata-train>
# Cases: help, bad_options, bad_config, baseline, metrics_jsonl, budget_refused,
# nvme_optimizer, nvme_params, nvme_soak_config, kill9, stages, plan, torchrun, resume, trace, two_nodes.
# Exit 0 pass, 1 fail, 77 (ctest SKIP_RETURN_CODE) with "SKIPPED: <reason>" when torchrun
# is not installed (torchrun case).
set -u
case_name=${1:?usage: strata_train_test.sh <case> <strata-train>}
bin=${2:?usage: strata_train_test.sh <case> <strata-train>}
src=$(cd "$(dirname "$0")/../.." && pwd)  # the source tree (scripts/stage_config.py)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=$tmp/out
err=$tmp/err

fail() {
  echo "FAIL: $*"
  echo "--- stdout:"; cat "$out" 2>/dev/null
  echo "--- stderr:"; cat "$err" 2>/dev/null
  exit 1
}

# run EXPECTED_RC args...: runs strata-train, checks its exit status.
run() {
  expected=$1
  shift
  echo "+ strata-train $*"
  "$bin" "$@" >"$out" 2>"$err"
  rc=$?
  [ "$rc" -eq "$expected" ] || fail "exit status $rc, expected $expected"
}

expect_in() {  # FILE PATTERN
  grep -q -- "$2" "$1" || fail "no \"$2\" in $(basename "$1")"
}

# nvme_config PARAMS: writes $tmp/nvme.json, the default config with the optimizer states
# on NVMe (the swap directory $tmp/swap; small sub-groups, the pipeline on) and, with
# PARAMS = 1, the working shards too (fewer buffers than groups, none kept in host memory);
# PARAMS = 2: both tiers as bench/soak.py sets them (their default buffers and sub-groups,
# every working shard on NVMe).
nvme_config() {
  "$bin" --print-config >"$tmp/default.json" 2>"$err" || fail "--print-config failed"
  mkdir "$tmp/swap"
  "${STRATA_PYTHON:-python3}" -c 'import json, sys
c = json.load(open(sys.argv[1]))
z = c["zero_optimization"]
if sys.argv[4] == "2":
    z["offload_optimizer"].update(device="nvme", nvme_path=[sys.argv[2]])
    z["offload_param"].update(device="nvme", nvme_path=[sys.argv[2]], max_in_cpu=0)
    c.pop("train_batch_size", None)
    json.dump(c, open(sys.argv[3], "w"))
    sys.exit(0)
z["sub_group_size"] = 20000
z["offload_optimizer"] = {"device": "nvme", "nvme_path": [sys.argv[2]], "buffer_count": 12,
                          "pipeline_read": True, "pipeline_write": True}
if sys.argv[4] == "1":
    z["offload_param"] = {"device": "nvme", "nvme_path": [sys.argv[2]], "buffer_count": 3,
                          "max_in_cpu": 0}
c.pop("train_batch_size", None)
json.dump(c, open(sys.argv[3], "w"))' "$tmp/default.json" "$tmp/swap" "$tmp/nvme.json" "$1" ||
    fail "could not write the nvme config"
}

# train_on_nvme PARAMS [MODEL]: with nvme_config PARAMS it trains MODEL (tiny) for 20 steps,
# agrees with plain LibTorch, reports the NVMe store(s), and leaves no swap file.
train_on_nvme() {
  nvme_config "$1"
  run 0 --model "${2:-tiny}" --steps 20 --baseline --no-progress --config "$tmp/nvme.json" \
    --resources-every 10
  expect_in "$out" "largest relative loss difference .* of steps 1-20 (within)"
  # What the process holds, with the swap files (open, nameless) counted.
  expect_in "$out" "resources at step 20: rss [1-9][0-9]* B, open fds [1-9][0-9]*, locked [0-9]* B, pinned [0-9]* B, swap files [1-9][0-9]* B"
  expect_in "$out" "nvme states: "
  if [ "$1" != 0 ]; then expect_in "$out" "nvme working shards: "; fi
  [ -z "$(ls -A "$tmp/swap")" ] || fail "swap files left in $tmp/swap: $(ls -A "$tmp/swap")"
}

case "$case_name" in
  help)
    run 0 --help
    for opt in --config --data --steps --model --layers --d-model --heads --seq-len --seed \
               --metrics --baseline --save-dir --save-every --resume; do
      expect_in "$out" "$opt"
    done
    run 0 --version
    expect_in "$out" "strata-train"
    ;;
  bad_options)
    run 2 --bogus
    expect_in "$err" "bogus"
    run 2 --model enormous
    expect_in "$err" "unknown preset"
    run 2 --steps 0
    expect_in "$err" "steps"
    run 2 --d-model 30 --heads 4
    expect_in "$err" "multiple of --heads"
    run 2 --baseline-check-steps -1
    expect_in "$err" "baseline-check-steps"
    run 2 --resources-every 0
    expect_in "$err" "resources-every needs a positive N"
    run 2 --peak-tflops 0
    expect_in "$err" "peak-tflops must be positive"
    run 2 --metrics "$tmp/metrics.txt"
    expect_in "$err" ".csv"
    run 2 --data "$tmp/does-not-exist.txt"
    expect_in "$err" "does-not-exist"
    ;;
  bad_config)
    printf '{"train_micro_batch_size_per_gpu": 2, "optimizr": {"type": "AdamW"}}\n' >"$tmp/bad.json"
    run 2 --config "$tmp/bad.json"
    expect_in "$err" "optimizr"
    expect_in "$err" "did you mean"
    printf '{"train_micro_batch_size_per_gpu": 2,' >"$tmp/syntax.json"
    run 2 --config "$tmp/syntax.json"
    expect_in "$err" "syntax.json"
    run 2 --config "$tmp/missing.json"
    expect_in "$err" "missing.json"
    ;;
  baseline)
    # fp32: the engine and plain LibTorch AdamW agree to 1e-5 at each of the first 20 steps,
    # and in their final mean loss to 3% (exit 5 otherwise).
    run 0 --model tiny --steps 30 --baseline --no-progress --metrics "$tmp/m.csv"
    expect_in "$out" "largest relative loss difference .* of steps 1-20 (within)"
    expect_in "$out" "after step 20 .*relative difference .* (within 0.03)"
    expect_in "$out" "engine statistics"
    expect_in "$out" "summary"
    # The default config overlaps the gradient reduction with the backward:
    # of the 4 blocks of tiny, at least 3 per backward are reduce-scattered before the
    # backward ends (60 backwards: 30 steps x 2 micro-steps), every one of those left in
    # flight beside the backward (two buckets of one block each).
    line=$(grep "^gradient buckets: " "$out") || fail "no gradient bucket statistics"
    launched=$(echo "$line" | sed -n 's/.* reduced, \([0-9]*\) launched during the backward, .*/\1/p')
    beside=$(echo "$line" | sed -n 's/.*, \([0-9]*\) of them in flight beside it, .*/\1/p')
    [ -n "$launched" ] && [ "$launched" -ge $((3 * 60)) ] ||
      fail "only '$launched' gradient buckets launched during 60 backwards of 4 blocks: $line"
    [ "$beside" = "$launched" ] || fail "not every launched bucket stayed in flight: $line"
    # With the accumulators in host memory every bucket's shards are added on the
    # reducer's thread (strata.accumulate_in_background, on by default).
    reduced=$(echo "$line" | sed -n 's/^gradient buckets: \([0-9]*\) reduced, .*/\1/p')
    added=$(echo "$line" | sed -n 's/.* in flight beside it, \([0-9]*\) added on the reducer.s thread .*/\1/p')
    [ -n "$added" ] && [ "$added" = "$reduced" ] ||
      fail "not every reduced bucket was added on the reducer's thread: $line"
    head -n 1 "$tmp/m.csv" >"$tmp/header"
    expect_in "$tmp/header" \
      "^step,loss,lr,tokens_per_s,device_bytes,device_peak_bytes,host_bytes,host_peak_bytes,elapsed_s,forward_s,backward_s,step_s,waited_s,tflops,mfu$"
    lines=$(wc -l <"$tmp/m.csv")
    [ "$lines" -eq 31 ] || fail "metrics.csv has $lines lines, expected 31"
    # Every row: 15 columns, step counting from 1, positive loss and host bytes (offloaded),
    # model TFLOPS, and no MFU (no --peak-tflops, no GPU).
    awk -F, 'NR > 1 { if (NF != 15 || $1 != NR - 1 || $2 <= 0 || $7 <= 0 || $8 < $7 || $6 < $5 || $10 <= 0 || $11 <= 0 || $12 <= 0 || $14 <= 0 || $15 != 0) bad = 1 }
             END { exit bad }' "$tmp/m.csv" || fail "malformed metrics row in m.csv"
    ;;
  metrics_jsonl)
    run 0 --model tiny --steps 5 --no-progress --metrics "$tmp/m.jsonl" --peak-tflops 0.25
    # The model FLOPs (core/throughput.h) of the tiny preset: 6 x 60.1k parameters +
    # attention 12 x 4 x 32 x 32, and the MFU against the given peak.
    expect_in "$out" "throughput: [0-9.]* tokens/s, [0-9.e+-]* model TFLOPS ([0-9.]* MFLOPs per token: 6 x [0-9]* parameters + attention 12 x 4 x 32 x 32), MFU [0-9.]*% of 0.25 TFLOPS per rank (--peak-tflops)"
    lines=$(wc -l <"$tmp/m.jsonl")
    [ "$lines" -eq 5 ] || fail "m.jsonl has $lines lines, expected 5"
    for key in step loss lr tokens_per_s device_bytes device_peak_bytes host_bytes \
               host_peak_bytes elapsed_s forward_s backward_s step_s waited_s tflops mfu; do
      n=$(grep -c "\"$key\":" "$tmp/m.jsonl")
      [ "$n" -eq 5 ] || fail "key $key in $n of 5 lines"
    done
    if "${STRATA_PYTHON:-python3}" -c 'import json' 2>/dev/null; then
      "${STRATA_PYTHON:-python3}" -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], rows
# Each step has a forward, a backward and an optimizer step that took time, within the
# wall time of the step (elapsed_s is printed to the millisecond).
prev = 0.0
for r in rows:
    assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["step_s"] > 0 and r["waited_s"] >= 0, r
    assert r["forward_s"] + r["backward_s"] + r["step_s"] <= r["elapsed_s"] - prev + 2e-3, r
    prev = r["elapsed_s"]
    # TFLOPS = tokens/s x model FLOPs per token; MFU = TFLOPS / the 0.25 given (1 rank).
    assert r["tflops"] > 0 and abs(r["mfu"] - r["tflops"] / 0.25) <= 1e-4 * r["mfu"] + 1e-9, r
' "$tmp/m.jsonl" ||
        fail "m.jsonl is not valid JSON lines"
    fi
    ;;
  resume)
    # 6 steps straight, or 3 (saving at 2 and 3) then --resume auto up to 6: the same losses
    # at steps 4-6, digit for digit (the data position travels in the checkpoint).
    run 0 --model tiny --steps 6 --no-progress --metrics "$tmp/full.csv"
    run 0 --model tiny --steps 3 --no-progress --save-dir "$tmp/ck" --save-every 2
    expect_in "$out" "saved $tmp/ck/global_step2"
    expect_in "$out" "saved $tmp/ck/global_step3"
    [ "$(cat "$tmp/ck/latest")" = global_step3 ] || fail "latest is not global_step3"
    run 0 --model tiny --steps 6 --no-progress --save-dir "$tmp/ck" --resume auto \
      --metrics "$tmp/resumed.csv"
    expect_in "$out" "resumed from $tmp/ck/global_step3 at step 3"
    tail -n 3 "$tmp/full.csv" | cut -d, -f1,2 >"$tmp/want"
    tail -n +2 "$tmp/resumed.csv" | cut -d, -f1,2 >"$tmp/got"
    cmp -s "$tmp/want" "$tmp/got" || fail "resumed losses differ: $(cat "$tmp/got") vs $(cat "$tmp/want")"
    # Another seed cannot continue this run; nothing left to train; usage errors.
    run 1 --model tiny --steps 8 --no-progress --seed 3 --resume "$tmp/ck"
    expect_in "$err" "resume with the same model, data and seed"
    run 1 --model tiny --steps 6 --no-progress --resume "$tmp/ck"
    expect_in "$err" "nothing left to train"
    run 2 --model tiny --resume auto
    expect_in "$err" "needs --save-dir"
    run 2 --model tiny --save-every 2
    expect_in "$err" "--save-every needs"
    # auto with no checkpoint yet: a fresh start.
    run 0 --model tiny --steps 1 --no-progress --save-dir "$tmp/fresh" --resume auto
    expect_in "$out" "starting at step 1"
    # A resumed run that learned passes its loss check (exit 0): the ratio is taken from the
    # loss of step 1, which the checkpoint keeps, not from the resumed segment's first step
    # (10 resumed steps alone have a ratio near 1, above the check's 0.70).
    run 0 --model tiny --steps 100 --no-progress --save-dir "$tmp/long"
    first=$(sed -n 's/.*summary: 100 steps.* loss \([0-9.]*\) -> .*/\1/p' "$out")
    [ -n "$first" ] || fail "no first loss in the summary"
    run 0 --model tiny --steps 110 --no-progress --save-dir "$tmp/long" --resume auto
    expect_in "$out" "resumed from $tmp/long/global_step100 at step 100"
    expect_in "$out" "summary: 110 steps, 1 rank(s), .* loss $first -> [0-9.]* (last 10-step mean) (resumed at step 100; first: step 1's, from the checkpoint), ratio 0\.[0-6][0-9]* (<= 0.70)"
    ;;
  budget_refused)
    "$bin" --print-config >"$tmp/default.json" 2>"$err" || fail "--print-config failed"
    sed 's/"device_budget": *[0-9][0-9]*/"device_budget": 4096/' "$tmp/default.json" \
      | grep -v '"train_batch_size"' >"$tmp/small_budget.json"
    grep -q '"device_budget": 4096' "$tmp/small_budget.json" || fail "could not set device_budget"
    run 1 --model tiny --steps 2 --no-progress --config "$tmp/small_budget.json"
    expect_in "$err" "strata.device_budget"
    expect_in "$err" "4096"
    ;;
  nvme_optimizer)
    train_on_nvme 0
    ;;
  plan)
    # --plan: the tier planner with the model's own numbers; the medium preset has
    # 1635584 parameters. It fits here with the default config; the ZeRO-Infinity example's
    # /mnt paths do not exist here: exit 2 naming them.
    run 0 --model medium --plan
    expect_in "$out" "plan: 1635584 parameters on 1 rank(s)"
    expect_in "$out" "fits this machine"
    run 2 --model medium --plan --config "$(dirname "$0")/../../examples/configs/zero3_nvme_offload.json"
    expect_in "$out" "optimizer NVMe buffers 12 x"
    expect_in "$err" "nvme_path /mnt/nvme0/strata: No such file or directory"
    expect_in "$out" "CPU-Adam: .* parameters/s (measured here: "
    # strata-config plan --model prints the same plan for the same preset and config.
    config_bin=$(dirname "$bin")/strata-config
    [ -x "$config_bin" ] || fail "no strata-config beside strata-train at $config_bin"
    run 0 --model medium --print-config
    cp "$out" "$tmp/medium.json"
    run 0 --model medium --plan --config "$tmp/medium.json" --adam-rate 1e9
    grep -v "^fits this machine" "$out" >"$tmp/train_plan"
    "$config_bin" plan "$tmp/medium.json" --model medium --adam-rate 1e9 --no-check \
      >"$tmp/config_plan" 2>"$err" || fail "strata-config plan --model medium failed"
    expect_in "$tmp/train_plan" "at 1e+09 parameters/s (given)"
    cmp -s "$tmp/train_plan" "$tmp/config_plan" ||
      fail "strata-train --plan and strata-config plan --model differ: $(diff "$tmp/train_plan" "$tmp/config_plan")"
    ;;
  nvme_params)
    train_on_nvme 1
    ;;
  nvme_soak_config)
    # The soak's configuration (its first steps failed once: the pipelined step's hand-over
    # of a new shard found every buffer held or being read ahead).
    train_on_nvme 2 small
    ;;
  stages)
    # ZeRO stages 1 and 2 from the config: parameters on the device, optimizer
    # states in host memory; each trains 20 steps in agreement with plain LibTorch.
    "$bin" --print-config >"$tmp/default.json" 2>"$err" || fail "--print-config failed"
    for stage in 1 2; do
      "${STRATA_PYTHON:-python3}" "$src/scripts/stage_config.py" "$tmp/default.json" "$tmp/stage.json" "$stage" ||
        fail "could not write the stage $stage config"
      run 0 --model tiny --steps 20 --baseline --no-progress --config "$tmp/stage.json"
      expect_in "$out" "ZeRO-$stage, "
      expect_in "$out" "largest relative loss difference .* of steps 1-20 (within)"
      if [ "$stage" = 1 ]; then
        expect_in "$out" "reduce-scatter 0 (0 B)"
      else
        expect_in "$out" "reduce-scatter [1-9][0-9]* ("
      fi
    done
    # Offloading parameters needs stage 3: a configuration error (exit 2) naming the key.
    sed 's/"stage": 3/"stage": 2/' "$tmp/default.json" | grep -v '"train_batch_size"' >"$tmp/bad.json"
    run 2 --model tiny --steps 2 --no-progress --config "$tmp/bad.json"
    expect_in "$err" "zero_optimization.offload_param.device"
    ;;
  kill9)
    # A training process killed with SIGKILL mid-run, with both tiers on NVMe and I/O in
    # flight, leaves nothing in its swap directory: the swap files never have a name there
    # (not even while it trains), and the kernel frees them with the process.
    nvme_config 1
    echo "+ strata-train --model tiny --steps 100000 --config nvme.json & (SIGKILL after 3 steps)"
    "$bin" --model tiny --steps 100000 --no-progress --config "$tmp/nvme.json" \
      --metrics "$tmp/k.csv" >"$out" 2>"$err" &
    pid=$!
    tries=0
    while [ "$(cat "$tmp/k.csv" 2>/dev/null | wc -l)" -lt 4 ]; do
      kill -0 "$pid" 2>/dev/null || fail "strata-train ended before it was killed"
      tries=$((tries + 1))
      if [ "$tries" -gt 1200 ]; then kill -9 "$pid"; fail "no 3 steps within 120 s"; fi
      sleep 0.1
    done
    # Its swap files are open in $tmp/swap (through /proc), and have no name there.
    ls -l "/proc/$pid/fd" 2>/dev/null | grep -q "$tmp/swap/" ||
      { kill -9 "$pid"; fail "strata-train has no file open under $tmp/swap"; }
    [ -z "$(ls -A "$tmp/swap")" ] ||
      { kill -9 "$pid"; fail "named entries in $tmp/swap while training: $(ls -A "$tmp/swap")"; }
    kill -9 "$pid"
    wait "$pid"
    rc=$?
    [ "$rc" -eq 137 ] || fail "strata-train ended with status $rc, not by SIGKILL (137)"
    [ -z "$(ls -A "$tmp/swap")" ] || fail "left in $tmp/swap after kill -9: $(ls -A "$tmp/swap")"
    ;;
  trace)
    # --trace: a Chrome trace whose spans show the overlap. Checked on the
    # spans' order, not on how long anything took.
    run 0 --model tiny --steps 4 --no-progress --trace "$tmp/t.json"
    expect_in "$out" "trace of rank 0 written to $tmp/t.json ([1-9][0-9]* spans)"
    expect_in "$out" "per step (ms, mean of 4): forward [0-9.]*, backward [0-9.]*, optimizer step"
    "${STRATA_PYTHON:-python3}" - "$tmp/t.json" <<'PY' || fail "the trace is wrong"
import json, sys
doc = json.load(open(sys.argv[1]))
ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
lanes = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
assert lanes == {"phase", "compute", "wait", "comm", "optimizer", "nvme"}, lanes
def spans(cat, prefix=""):
    return [e for e in ev if e["cat"] == cat and e["name"].startswith(prefix)]
fwd, bwd, steps = spans("phase", "forward"), spans("phase", "backward"), spans("phase", "step")
# 4 steps x 2 micro-steps (gradient accumulation 2), each a forward then a backward.
assert len(fwd) == 8 and len(bwd) == 8 and len(steps) == 8, (len(fwd), len(bwd), len(steps))
for f, b in zip(fwd, bwd):
    assert f["ts"] + f["dur"] <= b["ts"] + 1e-3, (f, b)
# Every block's forward and backward ran inside its phase.
blocks = {e["args"]["group"] for e in spans("compute", "backward ")}
assert len(blocks) >= 4, blocks
# The reductions overlap the backward: in every backward at least 3 of the 4 blocks'
# reduce-scatters were issued before the backward ended.
rs = spans("comm", "reduce-scatter")
for b in bwd:
    inside = [r for r in rs if b["ts"] <= r["ts"] < b["ts"] + b["dur"]]
    assert len(inside) >= 3, (b, inside)
# Prefetched all-gathers, waits and the CPU optimizer's passes are there too (the pipelined
# step's: one per group, "CPU optimizer step of <group>"); no NVMe traffic (host tiers).
assert spans("comm", "all-gather") and spans("optimizer", "CPU optimizer step of ")
assert not spans("nvme")
assert all(e["dur"] >= 0 for e in ev)
print(f"trace: {len(ev)} spans, {len(rs)} reduce-scatters")
PY
    run 2 --trace "$tmp/no/such/dir/t.json"
    expect_in "$err" "cannot write into"
    ;;
  torchrun)
    . "$(dirname "$0")/../lib/torchrun.sh"  # $torchrun and $port: the venv's torchrun
    echo "+ torchrun --nproc_per_node 2 ... strata-train --model tiny --steps 10 --baseline"
    OMP_NUM_THREADS=1 timeout 300 $torchrun --nproc_per_node 2 \
      --master_addr 127.0.0.1 --master_port "$port" --no_python "$bin" --model tiny \
      --steps 10 --baseline --no-progress --trace "$tmp/t.json" >"$out" 2>"$err"
    rc=$?
    [ "$rc" -eq 0 ] || fail "torchrun exit status $rc"
    grep -q "2 rank(s)" "$out" "$err" || fail "not trained on 2 ranks"
    # --trace on 2 ranks: one file per rank, named after the rank.
    for r in 0 1; do
      grep -q "trace of rank $r written to $tmp/t-rank$r.json" "$out" "$err" ||
        fail "rank $r's trace not written"
      [ -s "$tmp/t-rank$r.json" ] || fail "no $tmp/t-rank$r.json"
    done
    grep -q "within" "$out" "$err" || fail "2-rank run does not agree with the baseline"
    # On 2 ranks the gradient reductions and the all-gathers have communicators of their
    # own (the engine's lanes), duplicates of the one strata-train all-reduces its loss on.
    grep -q "all-gathers and gradient reductions on separate communicators (neither the engine's)" "$out" ||
      fail "the 2-rank run does not have both lanes"
    ;;
  two_nodes)
    # Two machines on one: network namespaces joined by a veth pair on a private
    # test subnet, torchrun --nnodes 2 --nproc-per-node 2 in each. (1) With GLOO_SOCKET_IFNAME
    # naming the veth, the tiny model trains with exactly the losses of 4 ranks on one node.
    # (2) Without it (the host name resolves to loopback) every rank fails at once with the
    # advice. (3) The second machine's processes killed mid-run: the first machine's ranks
    # stop with an error naming a lost rank; (4) resumed on the first machine alone (2 ranks,
    # the same global batch), the run goes on with the uninterrupted run's losses (1e-4).
    [ "$(id -u)" = 0 ] || { echo "SKIPPED: needs root to make network namespaces (ip netns)"; exit 77; }
    command -v ip >/dev/null 2>&1 || { echo "SKIPPED: no ip command (iproute2)"; exit 77; }
    . "$(dirname "$0")/../lib/torchrun.sh"
    na=strata$$a
    nb=strata$$b
    ip netns add "$na" 2>"$err" || { echo "SKIPPED: ip netns add failed: $(cat "$err")"; exit 77; }
    trap 'ip netns pids "$na" 2>/dev/null | xargs -r kill -9; ip netns pids "$nb" 2>/dev/null | xargs -r kill -9;
          ip netns del "$na" 2>/dev/null; ip netns del "$nb" 2>/dev/null; rm -rf "$tmp"' EXIT
    ip netns add "$nb" || fail "ip netns add $nb"
    ip link add sa$$ type veth peer name sb$$ || fail "ip link add veth"
    ip link set sa$$ netns "$na" && ip link set sb$$ netns "$nb" || fail "moving the veth ends"
    subnet=10.$((200 + $$ % 50)).$(($$ / 50 % 250))
    ip -n "$na" addr add "$subnet.1/24" dev sa$$ && ip -n "$nb" addr add "$subnet.2/24" dev sb$$ &&
      ip -n "$na" link set sa$$ up && ip -n "$nb" link set sb$$ up &&
      ip -n "$na" link set lo up && ip -n "$nb" link set lo up || fail "configuring the namespaces"
    # 8 samples a step: micro 1 x 2 accumulation steps on 4 ranks, x 4 on 2 ranks.
    "$bin" --print-config >"$tmp/default.json" 2>"$err" || fail "--print-config failed"
    "$py" -c 'import json, sys
c = json.load(open(sys.argv[1]))
c.update(train_batch_size=8, train_micro_batch_size_per_gpu=1)
c.pop("gradient_accumulation_steps", None)
json.dump(c, open(sys.argv[2], "w"))' "$tmp/default.json" "$tmp/c.json" || fail "could not write the config"
    train="--model tiny --no-progress --config $tmp/c.json"
    echo "+ torchrun --nproc_per_node 4 (one node) strata-train $train --steps 6"
    OMP_NUM_THREADS=1 timeout 300 $torchrun --nproc_per_node 4 --master_addr 127.0.0.1 \
      --master_port "$port" --no_python "$bin" $train --steps 6 --metrics "$tmp/one.csv" \
      >"$out" 2>"$err" || fail "4 ranks on one node failed"
    # node N: torchrun in namespace N (rendezvous at the first one's address).
    node() {  # N IFNAME|- OUT ARGS...
      n=$1; ifname=$2; o=$3; shift 3
      if [ "$n" = 0 ]; then ns=$na; else ns=$nb; fi
      if [ "$ifname" = - ]; then set -- env -u GLOO_SOCKET_IFNAME "$@"; else set -- env GLOO_SOCKET_IFNAME="$ifname" "$@"; fi
      ip netns exec "$ns" "$@" >"$o.out" 2>"$o.err"
    }
    echo "+ two namespaces x torchrun --nnodes 2 --nproc_per_node 2 strata-train $train --steps 6"
    for n in 0 1; do
      node "$n" "s$(printf '%s' ab | cut -c$((n + 1)))$$" "$tmp/two$n" env OMP_NUM_THREADS=1 timeout 300 \
        $torchrun --nnodes 2 --node_rank "$n" --nproc_per_node 2 --master_addr "$subnet.1" \
        --master_port "$port" --no_python "$bin" $train --steps 6 --metrics "$tmp/two$n.csv" &
      eval "pid$n=\$!"
    done
    wait "$pid0"; rc0=$?
    wait "$pid1"; rc1=$?
    [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] ||
      fail "two nodes: exit $rc0 and $rc1: $(tail -5 "$tmp/two0.err" "$tmp/two1.err")"
    grep -q "4 rank(s)" "$tmp/two0.out" || fail "node 0 did not train on 4 ranks: $(tail -3 "$tmp/two0.out")"
    cut -d, -f1,2 "$tmp/one.csv" >"$tmp/want"
    cut -d, -f1,2 "$tmp/two0.csv" >"$tmp/got"
    cmp -s "$tmp/want" "$tmp/got" || fail "two nodes' losses differ from one node's: $(cat "$tmp/got") vs $(cat "$tmp/want")"

    echo "+ the same without GLOO_SOCKET_IFNAME: every rank fails at once with the advice"
    for n in 0 1; do
      node "$n" - "$tmp/lo$n" env OMP_NUM_THREADS=1 timeout 120 \
        $torchrun --nnodes 2 --node_rank "$n" --nproc_per_node 2 --master_addr "$subnet.1" \
        --master_port "$port" --no_python "$bin" $train --steps 6 &
      eval "pid$n=\$!"
    done
    wait "$pid0"; rc0=$?
    wait "$pid1"; rc1=$?
    [ "$rc0" -ne 0 ] && [ "$rc0" -ne 124 ] && [ "$rc1" -ne 0 ] && [ "$rc1" -ne 124 ] ||
      fail "without GLOO_SOCKET_IFNAME: exit $rc0 and $rc1 (0: trained, 124: hung)"
    for n in 0 1; do
      [ "$(grep -c "resolves to a loopback address but the ranks span several hosts; set GLOO_SOCKET_IFNAME" "$tmp/lo$n.err")" -ge 2 ] ||
        fail "node $n's ranks did not both give the advice: $(tail -5 "$tmp/lo$n.err")"
    done

    echo "+ 4 ranks on two nodes, checkpoints every 2 steps, node 1 killed after step 5"
    mkdir "$tmp/ck"
    for n in 0 1; do
      node "$n" "s$(printf '%s' ab | cut -c$((n + 1)))$$" "$tmp/k$n" env OMP_NUM_THREADS=1 timeout 300 \
        $torchrun --nnodes 2 --node_rank "$n" --nproc_per_node 2 --master_addr "$subnet.1" \
        --master_port "$port" --no_python "$bin" $train --steps 100000 --save-dir "$tmp/ck" \
        --save-every 2 --metrics "$tmp/k$n.csv" &
      eval "pid$n=\$!"
    done
    tries=0
    while [ "$(cat "$tmp/k0.csv" 2>/dev/null | wc -l)" -lt 6 ]; do
      tries=$((tries + 1))
      [ "$tries" -le 1800 ] || fail "no 5 steps on two nodes within 180 s"
      sleep 0.1
    done
    ip netns pids "$nb" | xargs -r kill -9
    wait "$pid1"
    start=$(date +%s)
    wait "$pid0"; rc0=$?
    took=$(($(date +%s) - start))
    [ "$rc0" -ne 0 ] && [ "$rc0" -ne 124 ] || fail "node 0 after node 1 was killed: exit $rc0"
    [ "$took" -le 60 ] || fail "node 0 took $took s to stop after node 1 was killed"
    grep -q "lost rank [23]" "$tmp/k0.err" "$tmp/k0.out" ||
      fail "node 0's error does not name a lost rank: $(tail -5 "$tmp/k0.err")"
    last=$(cat "$tmp/ck/latest") || fail "no checkpoint was written"
    at=${last#global_step}
    echo "+ resumed on node 0 alone (2 ranks) from $last, to step $((at + 4))"
    node 0 "sa$$" "$tmp/r" env OMP_NUM_THREADS=1 timeout 300 \
      $torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" --no_python "$bin" \
      $train --steps $((at + 4)) --save-dir "$tmp/ck" --resume auto --metrics "$tmp/r.csv" ||
      fail "the resume on one node failed: $(tail -5 "$tmp/r.err")"
    grep -q "resumed from $tmp/ck/$last at step $at" "$tmp/r.out" || fail "did not resume from $last"
    echo "+ the uninterrupted run to step $((at + 4)) on 4 ranks, one node"
    OMP_NUM_THREADS=1 timeout 300 $torchrun --nproc_per_node 4 --master_addr 127.0.0.1 \
      --master_port "$port" --no_python "$bin" $train --steps $((at + 4)) --metrics "$tmp/full.csv" \
      >"$out" 2>"$err" || fail "the uninterrupted run failed"
    "$py" - "$tmp/full.csv" "$tmp/r.csv" "$at" <<'PY' || fail "the resumed losses differ"
import csv, sys
full = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(sys.argv[1]))}
got = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(sys.argv[2]))}
at = int(sys.argv[3])
assert sorted(got) == list(range(at + 1, at + 5)), sorted(got)
for s, v in got.items():
    assert abs(v - full[s]) <= 1e-4 * abs(full[s]), (s, v, full[s])
print("resumed losses within 1e-4 of the uninterrupted run:", got)
PY
    ;;
  *)
    echo "unknown case $case_name"
    exit 2
    ;;
esac
echo "PASS: $case_name"
