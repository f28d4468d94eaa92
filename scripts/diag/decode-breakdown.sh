#!/usr/bin/env bash
# Diagnostic (device): where a --cpu-moe decode step's time goes. Prints
#  - tg128 with and without --warm-workers (interleaved, to see run-to-run spread),
#  - the per-op-kind profile of the device part (events around each op, no graph replay),
#  - ncu kernel durations of decode steps on a 4-layer model (sum per kernel name).
# usage: bash scripts/diag/decode-breakdown.sh [MODEL]   (default: synthesises /tmp/q3-q4_k_m.gguf)
set -uo pipefail
source .device/env.sh
t=$(nproc)
model=${1:-/tmp/q3-q4_k_m.gguf}
[[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" -o "$model" 2>&1 | tail -1
for w in 0 1000 0 1000; do
  echo "== --cpu-moe --warm-workers $w"
  timeout 120 berth bench model -m "$model" -t "$t" -r 3 -p 0 -n 128 -ngl 99 --cpu-moe --warm-workers "$w" 2>/dev/null | grep -E "^tg|busy|bound"
done
echo "== profile"
timeout 120 berth bench model -m "$model" -t "$t" -r 1 -p 0 -n 32 -ngl 99 --cpu-moe --profile 2>/dev/null | tail -40
small=/tmp/q3-4l.gguf
[[ -f $small ]] || berth synth --preset qwen3-30b-a3b --n-layer 4 --type q4_k_m --router-skew 1 -s 1 -t "$t" -o "$small" 2>&1 | tail -1
echo "== ncu (4 layers, --cpu-moe, callback hand-off, decode)"
timeout 200 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
  berth bench model -m "$small" -t "$t" -r 1 -p 0 -n 4 -ngl 99 --cpu-moe --handoff callback >/tmp/ncu.csv 2>/tmp/ncu.err
echo "rc $?"; tail -3 /tmp/ncu.err
python3 scripts/diag/ncu_agg.py /tmp/ncu.csv
