#!/usr/bin/env bash
# Issue 25, item 6: the unified code path on a discrete CUDA device, for correctness. The device's
# pageableMemoryAccess attribute (berth plan's note says it), then greedy tokens with --unified off
# against --unified on, on stories260K and on an 8-layer synthetic qwen3-30b-a3b Q4_K file, all on
# the GPU and with --cpu-moe. The tokens must be identical; the tok/s show the cost of reading
# weights over the bus. Run on the device after packing (see ../shared/device/README.md):
#   bash scripts/diag/unified-h200.sh OUTDIR
set -uo pipefail
out=${1:-.}
mkdir -p "$out"
source .device/env.sh
tmp=${BERTH_TMP:-/dev/shm}
stories=.device/data/models/stories260K.gguf
q30=$tmp/q30-8l.gguf
status=0
berth plan -m $stories -ngl 99 --unified on >"$out/plan-stories.txt" 2>&1
echo "== plan note: $(grep -io '[^.]*pageable[^.]*' "$out/plan-stories.txt" | head -1)"
[[ -f $q30 ]] || timeout -k 5 240 berth synth --preset qwen3-30b-a3b --type q4_k --router-skew 1 -s 1 \
  --n-layer 8 -t 16 -o $q30 >"$out/synth.txt" 2>&1 || { echo "synth failed"; exit 1; }
pair() {  # FILE N NAME FLAGS...
  local file=$1 n=$2 name=$3; shift 3
  for u in off on; do
    timeout -k 5 240 berth run -m $file -p "Once upon a time" -n $n --temp 0 --unified $u "$@" \
      >"$out/$name-$u.txt" 2>"$out/$name-$u.err"
    echo "   --unified $u: rc $? $(grep -o 'decode [^|]*' "$out/$name-$u.err")"
  done
  if cmp -s "$out/$name-off.txt" "$out/$name-on.txt" && [[ -s $out/$name-off.txt ]]; then
    echo "== $name ($*): identical tokens ($(md5sum <"$out/$name-on.txt" | cut -c1-12))"
  else
    echo "== $name ($*): TOKENS DIFFER"; status=1
  fi
}
pair $stories 64 stories -ngl 99
pair $q30 32 q30-8l -ngl 99
pair $q30 32 q30-8l-cpu-moe -ngl 99 --cpu-moe
exit $status
