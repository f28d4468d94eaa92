#!/usr/bin/env bash
# Diagnostic (device, issue 19): where a decode step of N sequences spends its device time, kernel
# by kernel, on a 4-layer synthetic qwen3-30b-a3b (each layer's work equals the full model's).
#   bash scripts/diag/parallel-profile.sh OUT_DIR [N...]   (N default: 1 4 8)
# For each N: graph-replayed decode (bench model --parallel N), then ncu kernel durations (no
# cache flushes, no clock control) of two runs differing by 4 decode steps; the difference,
# divided by 8 (bench runs a warm-up and the measured run), is one step per kernel name
# (ncu_step.py).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-/tmp/parallel-profile}
shift || true
ns=("$@")
[[ ${#ns[@]} -gt 0 ]] || ns=(1 4 8)
mkdir -p "$out"
t=$(nproc)
small=/tmp/q3-4l.gguf
[[ -f $small ]] || berth synth --preset qwen3-30b-a3b --n-layer 4 --type q4_k_m --router-skew 1 -s 1 \
  -t "$t" -o "$small" 2>&1 | tail -1
list=$(IFS=,; echo "${ns[*]}")
# Replayed decode: the defaults, the MoE decode GEMVs grouped by expert (BERTH_MOE_GROUP=1), a
# layer's Q, K, V in one launch per matrix (BERTH_GEMV_GROUP_TOK=0), interleaved.
for rep in 1 2; do
  for cfg in default BERTH_MOE_GROUP=1 BERTH_GEMV_GROUP_TOK=0; do
    echo "== replayed decode, 4 layers, $cfg: --parallel $list (run $rep)"
    env "${cfg/default/BERTH_UNUSED=1}" timeout 200 berth bench model -m "$small" -t "$t" -r 3 \
      -p 32 -n 64 -ngl 99 --parallel "$list" 2>"$out/replay-${cfg%%=*}-$rep.err" |
      tee "$out/replay-${cfg%%=*}-$rep.txt" | tail -4
  done
done
for n in "${ns[@]}"; do
  for steps in 2 6; do
    timeout 240 ncu --clock-control none --cache-control none --csv --print-units base \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      berth bench model -m "$small" -t "$t" -r 1 -p 8 -n "$steps" -ngl 99 --parallel "$n" \
      >"$out/ncu-$n-$steps.csv" 2>"$out/ncu-$n-$steps.err"
    echo "ncu N=$n steps=$steps rc $?"
  done
  echo "== N = $n: one decode step, by kernel"
  # bench runs each test twice (a warm-up, then -r 1): 2 x 4 more decode steps.
  python3 "$here/ncu_step.py" "$out/ncu-$n-2.csv" "$out/ncu-$n-6.csv" 8 | tee "$out/step-$n.txt"
done
