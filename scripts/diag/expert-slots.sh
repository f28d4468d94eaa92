#!/usr/bin/env bash
# Device gates and first numbers for expert slots (issue 18's mechanism, --residency adaptive).
# Needs berth, test_runtime and test_gpu packed with ../shared/device/pack.sh (a CUDA build of this
# branch). Steps, each logged under OUTDIR:
# 1. correctness: test_runtime's expert-slot cases against CUDA (forced swaps every step at
#    ubatch 1 and 512 on synthetic qwen3moe and Mixtral files with distinct experts: same greedy
#    tokens as the CPU-only run outside the tie band, logits within the CUDA NMSE bound; the
#    device's memory constant across swaps), then the existing hybrid gates (test_hybrid);
# 2. compute-sanitizer memcheck and racecheck on the forced-swap case (ubatch 1 and 512);
# 3. numbers: synthetic qwen3-30b-a3b q4_k_m (router skew 1): `berth plan` at budgets around the
#    one holding 25% of the experts as slots, then tg128 with --residency adaptive against
#    --residency static at that budget, and the run line's residency summary. Random weights do
#    not route like a trained model (docs/residency.md): these show the mechanism's cost, not the
#    trace goals.
# usage: bash scripts/diag/expert-slots.sh OUTDIR [BUDGET]   (BUDGET default 6G)
set -uo pipefail
out=${1:-.}
budget=${2:-6G}
mkdir -p "$out"
source .device/env.sh
t=$(nproc)
export BERTH_TEST_DEVICE=cuda
{
  echo "== test_runtime expert slots (CUDA)"
  timeout 900 test_runtime -tc='expert slots*' 2>&1 | tail -40
  echo "== test_runtime hybrid (CUDA)"
  timeout 900 test_runtime -tc='hybrid*' 2>&1 | tail -15
} >"$out/slots-gates.txt" 2>&1
{
  echo "== memcheck"
  timeout 900 compute-sanitizer --tool memcheck test_runtime \
    -tc='expert slots: swaps forced every step*' 2>&1 | tail -15
  echo "== racecheck"
  timeout 900 compute-sanitizer --tool racecheck test_runtime \
    -tc='expert slots: swaps forced every step*' 2>&1 | tail -15
} >"$out/slots-sanitizer.txt" 2>&1
model=/tmp/q3-q4_k_m.gguf
[[ -f $model ]] || berth synth --preset qwen3-30b-a3b --type q4_k_m --router-skew 1 -s 1 -t "$t" \
  -o "$model" 2>&1 | tail -1
{
  for b in 5G 5.5G 6G 6.5G; do
    echo "== plan --vram-budget $b"
    berth plan -m "$model" -ub 512 --vram-budget "$b" 2>&1 | grep -E "^placement|^residency|slots|^GPU"
  done
  for mode in adaptive static; do
    echo "== run --vram-budget $budget --residency $mode"
    timeout 300 berth run -m "$model" -t "$t" -ub 512 --vram-budget "$budget" --residency "$mode" \
      -p "Once upon a time" -n 128 --temp 0 2>&1 >/dev/null | grep -E "^berth: prompt|^residency"
    echo "== bench tg128 --vram-budget $budget --residency $mode"
    timeout 300 berth bench model -m "$model" -t "$t" -r 3 -p 0 -n 128 --vram-budget "$budget" \
      --residency "$mode" 2>/dev/null | grep -E "^\| .*tg|^tg|bound"
  done
} >"$out/slots-numbers.txt" 2>&1
tail -n 60 "$out"/slots-*.txt
