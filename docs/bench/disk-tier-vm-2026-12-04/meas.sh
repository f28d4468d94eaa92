#!/bin/bash
# Issue 24: the disk tier's reads at the largest read sizes of 8 MiB (the default), 256 KiB and
# 128 KiB (BERTH_DISK_MAX_READ), under a memory cgroup of the budget + 256 MiB, cold cache.
set -u
B=${B:-/work/disk-meas/berth-new}
F=/work/disk-meas/q3-8l.gguf
LIM=$(((1055+256)<<20))
CG=/sys/fs/cgroup/memory/berthdisk
mkdir -p $CG
echo $LIM > $CG/memory.limit_in_bytes
echo 0 > $CG/memory.swappiness 2>/dev/null
OUT=${OUT:-/work/disk-meas/out}; mkdir -p $OUT
run() {  # name, env..., -- args...
  local name=$1; shift
  sync; echo 3 > /proc/sys/vm/drop_caches
  ( echo $BASHPID > $CG/cgroup.procs; exec env "$@" ) > $OUT/$name.out 2> $OUT/$name.err
  echo "$name rc=$? $(grep -E '^tg32 |disk tier|O_DIRECT' $OUT/$name.out | tr '\n' ' ')"
}
tier="bench model -m $F -p 0 -n 32 -r 2 -t 2 --ram-budget 1055M --disk-bench 4 --dram-mib 64"
for rep in 1 2; do
  run tier8m-$rep BERTH_DISK_MAX_READ=8388608 $B $tier --json $OUT/tier8m-$rep.json
  run tier256k-$rep BERTH_DISK_MAX_READ=262144 $B $tier --json $OUT/tier256k-$rep.json
  run tier128k-$rep BERTH_DISK_MAX_READ=131072 $B $tier --json $OUT/tier128k-$rep.json
done
[[ ${MMAP:-1} == 1 ]] && run mmap-1 X=1 $B bench model -m $F -p 0 -n 32 -r 2 -t 2 --ram-budget none --dram-mib 64 --json $OUT/mmap-1.json
