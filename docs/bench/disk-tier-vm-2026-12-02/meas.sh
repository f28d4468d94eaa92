#!/bin/bash
# Issue 24 measurement: disk tier vs mmap under the same memory limit (cgroup v1 memory).
set -u
B=/work/wt-disk/build-dev/bin/berth
F=/work/disk-meas/q3-8l.gguf
LIM=$(((1055+256)<<20))     # the budget (a third of the 3.17 GB file) + 256 MiB
CG=/sys/fs/cgroup/memory/berthdisk
mkdir -p $CG
echo $LIM > $CG/memory.limit_in_bytes
echo 0 > $CG/memory.swappiness 2>/dev/null
OUT=/work/disk-meas/out; mkdir -p $OUT
run() {  # name, args...
  local name=$1; shift
  sync; echo 3 > /proc/sys/vm/drop_caches
  ( echo $BASHPID > $CG/cgroup.procs; exec "$@" ) > $OUT/$name.out 2> $OUT/$name.err
  echo "$name rc=$? $(grep -E 'tg32 |disk tier|O_DIRECT' $OUT/$name.out | tr '\n' ' ')"
}
for rep in 1 2; do
  run tier-$rep $B bench model -m $F -p 0 -n 32 -r 2 -t 2 --ram-budget 1055M --disk-bench 4 --dram-mib 64 --json $OUT/tier-$rep.json
  run mmap-$rep $B bench model -m $F -p 0 -n 32 -r 2 -t 2 --ram-budget none --dram-mib 64 --json $OUT/mmap-$rep.json
done
