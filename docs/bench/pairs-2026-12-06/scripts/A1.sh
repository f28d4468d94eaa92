# lease A, call 1: device gates at the commit (test_gpu, the hybrid/batch/Qwen3.5 CUDA cases, golden md5), the 30B file made beside them
source .device/lib.sh
date +%s > $OUT/t0; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2
cat .device/COMMIT
setsid nohup bash -c 'source .device/prep.sh; nice -n 5 berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t 16 -o /dev/shm/q30.gguf > /tmp/q30.log 2>&1 && date +%s > /tmp/q30.done' > /dev/null 2>&1 < /dev/null &
GATES="test_gpu hybrid_cuda golden" timeout -k 5 560 bash scripts/gpu-gates.sh $OUT/gates
echo "gates rc $?"; ls -la /dev/shm /tmp/q30.done 2>/dev/null
date +%s > $OUT/t1
