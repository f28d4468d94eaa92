source .device/lib.sh
date +%s > $OUT/t0
w /dev/shm/q4b.gguf.done 100
for m in q08 q4b; do for L in 0 2 1 0; do L=$L B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5; done; done
w /tmp/q30.gguf.done 100
B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
ls -la /tmp/*.done /dev/shm/*.done; tail -1 /tmp/ikb-build.log
date +%s > $OUT/t1
