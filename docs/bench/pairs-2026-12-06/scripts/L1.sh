# call 1: the dense Qwen3.5 files against ik_llama.cpp (issue 21): tg128, pp512, pp4096
source .device/lib.sh
date +%s > $OUT/t0; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2
/tmp/ikb/bin/llama-bench --help > /dev/null 2>&1; echo "ik help rc $?"; cat .device/IKCOMMIT
setsid nohup bash .device/synthbg.sh > /dev/null 2>&1 < /dev/null &
for m in q08 q4b; do
  w /dev/shm/$m.gguf.done 90 || continue
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
  I -m /dev/shm/$m.gguf -p 512,4096 -n 0 -r 2
  B -m /dev/shm/$m.gguf -ngl 99 -p 512,4096 -n 0 -r 2
done
w /dev/shm/q27.gguf.done 120 || exit 1
I -m /dev/shm/q27.gguf -p 0 -n 128 -r 3
B -m /dev/shm/q27.gguf -ngl 99 -p 0 -n 128 -r 3
I -m /dev/shm/q27.gguf -p 0 -n 128 -r 3
B -m /dev/shm/q27.gguf -ngl 99 -p 0 -n 128 -r 3
I -m /dev/shm/q27.gguf -p 512,4096 -n 0 -r 2
B -m /dev/shm/q27.gguf -ngl 99 -p 512,4096 -n 0 -r 2
ls -la /dev/shm /tmp/*.done 2>/dev/null
date +%s > $OUT/t1
