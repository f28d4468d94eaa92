#!/usr/bin/env bash
# The heterogeneous-step benchmark of docs/performance.md, on a machine with a CUDA device:
# generates synthetic qwen3-30b-a3b (Q4_K_M-like mix, router skew 1) and runs `berth bench model`
# for all-GPU, --vram-budget 24G (automatic plan), --cpu-moe (prefill streams the experts: the
# default --stream-experts auto),
# --cpu-moe with a share of each token's experts computed by the GPU from pinned host memory
# (3 of the 8 slots; scripts/diag/host-share.sh sweeps the share, scripts/diag/share-paired.sh
# repeats it), --cpu-moe with the workers asleep during the GPU's part (--warm-workers 0; the
# other rows keep the default, warm in replayed decode on CUDA), --cpu-moe prefill with the
# experts on the CPU (no streaming), and CPU-only.
# usage: bash scripts/gpu-bench.sh OUTDIR [TYPE] [REPS]   (TYPE default q4_k_m, REPS 2)
#   env BERTH=berth-before   the binary to benchmark (default berth; the file is made with berth)
set -uo pipefail
out=${1:-.}
type=${2:-q4_k_m}
reps=${3:-2}
mkdir -p "$out"
source .device/env.sh
model=/tmp/q3-$type.gguf
t=$(nproc)
[[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type "$type" --router-skew 1 -s 1 -t "$t" -o "$model" 2>&1 | tail -1
# Only the JSON goes to OUTDIR (the device tool brings back the first 8 files); text and stderr
# logs go to $logs.
logs=${TMPDIR:-/tmp}/gpu-bench-logs
mkdir -p "$logs"
bench() {
  local name=$1; shift
  echo "== $name: $*"
  timeout 150 "${BERTH:-berth}" bench model -m "$model" -t "$t" -r "$reps" --json "$out/$name.json" "$@" 2>"$logs/$name.err" |
    tee "$logs/$name.txt" | grep -E "^pp|^tg|bound|busy|reaches|hand-off|moe_experts"
}
bench all-gpu -p 512 -n 128 -ngl 99
bench budget-24g -p 512 -n 128 --vram-budget 24G
bench cpu-moe -p 512 -n 128 -ngl 99 --cpu-moe
bench cpu-moe-share -p 0 -n 128 -ngl 99 --cpu-moe --host-expert-share 0.375
bench cpu-moe-cold -p 0 -n 128 -ngl 99 --cpu-moe --warm-workers 0
bench cpu-moe-cpu-prefill -p 512 -n 0 -ngl 99 --cpu-moe --stream-experts 0
bench cpu-only -p 512 -n 32 -ngl 0
