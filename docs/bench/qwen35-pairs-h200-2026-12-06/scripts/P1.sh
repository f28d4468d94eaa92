# dense Qwen3.5 pairs (issue 21): tg128, pp512, pp4096 all on the GPU, ik first then berth, two rounds (the second berth first)
source .device/lib.sh
date +%s > $OUT/t0; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cat .device/IKCOMMIT .device/COMMIT
w /tmp/q35.gguf.done 200 || exit 1; date +%T; tail -1 /tmp/q35.gguf.log
for m in q08 q4b q27; do
  I -m /dev/shm/$m.gguf -ngl 99 -p 512,4096 -n 128 -r 3
  B -m /dev/shm/$m.gguf -ngl 99 -p 512,4096 -n 128 -r 3
done
for m in q08 q4b q27; do
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 3
  I -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 3
done
date +%s > $OUT/t1
