# lease A, call 2: several sequences (issue 19), prefill with CPU-held experts against all on the GPU (issue 18)
source .device/lib.sh
date +%s > $OUT/t0
w /tmp/q30.done 100 || exit 1
B -m /dev/shm/q30.gguf -ngl 99 -p 32 -n 128 -r 2 --parallel 1,2,4,8
B -m /dev/shm/q30.gguf -ngl 99 --cpu-moe -p 32 -n 128 -r 2 --parallel 1,2,4,8
B -m /dev/shm/q30.gguf -ngl 99 -p 4096 -n 0 -r 2
B -m /dev/shm/q30.gguf -ngl 99 --cpu-moe -p 4096 -n 0 -r 2
B -m /dev/shm/q30.gguf -ngl 99 -p 4096 -n 0 -r 2 -b 4096 -ub 4096
B -m /dev/shm/q30.gguf -ngl 99 --cpu-moe -p 4096 -n 0 -r 2 -b 4096 -ub 4096
B -m /dev/shm/q30.gguf -ngl 99 -p 32 -n 128 -r 2 --parallel 1,4
date +%s > $OUT/t1
