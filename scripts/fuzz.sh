#!/usr/bin/env bash
# Fuzzes the model-file readers (GGUF parser, tokenizer, model loader, one forward step) with
# libFuzzer under ASan+UBSan. usage: scripts/fuzz.sh [SECONDS]   (default 120)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-120}
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DBERTH_CUDA=OFF -DBERTH_SANITIZE=ON -DBERTH_FUZZ=ON >/dev/null
cmake --build build-fuzz --target fuzz_load fuzz_make_seed -j"$(nproc)"
corpus=build-fuzz/corpus
mkdir -p "$corpus"
build-fuzz/bin/fuzz_make_seed "$corpus/seed-tiny-llama.gguf"
build-fuzz/bin/fuzz_make_seed --moe-bpe "$corpus/seed-tiny-qwen3moe-bpe.gguf"
build-fuzz/bin/fuzz_load -max_total_time="$secs" -max_len=16384 -rss_limit_mb=2048 \
  -timeout=10 "$corpus"
