#!/usr/bin/env bash
# The heterogeneous-step benchmark of docs/performance.md, on a machine with a CUDA device:
# generates synthetic qwen3-30b-a3b (router skew 1) and runs `berth bench model` for all-GPU,
# --cpu-moe, --vram-budget 24G (automatic plan) and CPU-only, plus the prefill crossover of
# streamed experts. usage: bash scripts/gpu-bench.sh OUTDIR [TYPE]   (TYPE default q4_k)
set -uo pipefail
out=${1:-.}
type=${2:-q4_k}
mkdir -p "$out"
source .device/env.sh
model=/tmp/q3-$type.gguf
t=$(nproc)
[[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type "$type" --router-skew 1 -s 1 -t "$t" -o "$model" 2>&1 | tail -2
bench() { local name=$1; shift; echo "== $name"; timeout 240 berth bench model -m "$model" -t "$t" --json "$out/$name.json" "$@" 2>"$out/$name.err" | tee "$out/$name.txt" | grep -E "^pp|^tg|bound|busy|reaches|device" ; }
bench all-gpu -p 512 -n 128 -r 3 -ngl 99
bench cpu-moe -p 512 -n 128 -r 3 -ngl 99 --cpu-moe --stream-experts 64
bench budget-24g -p 512 -n 128 -r 3 --vram-budget 24G --stream-experts 64
bench cpu-moe-nostream-pp -p 512 -n 0 -r 2 -ngl 99 --cpu-moe
for p in 32 64 128; do
  bench cpu-moe-pp$p-stream -p $p -n 0 -r 3 -ngl 99 --cpu-moe --stream-experts 1
  bench cpu-moe-pp$p-cpu -p $p -n 0 -r 3 -ngl 99 --cpu-moe
done
bench cpu-only -p 512 -n 128 -r 2 -ngl 0
