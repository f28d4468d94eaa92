#!/bin/bash
# Issue 24 on the development VM: the whole 17.2 GB qwen3-30b-a3b-shaped Q4_K file, --ram-budget a
# third of it, under a memory cgroup of the budget + 256 MiB, cold (guest) page cache before each
# run; the tier (io_uring, O_DIRECT) against the mmap path under the same limit, with the file's
# own routing (--router-skew 1) and with a locality trace (berth trace gen --preset locality).
set -u
B=${B:-/work/disk24/berth}
F=${F:-/work/disk24/q3-30b.gguf}
T=${T:-/work/disk24/locality.brtr}
BUD=${BUD:-5474}                       # MiB: a third of the file's 17.22 GB
LIM=$(((BUD+256)<<20))
CG=/sys/fs/cgroup/memory/berthdisk
mkdir -p $CG
echo $LIM > $CG/memory.limit_in_bytes
echo 0 > $CG/memory.swappiness 2>/dev/null
OUT=${OUT:-/work/disk24/out}; mkdir -p $OUT
run() {  # name, env..., -- args...
  local name=$1; shift
  sync; echo 3 > /proc/sys/vm/drop_caches
  local t0=$(date +%s)
  ( echo $BASHPID > $CG/cgroup.procs; exec env "$@" ) > $OUT/$name.out 2> $OUT/$name.err
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s)-t0 ))s $(grep -E '^\| .*tg|^tg|disk tier|O_DIRECT|from disk' $OUT/$name.out | tr '\n' ' ' | cut -c1-400)"
}
TG=${TG:-"-p 0 -n 32 -r 2"}
MG=${MG:-"-p 0 -n 16 -r 2"}
tier="bench model -m $F $TG -t 2 --ram-budget ${BUD}M --disk-bench 4 --dram-mib 64"
mmap="bench model -m $F $MG -t 2 --ram-budget none --dram-mib 64"
for rep in ${REPS:-1 2}; do
  run tier-skew-$rep X=1 $B $tier --json $OUT/tier-skew-$rep.json
  run mmap-skew-$rep X=1 $B $mmap --json $OUT/mmap-skew-$rep.json
  run tier-trace-$rep X=1 $B $tier --routing-trace $T --json $OUT/tier-trace-$rep.json
  run mmap-trace-$rep X=1 $B $mmap --routing-trace $T --json $OUT/mmap-trace-$rep.json
done
[[ ${PREAD:-1} == 1 ]] && run tier-skew-pread BERTH_DISK_READER=pread $B $tier --json $OUT/tier-skew-pread.json
