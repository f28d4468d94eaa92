source .device/lib.sh
B -m /tmp/q30.gguf -ngl 99 -p 0 -n 128 -d 0,16384,32768 -r 2
B -m /dev/shm/q27.gguf -ngl 99 -p 512,4096 -n 0 -r 2
B -m /tmp/q35.gguf -ngl 99 --cpu-moe -p 0 -n 128 -r 3
for i in $(seq 1 200); do [ -f /tmp/ik.done ] && break; sleep 2; done
tail -1 /tmp/ikb-build.log; ls /tmp/ik.done
