#!/usr/bin/env bash
# Issue 20 (device): the batching loop and the server interleaved, REPS pairs per N, so host
# bandwidth drift between runs falls on both sides alike. Loop: bench model -p 32 -n 128 -r 2
# --parallel N -c 4096 --greedy (the server's tokens and slot contexts). Server: bench serve
# --sync, N clients of REQUESTS greedy requests (-p 32 -n 128, -c 4096 -np N). Compared: the
# loop's aggregate decode against the server engine's decode steps (rows per step over the mean
# start-to-start interval, from /metrics) and against the clients' decode rates; the host DRAM
# read rate each run measured before it began (loop / server).
# Pairs alternate which side runs first (ORDER=fixed: the loop first); meminfo.txt holds free memory
# and huge pages before each run.
#   bash scripts/diag/serve-pairs.sh OUT_DIR [REPS] [REQUESTS] [N...]   (PLACE="-ngl 99 --cpu-moe")
set -uo pipefail
out=${1:-/tmp/serve-pairs}
reps=${2:-2}
reqs=${3:-2}
shift 3 2>/dev/null || shift $#
ns=("$@")
[[ ${#ns[@]} -gt 0 ]] || ns=(2 4)
flags=${PLACE:-"-ngl 99 --cpu-moe"}
mkdir -p "$out"
t=$(nproc)
f=${F:-/dev/shm/q3.gguf}
[[ -f $f ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" \
  -o "$f" 2>&1 | tail -1
cat /sys/kernel/mm/transparent_hugepage/enabled >"$out/thp.txt" 2>/dev/null
snap() { echo "$1 $(date +%s) $(grep -E '^(MemFree|AnonHugePages|ShmemHugePages)' /proc/meminfo | tr -s ' ' | tr '\n' ' ')" >>"$out/meminfo.txt"; }
run_loop() {
  echo "== loop $flags --parallel $1 (run $2)"
  snap "loop-$1-$2"
  # shellcheck disable=SC2086
  timeout 200 berth bench model -m "$f" -t "$t" -p 32 -n 128 -r 2 $flags --parallel "$1" \
    -c 4096 --greedy --json "$out/loop-$1-$2.json" 2>"$out/loop-$1-$2.err" | tail -2
}
run_serve() {
  echo "== serve $flags -np $1 --sync (run $2)"
  snap "serve-$1-$2"
  # shellcheck disable=SC2086
  timeout 200 berth bench serve -m "$f" -t "$t" -c 4096 --parallel "$1" --clients "$1" \
    --requests "$reqs" -p 32 -n 128 $flags --sync --json "$out/serve-$1-$2.json" \
    2>"$out/serve-$1-$2.err" | tail -3
}
# Odd pairs run the loop first, even pairs the server first (ORDER=fixed: always the loop first),
# so that a slot in the sequence that runs slower falls on both sides alike.
for rep in $(seq "$reps"); do
  for n in "${ns[@]}"; do
    if [[ ${ORDER:-alt} == alt && $((rep % 2)) -eq 0 ]]; then
      run_serve "$n" "$rep"; run_loop "$n" "$rep"
    else
      run_loop "$n" "$rep"; run_serve "$n" "$rep"
    fi
  done
done
python3 - "$out" <<'PY'
import glob, json, os, re, statistics, sys
d = sys.argv[1]
rows = {}
dram = {}
fwd = {}
for p in sorted(glob.glob(os.path.join(d, "loop-*-*.json"))):
    n, rep = re.match(r".*loop-(\d+)-(\d+)\.json", p).groups()
    sp = os.path.join(d, f"serve-{n}-{rep}.json")
    if not os.path.exists(sp):
        continue
    loop = json.load(open(p))["parallel"][0]["agg_tok_s"]
    s = json.load(open(sp))
    e = s["engine"]
    eng = e["decode_rows_per_step"] / e["decode_interval_ms"] * 1e3
    cli = int(n) * s["per_request_tok_s"]
    ld = json.load(open(p)).get("dram_gbps", 0)
    rows.setdefault(int(n), []).append((loop, eng, cli))
    fwd.setdefault(int(n), []).append(e["decode_step_ms"])
    dram.setdefault(int(n), []).append((ld, s.get("dram_gbps", 0)))
print("| N | pairs | loop tok/s | server engine tok/s | engine / loop (median, range) | clients' decode tok/s | clients / loop (median, range) | DRAM GB/s, loop/server | server forward ms |")
print("|---:|---:|---|---|---|---|---|---|---|")
for n, v in sorted(rows.items()):
    fmt = lambda xs: f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"
    print(f"| {n} | {len(v)} | {', '.join(f'{a:.1f}' for a, _, _ in v)} | {', '.join(f'{b:.1f}' for _, b, _ in v)} "
          f"| {fmt([b / a for a, b, _ in v])} | {', '.join(f'{c:.1f}' for _, _, c in v)} | {fmt([c / a for a, _, c in v])} "
          f"| {', '.join(f'{x:.0f}/{y:.0f}' for x, y in dram[n])} | {', '.join(f'{x:.2f}' for x in fwd[n])} |")
PY
