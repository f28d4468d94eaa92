#!/usr/bin/env bash
# The whole test suite: install dependencies, build (Release), run every doctest suite with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
