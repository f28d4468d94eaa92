#!/usr/bin/env bash
# ARM64 check on an x86-64 Debian host: cross-compiles the whole product (berth and its
# libraries) and the test_core, test_io and test_e2e suites for aarch64 with
# cmake/toolchain-aarch64.cmake into ./build-arm64, then runs them under qemu-user.
# 1. The kernel oracle (test_core) on several emulated CPUs, so that every Highway ARM target the
#    kernels are compiled for runs it (test_io on max and cortex-a72 only; it has no SIMD code):
#      max,sve-default-vector-length=16 SVE2_128 (128-bit SVE2, as on Neoverse N2), SVE2, SVE and
#                                       NEON, all at 128-bit vectors
#      max,sve-default-vector-length=32 SVE_256 (256-bit SVE, as on Neoverse V1) only
#      max                              SVE2 at 512-bit vectors only
#      cortex-a72                       no SVE: NEON
#    The wide-vector CPUs run only the target that needs their width (BERTH_TEST_SIMD_TARGETS,
#    tests/core/kernel_harness.h) and the K-quant oracle's smaller shape set (BERTH_TEST_SHAPES=
#    small: every kernel path, tile and remainder, fewer sizes): qemu emulates the K-quant dot
#    products at SVE widths above 128 bits many times slower (those two cases took ~500 s of a
#    wide run), and the other targets and the full shape set run at 128 bits.
#    Each run prints the Highway targets the emulated CPU supports (and fails if they are not the
#    expected ones, so a silent fall-back to NEON cannot pass as an SVE run), then, from qemu's
#    translation log (-d in_asm), how many functions of each target's code test_core executed;
#    it fails if test_core has code for a selected target that never ran.
# 2. The CPU end-to-end tests on one emulated CPU, max with 128-bit SVE (SVE2_128): every case of
#    tests/e2e/test_stories.cpp (`berth run` prints stories260K's golden 64 tokens, the forward
#    against the f64 oracle) and tests/e2e/test_arch_oracle.cpp (every architecture against the
#    oracle); the suites start `berth` through build-arm64/bin/berth-emulated.
# Everything is built first; then the runs of both phases go in parallel (ARM64_JOBS at once, the
# longest first); logs: build-arm64/arm64-logs. Idempotent: installs its Debian
# packages (arm64 multiarch, cross g++, qemu-user) only when missing, and rebuilds incrementally.
# usage: scripts/test-arm64.sh
#   env ARM64_JOBS=N   how many qemu runs at once (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=$root/build-arm64
triple=aarch64-linux-gnu
t_start=$SECONDS

