#!/usr/bin/env bash
# Before/after benchmark of a change on the GPU machine: the rows of scripts/gpu-bench.sh run
# with two builds of berth (BEFORE and AFTER, e.g. berth-before packed from the old commit and
# berth), interleaved (before, after, before, after, ...) for ROUNDS rounds on the same synthetic
# qwen3-30b-a3b file. Per row and test (pp, tg) it prints each round's ratio after/before and
# their median; a row counts as slower when that median is below 0.97 (issue 17's rule).
# Writes OUTDIR/before-after.tsv (row, round, build, pp tok/s, tg tok/s) and
# OUTDIR/before-after.txt (the ratios); the raw logs go to $TMPDIR.
# usage: BEFORE=berth-before AFTER=berth bash scripts/diag/before-after.sh OUTDIR [TYPE] [ROUNDS] [REPS]
#   env ROWS="all-gpu cpu-moe"   only these rows (default: all); results append to the TSV, so a
#                                long table can be run in parts (one device command each)
set -uo pipefail
out=${1:-.}
type=${2:-q4_k_m}
rounds=${3:-3}
reps=${4:-2}
before=${BEFORE:-berth-before}
after=${AFTER:-berth}
mkdir -p "$out"
source .device/env.sh
model=/tmp/q3-$type.gguf
t=$(nproc)
[[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type "$type" --router-skew 1 -s 1 -t "$t" -o "$model" 2>&1 | tail -1
logs=${TMPDIR:-/tmp}/before-after-logs
mkdir -p "$logs"
rows=(
  "all-gpu|-p 512 -n 128 -ngl 99"
  "budget-24g|-p 512 -n 128 --vram-budget 24G"
  "cpu-moe|-p 512 -n 128 -ngl 99 --cpu-moe"
  "cpu-moe-share|-p 0 -n 128 -ngl 99 --cpu-moe --host-expert-share 0.375"
  "cpu-moe-cold|-p 0 -n 128 -ngl 99 --cpu-moe --warm-workers 0"
  "cpu-moe-cpu-prefill|-p 512 -n 0 -ngl 99 --cpu-moe --stream-experts 0"
  "cpu-only|-p 512 -n 32 -ngl 0"
)
tsv=$out/before-after.tsv
[[ -f $tsv ]] || printf 'row\tround\tbuild\tpp_tok_s\ttg_tok_s\n' >"$tsv"
for row in "${rows[@]}"; do
  IFS='|' read -r name args <<<"$row"
  [[ -z ${ROWS:-} || " $ROWS " == *" $name "* ]] || continue
  for r in $(seq 1 "$rounds"); do
    for build in before after; do
      bin=$before
      [[ $build == after ]] && bin=$after
      j=$logs/$name-$r-$build.json
      # shellcheck disable=SC2086
      timeout 170 "$bin" bench model -m "$model" -t "$t" -r "$reps" -q --json "$j" $args \
        >"$logs/$name-$r-$build.txt" 2>&1 || echo "$name round $r $build: exit $?" >&2
      python3 - "$j" "$name" "$r" "$build" >>"$tsv" <<'PY'
import json, sys
path, name, r, build = sys.argv[1:]
try:
    d = json.load(open(path))
    pp, tg = d.get("pp_tok_s") or 0, d.get("tg_tok_s") or 0
except Exception:
    pp = tg = 0
print(f"{name}\t{r}\t{build}\t{pp:.2f}\t{tg:.2f}")
PY
    done
  done
  echo "== $name done" >&2
done
python3 - "$tsv" >"$out/before-after.txt" <<'PY'
import csv, statistics, sys
rows = {}
for rec in csv.DictReader(open(sys.argv[1]), delimiter="\t"):
    rows.setdefault(rec["row"], {}).setdefault(rec["round"], {})[rec["build"]] = rec
print("row                  test  before (median)  after (median)  ratios after/before      median  verdict")
for name, rounds in rows.items():
    for test in ("pp_tok_s", "tg_tok_s"):
        b = [float(v["before"][test]) for v in rounds.values() if "before" in v and "after" in v]
        a = [float(v["after"][test]) for v in rounds.values() if "before" in v and "after" in v]
        if not b or max(b) == 0:
            continue
        ratios = [x / y if y > 0 else 0 for x, y in zip(a, b)]
        m = statistics.median(ratios)
        verdict = "slower" if m < 0.97 else "ok"
        print(f"{name:20} {test[:2]:4}  {statistics.median(b):15.1f}  {statistics.median(a):14.1f}  "
              f"{' '.join(f'{x:.3f}' for x in ratios):22}  {m:6.3f}  {verdict}")
PY
cat "$out/before-after.txt"
