#!/usr/bin/env bash
# nvme_bench against fio, in one run, on the same filesystem, with the same file size,
# block size, queue depth and O_DIRECT (the swap engine's bandwidth target: nvme_bench >= 0.95
# of the best fio bandwidth, for read and for write).
#
#   bench/nvme_vs_fio.sh [--nvme-bench BIN] [--dir DIR] [--rounds N] [--size 1GiB]
#                        [--bs 1M] [--qd 16] [--seconds S] [--out DIR]
#                        [--nvme-bench-args "ARGS"]   (extra options, e.g. "--backlog 0")
#
# Each round runs nvme_bench once (read then write, --memory hugepage, default backlog),
# then four fio variants: ordinary buffers (--mem=malloc) and huge-page buffers
# (--mem=shmhuge), each without and with registered buffers (fixedbufs=0/1); nvme_bench
# is compared with the best of them. Like nvme_bench, which creates, fills, reads, writes
# and removes a fresh file in every run, each fio variant gets a fresh file written in
# full (untimed), then reads it and writes it. Rounds interleave the tools so drift
# (other load, the VM's host) spreads over all of them; the table shows the medians.
# fio: ioengine=io_uring, registerfiles=1, one job, direct=1.
#
# --seconds 0 (the default) measures one pass over the file per measurement for both
# tools (fio without time_based, nvme_bench --seconds 0); --seconds S > 0 runs each for
# S seconds (fio --time_based --runtime=S, nvme_bench --seconds S: whole passes).
#
# Huge pages for fio's shmhuge: reserves enough hugetlbfs pages (root writes
# /proc/sys/vm/nr_hugepages) and restores the old value on exit. Without root, the
# shmhuge variant is skipped and the table says so.
#
# The table names the best fio variant for each direction, beside the device's request limits
# (max_segments): what separates the variants.
#
# Needs: fio (with the io_uring engine), /usr/bin/python3. Exit 0 when it measured; it
# does not fail on the ratio (the table states it) — a benchmark reports, it does not
# judge.
set -u
set -o pipefail

here=$(cd "$(dirname "$0")" && pwd)
nvme_bench=""
dir=$PWD
rounds=5
size=1GiB
bs=1M
qd=16
seconds=0
out=""
nb_args=""
py=/usr/bin/python3

usage() {
  sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}
while [ $# -gt 0 ]; do
  case $1 in
    --nvme-bench) nvme_bench=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --bs) bs=$2; shift 2 ;;
    --qd) qd=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --nvme-bench-args) nb_args=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "nvme_vs_fio.sh: unknown option $1" >&2; usage 2 ;;
  esac
done

if [ -z "$nvme_bench" ]; then
  for c in "$here/../build/bin/nvme_bench" "$here/../build-nvb/bin/nvme_bench" \
           "$(command -v nvme_bench 2>/dev/null)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then nvme_bench=$c; break; fi
  done
fi
[ -x "$nvme_bench" ] || { echo "nvme_vs_fio.sh: nvme_bench not found; give --nvme-bench BIN" >&2; exit 2; }
command -v fio >/dev/null || { echo "nvme_vs_fio.sh: fio not found" >&2; exit 2; }
fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*io_uring' ||
  { echo "nvme_vs_fio.sh: this fio has no io_uring engine" >&2; exit 2; }
[ -d "$dir" ] || { echo "nvme_vs_fio.sh: --dir $dir is not a directory" >&2; exit 2; }
case $rounds in '' | *[!0-9]* | 0) echo "nvme_vs_fio.sh: --rounds must be >= 1" >&2; exit 2 ;; esac

# fio reads sizes with k/m/g as powers of 1024 (kb_base=1024), as nvme_bench does.
fio_size=$(echo "$size" | sed -E 's/([0-9.]+)[[:space:]]*([KMGT])i?B?$/\1\2/I')
fio_bs=$(echo "$bs" | sed -E 's/([0-9.]+)[[:space:]]*([KMGT])i?B?$/\1\2/I')

