#!/usr/bin/env bash
# Diagnostic (device): test_runtime's hybrid cases against CUDA one at a time, from case FIRST
# on, each under a hard limit; a case still running after LIMIT_S gets its threads' states and
# kernel stacks written to OUT/stack_N.txt and is killed. Stops starting cases after STOP_S.
# Usage: bash scripts/diag/hybrid-each.sh OUT [LIMIT_S] [STOP_S] [FIRST]
set -uo pipefail
out=$1; lim=${2:-90}; stop=${3:-330}; first=${4:-1}
source .device/env.sh
[[ -e /work/shared ]] || { mkdir -p /work && ln -sfn "$PWD/.device/data" /work/shared; }
mapfile -t cases < <(test_runtime -ltc 2>/dev/null | grep -E '^(hybrid|the simulated device)' | cut -c1-40)
i=0
for c in "${cases[@]}"; do
  i=$((i+1)); (( i < first )) && continue
  pat="${c//,/?}*"; t0=$SECONDS
  BERTH_TEST_DEVICE=cuda stdbuf -oL -eL test_runtime -tc="$pat" >"$out/case_$i.txt" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null && (( SECONDS - t0 < lim )); do sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    { grep State /proc/$pid/status; for t in /proc/$pid/task/*; do
        echo "-- $(cat $t/comm) wchan=$(cat $t/wchan) $(grep State $t/status)"; timeout -s KILL 5 cat $t/stack; done
    } >"$out/stack_$i.txt" 2>&1
    kill -9 $pid; echo "case $i HUNG after ${lim}s: $c"
  else
    wait $pid; rc=$?; echo "case $i rc $rc $((SECONDS-t0))s: $c $(tail -2 $out/case_$i.txt | head -1)"
  fi
  (( SECONDS > stop )) && { echo "stopping: time"; break; }
done
