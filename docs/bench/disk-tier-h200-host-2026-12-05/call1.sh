#!/bin/bash
# Call 1 on the H200 lease: probe the host's disks, memory limits and cgroups; write the 17.2 GB
# qwen3-30b-a3b-shaped Q4_K file and the locality trace to the host's disk (in the background),
# and run the device gates meanwhile.
[ -d .device/bin ] || tar -xJf .device/bin.tar.xz -C .device
source .device/env.sh
t0=$(date +%s)
{
  echo "== id"; id; uname -r; nproc; free -m; swapon --show
  echo "== df"; df -hT / /tmp /var/tmp "$PWD" /dev/shm 2>&1
  echo "== lsblk"; lsblk -o NAME,SIZE,ROTA,TYPE,MODEL,TRAN,MOUNTPOINT 2>&1
  echo "== mounts"; grep -v -E ' (proc|sysfs|cgroup2?|devpts|mqueue|securityfs|debugfs|tracefs|bpf|pstore|configfs|fusectl|hugetlbfs) ' /proc/mounts
  echo "== cgroup"; stat -fc %T /sys/fs/cgroup; cat /proc/self/cgroup; cat /sys/fs/cgroup/cgroup.controllers 2>&1
  cat /sys/fs/cgroup/cgroup.subtree_control 2>&1; ls /sys/fs/cgroup | head -40
  echo "== drop_caches"; sync; ( echo 3 > /proc/sys/vm/drop_caches ) && echo "drop_caches ok"
  echo "== block queues"; for q in /sys/block/*/queue; do echo "$q $(cat $q/scheduler 2>/dev/null) rotational=$(cat $q/rotational) nr_requests=$(cat $q/nr_requests) max_sectors_kb=$(cat $q/max_sectors_kb)"; done
  echo "== cpu"; lscpu | grep -E 'Model name|Socket|Core|Thread|NUMA'
} > $OUT/probe.txt 2>&1
# the first non-tmpfs directory with room for the file (outside the repository copy)
D=; best=0
for d in /var/tmp /tmp /root "$PWD"; do
  [ -d "$d" ] || continue
  t=$(stat -fc %T "$d"); a=$(df -P --block-size=1G "$d" | awk 'NR==2{print $4}')
  echo "candidate $d fs=$t free=${a}G" >> $OUT/probe.txt
  [[ $t == tmpfs ]] && continue
  [[ -z $D ]] && (( a >= 25 )) && { best=$a; D=$d; }
done
echo "disk dir: $D (${best}G free)" | tee -a $OUT/probe.txt
mkdir -p $D/disk24 && echo "$D/disk24" > /tmp/disk24.dir
( berth synth --preset qwen3-30b-a3b --type q4_k --router-skew 1 -s 1 -t 8 -o $D/disk24/q3-30b.gguf > $OUT/synth.txt 2>&1
  berth trace gen --preset locality --tokens 8192 -s 1 -o $D/disk24/locality.brtr >> $OUT/synth.txt 2>&1
  sync; echo $(( $(date +%s) - t0 )) > /tmp/synth.done ) &
timeout -k 5 450 bash scripts/gpu-gates.sh $OUT/gates; echo "gates rc $? in $(( $(date +%s) - t0 )) s"
for i in $(seq 1 150); do [ -f /tmp/synth.done ] && break; sleep 2; done
echo "synth done at $(cat /tmp/synth.done 2>/dev/null) s"; tail -2 $OUT/synth.txt; ls -la $D/disk24
cat $OUT/probe.txt | head -80
