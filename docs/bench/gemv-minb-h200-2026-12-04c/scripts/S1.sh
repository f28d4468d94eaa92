# call 1: ik_llama.cpp's llama-bench (prebuilt) and the 27B file; ik's tg128 on it
t0=$(date +%s)
mkdir -p /tmp/b1 && tar -xJf .ikb/berth-min.tar.xz -C /tmp/b1 && tar -xJf .ikb/ik-bin.tar.xz -C /tmp || exit 1
export LD_LIBRARY_PATH=/tmp/b1/lib:/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
/tmp/ikb/bin/llama-bench --help > /dev/null 2>&1; echo "ik help rc $?"
/tmp/b1/bin/berth synth --preset qwen3.5-27b --type q4_k_m --vocab /tmp/b1/data/tokenizers/qwen3/tokenizer.json -s 1 -t 16 -o /dev/shm/q27.gguf > $OUT/synth27.txt 2>&1; echo "synth rc $? at $(( $(date +%s) - t0 )) s"
echo "== ik -m /dev/shm/q27.gguf -p 0 -n 128 -r 3" | tee $OUT/ik27.txt
timeout 200 /tmp/ikb/bin/llama-bench -m /dev/shm/q27.gguf -t 16 -p 0 -n 128 -r 3 -o md >> $OUT/ik27.txt 2> $OUT/ik27.err; echo "ik rc $?"
grep -E "tg128" $OUT/ik27.txt; tail -3 $OUT/ik27.err | grep -i -E "error|fail"
echo "done at $(( $(date +%s) - t0 )) s"
