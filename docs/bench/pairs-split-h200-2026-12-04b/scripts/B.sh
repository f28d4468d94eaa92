# issue 18: prefill with CPU-held experts
source .device/lib.sh
date +%s > $OUT/t0
w /tmp/q30.gguf.done 150 || exit 1
for r in 1 2; do
  B -m /tmp/q30.gguf -ngl 99 --cpu-moe -p 512 -n 0 -r 3 --stream-split off
  B -m /tmp/q30.gguf -ngl 99 --cpu-moe -p 512 -n 0 -r 3
done
[ -f /tmp/ik.done ] && I -m /tmp/q30.gguf -ngl 99 -ot exps=CPU -p 512 -n 0 -r 3 -ub 512
B -m /tmp/q30.gguf -ngl 99 -p 4096 -n 0 -r 2
B -m /tmp/q30.gguf -ngl 99 --cpu-moe -p 4096 -n 0 -r 2
B -m /tmp/q30.gguf -ngl 99 --cpu-moe -p 4096 -n 0 -r 2 -b 4096 -ub 4096
[ -f /tmp/ik.done ] && I -m /tmp/q30.gguf -ngl 99 -ot exps=CPU -p 512 -n 0 -r 3 -ub 512
date +%s > $OUT/t1
