#!/bin/bash
# Call 3 on the H200 lease (a fresh machine: the first call's was gone): issue 24's measurement
# on the device host. The 17.2 GB file made again, the
# tier (io_uring, O_DIRECT) with --ram-budget a third of it against the mmap path under the same
# memory limit (a memory cgroup of the budget + 256 MiB, or, where no cgroup can be made, a
# resident balloon that leaves that much of MemAvailable), cold page cache before each run,
# CPU only (-ngl 0, 16 threads); the drive's O_DIRECT QD32 random-read rate in the same run.
[ -d .device/bin ] || tar -xJf .device/bin.tar.xz -C .device
source .device/env.sh
t0=$(date +%s)
D=/var/tmp/disk24; mkdir -p $D; F=$D/q3-30b.gguf; T=$D/locality.brtr; B=berth
echo "$(nproc) cores; $(df -hT /var/tmp | tail -1)"
berth synth --preset qwen3-30b-a3b --type q4_k --router-skew 1 -s 1 -t 16 -o $F > $OUT/synth.txt 2>&1
berth trace gen --preset locality --tokens 8192 -s 1 -o $T >> $OUT/synth.txt 2>&1; sync
echo "synth at $(( $(date +%s) - t0 )) s"; tail -2 $OUT/synth.txt
BUD=${BUD:-5474}; LIM=$(((BUD+256)<<20))
ls -la $F $T || exit 1
lim=none
if [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; then
  CG=/sys/fs/cgroup/berthdisk
  grep -qw memory /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || {
    mkdir -p /sys/fs/cgroup/leaf; for p in $(cat /sys/fs/cgroup/cgroup.procs); do echo $p > /sys/fs/cgroup/leaf/cgroup.procs 2>/dev/null; done
    echo +memory > /sys/fs/cgroup/cgroup.subtree_control; }
  mkdir -p $CG && echo $LIM > $CG/memory.max && { echo 0 > $CG/memory.swap.max 2>/dev/null; lim=cgroup2; }
else
  CG=/sys/fs/cgroup/memory/berthdisk
  mkdir -p $CG && echo $LIM > $CG/memory.limit_in_bytes && lim=cgroup1
fi
echo "memory limit by: $lim ($LIM bytes)"
enter() { [[ $lim == cgroup* ]] && echo $BASHPID > $CG/cgroup.procs; }
BPID=
if [[ $lim == none ]]; then
  avail=$(awk '/MemAvailable/{print int($2/1024)}' /proc/meminfo)
  bal=$(( avail - BUD - 256 )); echo "balloon $bal MiB of $avail MiB available"
  balloon $bal & BPID=$!; sleep 25; grep -E 'MemAvailable|Cached|MemFree' /proc/meminfo
fi
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || python3 -c "import os,sys;fd=os.open(sys.argv[1],os.O_RDONLY);os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)" $F; }
run() {  # name, timeout, env... command...
  local name=$1 to=$2; shift 2
  drop; local s=$(date +%s)
  ( enter; exec timeout -k 5 $to env "$@" ) > $OUT/$name.out 2> $OUT/$name.err
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s)-s ))s $(grep -E '^\| .*tg[0-9]' $OUT/$name.out | awk -F'|' '{print $(NF-1)}') $(grep -E 'disk tier|drive' $OUT/$name.out | tr '\n' ' ' | cut -c1-300)"
}
tier="bench model -m $F -p 0 -n 32 -r 2 -t 16 -ngl 0 --ram-budget ${BUD}M --disk-bench 4 --dram-mib 64"
mmap="bench model -m $F -p 0 -n 8 -r 2 -t 16 -ngl 0 --ram-budget none --dram-mib 64"
left() { (( $(date +%s) - t0 < $1 )); }
run tier-skew-1 80 X=1 $B $tier --json $OUT/tier-skew-1.json
run mmap-skew-1 90 X=1 $B $mmap --json $OUT/mmap-skew-1.json
left 250 && run tier-trace-1 80 X=1 $B $tier --routing-trace $T --json $OUT/tier-trace-1.json
left 280 && run mmap-trace-1 90 X=1 $B $mmap --routing-trace $T --json $OUT/mmap-trace-1.json
TV=; [ -x /usr/bin/time ] && TV="/usr/bin/time -v"
P="the quick brown fox jumps over the lazy dog and then"
for m in tier mmap pread; do
  left 330 || break
  case $m in tier) e=X=1; rb="${BUD}M";; mmap) e=X=1; rb=none;; pread) e=BERTH_DISK_READER=pread; rb="${BUD}M";; esac
  drop; ( enter; exec timeout 50 env $e $TV $B run -m $F -p "$P" -n 24 --temp 0 -t 16 -ngl 0 --ram-budget $rb ) > $OUT/tokens-$m.txt 2> $OUT/tokens-$m.err
  echo "tokens $m rc=$? md5 $(md5sum < $OUT/tokens-$m.txt | cut -c1-12) maxrss $(grep 'Maximum resident' $OUT/tokens-$m.err | awk '{print $NF}') KiB"
done
left 360 && run tier-skew-pread 55 BERTH_DISK_READER=pread $B $tier --json $OUT/tier-skew-pread.json
left 370 && run tier-skew-2 50 X=1 $B $tier --json $OUT/tier-skew-2.json
[[ -n $BPID ]] && kill $BPID
echo "done at $(( $(date +%s) - t0 )) s"
