source .device/prep.sh
V=/work/shared/tokenizers/qwen3/tokenizer.json
[ -f /dev/shm/q27.gguf ] || berth synth --preset qwen3.5-27b --type q4_k_m --vocab $V -s 1 -t 16 -o /dev/shm/q27.gguf > /tmp/s27.log 2>&1
export PATH=/usr/local/cuda/bin:$PATH
timeout 500 bash scripts/diag/decode-step-table.sh /dev/shm/q27.gguf $OUT/st27 64 2>&1 | tail -40
