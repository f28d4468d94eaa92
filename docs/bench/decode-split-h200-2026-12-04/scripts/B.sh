source .device/lib.sh
date +%s > $OUT/t0
w /tmp/q30.gguf.done 150 || { cat /tmp/q30.gguf.log | tail -3; exit 1; }
for r in 1 2; do
  V="BERTH_ATTN_DEC_CLUSTERS=1 BERTH_ATTN_DEC_HEADS=4" B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
  V="" B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
  V="BERTH_ATTN_DEC_WARPS=8" B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
  V="BERTH_ATTN_DEC_HEADS=4" B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
done
ls -la /tmp/*.done /dev/shm/*.done; tail -1 /tmp/ikb-build.log
date +%s > $OUT/t1
