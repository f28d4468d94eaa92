# call 2: 35B-A3B with CPU-held experts (issue 21); qwen3-30b-a3b at depth (issue 23)
source .device/lib.sh
date +%s > $OUT/t0
w /tmp/synth.alldone 150 || exit 1
I -m /tmp/q35.gguf -ngl 99 -ot exps=CPU -p 512 -n 128 -r 3
B -m /tmp/q35.gguf -ngl 99 --cpu-moe -p 512 -n 128 -r 3
I -m /tmp/q35.gguf -ngl 99 -ot exps=CPU -p 512 -n 128 -r 3
B -m /tmp/q35.gguf -ngl 99 --cpu-moe -p 512 -n 128 -r 3
I -m /tmp/q30.gguf -p 0 -n 128 -gp 16384,128 -gp 32768,128 -r 2
B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
date +%s > $OUT/t1
