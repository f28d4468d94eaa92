source .device/lib.sh
V=/work/shared/tokenizers/qwen3/tokenizer.json
berth synth --preset qwen3.5-0.8b --type q4_k_m --vocab $V -s 1 -t 16 -o /dev/shm/q08.gguf > /dev/null 2>&1
berth synth --preset qwen3.5-4b --type q4_k_m --vocab $V -s 1 -t 16 -o /dev/shm/q4b.gguf > /dev/null 2>&1
for r in 1 2 3; do
 for m in q08 q4b; do
  echo "--- block (BERTH_SYNC_SPIN_US=0)"; BERTH_SYNC_SPIN_US=0 B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
  echo "--- poll (default)"; B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
 done
done
echo "--- hybrid gate"
BERTH_TEST_DEVICE=cuda timeout -k 5 200 test_runtime -tc='hybrid*,batch:*,expert slots*' 2>&1 | tail -3
