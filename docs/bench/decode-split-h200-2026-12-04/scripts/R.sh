source .device/lib.sh
date +%s > $OUT/t0
nice -n 5 berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t 16 -o /dev/shm/q30.gguf > /tmp/synth.log 2>&1 < /dev/null &
SP=$!
echo "== test_gpu attention" | tee -a $OUT/all.txt
timeout -k 5 150 test_gpu -tc='*attention decode*,*captured decode graph*,*8-bit blocks left by the attention*,*several sequences*' 2>&1 | tail -4 | tee -a $OUT/all.txt
wait $SP
ls -la /dev/shm; tail -2 /tmp/synth.log
M=/dev/shm/q30.gguf
for V in "BERTH_ATTN_DEC_CLUSTERS=1" "" "BERTH_ATTN_DEC_CB=1" "BERTH_ATTN_DEC_CB=4" "BERTH_ATTN_DEC_HEADS=4" "BERTH_ATTN_DEC_WARPS=8"; do
  V="$V" B -m $M -ngl 99 -p 0 -n 128 -d 32768 -r 2
done
V="" B -m $M -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
V="BERTH_ATTN_DEC_CLUSTERS=1" B -m $M -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
date +%s > $OUT/t1
