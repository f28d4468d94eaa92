source .device/lib.sh
V=/work/shared/tokenizers/qwen3/tokenizer.json
berth synth --preset qwen3.5-0.8b --type q4_k_m --vocab $V -s 1 -t 16 -o /dev/shm/q08.gguf > /dev/null 2>&1
berth synth --preset qwen3.5-4b --type q4_k_m --vocab $V -s 1 -t 16 -o /dev/shm/q4b.gguf > /dev/null 2>&1
spin() { for k in $(seq 1 $1); do nice -n 19 sh -c 'while :; do :; done' & done; }
for r in 1 2; do
 for m in q08 q4b; do
  echo "--- idle"; B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
  spin 4; echo "--- 4 spinners"; B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5; kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
  spin 16; echo "--- 16 spinners"; B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5; kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
 done
done
