# 35B-A3B with CPU-held experts (issue 21), two rounds
source .device/lib.sh
date +%s > $OUT/t0
w /tmp/q35.gguf.done 150 || exit 1
I -m /tmp/q35.gguf -ngl 99 -ot exps=CPU -p 512 -n 128 -r 3
B -m /tmp/q35.gguf -ngl 99 --cpu-moe -p 512 -n 128 -r 3
B -m /tmp/q35.gguf -ngl 99 --cpu-moe -p 0 -n 128 -r 3
I -m /tmp/q35.gguf -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3
date +%s > $OUT/t1
for r in 1 2; do
  I -m /dev/shm/q27.gguf -ngl 99 -p 0 -n 128 -r 3
  B -m /dev/shm/q27.gguf -ngl 99 -p 0 -n 128 -r 3
done
date +%s > $OUT/t2
