# call 3: qwen3-30b-a3b: depth 0 again (issue 23); pp512 with CPU-held experts (issue 18)
source .device/lib.sh
date +%s > $OUT/t0
B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -r 3
I -m /tmp/q30.gguf -p 0 -n 128 -r 3
B -m /tmp/q30.gguf -ngl 99 --cpu-moe -p 512 -n 0 -r 3
I -m /tmp/q30.gguf -ngl 99 -ot exps=CPU -p 512 -n 0 -r 3 -ub 512
B -m /tmp/q30.gguf -ngl 99 --cpu-moe -p 512 -n 0 -r 3
I -m /tmp/q30.gguf -ngl 99 -ot exps=CPU -p 512 -n 0 -r 3 -ub 512
date +%s > $OUT/t1
