#!/usr/bin/env bash
# Issue 19 on the device (builds nothing): several sequences per step on CUDA.
#   1. test_gpu's multi-sequence cases: attention over a pool of sequences against the double
#      reference, per-row bits alone vs in a mixed step (both decode kernels), matmul by kind;
#      then the whole of test_gpu (the kernels changed: attention, matmul).
#   2. test_runtime's batch cases against CUDA: bit-identical tokens and logits alone vs beside 1,
#      3, 7 others and with prompt chunks (stories260K all-GPU and last 3 layers, tiny qwen3moe
#      with the experts on the CPU; the experts-on-GPU case is may_fail until moe_experts rows are
#      computed by kind), and the hybrid cases (graph replay == eager, placements).
#   3. berth run on stories260K, -ngl 99 / 3: the golden 64 tokens (md5).
#   4. compute-sanitizer memcheck on the batch cases (KV rows of several sequences).
#   5. berth bench model --parallel 1,2,4,8 on synthetic qwen3-30b-a3b (q4_k_m, router skew 1),
#      all on the GPU and --cpu-moe (issue 19's table), and pp512/tg32 all on the GPU (the prompt
#      rows' GEMM is ours now, no longer cuBLAS: compare with docs/performance.md).
# Pack first: ../shared/device/pack.sh build/bin/berth build/tests/test_gpu
#   build/tests/test_runtime -- ../shared/models
# Device: carry [".device"], command: bash scripts/diag/batch-invariance.sh $OUT
# (steps 1-4 take about 5 minutes; step 5 generates the 17 GB model first: run it as its own call
#  with `bash scripts/diag/batch-invariance.sh $OUT bench` if the first call ran out of time).
set -uo pipefail
out=${1:-.}
only=${2:-all}
mkdir -p "$out"
source .device/env.sh
[[ -e /work/shared ]] || { mkdir -p /work && ln -sfn "$PWD/.device/data" /work/shared; }
stories=.device/data/models/stories260K.gguf
golden=0b999e769e18af0f01f0ff820e3b3698
status=0
step() { local name=$1; shift; echo "== $name: $*"; if stdbuf -oL -eL "$@" >"$out/$name.txt" 2>&1; then echo "   ok"; else echo "   FAILED (rc $?)"; status=1; fi; tail -6 "$out/$name.txt" | sed 's/^/   /'; }
nvidia-smi -L
if [[ $only != bench ]]; then
  step gpu_batch timeout -k 10 300 test_gpu -tc='gpu attention: several*,gpu attention: n_decode*,gpu matmul: a row*'
  step gpu_all timeout -k 10 400 test_gpu -tce='*timing*'
  step batch_cuda env BERTH_TEST_DEVICE=cuda timeout -k 10 400 test_runtime -tc='batch:*'
  step hybrid_cuda env BERTH_TEST_DEVICE=cuda timeout -k 10 200 test_runtime -tc='hybrid*'
  for ngl in 99 3; do
    got=$(timeout -k 5 60 berth run -m $stories -p "Once upon a time" -n 64 --temp 0 -ngl $ngl 2>"$out/run_ngl$ngl.err" | md5sum | cut -d' ' -f1)
    if [[ $got == "$golden" ]]; then echo "== berth run -ngl $ngl: golden md5 ok"; else echo "== berth run -ngl $ngl: md5 $got != $golden"; status=1; fi
  done
  step memcheck env BERTH_TEST_DEVICE=cuda timeout -k 10 300 compute-sanitizer --tool memcheck --error-exitcode 3 test_runtime -tc='batch: a sequence*'
fi
if [[ $only == all || $only == bench ]]; then
  model=/tmp/q3-q4_k_m.gguf
  t=$(nproc)
  [[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" -o "$model" 2>&1 | tail -1
  step parallel_gpu timeout -k 10 300 berth bench model -m "$model" -t "$t" -ngl 99 --parallel 1,2,4,8 -p 128 -n 64 -r 2
  step parallel_cpu_moe timeout -k 10 300 berth bench model -m "$model" -t "$t" -ngl 99 --cpu-moe --parallel 1,2,4,8 -p 128 -n 64 -r 2
  # Prompt rows now take our WMMA GEMM instead of cuBLAS: pp512 all on the GPU, against the
  # figure in docs/performance.md.
  step pp_gpu timeout -k 10 200 berth bench model -m "$model" -t "$t" -ngl 99 -p 512 -n 32 -r 2
  cat "$out/parallel_gpu.txt" "$out/parallel_cpu_moe.txt" "$out/pp_gpu.txt"
fi
exit $status