# --- 1. packages ---------------------------------------------------------------------------------
sudo_cmd=""
[[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
# CLI11, nlohmann-json and doctest are header-only (Architecture: all); cpp-httplib ships a
# compiled library, so it is an :arm64 package.
host_pkgs=(cmake ninja-build pkg-config ccache doctest-dev libcli11-dev nlohmann-json3-dev
  "g++-$triple" qemu-user)
arm64_pkgs=(libhwy-dev:arm64 libfmt-dev:arm64 libspdlog-dev:arm64 liburing-dev:arm64
  libtbb-dev:arm64 libhwloc-dev:arm64 libpcre2-dev:arm64 libcpp-httplib-dev:arm64)
need_update=0
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  echo "arm64: adding the arm64 dpkg architecture"
  $sudo_cmd dpkg --add-architecture arm64
  need_update=1
fi
missing=()
for p in "${host_pkgs[@]}" "${arm64_pkgs[@]}"; do
  if [[ $p == qemu-user ]] && command -v qemu-aarch64-static >/dev/null; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "arm64: installing ${missing[*]}"
  # The :arm64 packages need the same versions as their :amd64 twins (Multi-Arch: same); apt
  # upgrades the amd64 ones in lockstep where needed.
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
elif ((need_update)); then
  $sudo_cmd apt-get update -qq
fi
qemu=$(command -v qemu-aarch64 || command -v qemu-aarch64-static)
t_install=$SECONDS

# --- 2. configure and build ----------------------------------------------------------------------
# Everything before any qemu run (the runs then have the cores to themselves). Release;
# everything but core, io and cpu_kernels at -O1 (BERTH_PRODUCT_OPT), which compiles faster;
# phase 2 checks results, not speed.
cmake -S . -B "$build" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$root/cmake/toolchain-aarch64.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DBERTH_KERNELS_ONLY=OFF -DBERTH_CUDA=OFF -DBERTH_PRODUCT_OPT=-O1 \
  >/dev/null
cmake --build "$build" -j"$(nproc)" --target test_core test_io berth test_e2e
# A tiny probe, compiled like the kernels (same compiler, same Highway), that prints the targets
# Highway's dynamic dispatch can pick on the emulated CPU: compiled in and supported.
mkdir -p "$build/arm64-probe"
cat >"$build/arm64-probe/hwy_targets.cc.new" <<'EOF'
#include <hwy/targets.h>
#include <cstdio>
int main() {
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) std::printf("%s ", hwy::TargetName(t));
  std::printf("\n");
}
EOF
if ! cmp -s "$build/arm64-probe/hwy_targets.cc.new" "$build/arm64-probe/hwy_targets.cc" ||
   [[ ! -x $build/arm64-probe/hwy_targets ]]; then
  mv "$build/arm64-probe/hwy_targets.cc.new" "$build/arm64-probe/hwy_targets.cc"
  $triple-g++ -std=c++20 -O1 "$build/arm64-probe/hwy_targets.cc" \
    -o "$build/arm64-probe/hwy_targets" -lhwy
fi
rm -f "$build/arm64-probe/hwy_targets.cc.new"
t_build=$SECONDS

# --- 3. phase 1: the kernel suites under qemu-user on several CPUs --------------------------------
# The guest's loader and C/C++ runtime come from the cross toolchain (QEMU_LD_PREFIX); the :arm64
# libraries (libhwy, libtbb, libhwloc, ...) from /usr/lib/aarch64-linux-gnu.
export QEMU_LD_PREFIX=/usr/$triple
guest_env=(-E "LD_LIBRARY_PATH=/usr/$triple/lib:/usr/lib/$triple")
# cpu model | expected Highway targets, best first | suites
# (Longest first: the two wide-SVE runs take most of the time; the short runs and the e2e phase
# fill the other core meanwhile.)
# cpu model | expected Highway targets, best first | suites | the targets test_core runs (empty:
# all supported) | its shape set (empty: all)
configs=(
  "max,sve-default-vector-length=32|SVE_256 SVE2 SVE NEON|test_core|SVE_256|small"
  "max|SVE2 SVE NEON|test_core test_io|SVE2|small"
  "max,sve-default-vector-length=16|SVE2_128 SVE2 SVE NEON|test_core||"
  "cortex-a72|NEON|test_core test_io||"
)
logs=$build/arm64-logs
rm -rf "$logs"
mkdir -p "$logs"

# Which Highway targets' code test_core actually executed: qemu logs every translated block with
# the symbol it belongs to (-d in_asm); the per-target namespaces (N_SVE2, N_NEON, ...) name the
# target. Prints "TARGET:functions" pairs (distinct functions of that target's code that ran).
executed_targets() {  # in_asm-log
  grep '^IN: ' "$1" | cut -c5- | sort -u | $triple-c++filt |
    grep -oE '::N_(SVE2_128|SVE_256|SVE2|SVE|NEON|EMU128)::.*' | sort -u |
    sed -E 's/^::N_([A-Z0-9_]+)::.*/\1/' | sort | uniq -c |
    awk '{print $2 ":" $1}' | xargs
}

run_config() {  # index cpu expected suites selected shapes: writes $logs/<index>.log and .rc
  local i=$1 cpu=$2 expected=$3 suites=$4 selected=$5 shapes=$6 rc=0 got s t0 ran t n trace
  {
    echo "=== qemu-aarch64 -cpu $cpu"
    got=$("$qemu" -cpu "$cpu" "${guest_env[@]}" "$build/arm64-probe/hwy_targets" | xargs) ||
      got="(the target probe failed)"
    echo "Highway targets supported: $got"
    if [[ $got != "$expected" ]]; then
      echo "FAIL: expected Highway targets '$expected' on -cpu $cpu"
      rc=1
    fi
    for s in $suites; do
      t0=$SECONDS
      trace=()
      [[ $s == test_core ]] && trace=(-d in_asm -D "$logs/$i.in_asm"
        -E "BERTH_TEST_SIMD_TARGETS=$selected" -E "BERTH_TEST_SHAPES=$shapes")
      if "$qemu" -cpu "$cpu" "${trace[@]}" "${guest_env[@]}" "$build/bin/$s" --minimal=true; then
        echo "$s on -cpu $cpu: passed ($((SECONDS - t0)) s)"
      else
        echo "FAIL: $s on -cpu $cpu ($((SECONDS - t0)) s)"
        rc=1
      fi
    done
    if [[ " $suites " == *" test_core "* ]]; then
      ran=$(executed_targets "$logs/$i.in_asm" || true)
      echo "Highway code test_core executed (target:functions): ${ran:-none}" \
        "(selected: ${selected:-all}; shapes: ${shapes:-all})"
      # Every selected supported target that test_core has code for must have run.
      for t in ${selected:-$expected}; do
        [[ " $compiled " == *" $t "* ]] || continue
        n=$(tr ' ' '\n' <<<"$ran" | sed -n "s/^$t://p")
        if [[ -z $n ]]; then
          echo "FAIL: test_core has $t code but never executed it on -cpu $cpu"
          rc=1
        fi
      done
      rm -f "$logs/$i.in_asm"
    fi
  } >"$logs/$i.log" 2>&1
  echo "$rc" >"$logs/$i.rc"
}

# The Highway targets test_core has code for (its per-target namespaces).
compiled=$($triple-nm -C --defined-only "$build/bin/test_core" |
  grep -oE '::N_(SVE2_128|SVE_256|SVE2|SVE|NEON|EMU128)::' | sort -u |
  sed -E 's/^::N_(.*)::$/\1/' | xargs || true)
echo "arm64: test_core has Highway code for: ${compiled:-no target}"

# Phase 2: the whole product's CPU end-to-end tests on one emulated CPU. Every TEST_CASE of the
# two files must run and pass: a renamed file or a filter that matches nothing fails here instead
# of passing with zero cases. Writes $logs/e2e.log and $logs/e2e.rc.
e2e_cpu=max,sve-default-vector-length=16
e2e_expected="SVE2_128 SVE2 SVE NEON"
e2e_files=(tests/e2e/test_stories.cpp tests/e2e/test_arch_oracle.cpp)
run_e2e() {
  local rc=0 got cases filter passed t0=$SECONDS
  {
    cases=$(cat "${e2e_files[@]}" | grep -c '^TEST_CASE(' || true)
    filter=$(printf '*/%s,' "${e2e_files[@]}")
    echo "=== qemu-aarch64 -cpu $e2e_cpu: test_e2e, the $cases cases of ${e2e_files[*]}"
    # QEMU_CPU, not -cpu: the `berth` processes the tests start (bin/berth-emulated) inherit it.
    export QEMU_CPU=$e2e_cpu
    got=$("$qemu" "${guest_env[@]}" "$build/arm64-probe/hwy_targets" | xargs) ||
      got="(the target probe failed)"
    echo "Highway targets supported: $got"
    if [[ $got != "$e2e_expected" ]]; then
      echo "FAIL: expected Highway targets '$e2e_expected' on -cpu $e2e_cpu"
      rc=1
    fi
    local run_rc=0
    "$qemu" "${guest_env[@]}" "$build/bin/test_e2e" --source-file="${filter%,}" --duration=true \
      >"$logs/e2e.out" 2>&1 || run_rc=$?
    cat "$logs/e2e.out"
    passed=$(sed -nE 's/^\[doctest\] test cases: *[0-9]+ \| *([0-9]+) passed.*/\1/p' "$logs/e2e.out")
    if ((run_rc != 0 || cases == 0)) || [[ $passed != "$cases" ]]; then
      echo "FAIL: test_e2e on -cpu $e2e_cpu: exit $run_rc, ${passed:-no} of $cases cases passed"
      rc=1
    else
      echo "test_e2e on -cpu $e2e_cpu: all $cases cases passed ($((SECONDS - t0)) s)"
    fi
  } >"$logs/e2e.log" 2>&1
  echo "$rc" >"$logs/e2e.rc"
}

jobs_max=${ARM64_JOBS:-$(nproc)}
# The kernel configs, the e2e phase after the first two (so it runs beside a long one).
for i in "${!configs[@]}"; do
  IFS='|' read -r cpu expected suites selected shapes <<<"${configs[$i]}"
  while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n || true; done
  run_config "$i" "$cpu" "$expected" "$suites" "$selected" "$shapes" &
  if ((i == 1)); then
    while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n || true; done
    run_e2e &
  fi
done
wait

failed=0
for i in "${!configs[@]}"; do
  cat "$logs/$i.log"
  [[ $(cat "$logs/$i.rc" 2>/dev/null) == 0 ]] || failed=1
done
cat "$logs/e2e.log"
[[ $(cat "$logs/e2e.rc" 2>/dev/null) == 0 ]] || failed=1
t_end=$SECONDS
echo "arm64: install $((t_install - t_start)) s, build $((t_build - t_install)) s," \
  "qemu runs (kernels and e2e) $((t_end - t_build)) s"
if ((failed)); then
  echo "arm64: FAILED"
  exit 1
fi
echo "arm64: all passed"
