source .device/lib.sh
w /tmp/ik.done 250 || { tail -2 /tmp/ikb-build.log; exit 1; }
for m in q08 q4b; do
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
  I -m /dev/shm/$m.gguf -p 0 -n 128 -r 5
  B -m /dev/shm/$m.gguf -ngl 99 -p 0 -n 128 -r 5
done
I -m /tmp/q35.gguf -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3
B -m /tmp/q35.gguf -ngl 99 --cpu-moe -p 0 -n 128 -r 3
I -m /tmp/q35.gguf -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3
I -m /dev/shm/q27.gguf -p 512,4096 -n 0 -r 2
I -m /tmp/q30.gguf -p 0 -n 128 -gp 16384,128 -gp 32768,128 -r 2
B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
