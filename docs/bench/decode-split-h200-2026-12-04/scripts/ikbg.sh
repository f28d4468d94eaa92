# background: build ik_llama.cpp's llama-bench without a time limit
d=$1
[ -f /tmp/ikb/build.ninja ] || cmake -S "$d/src" -B /tmp/ikb -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_STANDARD=17 \
  -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_IQK_FA_ALL_QUANTS=OFF -DGGML_NATIVE=ON > /tmp/ikb-cmake.log 2>&1
date +%s > /tmp/ik.start
nice -n 10 ninja -C /tmp/ikb -j16 llama-bench > /tmp/ikb-build.log 2>&1 && date +%s > /tmp/ik.done
