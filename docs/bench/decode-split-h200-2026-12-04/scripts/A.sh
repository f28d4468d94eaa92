source .device/prep.sh
date +%s > $OUT/t0
setsid nohup bash .device/ikbg.sh $PWD/.ik > /dev/null 2>&1 < /dev/null &
setsid nohup bash .device/synthbg.sh > /dev/null 2>&1 < /dev/null &
timeout -k 5 520 bash scripts/gpu-gates.sh $OUT/gates
echo "gates rc $?"
ls -la /dev/shm /tmp/*.done /tmp/ik.* 2>/dev/null; tail -2 /tmp/ikb-build.log
date +%s > $OUT/t1
