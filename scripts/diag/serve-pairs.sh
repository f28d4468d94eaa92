#!/usr/bin/env bash
# Issue 20 (device): the batching loop and the server interleaved, REPS pairs per N, so host
# bandwidth drift between runs falls on both sides alike. Loop: bench model -p 32 -n 128 -r 2
# --parallel N -c 4096 --greedy (the server's tokens and slot contexts). Server: bench serve
# --sync, N clients of REQUESTS greedy requests (-p 32 -n 128, -c 4096 -np N). Compared: the
# loop's aggregate decode against the server engine's decode steps (rows per step over the mean
# start-to-start interval, from /metrics) and against the clients' decode rates; the host DRAM
# read rate each run measured before it began (loop / server).
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
for rep in $(seq "$reps"); do
  for n in "${ns[@]}"; do
    echo "== loop $flags --parallel $n (run $rep)"
    # shellcheck disable=SC2086
    timeout 200 berth bench model -m "$f" -t "$t" -p 32 -n 128 -r 2 $flags --parallel "$n" \
      -c 4096 --greedy --json "$out/loop-$n-$rep.json" 2>"$out/loop-$n-$rep.err" | tail -2
    echo "== serve $flags -np $n --sync (run $rep)"
    # shellcheck disable=SC2086
    timeout 200 berth bench serve -m "$f" -t "$t" -c 4096 --parallel "$n" --clients "$n" \
      --requests "$reqs" -p 32 -n 128 $flags --sync --json "$out/serve-$n-$rep.json" \
      2>"$out/serve-$n-$rep.err" | tail -3
  done
done
python3 - "$out" <<'PY'
import glob, json, os, re, statistics, sys
d = sys.argv[1]
rows = {}
dram = {}
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
    dram.setdefault(int(n), []).append((ld, s.get("dram_gbps", 0)))
print("| N | pairs | loop tok/s | server engine tok/s | engine / loop (median, range) | clients' decode tok/s | clients / loop (median, range) | DRAM GB/s, loop/server |")
print("|---:|---:|---|---|---|---|---|---|")
for n, v in sorted(rows.items()):
    fmt = lambda xs: f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"
    print(f"| {n} | {len(v)} | {', '.join(f'{a:.1f}' for a, _, _ in v)} | {', '.join(f'{b:.1f}' for _, b, _ in v)} "
          f"| {fmt([b / a for a, b, _ in v])} | {', '.join(f'{c:.1f}' for _, _, c in v)} | {fmt([c / a for a, _, c in v])} "
          f"| {', '.join(f'{x:.0f}/{y:.0f}' for x, y in dram[n])} |")
PY
