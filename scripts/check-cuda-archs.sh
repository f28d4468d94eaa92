#!/usr/bin/env bash
# Compile-only check of the CUDA code for the unified-memory boards' GPUs (issue 25): the kernels
# (gpu_kernels/) and the CUDA device (backends/cuda/) built for sm_87 (Jetson Orin), sm_110 (Jetson
# Thor) and sm_121 (GB10 / DGX Spark), as many of them as this nvcc lists (`nvcc
# --list-gpu-arch`), into ./build-cuda-archs. Nothing runs: no such GPU is here. It proves the
# sm_90-only paths have their fallbacks: thread-block clusters and griddepcontrol (programmatic
# dependent launch) are compiled only for __CUDA_ARCH__ >= 900 and chosen at run time by compute
# capability (gpu_kernels/src/launch.cuh); berth has no wgmma/TMA code. Then it checks that every
# kernel object holds code for every requested architecture.
# usage: scripts/check-cuda-archs.sh            (skips, exit 0, when there is no nvcc)
#   env CUDA_ARCHS="87;121"   other architectures
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=$(command -v nvcc || true)
[[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
if [[ -z $nvcc ]]; then
  echo "cuda-archs: no nvcc: skipped"
  exit 0
fi
listed=$("$nvcc" --list-gpu-arch | sed -n 's/^compute_//p' | xargs)
archs=()
for a in $(tr ';' ' ' <<<"${CUDA_ARCHS:-87;110;121}"); do
  if [[ " $listed " == *" $a "* ]]; then
    archs+=("$a")
  else
    echo "cuda-archs: this nvcc does not list compute_$a: left out"
  fi
done
if ((${#archs[@]} == 0)); then
  echo "cuda-archs: none of the architectures is available: skipped"
  exit 0
fi
list=$(IFS=';'; echo "${archs[*]}")
echo "cuda-archs: compiling gpu_kernels and the CUDA device for sm_${list//;/, sm_} ($("$nvcc" --version | tail -1))"
t0=$SECONDS
cmake -S . -B build-cuda-archs -G Ninja -DCMAKE_BUILD_TYPE=Release -DBERTH_CUDA=ON \
  -DBERTH_BUILD_TESTS=OFF -DCMAKE_CUDA_COMPILER="$nvcc" "-DCMAKE_CUDA_ARCHITECTURES=$list" >/dev/null
cmake --build build-cuda-archs -j"$(nproc)" --target berth_gpu_kernels berth_backends
failed=0
for o in build-cuda-archs/gpu_kernels/CMakeFiles/berth_gpu_kernels.dir/src/*.cu.o; do
  have=$(strings "$o" | grep -oE '\bsm_[0-9]+\b' | sort -u | xargs)
  for a in "${archs[@]}"; do
    if [[ " $have " != *" sm_$a "* ]]; then
      echo "FAIL: $(basename "$o") has no sm_$a code"
      failed=1
    fi
  done
done
((failed)) && exit 1
echo "cuda-archs: passed ($((SECONDS - t0)) s)"
