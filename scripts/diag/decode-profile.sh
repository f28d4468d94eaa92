#!/usr/bin/env bash
# Diagnostic (device): per-op device time of --cpu-moe decode on a 4-layer synthetic
# qwen3-30b-a3b (the per-layer work equals the full model's): bench model --profile (events
# around each op, no graph replay) and ncu kernel durations without cache flushes.
set -uo pipefail
source .device/env.sh
t=$(nproc)
small=/tmp/q3-4l.gguf
[[ -f $small ]] || berth synth --preset qwen3-30b-a3b --n-layer 4 --type q4_k_m --router-skew 1 -s 1 -t "$t" -o "$small" 2>&1 | tail -1
for h in flags callback; do
  echo "== tg (4 layers, --cpu-moe, $h), graph replay"
  timeout 100 berth bench model -m "$small" -t "$t" -r 3 -p 0 -n 64 -ngl 99 --cpu-moe --handoff $h 2>/dev/null | grep -E "^tg|busy"
done
echo "== profile (4 layers, --cpu-moe)"
timeout 100 berth bench model -m "$small" -t "$t" -r 1 -p 0 -n 32 -ngl 99 --cpu-moe --profile 2>/dev/null | sed -n '/time by op/,$p'
echo "== ncu (4 layers, --cpu-moe, callback hand-off, decode, no cache flush)"
timeout 200 ncu --clock-control none --cache-control none --csv --print-units base --metrics gpu__time_duration.sum \
  berth bench model -m "$small" -t "$t" -r 1 -p 0 -n 4 -ngl 99 --cpu-moe --handoff callback >/tmp/ncu.csv 2>/tmp/ncu.err
echo "rc $?"
python3 scripts/diag/ncu_agg.py /tmp/ncu.csv
