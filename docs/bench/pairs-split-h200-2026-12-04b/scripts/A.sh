source .device/prep.sh
date +%s > $OUT/t0
nproc; free -g | head -2
setsid nohup bash .device/synthbg.sh > /dev/null 2>&1 < /dev/null &
if [ -f .device/ik-bin.tar.xz ]; then
  mkdir -p /tmp && tar -xJf .device/ik-bin.tar.xz -C /tmp && ls -la /tmp/ikb/bin && (/tmp/ikb/bin/llama-bench --help > /tmp/ikhelp.txt 2>&1; echo "ik help rc $?"; head -3 /tmp/ikhelp.txt) && date +%s > /tmp/ik.done
else
  setsid nohup bash .device/ikbg.sh $PWD/.ik > /dev/null 2>&1 < /dev/null &
fi
timeout -k 5 540 bash scripts/gpu-gates.sh $OUT/gates
echo "gates rc $?"
ls -la /dev/shm /tmp/*.done /tmp/ik.* 2>/dev/null; tail -2 /tmp/ikb-build.log 2>/dev/null
date +%s > $OUT/t1
