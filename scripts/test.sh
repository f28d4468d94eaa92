#!/usr/bin/env bash
# The whole test suite: install dependencies, build (Release) and run every doctest suite with
# ctest; then build again with AddressSanitizer + UBSan (./build-asan) and run them all once
# more, so a crash or undefined behaviour on bad input fails the run.
# usage: scripts/test.sh [--quick]   (--quick: the Release pass only)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
if [[ ${1:-} != --quick ]]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DBERTH_SANITIZE=ON -DBERTH_CUDA=OFF >/dev/null
  cmake --build build-asan -j"$(nproc)"
  ctest --test-dir build-asan --output-on-failure -j"$(nproc)"
fi
