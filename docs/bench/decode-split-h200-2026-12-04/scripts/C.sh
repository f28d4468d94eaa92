source .device/lib.sh
date +%s > $OUT/t0
w /tmp/ik.done 200 || { tail -3 /tmp/ikb-build.log; exit 1; }
for r in 1 2; do
  I -m /tmp/q30.gguf -p 0 -n 128 -gp 16384,128 -gp 32768,128 -r 2
  V="$BV" B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
done
for m in q08 q4b; do
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
done
date +%s > $OUT/t1
