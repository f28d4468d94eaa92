#!/usr/bin/env bash
# Issue 20's benchmark table (device): the batching loop against the server at -np 1, 2, 4, 8 on
# the synthetic qwen3-30b-a3b Q4_K_M, all on the GPU and with --cpu-moe.
#   bash scripts/diag/serve-table.sh OUT_DIR [REQUESTS] [PLACEMENT...]
# PLACEMENT: gpu (-ngl 99) and/or cpumoe (-ngl 99 --cpu-moe); both when none is named.
# Loop: bench model -p 32 -n 128 -r 2 --parallel 1,2,4,8 -c 4096 --greedy (each sequence 4096 / N
# tokens of KV cache, as the server's slots; each sequence decodes its greedy tokens from the
# prompts bench serve sends, so the loop's steps carry the server's tokens and read the same
# experts), and once with random tokens and no -c (-p + -n per sequence, issue 19's rows). Server: bench serve with N streaming clients, REQUESTS (default 3) greedy requests
# each of -p 32 -n 128, -c 4096, once with --sync (the clients' requests start together, so
# their sequences decode in the same steps, as the loop's do) and once free-running (a client's
# next prompt is prefilled while the others decode); JSON per run in OUT_DIR.
set -uo pipefail
out=${1:-/tmp/serve-table}
reqs=${2:-3}
shift 2 2>/dev/null || shift $#
places=("$@")
[[ ${#places[@]} -gt 0 ]] || places=(gpu cpumoe)
mkdir -p "$out"
t=$(nproc)
f=${F:-/dev/shm/q3.gguf}
[[ -f $f ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" \
  -o "$f" 2>&1 | tail -1
for tag in "${places[@]}"; do
  case $tag in
    gpu) flags="-ngl 99" ;;
    cpumoe) flags="-ngl 99 --cpu-moe" ;;
    *) echo "serve-table.sh: unknown placement '$tag' (gpu, cpumoe)" >&2; exit 2 ;;
  esac
  for c in 4096 0; do
    sfx=$( [[ $c == 0 ]] && echo "-short" )
    echo "== loop $flags -c $c"
    # shellcheck disable=SC2046,SC2086
    timeout 300 berth bench model -m "$f" -t "$t" -p 32 -n 128 -r 2 $flags --parallel 1,2,4,8 \
      $( [[ $c != 0 ]] && echo "-c $c --greedy" ) --json "$out/loop-$tag$sfx.json" \
      2>"$out/loop-$tag$sfx.err" | tee "$out/loop-$tag$sfx.txt" | tail -6
  done
  for n in 1 2 4 8; do
    for mode in sync free; do
      sfx=$( [[ $mode == sync ]] && echo "-sync" )
      echo "== serve $flags -np $n ($mode)"
      # shellcheck disable=SC2046,SC2086
      timeout 200 berth bench serve -m "$f" -t "$t" -c 4096 --parallel "$n" --clients "$n" \
        --requests "$reqs" -p 32 -n 128 $flags $( [[ $mode == sync ]] && echo --sync ) \
        --json "$out/serve-$tag-$n$sfx.json" 2>"$out/serve-$tag-$n$sfx.err" | tail -3
    done
  done
done
python3 "$(dirname "${BASH_SOURCE[0]}")/serve_table.py" "$out" | tee "$out/table.md"
