# call 2: 27B decode, the GEMV restructure (berth) against the kernel before it (berth-old), launch bounds
source .device/prep.sh
t0=$(date +%s)
ls -la /dev/shm/q27.gguf || exit 1
b() { echo "== $1 ${V:+[$V] }" | tee -a $OUT/tg27.txt; env ${V:-} timeout 120 $1 bench model -m /dev/shm/q27.gguf -t 16 -ngl 99 -p 0 -n 128 -r 3 > /tmp/c.txt 2>&1; cat /tmp/c.txt >> $OUT/tg27.txt; grep -E "^tg128  *run|^\| .*tg128" /tmp/c.txt | tail -4; }
V= b berth-old; V= b berth; V=BERTH_GEMV_KQ_MINB=7 b berth
V= b berth-old; V= b berth
echo "done at $(( $(date +%s) - t0 )) s"
