source .device/lib.sh
V=/work/shared/tokenizers/qwen3/tokenizer.json
berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t 16 -o /dev/shm/q30.gguf > /dev/null 2>&1
for r in 1 2; do
  echo "--- block"; BERTH_SYNC_SPIN_US=0 B -m /dev/shm/q30.gguf -ngl 99 -p 0 -n 128 -r 3
  echo "--- poll"; B -m /dev/shm/q30.gguf -ngl 99 -p 0 -n 128 -r 3
done
rm /dev/shm/q30.gguf
berth synth --preset qwen3.5-35b-a3b --type q4_k_m --vocab $V -s 1 -t 16 -o /dev/shm/q35.gguf > /dev/null 2>&1
for r in 1 2; do
  echo "--- block"; BERTH_SYNC_SPIN_US=0 B -m /dev/shm/q35.gguf -ngl 99 --cpu-moe -p 0 -n 128 -r 3
  echo "--- poll"; B -m /dev/shm/q35.gguf -ngl 99 --cpu-moe -p 0 -n 128 -r 3
done
