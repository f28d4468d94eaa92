#!/usr/bin/env bash
# Diagnostic (device): is the --host-expert-share gain robust? Synthetic qwen3-30b-a3b
# (Q4_K_M-like, router skew 1), tg128 with --cpu-moe, configurations interleaved round by
# round so that drift in the host (page cache, DRAM traffic, clocks) hits each alike:
#   share 0 with --stream-experts 0 (the CPU reads the file's pages),
#   share 0 with the default --stream-experts auto (the CPU reads the experts' pinned copy),
#   share 0.25 and 0.375 (2 and 3 of each token's 8 routed experts read by the device).
# Each run keeps tok/s, the bound, both busy shares and the CPU's mean time per experts call.
# WARM (default 0, as the runs of docs/performance.md): --warm-workers for every run; empty
# for the executor's default. Usage: [WARM=US] bash scripts/diag/share-paired.sh [ROUNDS]
set -uo pipefail
rounds=${1:-3}
warm=${WARM-0}
source .device/env.sh
t=$(nproc)
model=/tmp/q3-q4_k_m.gguf
[[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" -o "$model" 2>&1 | tail -1
for r in $(seq 1 "$rounds"); do
  for cfg in "--stream-experts 0 --host-expert-share 0" "--host-expert-share 0" \
             "--stream-experts 0 --host-expert-share 0.25" "--stream-experts 0 --host-expert-share 0.375"; do
    echo "== round $r: --cpu-moe $cfg"
    # shellcheck disable=SC2086
    timeout -k 5 120 berth bench model -m "$model" -t "$t" -r 1 -p 0 -n 128 -ngl 99 --cpu-moe $cfg \
      ${warm:+--warm-workers $warm} \
      2>&1 | grep -E "^tg128 +run 1|^tg128 +[0-9]|hybrid bound|busy|reaches|moe_experts|pinned copy"
  done
done
