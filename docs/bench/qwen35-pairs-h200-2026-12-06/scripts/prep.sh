# sourced at the top of every device command
[ -d .device/bin ] || tar -xJf .device/bin.tar.xz -C .device
source .device/env.sh
[[ -e /work/shared ]] || { mkdir -p /work && ln -sfn "$PWD/.device/data" /work/shared; }
[[ -x /work/main/build/bin/berth ]] || { mkdir -p /work/main/build && ln -sfn "$PWD/.device/bin" /work/main/build/bin; }
[ -x /tmp/ikb/bin/llama-bench ] || { [ -f /tmp/ik.ok ] && tar -xJf /tmp/ik.tar.xz -C /tmp; }
