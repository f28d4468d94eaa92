#!/usr/bin/env bash
# Configures and builds berth in ./build (Release). usage: scripts/build.sh [TARGET...]
# (default: every target, test suites included; scripts/demo.sh builds only `berth`).
# CMake options go in the environment: BERTH_CMAKE_ARGS="-DBERTH_CUDA=OFF" scripts/build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC2086
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${BERTH_CMAKE_ARGS:-} >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j"$(nproc)" "${targets[@]}"
