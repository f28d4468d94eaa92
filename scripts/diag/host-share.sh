#!/usr/bin/env bash
# Diagnostic (device): --host-expert-share on synthetic qwen3-30b-a3b (Q4_K_M-like, router skew
# 1). First the kernel: test_gpu's timing of one decode token's experts read from pinned host
# memory, in place vs staged, for 1, 2, 3 and 8 of the 8 slots (the staged rate is the
# device's cost per slot). Then the sweep: --cpu-moe decode with shares 0 (off), 1/8, 3/16,
# 1/4, 5/16 and 3/8 of each token's 8 routed experts (1, 1.5, 2, 2.5, 3 slots per layer), each
# with its bound and the busy shares of both sides. Usage: bash scripts/diag/host-share.sh [REPS]
set -uo pipefail
reps=${1:-2}
source .device/env.sh
t=$(nproc)
model=/tmp/q3-q4_k_m.gguf
timeout 60 test_gpu --no-skip -tc='*pinned host memory*' 2>&1 | grep -E "moe host|cudaMemcpy"
[[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" -o "$model" 2>&1 | tail -1
for f in 0 0.125 0.1875 0.25 0.3125 0.375; do
  echo "== --cpu-moe --host-expert-share $f"
  timeout 120 berth bench model -m "$model" -t "$t" -r "$reps" -p 0 -n 128 -ngl 99 --cpu-moe \
    --host-expert-share "$f" 2>/dev/null | grep -E "^tg|bound|busy|moe_experts"
done