work=$(mktemp -d "$dir/nvme_vs_fio.XXXXXX") || exit 1
raw=${out:-$work/raw}
mkdir -p "$raw"
old_hugepages=$(cat /proc/sys/vm/nr_hugepages)
restore() {
  if [ -n "${hugepages_changed:-}" ]; then
    echo "$old_hugepages" >/proc/sys/vm/nr_hugepages 2>/dev/null ||
      echo "nvme_vs_fio.sh: could not restore vm.nr_hugepages to $old_hugepages" >&2
  fi
  rm -f "$work/fio.dat"
  if [ -z "$out" ]; then rm -rf "$raw"; fi
  rmdir "$work" 2>/dev/null
}
trap restore EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Huge pages for fio's shmhuge buffers: iodepth x bs, plus slack.
bs_bytes=$("$py" -c '
import re, sys
m = re.fullmatch(r"([0-9.]+)\s*([KMGT]?)(i?B?)", sys.argv[1], re.I)
print(int(float(m.group(1)) * 1024 ** "_KMGT".index((m.group(2) or "_").upper())))' "$fio_bs")
need_pages=$(( (qd * bs_bytes) / (2 * 1024 * 1024) + 8 ))
shmhuge=1
if [ -w /proc/sys/vm/nr_hugepages ]; then
  want=$((old_hugepages + need_pages))
  echo "$want" >/proc/sys/vm/nr_hugepages && hugepages_changed=1
  got=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$got" -lt "$want" ]; then
    echo "nvme_vs_fio.sh: reserved only $got of $want huge pages (memory fragmented?)" >&2
    [ "$got" -ge "$need_pages" ] || shmhuge=0
  fi
else
  echo "nvme_vs_fio.sh: cannot reserve huge pages (not root); skipping fio --mem=shmhuge" >&2
  shmhuge=0
fi

echo "nvme_bench vs fio: $size file, block $bs, queue depth $qd, O_DIRECT, $rounds rounds"
echo "directory:  $work ($(df -T "$work" | awk 'NR==2 {print $2 " on " $1}'))"
echo "kernel:     $(uname -r); $(nproc) CPUs; fio $(fio --version)"
# The block device's request limits: a request of B bytes in 4 KiB pages needs B/4096
# segments (fewer where neighbouring pages happen to be contiguous), in 2 MiB huge pages one
# per 2 MiB; past max_segments the kernel splits it. What the fio variants differ in.
dev=$(df --output=source "$work" | tail -1)
blk=$(basename "$(readlink -f "$dev")" 2>/dev/null)
q=/sys/block/$blk/queue
[ -d "$q" ] || q=/sys/class/block/$blk/../queue
if [ -r "$q/max_segments" ]; then
  echo "device:     $blk: max_segments $(cat "$q/max_segments"), max_sectors_kb $(cat "$q/max_sectors_kb"), a $bs request = $(( $(numfmt --from=iec "$bs") / 4096 )) pages of 4 KiB"
fi
echo "nvme_bench: $nvme_bench $nb_args"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "huge pages: vm.nr_hugepages $old_hugepages -> $(cat /proc/sys/vm/nr_hugepages) (restored on exit)"

fio_common=(--name=nvme_vs_fio "--filename=$work/fio.dat" "--size=$fio_size" "--bs=$fio_bs"
  "--iodepth=$qd" --direct=1 --ioengine=io_uring --registerfiles=1
  --numjobs=1 --output-format=json)
if [ "$seconds" != 0 ]; then fio_common+=(--time_based "--runtime=$seconds"); fi

variants=(malloc-fixedbufs0 malloc-fixedbufs1)
[ "$shmhuge" = 1 ] && variants+=(shmhuge-fixedbufs0 shmhuge-fixedbufs1)
for r in $(seq 1 "$rounds"); do
  printf 'round %d/%d: nvme_bench' "$r" "$rounds"
  if ! "$nvme_bench" --path "$work" --size "$size" --block-size "$bs" --queue-depth "$qd" \
      --threads 1 --mode read,write --direct --memory hugepage --seconds "$seconds" \
      --rounds 1 --no-progress --json "$raw/nvme_bench-$r.json" $nb_args >"$raw/nvme_bench-$r.txt" \
      2>"$raw/nvme_bench-$r.err"; then
    echo
    echo "nvme_vs_fio.sh: nvme_bench failed:" >&2
    cat "$raw/nvme_bench-$r.err" >&2
    exit 1
  fi
  for v in "${variants[@]}"; do
    mem=${v%-*}
    fixed=${v##*-fixedbufs}
    # A fresh file written in full, then read, then written: what nvme_bench does with its
    # own file in every run (create, fallocate, fill; read; write; remove).
    rm -f "$work/fio.dat"
    if ! fio "${fio_common[@]}" --rw=write --mem=malloc --fallocate=native \
        --output="$raw/fio-layout.json" >/dev/null 2>"$raw/fio-layout.err"; then
      echo
      echo "nvme_vs_fio.sh: fio failed laying out its file:" >&2
      cat "$raw/fio-layout.err" >&2
      exit 1
    fi
    for rw in read write; do
      printf ', fio %s %s' "$rw" "$v"
      if ! fio "${fio_common[@]}" "--rw=$rw" "--mem=$mem" "--fixedbufs=$fixed" \
          --output="$raw/fio-$v-$rw-$r.json" >/dev/null 2>"$raw/fio-$v-$rw-$r.err"; then
        echo
        echo "nvme_vs_fio.sh: fio failed:" >&2
        cat "$raw/fio-$v-$rw-$r.err" >&2
        exit 1
      fi
    done
  done
  rm -f "$work/fio.dat"
  echo
done
echo "load after:  $(cut -d' ' -f1-3 /proc/loadavg)"

"$py" - "$raw" "$rounds" "${variants[@]}" <<'PY'
import json, statistics, sys
raw, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def nb(mode):
    out = []
    for r in range(1, rounds + 1):
        j = json.load(open(f"{raw}/nvme_bench-{r}.json"))
        out += [p["gbps"] for p in j["points"] if p["mode"] == mode]
    return out

def fio(mem, mode):
    out = []
    for r in range(1, rounds + 1):
        j = json.load(open(f"{raw}/fio-{mem}-{mode}-{r}.json"))
        out.append(j["jobs"][0][mode]["bw_bytes"] / 1e9)
    return out

j1 = json.load(open(f"{raw}/nvme_bench-1.json"))
rpt = j1["points"][0].get("requests_per_thread", "?")
rows = [(f"nvme_bench ({j1['settings']['engine']}, {rpt} submitted)", nb("read"), nb("write"))]
for v in variants:
    mem, fixed = v.split("-fixedbufs")
    rows.append((f"fio io_uring mem={mem} fixedbufs={fixed}", fio(v, "read"), fio(v, "write")))

def cell(v):
    return f"{statistics.median(v):6.3f} ({min(v):.2f}-{max(v):.2f})"

print()
print("nvme_bench memory: " + j1["settings"]["memory_obtained"])
print("GB/s = 1e9 bytes/s; median of %d rounds (min-max)" % rounds)
print(f"{'':36} {'read GB/s':>22} {'write GB/s':>22}")
for name, r, w in rows:
    print(f"{name:36} {cell(r):>22} {cell(w):>22}")
best_r = max(statistics.median(r) for _, r, _ in rows[1:])
best_w = max(statistics.median(w) for _, _, w in rows[1:])
ratio_r = statistics.median(rows[0][1]) / best_r
ratio_w = statistics.median(rows[0][2]) / best_w
print(f"{'nvme_bench / best fio':36} {ratio_r:>22.3f} {ratio_w:>22.3f}")
for col, label in ((1, "read"), (2, "write")):
    best = max(rows[1:], key=lambda row: statistics.median(row[col]))
    print(f"best fio {label}: {best[0].replace('fio io_uring ', '')}")
print("(huge-page buffers need one segment per 2 MiB, 4 KiB pages one per page: see the "
      "device's max_segments above)")
ok = lambda x: "meets" if x >= 0.95 else "BELOW"
print(f"target >= 0.95: read {ok(ratio_r)}, write {ok(ratio_w)}")
PY
