#!/usr/bin/env bash
# Issue 20's benchmark table (device): the batching loop against the server at -np 1, 2, 4, 8 on
# the synthetic qwen3-30b-a3b Q4_K_M, all on the GPU and with --cpu-moe.
#   bash scripts/diag/serve-table.sh OUT_DIR [REQUESTS] [FLAGS_SET...]
# Loop: bench model -p 32 -n 128 -r 2 --parallel 1,2,4,8 (every row's logits to the host, no
# sampling). Server: bench serve with N streaming clients, REQUESTS (default 3) greedy requests
# each of -p 32 -n 128, -c 4096; JSON per run in OUT_DIR.
set -uo pipefail
out=${1:-/tmp/serve-table}
reqs=${2:-3}
mkdir -p "$out"
t=$(nproc)
f=${F:-/dev/shm/q3.gguf}
[[ -f $f ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" \
  -o "$f" 2>&1 | tail -1
for flags in "-ngl 99" "-ngl 99 --cpu-moe"; do
  tag=$( [[ $flags == *cpu-moe* ]] && echo cpumoe || echo gpu )
  echo "== loop $flags"
  # shellcheck disable=SC2086
  timeout 300 berth bench model -m "$f" -t "$t" -p 32 -n 128 -r 2 $flags --parallel 1,2,4,8 \
    --json "$out/loop-$tag.json" 2>"$out/loop-$tag.err" | tee "$out/loop-$tag.txt" | tail -8
  for n in 1 2 4 8; do
    echo "== serve $flags -np $n"
    # shellcheck disable=SC2086
    timeout 200 berth bench serve -m "$f" -t "$t" -c 4096 --parallel "$n" --clients "$n" \
      --requests "$reqs" -p 32 -n 128 $flags --json "$out/serve-$tag-$n.json" \
      2>"$out/serve-$tag-$n.err" | tail -3
  done
done
python3 "$(dirname "${BASH_SOURCE[0]}")/serve_table.py" "$out" | tee "$out/table.md"
