#!/usr/bin/env bash
# Diagnostic (device): ncu details (duration, cycles, stall reasons) of chosen decode kernels of
# a --cpu-moe step on the 4-layer synthetic model. usage: kernel-detail.sh REGEX [COUNT]
set -uo pipefail
source .device/env.sh
small=/tmp/q3-4l.gguf
[[ -f $small ]] || berth synth --preset qwen3-30b-a3b --n-layer 4 --type q4_k_m --router-skew 1 -s 1 -t "$(nproc)" -o "$small" 2>&1 | tail -1
timeout 200 ncu --clock-control none -k "regex:$1" -c "${2:-3}" --section SpeedOfLight --section LaunchStats \
  --section WarpStateStats --section Occupancy \
  berth bench model -m "$small" -t "$(nproc)" -r 1 -p 0 -n 4 -ngl 99 --cpu-moe --handoff callback 2>&1 |
  grep -E "^  [a-z_]+.*\(|Duration|Elapsed Cycles|Registers Per|Warp Cycles Per Issued|Grid Size|Block Size|Achieved Occ|Memory Throughput|stall|Stall" | cut -c1-200
