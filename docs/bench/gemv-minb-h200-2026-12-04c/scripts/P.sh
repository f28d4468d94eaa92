source .device/prep.sh
V=/work/shared/tokenizers/qwen3/tokenizer.json
date +%s > $OUT/t0
(berth synth --preset qwen3.5-27b --type q4_k_m --vocab $V -s 1 -t 16 -o /dev/shm/q27.gguf > /tmp/s27.log 2>&1; date +%s > /tmp/q27.done) &
which ncu || ls /usr/local/cuda/bin | grep -i ncu
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 200 nice -n 5 $NCU --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats --launch-skip 0 --launch-count 8 .device/micro/gemv_micro ncu > $OUT/ncu.txt 2>&1; echo "ncu rc $?"
for i in $(seq 1 250); do [ -f /tmp/q27.done ] && break; sleep 2; done
echo "synth27 $(( $(cat /tmp/q27.done) - $(cat $OUT/t0) )) s"; tail -2 /tmp/s27.log
berth bench model -m /dev/shm/q27.gguf -ngl 99 -t 16 -p 0 -n 128 -r 3 > $OUT/tg27.txt 2>&1; grep -E "tg128|HBM" $OUT/tg27.txt
BERTH_PROFILE_BY_NAME=1 berth bench model -m /dev/shm/q27.gguf -ngl 99 -t 16 -p 0 -n 32 -r 1 --profile > $OUT/prof27.txt 2>&1; tail -45 $OUT/prof27.txt
date +%s > $OUT/t1
