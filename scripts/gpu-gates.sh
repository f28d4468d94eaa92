#!/usr/bin/env bash
# The GPU gates of the heterogeneous step, run on a machine with a CUDA device (see
# ../shared/device/README.md): build here with -DBERTH_CUDA=ON, pack test_gpu, test_runtime and
# berth with ../shared/models, then on the device: `bash scripts/gpu-gates.sh OUTDIR`.
#   1. test_gpu: every GPU kernel against the CPU reference (oracle harness).
#   2. test_runtime's hybrid cases against the CUDA device: placement invariance (all-CPU,
#      all-GPU, -ngl splits, --cpu-moe, --n-cpu-moe), MoE ubatches of 1, 2 and 512 tokens,
#      streamed experts (whole and split with the CPU), graph replay == eager bit for bit; the
#      batch cases (a sequence's bits alone and beside others) and the expert-slot cases (swaps
#      forced every step), the routing cases, and the unified cases (on CUDA: the unified path,
#      --unified on, against the normal path bit for bit, with and without --cpu-moe), and the
#      Qwen3.5 hybrid cases (placement invariance of the GDN layers, several sequences, state copies).
#   3. berth run on stories260K with -ngl 99 / 3 / 0 and -ngl 99 --unified on: the golden 64
#      tokens (md5).
#   4. compute-sanitizer memcheck on hybrid steps and on the attention decode kernels (their
#      split over clusters and its workspace), racecheck on the kernels (the GDN ones among them).
# Each step is killed (timeout -k) past its limit, so a hang costs minutes, not the lease.
# GATES="test_gpu hybrid_cuda golden" (names of the steps) runs only those, to split the gates
# over two device calls of at most 10 minutes; the default runs them all.
set -uo pipefail
out=${1:-.}
mkdir -p "$out"
source .device/env.sh
[[ -e /work/shared ]] || { mkdir -p /work && ln -sfn "$PWD/.device/data" /work/shared; }
# The suites start `berth` by the build tree's path (tests/CMakeLists.txt, BERTH_BIN).
[[ -x /work/main/build/bin/berth ]] || { mkdir -p /work/main/build && ln -sfn "$PWD/.device/bin" /work/main/build/bin; }
stories=.device/data/models/stories260K.gguf
golden=0b999e769e18af0f01f0ff820e3b3698
status=0
gates=${GATES:-test_gpu hybrid_cuda golden memcheck memcheck_attn racecheck}
want() { [[ " $gates " == *" $1 "* ]]; }
step() { local name=$1; shift; want "$name" || return 0; echo "== $name: $*"; if stdbuf -oL -eL "$@" >"$out/$name.txt" 2>&1; then echo "   ok"; else echo "   FAILED (rc $?)"; status=1; fi; tail -4 "$out/$name.txt" | sed 's/^/   /'; }
nvidia-smi -L
step test_gpu timeout -k 10 480 test_gpu
step hybrid_cuda env BERTH_TEST_DEVICE=cuda timeout -k 10 300 test_runtime -tc='hybrid*,batch:*,expert slots*,stream split*,routing*,unified*,qwen35*,gdn*'
want golden && for flags in "-ngl 99" "-ngl 3" "-ngl 0" "-ngl 99 --unified on"; do
  name=$(echo "$flags" | tr -d ' -')
  got=$(timeout -k 5 60 berth run -m $stories -p "Once upon a time" -n 64 --temp 0 $flags 2>"$out/run_$name.err" | md5sum | cut -d' ' -f1)
  if [[ $got == "$golden" ]]; then echo "== berth run $flags: golden md5 ok"; else echo "== berth run $flags: md5 $got != $golden"; status=1; fi
done
step memcheck env BERTH_TEST_DEVICE=cuda timeout -k 10 240 compute-sanitizer --tool memcheck --error-exitcode 3 test_runtime -tc='hybrid: replaying*,hybrid: prefill streams*,batch: a sequence*,hybrid: the values only*,hybrid: a split step*,expert slots: swaps forced every step*,stream split: every*,unified: without pageable*,qwen35: on the device*'
step memcheck_attn timeout -k 10 300 compute-sanitizer --tool memcheck --error-exitcode 3 test_gpu -tc='*attention decode*,*captured decode graph*,*8-bit blocks left by the attention*'
step racecheck timeout -k 10 300 compute-sanitizer --tool racecheck --error-exitcode 3 test_gpu -tc='*attention decode*,*router*,*moe*,*add_rms_norm*,*matmul_group*,*norm_rope*,*hand-off*,*rms_norm*,*head_slice*,*sigmoid_mul*,*ssm_conv*,*gated_delta*' -tce='*timing*,*long caches*'
exit $status
