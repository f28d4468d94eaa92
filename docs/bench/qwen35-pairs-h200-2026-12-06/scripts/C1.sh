# call 1: first ik part, the benchmark files made in the background, the CUDA gates of test_runtime and golden md5 at the commit
source .device/lib.sh
date +%s > $OUT/t0; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2
cat .device/COMMIT
cp .ikc/part /tmp/ik.tar.xz; ls -la /tmp/ik.tar.xz
sed -i '/q30.gguf/d' .device/synthbg.sh
setsid nohup bash .device/synthbg.sh > /tmp/synthbg.log 2>&1 < /dev/null &
GATES="hybrid_cuda golden" timeout -k 5 300 bash scripts/gpu-gates.sh $OUT/gates
echo "gates rc $?"; ls /dev/shm /tmp/*.done 2>/dev/null
date +%s > $OUT/t1
