# issues 23 and 21: pairs against ik_llama.cpp
source .device/lib.sh
date +%s > $OUT/t0
w /tmp/ik.done 250 || { tail -3 /tmp/ikb-build.log; exit 1; }
I -m /tmp/q30.gguf -p 0 -n 128 -gp 16384,128 -gp 32768,128 -r 2
B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
for m in q08 q4b; do
  w /dev/shm/$m.gguf.done 60
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
done
I -m /tmp/q30.gguf -p 0 -n 128 -gp 16384,128 -gp 32768,128 -r 2
B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
date +%s > $OUT/t1
