#!/usr/bin/env bash
# Issue 23, item 1 (device): the table of one all-GPU decode step, every kernel with its time,
# DRAM bytes and achieved bandwidth, against the measured step (graph replay) and the HBM bound.
#   bash scripts/diag/decode-step-table.sh [FILE] [OUT_DIR] [N_LAYER]
# FILE defaults to a synthetic qwen3-30b-a3b Q4_K_M in /dev/shm (made when missing), N_LAYER
# to its 48 (a dense file, e.g. Qwen3.5-27B with N_LAYER 64, is cut at its whole-row norms). Depth
# 0 only: ncu would profile every kernel of a depth fill too.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
f=${1:-/dev/shm/q4km.gguf}
out=${2:-/tmp/decode-step}
n_layer=${3:-48}
t=$(nproc)
mkdir -p "$out"
[[ -f $f ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" \
  -o "$f" >"$out/synth.log" 2>&1 || { echo "synth failed: $out/synth.log"; exit 1; }
# The measured step: tg128 on graph replay (median of 3 runs after a warm-up).
berth bench model -m "$f" -t "$t" -ngl 99 -p 0 -n 128 -r 3 --json "$out/tg.json" \
  >"$out/tg.txt" 2>&1 || { echo "bench failed: $out/tg.txt"; exit 1; }
read -r ts hbm < <(python3 -c "import json; j=json.load(open('$out/tg.json')); print(j['tg_tok_s'], j['hbm_copy_gbps'])")
step_us=$(python3 -c "print(1e6/$ts)")
# Every kernel of a few decode steps, one at a time, caches as the step leaves them.
ncu --clock-control none --cache-control none --csv --print-units base \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  berth bench model -m "$f" -t "$t" -ngl 99 -p 0 -n 4 -r 1 >"$out/ncu.csv" 2>"$out/ncu.err"
{
  echo "tg128: $ts tok/s (step $step_us us); HBM copy $hbm GB/s"
  echo
  python3 "$here/decode_step_table.py" "$out/ncu.csv" "$step_us" "$n_layer" "$hbm"
} | tee "$out/table.md"
