#!/usr/bin/env bash
# Issue 19 (device): aggregate decode of N sequences on the synthetic qwen3-30b-a3b Q4_K_M, all on
# the GPU: the defaults, then the MoE decode GEMVs grouped by expert (BERTH_MOE_GROUP=1), then a
# layer's Q, K, V in one launch per matrix (BERTH_GEMV_GROUP_TOK=0), interleaved.
#   bash scripts/diag/parallel-ab.sh OUT_DIR [REPS]
set -uo pipefail
out=${1:-/tmp/parallel-ab}
reps=${2:-2}
mkdir -p "$out"
t=$(nproc)
f=${F:-/dev/shm/q3.gguf}
[[ -f $f ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" \
  -o "$f" 2>&1 | tail -1
for rep in $(seq "$reps"); do
  for cfg in default BERTH_MOE_GROUP=1 BERTH_GEMV_GROUP_TOK=0; do
    echo "== -ngl 99, $cfg (run $rep)"
    env "${cfg/default/BERTH_UNUSED=1}" timeout 200 berth bench model -m "$f" -t "$t" \
      -p 128 -n 64 -r 2 -ngl 99 --parallel 1,2,4,8 --json "$out/ab-${cfg%%=*}-$rep.json" \
      2>"$out/ab-${cfg%%=*}-$rep.err" | tail -6
  done
done
