#!/usr/bin/env bash
# Issue 19 (device): aggregate decode of N sequences on the synthetic qwen3-30b-a3b Q4_K_M, all on
# the GPU, interleaved: the defaults, then each configuration of CONFIGS (default: the MoE decode
# GEMVs grouped by expert, BERTH_MOE_GROUP=1; a layer's Q, K, V in one launch per matrix,
# BERTH_GEMV_GROUP_TOK=0; GEMVs of 2-4 tokens on the 4-token kernel, BERTH_GEMV_TOK4=1).
#   [CONFIGS="BERTH_GEMV_TOK4=1 ..."] bash scripts/diag/parallel-ab.sh OUT_DIR [REPS]
set -uo pipefail
out=${1:-/tmp/parallel-ab}
reps=${2:-2}
mkdir -p "$out"
t=$(nproc)
f=${F:-/dev/shm/q3.gguf}
[[ -f $f ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" \
  -o "$f" 2>&1 | tail -1
for rep in $(seq "$reps"); do
  # shellcheck disable=SC2086
  for cfg in default ${CONFIGS:-BERTH_MOE_GROUP=1 BERTH_GEMV_GROUP_TOK=0 BERTH_GEMV_TOK4=1}; do
    echo "== -ngl 99, $cfg (run $rep)"
    env "${cfg/default/BERTH_UNUSED=1}" timeout 200 berth bench model -m "$f" -t "$t" \
      -p 128 -n 64 -r 2 -ngl 99 --parallel 1,2,4,8 --json "$out/ab-${cfg%%=*}-$rep.json" \
      2>"$out/ab-${cfg%%=*}-$rep.err" | tail -6
  done
done
